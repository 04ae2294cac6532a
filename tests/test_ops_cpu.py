"""The custom ops' fake implementations, the backward's shapes and grad_out checks, and the
SDPA-style call's argument checks, on meta tensors (no GPU needed)."""
import pytest
import torch

import hopper_flash
from hopper_flash import checks, dispatch


def meta(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=requires_grad)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sq,sk,h,hkv", [(300, 300, 8, 8), (300, 200, 8, 2), (1, 4099, 4, 1)])
def test_fake_impl_shapes(head_dim, dtype, sq, sk, h, hkv):
    q, k = meta(3, sq, h, head_dim, dtype=dtype), meta(3, sk, hkv, head_dim, dtype=dtype)
    out, lse = torch.ops.hopper_flash.fwd(q, k, k, 0.125, True)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (3, h, sq) and lse.dtype == torch.float32


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_backward_through_op_gives_gradient_shapes(head_dim):
    q = meta(2, 64, 8, head_dim, requires_grad=True)
    k = meta(2, 33, 2, head_dim, requires_grad=True)
    v = meta(2, 33, 2, head_dim, requires_grad=True)
    out, lse = torch.ops.hopper_flash.fwd(q, k, v, 0.1, True)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16


@pytest.mark.parametrize("bad,match", [
    (lambda o: o.float(), "grad_out must have the output's dtype"),
    (lambda o: o[:, :10], "grad_out must have the output's shape"),
])
def test_backward_op_checks_grad_out(bad, match):
    q = meta(2, 64, 4, 128)
    out, lse = torch.ops.hopper_flash.fwd(q, q, q, 0.1, True)
    with pytest.raises(ValueError, match=match):
        torch.ops.hopper_flash.bwd(bad(out), q, q, q, out, lse, 0.1, True, False)


@pytest.mark.parametrize("window,error,match", [
    ((-2, 0), ValueError, r"window_left=-2, window_right=0: window_size entries must be >= 0"),
    ((3, -5), ValueError, r"window_left=3, window_right=-5"),
])
def test_ops_check_their_window_ints(window, error, match):
    """The ops are public: a window passed to them directly is checked as
    window_size is, by the fake implementations too (so torch.compile fails
    at trace time), naming the ops' arguments."""
    q = meta(2, 64, 4, 128)
    with pytest.raises(error, match=match):
        torch.ops.hopper_flash.fwd(q, q, q, 0.1, False, False, *window)
    out, lse = torch.ops.hopper_flash.fwd(q, q, q, 0.1, False, False, 3, 0)
    with pytest.raises(error, match=match):
        torch.ops.hopper_flash.bwd(out, q, q, q, out, lse, 0.1, False, False, *window)
    qt = meta(64, 4, 128)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    with pytest.raises(error, match=match):
        torch.ops.hopper_flash.varlen_fwd(qt, qt, qt, cu, cu, None, None, 32, 32, 0.1, False, False, *window)
    out, lse = torch.ops.hopper_flash.varlen_fwd(qt, qt, qt, cu, cu, None, None, 32, 32, 0.1, False, False, 3, 0)
    with pytest.raises(error, match=match):
        torch.ops.hopper_flash.varlen_bwd(out, qt, qt, qt, out, lse, cu, cu, None, None, 32, 32, 0.1, False, False,
                                          *window)
    k_cache = meta(2, 256, 4, 128)
    with pytest.raises(error, match=match):
        torch.ops.hopper_flash.fwd_kvcache(q[:, :1], k_cache, k_cache, None, None, None, None, None, 0.1, False, 0,
                                           -1, *window)


def test_kvcache_op_checks_rotary_at_trace_time():
    """The KV-cache op's fake checks flash-attn's rotary arguments (shapes,
    dtypes, the append they need), so torch.compile fails while tracing,
    naming them; good ones give the output's shapes."""
    q, k_cache = meta(2, 1, 8, 128), meta(2, 256, 2, 128)
    k = meta(2, 1, 2, 128)
    cos = meta(256, 32)
    op = torch.ops.hopper_flash.fwd_kvcache
    rest = (None, None, None, 0.1, True, 0, -1, -1, -1, 0.0, None)  # cache_seqlens .. sink
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin need the new keys k and v"):
        op(q, k_cache, k_cache, None, None, *rest, cos, cos, True)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be given together"):
        op(q, k_cache, k_cache, k, k, *rest, cos, None, True)
    with pytest.raises(ValueError, match=r"capacity \(256\)"):
        op(q, k_cache, k_cache, k, k, *rest, cos[:100], cos[:100], True)
    out, lse = op(q, k_cache, k_cache, k, k, *rest, cos, cos, False)
    assert out.shape == q.shape and lse.shape == (2, 8, 1)


def test_flash_attn_func_routes_grad_inputs_through_op(monkeypatch):
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)  # meta tensors stand in for CUDA ones
    q = meta(2, 64, 4, 128, requires_grad=True)
    out = hopper_flash.flash_attn_func(q, q, q, causal=True)
    assert out.grad_fn is not None, "autograd must see the op, or gradients would silently be missing"
    (dq,) = torch.autograd.grad(out.float().sum(), (q,))
    assert dq.shape == q.shape


def test_no_grad_fn_under_no_grad_needs_device():
    # Without autograd or tracing the eager path runs and validates the device.
    q = meta(2, 64, 4, 128)
    with pytest.raises(ValueError, match="CUDA tensor"):
        hopper_flash.flash_attn_func(q, q, q, causal=True)


# ---- scaled_dot_product_attention: SDPA's signature, BHSD inputs.

def bhsd(b=2, h=4, s=64, d=128):
    return meta(b, h, s, d)


def test_sdpa_rejects_attn_mask():
    q = bhsd()
    with pytest.raises(NotImplementedError, match="attn_mask is not supported"):
        hopper_flash.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(64, 64, dtype=torch.bool))


def test_sdpa_rejects_dropout():
    q = bhsd()
    with pytest.raises(NotImplementedError, match="dropout_p must be 0.0"):
        hopper_flash.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


def test_sdpa_rejects_top_left_causal_with_unequal_lengths():
    q, k = bhsd(s=64), bhsd(s=128)
    with pytest.raises(NotImplementedError, match="top-left"):
        hopper_flash.scaled_dot_product_attention(q, k, k, is_causal=True)


def test_sdpa_needs_enable_gqa_for_fewer_kv_heads():
    q, k = bhsd(h=8), bhsd(h=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        hopper_flash.scaled_dot_product_attention(q, k, k)


def test_sdpa_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"query must be a 4-D tensor \[batch, heads, seqlen, headdim\]"):
        hopper_flash.scaled_dot_product_attention(meta(4, 64, 128), bhsd(), bhsd())


def test_sdpa_passes_bshd_views_to_the_kernel(monkeypatch):
    seen = {}

    def fake_forward(q, k, v, softmax_scale, causal, return_lse, out=None, window=None, softcap=0.0, sink=None):
        seen.update(q=q, k=k, scale=softmax_scale, causal=causal)
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    monkeypatch.setattr(dispatch, "forward", fake_forward)
    q, k = bhsd(h=8, s=100), bhsd(h=2, s=100)
    out = hopper_flash.scaled_dot_product_attention(q, k, k, is_causal=True, scale=0.3, enable_gqa=True)
    assert seen["q"].shape == (2, 100, 8, 128) and seen["k"].shape == (2, 100, 2, 128)
    assert seen["q"].stride() == q.transpose(1, 2).stride(), "no copy: a transposed view"
    assert seen["scale"] == 0.3 and seen["causal"] is True
    assert out.shape == (2, 8, 100, 128)


@pytest.mark.parametrize("dynamic", [False, True])
def test_fake_impl_traces_with_dynamic_shapes_and_a_symbolic_scale(dynamic):
    """Under torch.compile(dynamic=True) the fake implementation sees SymInt
    shapes and a SymFloat scale; its argument checks must accept them (and
    still refuse a bad scale)."""
    torch._dynamo.reset()

    def f(q, k, v, scale):
        return torch.ops.hopper_flash.fwd(q, k, v, scale, True)

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for s, scale in ((300, 0.3), (517, 0.4)):
        q, k = meta(2, s, 4, 128), meta(2, s, 2, 128)
        out, lse = compiled(q, k, k, scale)
        assert out.shape == q.shape and lse.shape == (2, 4, s)
    with pytest.raises(Exception, match="softmax_scale must be a finite positive number"):
        compiled(q, k, k, -0.5)


def test_plain_eager_backward_predicate():
    # The autograd formulas skip the op only in a plain eager backward of
    # CUDA tensors; tracing, dispatch modes, grad mode and meta tensors keep it.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hopper_flash.ops import _plain_eager_backward
    t = meta(2, 64, 4, 128)
    with torch.no_grad():
        assert not _plain_eager_backward(t)  # meta: the fake implementation
    with torch.no_grad(), FakeTensorMode():
        assert not _plain_eager_backward(torch.empty(2, 3))
    with torch.enable_grad():
        assert not _plain_eager_backward()
    with torch.no_grad():
        assert _plain_eager_backward()  # (no tensors: the conditions alone)
