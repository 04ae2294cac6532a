"""The private-launcher fast path of ``plan.launch_forward`` against triton's
public ``kernel[grid](...)`` launch, on the GPU.

The fast path calls a compiled kernel's launcher with hand-built arguments
(``launcher.TmaArg`` instead of a TensorDescriptor); a mistake in that convention
(an argument in the wrong place, a descriptor field the launcher reads
differently on a new triton) shows up as a difference here. The kernel is
deterministic (each output tile is written by one CTA, no atomics), so both
launches must agree bit for bit, output and LSE, on the same inputs.
"""
import random

import pytest
import torch

from hopper_flash import _triton_support, plan
from hopper_flash.kernels import forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not plan.FAST_LAUNCH, reason="the fast launch path is off on this triton "
                       "(see hopper_flash._triton_support.FAST_LAUNCH_MINORS)"),
]

# (dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, with LSE). Odd lengths,
# GQA, unequal lengths; seqlen_q > seqlen_k under causal leaves rows that see
# no key (zero output, -inf LSE).
CASES = [
    (torch.bfloat16, 2, 1000, 1000, 8, 2, True),
    (torch.float16, 3, 129, 3001, 4, 4, True),
    (torch.bfloat16, 1, 300, 17, 2, 1, True),
    (torch.bfloat16, 2, 127, 129, 4, 1, False),
]


def case_id(case):
    dtype, b, sq, sk, h, hkv, lse = case
    return f"{str(dtype)[6:]}-b{b}-sq{sq}-sk{sk}-h{h}x{hkv}-{'lse' if lse else 'nolse'}"


@pytest.fixture
def jit_launches(monkeypatch):
    """Counts launches that go through triton's JIT (``kernel[grid](...)``)."""
    calls = []
    jit_run = forward.attention_forward_kernel.run

    def counting_run(*args, **kwargs):
        calls.append(kwargs.get("grid"))
        return jit_run(*args, **kwargs)

    monkeypatch.setattr(forward.attention_forward_kernel, "run", counting_run)
    return calls


def launch(q, k, v, causal, with_lse):
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32,
                     device=q.device) if with_lse else None
    plan.launch_forward(q, k, v, out, lse, q.shape[-1] ** -0.5, causal)
    return out, lse


def test_fast_path_is_on_for_this_triton():
    import triton

    assert _triton_support.fast_launch_supported(triton.__version__)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", plan.SUPPORTED_HEAD_DIMS)
def test_fast_path_matches_public_launch(monkeypatch, jit_launches, head_dim, causal, case):
    dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, with_lse = case
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(s, h):
        return torch.randn(batch, s, h, head_dim, generator=gen, device="cuda").to(dtype)

    q, k, v = rnd(seqlen_q, nheads), rnd(seqlen_k, nheads_kv), rnd(seqlen_k, nheads_kv)

    monkeypatch.setattr(plan, "FAST_LAUNCH", False)
    ref_out, ref_lse = launch(q, k, v, causal, with_lse)
    assert len(jit_launches) == 1

    # The public launch above cached the compiled kernel; this one must bypass the JIT.
    monkeypatch.setattr(plan, "FAST_LAUNCH", True)
    out, lse = launch(q, k, v, causal, with_lse)
    assert len(jit_launches) == 1, "the second launch went through the JIT, not the fast path"
    torch.cuda.synchronize()

    assert torch.isfinite(ref_out).all(), f"public launch left NaN/inf in the output (seed {seed})"
    assert torch.equal(out, ref_out), \
        f"fast path output differs: max |diff| {(out.float() - ref_out.float()).abs().max().item()} (seed {seed})"
    if with_lse:
        assert not ref_lse.isnan().any(), f"public launch left NaN in the LSE (seed {seed})"
        assert torch.equal(lse, ref_lse), f"fast path LSE differs (seed {seed})"


# --- the backward's main kernel (plan_backward.launch_backward) -----------------------

from hopper_flash import dispatch, plan_backward  # noqa: E402
from hopper_flash.kernels import backward as backward_kernels  # noqa: E402

# (dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv): odd lengths, GQA/MQA,
# unequal lengths (causal rows that see no key).
BWD_CASES = [
    (torch.bfloat16, 2, 1000, 1000, 8, 2),
    (torch.float16, 2, 129, 3001, 4, 4),
    (torch.bfloat16, 1, 300, 17, 2, 1),
]


@pytest.fixture
def bwd_jit_launches(monkeypatch):
    """Counts backward launches that go through triton's JIT."""
    calls = []
    jit_run = backward_kernels.attention_backward_kernel.run

    def counting_run(*args, **kwargs):
        calls.append(kwargs.get("grid"))
        return jit_run(*args, **kwargs)

    monkeypatch.setattr(backward_kernels.attention_backward_kernel, "run", counting_run)
    monkeypatch.setattr(plan_backward, "_COMPILED", {})
    monkeypatch.setattr(plan_backward, "_PLANS", {})
    return calls


def launch_bwd(q, k, v, do, out, lse, causal, deterministic):
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    plan_backward.launch_backward(do, q, k, v, out, lse, *grads, q.shape[-1] ** -0.5, causal, deterministic)
    return grads


def test_backward_fast_path_follows_the_forwards_guard():
    assert plan_backward.FAST_LAUNCH == plan.FAST_LAUNCH


@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: f"{str(c[0])[6:]}-b{c[1]}-sq{c[2]}-sk{c[3]}-h{c[4]}x{c[5]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", plan_backward.BACKWARD_HEAD_DIMS)
def test_backward_fast_path_matches_public_launch(monkeypatch, bwd_jit_launches, head_dim, causal, case):
    """Deterministic mode: dq, dk, dv bitwise equal between the JIT launch and
    the fast path. Default mode: dk, dv bitwise (no atomics), dq up to the
    order of its fp32 reduce-adds."""
    dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv = case
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(s, h):
        return torch.randn(batch, s, h, head_dim, generator=gen, device="cuda").to(dtype)

    q, k, v, do = rnd(seqlen_q, nheads), rnd(seqlen_k, nheads_kv), rnd(seqlen_k, nheads_kv), rnd(seqlen_q, nheads)
    out, lse = dispatch.forward(q, k, v, None, causal, True)
    for deterministic in (True, False):
        monkeypatch.setattr(plan_backward, "FAST_LAUNCH", False)
        ref = launch_bwd(q, k, v, do, out, lse, causal, deterministic)
        jit_count = len(bwd_jit_launches)
        monkeypatch.setattr(plan_backward, "FAST_LAUNCH", True)
        got = launch_bwd(q, k, v, do, out, lse, causal, deterministic)
        # The third call launches the plan's compiled kernels without lookups (BackwardPlan.compiled).
        planned = launch_bwd(q, k, v, do, out, lse, causal, deterministic)
        assert len(bwd_jit_launches) == jit_count, "a later launch went through the JIT, not the fast path"
        assert plan_backward.plan_for(do, q, k, out, lse, *planned, q.shape[-1] ** -0.5, causal,
                                      deterministic).compiled is not None
        torch.cuda.synchronize()
        for path, grads in (("fast path", got), ("planned path", planned)):
            for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
                assert torch.isfinite(b).all(), f"public launch left NaN/inf in {name} (seed {seed})"
                if deterministic or name != "dq":
                    assert torch.equal(a, b), (f"{path} {name} differs (deterministic={deterministic}): max |diff| "
                                               f"{(a.float() - b.float()).abs().max().item()} (seed {seed})")
                else:
                    assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max(), f"dq (seed {seed})"
