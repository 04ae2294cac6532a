"""Eager autograd without the ops' dispatch (``ops.EagerAttention``,
``ops.EagerVarlenAttention``) on the CPU: the kernels are replaced by float64
math, so these check the plumbing (what is saved, which arguments reach the
forward and backward implementations, what is differentiable, the routing in
``interface``), not the kernels. The GPU half (gradients bitwise equal to the
ops', the ops not called) is in tests/test_torch_integration_gpu.py."""
import pytest
import torch

import hopper_flash
from hopper_flash import checks, dispatch, ops, plan_backward


def math_attention(q, k, v, scale, causal):
    """(out, lse) of BSHD q, k, v (equal lengths when causal)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v), lse


@pytest.fixture
def calls(monkeypatch):
    """Fake forward/backward implementations on float64 math; returns the
    log of (name, args) they were called with."""
    log = []

    def forward(q, k, v, scale, causal, return_lse, window=None, softcap=0.0, sink=None):
        log.append(("forward", scale, causal, return_lse) + ((window,) if window else ())
                   + ((("softcap", softcap),) if softcap else ()))
        return math_attention(q, k, v, scale, causal)

    def backward(grad_out, q, k, v, out, lse, scale, causal, deterministic, window=None, softcap=0.0, sink=None):
        assert sink is None  # (no test here has sinks: tests/test_sinks_cpu.py)
        log.append(("backward", scale, causal, deterministic) + ((window,) if window else ())
                   + ((("softcap", softcap),) if softcap else ()))
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            o, _ = math_attention(*leaves, scale, causal)
            return torch.autograd.grad(o, leaves, grad_out)

    monkeypatch.setattr(dispatch, "forward_validated", forward)
    monkeypatch.setattr(plan_backward, "backward", backward)
    return log


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("deterministic", [True, False])
def test_eager_attention_gradients_and_arguments(calls, causal, deterministic):
    q, k, v = inputs()
    out, lse = ops.EagerAttention.apply(q, k, v, 0.3, causal, deterministic)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_out, ref_lse = math_attention(q, k, v, 0.3, causal)
    want = torch.autograd.grad(ref_out, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert calls == [("forward", 0.3, causal, True), ("backward", 0.3, causal, deterministic)]
    assert not lse.requires_grad, "the LSE carries no gradient (as the op's)"
    torch.testing.assert_close(lse, ref_lse)


def test_eager_attention_is_once_differentiable(calls):
    q, k, v = inputs()
    out, _ = ops.EagerAttention.apply(q, k, v, 0.3, True, False)
    (dq,) = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    # A second derivative is refused, never silently zero.
    with pytest.raises(RuntimeError, match="does not require grad|once_differentiable|differentiate twice"):
        torch.autograd.grad(dq.sum(), (q,))


def test_flash_attn_func_routes_plain_eager_autograd_past_the_op(calls, monkeypatch):
    monkeypatch.setattr(checks, "check_arguments", lambda q, k, v, scale, causal: scale)
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    used = []
    monkeypatch.setattr(ops, "fwd", lambda *a: used.append("op") or math_attention(*a[:5]))
    monkeypatch.setattr(ops, "plain_eager", lambda *t: True)
    q, k, v = inputs()
    out = hopper_flash.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True, deterministic=True)
    assert out.grad_fn is not None and "EagerAttention" in type(out.grad_fn).__name__
    assert not used
    torch.autograd.grad(out.sum(), (q, k, v))
    assert calls[-1] == ("backward", 0.3, True, True)
    monkeypatch.setattr(ops, "plain_eager", lambda *t: False)
    hopper_flash.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    assert used == ["op"]


def test_eager_varlen_attention_passes_its_arguments(monkeypatch):
    seen = {}

    def forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, scale, causal, return_lse, window=None,
                       softcap=0.0, sink=None, num_splits=1):
        seen["forward"] = (max_q, max_k, used_q, used_k, scale, causal, return_lse)
        seen["forward window"] = window
        seen["forward splits"] = num_splits
        seen["forward softcap"] = softcap
        return q * 2, torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)

    def bwd_impl(grad_out, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, det,
                 window=None, softcap=0.0, sink=None):
        seen["backward"] = (cu_q.tolist(), used_q, used_k, max_q, max_k, scale, causal, det)
        seen["backward window"] = window
        seen["backward softcap"] = softcap
        return grad_out * 2, torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(dispatch, "forward_varlen_validated", forward_varlen)
    monkeypatch.setattr(ops, "_varlen_bwd_impl", bwd_impl)
    q, k, v = (torch.randn(7, 3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, lse = ops.EagerVarlenAttention.apply(q, k, v, cu, cu, None, None, 4, 4, 0.5, True, True)
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    torch.testing.assert_close(dq, torch.full_like(q, 2.0))  # the fake backward: 2 x grad_out
    assert seen["forward"] == (4, 4, None, None, 0.5, True, True)
    assert seen["backward"] == ([0, 3, 7], None, None, 4, 4, 0.5, True, True)
    assert seen["forward window"] is None and seen["backward window"] is None
    assert seen["forward splits"] == 0  # flash_attn_varlen_func's default: the heuristic
    assert not lse.requires_grad
    out, _ = ops.EagerVarlenAttention.apply(q, k, v, cu, cu, None, None, 4, 4, 0.5, True, False, (9, 0))
    torch.autograd.grad(out.sum(), (q,))
    assert seen["forward window"] == (9, 0) and seen["backward window"] == (9, 0)
    ops.EagerVarlenAttention.apply(q, k, v, cu, cu, None, None, 4, 4, 0.5, True, False, None, 0.0, None, 3)
    assert seen["forward splits"] == 3
    assert seen["forward softcap"] == 0.0 and seen["backward softcap"] == 0.0
    out, _ = ops.EagerVarlenAttention.apply(q, k, v, cu, cu, None, None, 4, 4, 0.5, True, False, None, 30.0)
    torch.autograd.grad(out.sum(), (q,))
    assert seen["forward softcap"] == 30.0 and seen["backward softcap"] == 30.0


def test_eager_attention_passes_the_window_to_forward_and_backward(calls):
    q, k, v = inputs()
    out, _ = ops.EagerAttention.apply(q, k, v, 0.3, True, False, (7, 0))
    torch.autograd.grad(out.sum(), (q, k, v))
    assert calls == [("forward", 0.3, True, True, (7, 0)), ("backward", 0.3, True, False, (7, 0))]


def test_eager_attention_passes_the_softcap_to_forward_and_backward(calls):
    q, k, v = inputs()
    out, _ = ops.EagerAttention.apply(q, k, v, 0.3, True, False, None, 50.0)
    torch.autograd.grad(out.sum(), (q, k, v))
    assert calls == [("forward", 0.3, True, True, ("softcap", 50.0)),
                     ("backward", 0.3, True, False, ("softcap", 50.0))]


def test_plain_eager_predicate():
    from torch._subclasses.fake_tensor import FakeTensorMode
    assert not ops.plain_eager(torch.empty(2, device="meta"))
    assert not ops.plain_eager(torch.empty(2))  # CPU: the op path's device error
    with FakeTensorMode():
        assert not ops.plain_eager()
    assert ops.plain_eager(None)
