"""The backward's workspace, on the CPU with the three launches faked: what
``plan_backward.launch_backward`` allocates besides dQ/dK/dV is exactly
``plan_backward.workspace_bytes()``, and that is the README's statement
(fp32 dq_accum [B, H, Sq_r, D] + fp32 lse2 and delta [B, H, Sq_r] + an
int32 item counter, int32 semaphores [B, H, Sq_r / tile] in deterministic
mode; Sq_r is seqlen_q rounded up to the query tile)."""
import pytest
import torch

from hopper_flash import plan, plan_backward
from hopper_flash.kernels import backward as backward_kernels
from hopper_flash.kernels import backward_pre
from launch_fakes import FakeCompiled


@pytest.fixture
def captured(monkeypatch):
    """The workspace tensors each launch received, kernels not run."""
    seen = {}

    def small_launch(self, pointers):
        if self.kernel is backward_pre._bwd_preprocess_kernel:
            seen["pre"] = pointers  # out, dout, lse, delta, lse2, dq_accum, cu, used
        else:
            seen["post"] = pointers  # dq_accum, dq, cu, used

    class FakeKernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["grid"] = grid
                seen["descs"] = args[:9]
                seen["sem"] = args[9]  # after the nine descriptors
                seen["deterministic"] = kwargs["DETERMINISTIC"]
                return FakeCompiled([])
            return launch

    monkeypatch.setattr(plan_backward.SmallLaunch, "__call__", small_launch)
    monkeypatch.setattr(backward_kernels, "attention_backward_kernel", FakeKernel())
    monkeypatch.setattr(plan_backward, "_descriptor", lambda t, block: t)
    monkeypatch.setattr(plan_backward, "_fp32_descriptor", lambda t, block: t)
    monkeypatch.setattr(plan_backward, "_COMPILED", {})
    monkeypatch.setattr(plan_backward, "FAST_LAUNCH", False)
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)  # the persistent grid (no GPU)
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
    rows = batch * h * sq_r
    delta, lse2, dq_accum = captured["pre"][3:6]
    counter = captured["pre"][-1]  # the persistent grid's item counter (the preprocess zeroes it)
    # The preprocess zeroes the dq_accum the main kernel adds into and the postprocess reads.
    assert captured["post"][0] is dq_accum and captured["post"][1] is dq
    assert captured["descs"][6] is dq_accum and captured["descs"][7] is lse2 and captured["descs"][8] is delta
    assert dq_accum.shape == (rows, d) and dq_accum.dtype == torch.float32 and dq_accum.is_contiguous()
    for t in (delta, lse2):
        assert t.shape == (rows,) and t.dtype == torch.float32
    # dq_accum, then delta, then lse2, then the counter: one allocation, nothing else in it.
    storage = dq_accum.untyped_storage()
    assert delta.untyped_storage().data_ptr() == lse2.untyped_storage().data_ptr() == storage.data_ptr()
    assert counter.untyped_storage().data_ptr() == storage.data_ptr()
    assert delta.data_ptr() == dq_accum.data_ptr() + 4 * rows * d and lse2.data_ptr() == delta.data_ptr() + 4 * rows
    assert counter.data_ptr() == lse2.data_ptr() + 4 * rows and counter.dtype == torch.int32 and counter.numel() == 1
    allocated = storage.nbytes()
    assert allocated == 4 * rows * (d + 2) + 4
    if deterministic:
        sem = captured["sem"]
        assert sem.dtype == torch.int32 and sem.shape == (batch, h, sq_r // tile)
        allocated += sem.numel() * sem.element_size()
    else:
        assert captured["sem"] is delta  # a placeholder, never read
    assert plan_backward.workspace_bytes(batch, h, sq, d, deterministic) == allocated


def test_the_documented_example():
    # README / docs/backward.md: B=4 H=32 S=8192 D=128 is 512 MiB of dq_accum
    # + 8 MiB of lse2/delta (+ a 4-byte counter), against 256 MiB for a bf16
    # dQ; deterministic mode adds 64 KiB of semaphores.
    mib = 2**20
    assert plan_backward.workspace_bytes(4, 32, 8192, 128) == 520 * mib + 4
    assert plan_backward.workspace_bytes(4, 32, 8192, 128, deterministic=True) == 520 * mib + 4 + 64 * 1024
