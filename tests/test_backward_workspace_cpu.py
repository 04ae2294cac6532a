"""The backward's workspace, on the CPU with the three launches faked: what
``plan_backward.launch_backward`` allocates besides dQ/dK/dV is exactly
``plan_backward.workspace_bytes()``, and that is the README's statement
(fp32 dq_accum [B, H, Sq_r, D] + fp32 lse2 and delta [B, H, Sq_r], int32
semaphores [B, H, Sq_r / tile] in deterministic mode; Sq_r is seqlen_q
rounded up to the query tile)."""
import pytest
import torch

from hopper_flash import plan_backward
from hopper_flash.kernels import backward as backward_kernels
from launch_fakes import FakeCompiled


@pytest.fixture
def captured(monkeypatch):
    """The workspace tensors each launch received, kernels not run."""
    seen = {}

    def preprocess(out, dout, lse, delta, lse2, dq_accum, block_m):
        seen["delta"], seen["lse2"], seen["pre_dq_accum"] = delta, lse2, dq_accum

    def postprocess(dq_accum, dq, scale, block_m, varlen=None):
        seen["dq_accum"] = dq_accum

    class FakeKernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["grid"] = grid
                seen["sem"] = args[9]  # after the nine descriptors
                seen["deterministic"] = kwargs["DETERMINISTIC"]
                return FakeCompiled([])
            return launch

    monkeypatch.setattr(plan_backward, "bwd_preprocess", preprocess)
    monkeypatch.setattr(plan_backward, "bwd_postprocess", postprocess)
    monkeypatch.setattr(backward_kernels, "attention_backward_kernel", FakeKernel())
    monkeypatch.setattr(plan_backward, "_descriptor", lambda t, block: t)
    monkeypatch.setattr(plan_backward, "_fp32_descriptor", lambda t, block: t)
    monkeypatch.setattr(plan_backward, "_COMPILED", {})
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", False)
    return seen


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("batch,sq,sk,h,hkv,d", [(2, 129, 70, 4, 2, 128), (1, 1, 5, 3, 1, 64), (2, 200, 200, 2, 2, 256)])
def test_workspace_is_what_launch_backward_allocates(captured, batch, sq, sk, h, hkv, d, deterministic):
    q = torch.randn(batch, sq, h, d, dtype=torch.bfloat16)
    k = torch.randn(batch, sk, hkv, d, dtype=torch.bfloat16)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(batch, h, sq)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)
    plan_backward.launch_backward(dout, q, k, k, out, lse, dq, dk, dv, d ** -0.5, True, deterministic)
    tile = plan_backward.BACKWARD_CONFIGS[d].block_m  # the query tile: 128 at D=64, else 64
    sq_r = -(-sq // tile) * tile
    assert captured["dq_accum"].shape == (batch, h, sq_r, d) and captured["dq_accum"].dtype == torch.float32
    assert captured["pre_dq_accum"] is captured["dq_accum"]  # the preprocess zeroes it
    for name in ("delta", "lse2"):
        assert captured[name].shape == (batch, h, sq_r) and captured[name].dtype == torch.float32
    tensors = [captured["dq_accum"], captured["delta"], captured["lse2"]]
    if deterministic:
        sem = captured["sem"]
        assert sem.dtype == torch.int32 and sem.shape == (batch, h, sq_r // tile)
        tensors.append(sem)
    else:
        assert captured["sem"] is captured["delta"]  # a placeholder, never read
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert plan_backward.workspace_bytes(batch, h, sq, d, deterministic) == allocated


def test_the_documented_example():
    # README / docs/backward.md: B=4 H=32 S=8192 D=128 is 512 MiB of dq_accum
    # + 8 MiB of lse2/delta, against 256 MiB for a bf16 dQ; deterministic
    # mode adds 64 KiB of semaphores.
    mib = 2**20
    assert plan_backward.workspace_bytes(4, 32, 8192, 128) == 520 * mib
    assert plan_backward.workspace_bytes(4, 32, 8192, 128, deterministic=True) == 520 * mib + 64 * 1024
