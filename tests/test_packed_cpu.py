"""flash-attn's packed-layout functions (``hopper_flash.packed``) on a
CPU-only machine: what each unpacks and hands on, and the errors for a
packed tensor of the wrong kind. Their GPU half (results and gradients
against the float64 reference) is in tests/test_torch_integration_gpu.py.

A well-formed call on CPU tensors gets past every argument check and stops
at the device check, as ``flash_attn_func``'s does (tests/test_api_cpu.py).
"""
import inspect

import pytest
import torch

import hopper_flash
from hopper_flash import interface, packed

B, S, H, HKV, D = 2, 8, 4, 2, 128
BF16 = torch.bfloat16
DEVICE_ERROR = r"q must be a CUDA tensor on a Hopper GPU \(sm_90\), got device 'cpu'"
PACKED = ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
          "flash_attn_varlen_kvpacked_func"]


def cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("name", PACKED)
def test_exported_from_package_root(name):
    assert name in hopper_flash.__all__
    assert getattr(hopper_flash, name) is getattr(packed, name)


@pytest.fixture
def calls(monkeypatch):
    """Record what the packed functions pass to the unpacked ones."""
    log = []
    monkeypatch.setattr(interface, "flash_attn_func", lambda *a, **kw: log.append(("fixed", a, kw)) or "out")
    monkeypatch.setattr(interface, "flash_attn_varlen_func", lambda *a, **kw: log.append(("varlen", a, kw)) or "out")
    return log


def _is_view(part, whole, index):
    """``part`` is ``whole`` indexed at ``index``: same storage, same values, no copy."""
    return part.data_ptr() == whole[index].data_ptr() and part.stride() == whole[index].stride() \
        and torch.equal(part, whole[index])


def test_qkvpacked_hands_on_views_of_the_three_slices(calls):
    qkv = torch.randn(B, S, 3, H, D).to(BF16)
    assert hopper_flash.flash_attn_qkvpacked_func(qkv, causal=True, softmax_scale=0.5, return_lse=True,
                                                  deterministic=True) == "out"
    [(kind, (q, k, v), kw)] = calls
    assert kind == "fixed"
    assert _is_view(q, qkv, (slice(None), slice(None), 0))
    assert _is_view(k, qkv, (slice(None), slice(None), 1))
    assert _is_view(v, qkv, (slice(None), slice(None), 2))
    assert q.shape == (B, S, H, D)
    assert kw["causal"] is True and kw["softmax_scale"] == 0.5 and kw["return_lse"] is True
    assert kw["deterministic"] is True


def test_kvpacked_hands_on_q_and_views_of_k_and_v(calls):
    q = torch.randn(B, S + 3, H, D).to(BF16)
    kv = torch.randn(B, S, 2, HKV, D).to(BF16)
    hopper_flash.flash_attn_kvpacked_func(q, kv, causal=False)
    [(kind, (q_, k, v), kw)] = calls
    assert kind == "fixed" and q_ is q
    assert _is_view(k, kv, (slice(None), slice(None), 0)) and _is_view(v, kv, (slice(None), slice(None), 1))
    assert k.shape == (B, S, HKV, D) and kw["causal"] is False


def test_varlen_qkvpacked_uses_one_set_of_metadata_for_queries_and_keys(calls):
    qkv = torch.randn(11, 3, H, D).to(BF16)
    c, used = cu([4, 7]), torch.tensor([3, 7], dtype=torch.int32)
    hopper_flash.flash_attn_varlen_qkvpacked_func(qkv, c, 7, seqused=used, causal=True, check_contract=True)
    [(kind, (q, k, v, cq, ck, mq, mk), kw)] = calls
    assert kind == "varlen"
    assert _is_view(q, qkv, (slice(None), 0)) and _is_view(k, qkv, (slice(None), 1))
    assert _is_view(v, qkv, (slice(None), 2))
    assert cq is c and ck is c and (mq, mk) == (7, 7)
    assert kw["seqused_q"] is used and kw["seqused_k"] is used
    assert kw["causal"] is True and kw["check_contract"] is True


def test_varlen_kvpacked_hands_on_both_sets_of_metadata(calls):
    q = torch.randn(5, H, D).to(BF16)
    kv = torch.randn(9, 2, HKV, D).to(BF16)
    cq, ck = cu([2, 3]), cu([4, 5])
    hopper_flash.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 3, 5, return_lse=True)
    [(kind, (q_, k, v, cq_, ck_, mq, mk), kw)] = calls
    assert kind == "varlen" and q_ is q and cq_ is cq and ck_ is ck and (mq, mk) == (3, 5)
    assert _is_view(k, kv, (slice(None), 0)) and _is_view(v, kv, (slice(None), 1))
    assert kw["return_lse"] is True and kw["seqused_q"] is None and kw["seqused_k"] is None


# ------------------------------------------------------------ through the real checks

def test_well_formed_calls_reach_the_device_check():
    qkv = torch.randn(B, S, 3, H, D).to(BF16)
    q = torch.randn(B, S, H, D).to(BF16)
    kv = torch.randn(B, S + 5, 2, HKV, D).to(BF16)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        hopper_flash.flash_attn_qkvpacked_func(qkv, causal=True)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        hopper_flash.flash_attn_kvpacked_func(q, kv)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        hopper_flash.flash_attn_varlen_qkvpacked_func(torch.randn(11, 3, H, D).to(BF16), cu([4, 7]), 7)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        hopper_flash.flash_attn_varlen_kvpacked_func(torch.randn(5, H, D).to(BF16),
                                                     torch.randn(9, 2, HKV, D).to(BF16), cu([2, 3]), cu([4, 5]), 3, 5)


@pytest.mark.parametrize("shape", [(B, S, H, D), (B, S, 2, H, D), (B, S, 3, H, D, 1), (B, 3, S, H, D)],
                         ids=["rank4", "two", "rank6", "axis1"])
def test_qkv_of_the_wrong_shape_names_qkv_and_its_layout(shape):
    with pytest.raises(ValueError, match=r"qkv must have shape \[batch, seqlen, 3, nheads, headdim\], got "
                                         + r"\(" + ", ".join(map(str, shape)) + r"\)"):
        hopper_flash.flash_attn_qkvpacked_func(torch.zeros(shape, dtype=BF16))


@pytest.mark.parametrize("shape", [(B, S, HKV, D), (B, S, 3, HKV, D)], ids=["rank4", "three"])
def test_kv_of_the_wrong_shape_names_kv_and_its_layout(shape):
    q = torch.zeros(B, S, H, D, dtype=BF16)
    with pytest.raises(ValueError, match=r"kv must have shape \[batch, seqlen_k, 2, nheads_kv, headdim\]"):
        hopper_flash.flash_attn_kvpacked_func(q, torch.zeros(shape, dtype=BF16))


def test_varlen_packed_shapes_name_the_argument():
    with pytest.raises(ValueError, match=r"qkv must have shape \[total, 3, nheads, headdim\], got \(11, 3, 4\)"):
        hopper_flash.flash_attn_varlen_qkvpacked_func(torch.zeros(11, 3, H, dtype=BF16), cu([4, 7]), 7)
    with pytest.raises(ValueError, match=r"kv must have shape \[total_k, 2, nheads_kv, headdim\]"):
        hopper_flash.flash_attn_varlen_kvpacked_func(torch.zeros(5, H, D, dtype=BF16),
                                                     torch.zeros(9, HKV, D, dtype=BF16), cu([2, 3]), cu([4, 5]), 3, 5)


@pytest.mark.parametrize("bad", [None, [[1.0]]], ids=["None", "list"])
def test_non_tensor_is_a_type_error_naming_the_argument(bad):
    with pytest.raises(TypeError, match=r"qkv must be a torch\.Tensor \[batch, seqlen, 3, nheads, headdim\], "
                                        r"got (NoneType|list)"):
        hopper_flash.flash_attn_qkvpacked_func(bad)
    with pytest.raises(TypeError, match=r"kv must be a torch\.Tensor"):
        hopper_flash.flash_attn_kvpacked_func(torch.zeros(B, S, H, D, dtype=BF16), bad)


def test_the_unpacked_checks_still_apply():
    # A dtype the kernels do not take is refused by flash_attn_func's own check, naming q.
    with pytest.raises(ValueError, match=r"q\.dtype must be one of \(bfloat16, float16\), got float32"):
        hopper_flash.flash_attn_qkvpacked_func(torch.zeros(B, S, 3, H, D))
    # GQA heads that do not divide: k/v's heads come from kv.
    with pytest.raises(ValueError, match=r"q's number of heads \(4\) must be a multiple of k/v's number of heads "
                                         r"\(3\)"):
        hopper_flash.flash_attn_kvpacked_func(torch.zeros(B, S, H, D, dtype=BF16),
                                              torch.zeros(B, S, 2, 3, D, dtype=BF16))
    with pytest.raises(NotImplementedError, match=r"dropout_p must be 0\.0"):
        hopper_flash.flash_attn_qkvpacked_func(torch.zeros(B, S, 3, H, D, dtype=BF16), dropout_p=0.1)


@pytest.mark.parametrize("name, positional", [
    ("flash_attn_qkvpacked_func", ["qkv"]),
    ("flash_attn_kvpacked_func", ["q", "kv"]),
    ("flash_attn_varlen_qkvpacked_func", ["qkv", "cu_seqlens", "max_seqlen"]),
    ("flash_attn_varlen_kvpacked_func", ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                         "max_seqlen_k"]),
])
def test_options_are_keyword_only(name, positional):
    params = list(inspect.signature(getattr(hopper_flash, name)).parameters.values())
    assert [p.name for p in params[:len(positional)]] == positional
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(positional):]), params
    # flash-attn 2 passes dropout_p next: refused, not misread as another option.
    with pytest.raises(TypeError, match="positional"):
        getattr(hopper_flash, name)(*([None] * len(positional)), 0.0)


# ------------------------------------------------------------ every path
# Eager, through the custom op (autograd records the call) and under
# torch.compile, a packed call gets the same named errors.

def _eager(fn, *args, **kw):
    return fn(*args, **kw)


def _autograd(fn, first, *rest, **kw):
    return fn(first.detach().requires_grad_(), *rest, **kw)


def _compiled(fn, *args, **kw):
    torch._dynamo.reset()
    return torch.compile(lambda *a: fn(*a, **kw), backend="eager")(*args)


@pytest.mark.parametrize("path", [_eager, _autograd, _compiled], ids=["eager", "autograd", "compiled"])
def test_every_path_gives_the_same_named_errors(path):
    qkv = torch.randn(B, S, 3, H, D).to(BF16)
    with pytest.raises(ValueError, match="^" + DEVICE_ERROR + "$"):
        path(hopper_flash.flash_attn_qkvpacked_func, qkv, causal=True)
    with pytest.raises(ValueError, match=r"^qkv must have shape \[batch, seqlen, 3, nheads, headdim\]"):
        path(hopper_flash.flash_attn_qkvpacked_func, qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"^q\.dtype must be one of \(bfloat16, float16\), got float32$"):
        path(hopper_flash.flash_attn_qkvpacked_func, qkv.float())
    kv = torch.randn(11, 2, HKV, D).to(BF16)
    with pytest.raises(ValueError, match="^" + DEVICE_ERROR + "$"):
        path(hopper_flash.flash_attn_varlen_kvpacked_func, torch.randn(5, H, D).to(BF16), kv, cu([2, 3]),
             cu([4, 7]), 3, 7)


# ------------------------------------------------------------ plain eager autograd: gradients written in place
# ops.EagerPackedAttention with the kernels replaced by float64 math (as in
# tests/test_eager_autograd_cpu.py): the plumbing, not the kernels. The GPU
# half is tests/test_packed_gpu.py.

def math_attention(q, k, v, scale, causal):
    """(out, lse) of BSHD q, k, v (GQA by repetition; equal lengths when causal)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v), torch.logsumexp(s, -1)


@pytest.fixture
def eager(monkeypatch):
    """Plain eager autograd on CPU float64 tensors, the kernels faked; returns
    the (dq, dk, dv) each backward call was handed."""
    from hopper_flash import checks, dispatch, ops, plan_backward

    handed = []
    monkeypatch.setattr(ops, "plain_eager", lambda *t: True)
    monkeypatch.setattr(checks, "check_arguments", lambda q, k, v, scale, causal: scale)
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(dispatch, "forward_validated",
                        lambda q, k, v, scale, causal, lse, window=None, softcap=0.0: math_attention(q, k, v, scale,
                                                                                                     causal))

    def backward(grad_out, q, k, v, out, lse, scale, causal, deterministic, grads=None, window=None, softcap=0.0):
        assert grads is not None, "the packed path hands its gradient views in"
        handed.append(grads)
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            o, _ = math_attention(*leaves, scale, causal)
            for dst, src in zip(grads, torch.autograd.grad(o, leaves, grad_out)):
                dst.copy_(src)

    monkeypatch.setattr(plan_backward, "backward", backward)
    return handed


def _f64(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64,
                       requires_grad=True)


@pytest.mark.parametrize("causal", [True, False])
def test_qkvpacked_backward_writes_into_one_packed_gradient(eager, causal):
    qkv = _f64(2, 5, 3, 4, 8, seed=1)
    out = hopper_flash.flash_attn_qkvpacked_func(qkv, softmax_scale=0.3, causal=causal)
    assert "EagerPackedAttention" in type(out.grad_fn).__name__
    grad = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, (qkv,), grad)
    want = torch.autograd.grad(math_attention(*qkv.unbind(2), 0.3, causal)[0], (qkv,), grad)[0]
    torch.testing.assert_close(dqkv, want)
    [(dq, dk, dv)] = eager
    # dQ, dK, dV were the three slices of the returned gradient itself: nothing stacked them afterwards.
    assert [t.data_ptr() for t in (dq, dk, dv)] == [dqkv[:, :, i].data_ptr() for i in range(3)]


def test_kvpacked_backward_writes_dk_dv_into_the_packed_gradient(eager):
    q = _f64(2, 6, 4, 8, seed=2)
    kv = _f64(2, 6, 2, 2, 8, seed=3)  # GQA 4/2
    out, lse = hopper_flash.flash_attn_kvpacked_func(q, kv, softmax_scale=0.5, causal=True, return_lse=True)
    assert not lse.requires_grad
    dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    want = torch.autograd.grad(math_attention(q, *kv.unbind(2), 0.5, True)[0].sum(), (q, kv))
    torch.testing.assert_close(dq, want[0])
    torch.testing.assert_close(dkv, want[1])
    [(_, dk, dv)] = eager
    assert (dk.data_ptr(), dv.data_ptr()) == (dkv[:, :, 0].data_ptr(), dkv[:, :, 1].data_ptr())


@pytest.mark.parametrize("window_size,window", [((-1, -1), None), ((3, 5), (3, 0))])
def test_varlen_packed_backward_hands_its_views_and_the_metadata(monkeypatch, window_size, window):
    from hopper_flash import checks, dispatch, ops, plan_backward

    seen = {}
    monkeypatch.setattr(ops, "plain_eager", lambda *t: True)
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(checks, "check_varlen_arguments",
                        lambda q, k, v, cq, ck, mq, mk, uq, uk, scale, causal: (scale, mq, mk))

    def forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, scale, causal, return_lse, window=None,
                       softcap=0.0):
        seen["forward"] = (cu_q is cu_k, max_q, max_k, used_q is used_k, scale, causal)
        seen["windows"] = [window]
        return q * 2, torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)

    def backward_varlen(grad_out, q, k, v, out, lse, varlen, scale, causal, deterministic, grads=None,
                        window=None, softcap=0.0):
        seen["windows"].append(window)
        seen["batch"] = (varlen.max_seqlen_q, varlen.max_seqlen_k, varlen.batch, deterministic)
        grads[0].copy_(grad_out * 2)
        grads[1].fill_(1.0)
        grads[2].fill_(3.0)

    monkeypatch.setattr(dispatch, "forward_varlen_validated", forward_varlen)
    monkeypatch.setattr(plan_backward, "backward_varlen", backward_varlen)
    qkv = _f64(7, 3, 2, 8, seed=4)
    cu, used = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([2, 4], dtype=torch.int32)
    out = hopper_flash.flash_attn_varlen_qkvpacked_func(qkv, cu, 4, seqused=used, softmax_scale=0.5, causal=True,
                                                        deterministic=True, window_size=window_size)
    assert "EagerPackedAttention" in type(out.grad_fn).__name__
    (dqkv,) = torch.autograd.grad(out.sum(), (qkv,))
    # A sliding window reaches the forward and the backward (causal folds its right side to 0).
    assert seen.pop("windows") == [window, window]
    # (The gradients come in uninitialised: backward_varlen zeroes the rows no kernel writes.)
    assert seen == {"forward": (True, 4, 4, True, 0.5, True), "batch": (4, 4, 2, True)}
    torch.testing.assert_close(dqkv[:, 0], torch.full_like(dqkv[:, 0], 2.0))
    assert bool((dqkv[:, 1] == 1).all()) and bool((dqkv[:, 2] == 3).all())


def test_without_gradients_the_unpacked_call_runs(calls):
    # No autograd: the unpacked function on the views (its own eager path), not the packed Function.
    qkv = torch.randn(B, S, 3, H, D).to(BF16)
    hopper_flash.flash_attn_qkvpacked_func(qkv)
    assert [kind for kind, _, _ in calls] == ["fixed"]
