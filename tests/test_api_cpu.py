"""Argument checks of the public call, on a CPU-only machine.

``checks.validate`` checks, in order: tensor type and rank, same device,
same dtype, supported dtype, k/v shapes against q, supported head dim, GQA
head ratio, ``causal``, ``softmax_scale``, the work-item limit, then the
device (CUDA + Hopper), then TMA addressability. CPU tensors therefore reach
every check up to and including the device check; the TMA rules are
exercised by calling ``check_tma_addressable`` directly (and through
``validate`` with the device check stubbed out).

Expectations are written out (the supported dtypes and head dims), never
read from the code under test.
"""
import math
import re
import types

import pytest
import torch

import hopper_flash
from hopper_flash import checks, interface, plan
from hopper_flash.interface import flash_attn_func

B, S, H, D = 2, 8, 4, 128
BF16 = torch.bfloat16


def qkv(q_shape=(B, S, H, D), kv_shape=None, dtype=BF16, k_shape=None, v_shape=None):
    kv_shape = kv_shape or q_shape
    q = torch.randn(q_shape).to(dtype)
    k = torch.randn(k_shape or kv_shape).to(dtype)
    v = torch.randn(v_shape or kv_shape).to(dtype)
    return q, k, v


# A well-formed call on CPU gets past every argument check and stops at the
# device check; errors below must be raised *before* that point.
DEVICE_ERROR = r"q must be a CUDA tensor on a Hopper GPU \(sm_90\), got device 'cpu'"


# ---------------------------------------------------------------- package root

def test_flash_attn_func_exported_from_package_root():
    assert "flash_attn_func" in hopper_flash.__all__
    assert hopper_flash.flash_attn_func is interface.flash_attn_func


def test_flash_attn_func_docstring_describes_layout():
    doc = hopper_flash.flash_attn_func.__doc__
    assert doc, "flash_attn_func has no docstring"
    assert "[batch, seqlen_q, nheads, headdim]" in doc
    assert "[batch, seqlen_k, nheads_kv, headdim]" in doc


# ------------------------------------------------------------ type and rank

@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [[[1.0]], None, 3.0], ids=["list", "None", "float"])
def test_non_tensor_is_type_error_naming_argument(name, bad):
    args = dict(zip("qkv", qkv()))
    args[name] = bad
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor, got {type(bad).__name__}"):
        flash_attn_func(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(B, S, H * D), (B, S, H, D, 1)], ids=["3d", "5d"])
def test_wrong_rank(name, shape):
    args = dict(zip("qkv", qkv()))
    args[name] = torch.zeros(shape, dtype=BF16)
    with pytest.raises(ValueError, match=rf"^{name} must have 4 dimensions \[batch, seqlen, nheads, headdim\], "
                                         rf"got shape {re.escape(str(shape))}"):
        flash_attn_func(args["q"], args["k"], args["v"])


# ------------------------------------------------------------ device and dtype

def test_mixed_devices():
    q, k, v = qkv()
    k = torch.empty(k.shape, dtype=k.dtype, device="meta")
    with pytest.raises(ValueError, match=r"q, k and v must be on the same device, .*k on meta"):
        flash_attn_func(q, k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    v = v.to(torch.float16)
    with pytest.raises(ValueError, match=r"q, k and v must have the same dtype, got q bfloat16, k bfloat16, "
                                         r"v float16"):
        flash_attn_func(q, k, v)


def test_float32_rejected_listing_supported_dtypes():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"q\.dtype must be one of \(bfloat16, float16\), got float32"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_bf16_and_fp16_pass_argument_checks(dtype):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v)


# ------------------------------------------------------------ shapes

def test_k_v_shape_mismatch():
    q, k, v = qkv(k_shape=(B, S, H, D), v_shape=(B, S + 1, H, D))
    with pytest.raises(ValueError, match=r"k and v must have the same shape but for the head dim, got k "
                                         r"\(2, 8, 4, 128\) and v \(2, 9, 4, 128\)"):
        flash_attn_func(q, k, v)


def test_batch_mismatch():
    q, k, v = qkv(kv_shape=(B + 1, S, H, D))
    with pytest.raises(ValueError, match=rf"k and v must have q's batch size {B}, got {B + 1}"):
        flash_attn_func(q, k, v)


def test_head_dim_mismatch():
    q, k, v = qkv(kv_shape=(B, S, H, 64))
    with pytest.raises(ValueError, match=rf"k must have q's head dim {D}, got 64$"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("head_dim_v", [4, 100, 264])
def test_unsupported_v_head_dim_is_named(head_dim_v):
    # v's head dim may differ from q's and k's (FA3's hdim_v), but must be one the kernels serve.
    q, k, v = qkv(v_shape=(B, S, H, head_dim_v))
    with pytest.raises(ValueError, match=rf"head dim \(v\.shape\[3\]\) must be one of \(64, 128, 256\) or a "
                                         rf"multiple of 8 below 256 \(run on the next of those\), got {head_dim_v}$"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("head_dim", [4, 12, 100, 264, 512])
def test_unsupported_head_dim_lists_supported(head_dim):
    q, k, v = qkv(q_shape=(B, S, H, head_dim))
    with pytest.raises(ValueError, match=rf"head dim \(q\.shape\[3\]\) must be one of \(64, 128, 256\) or a "
                                         rf"multiple of 8 below 256 \(run on the next of those\), got {head_dim}$"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_supported_head_dims_pass_argument_checks(head_dim):
    q, k, v = qkv(q_shape=(B, S, H, head_dim))
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v)


def test_zero_kv_heads_rejected():
    q, k, v = qkv(q_shape=(B, S, 4, D), kv_shape=(B, S, 0, D))
    with pytest.raises(ValueError, match=r"k and v must have at least one head \(k.shape\[2\] >= 1\), got 0"):
        flash_attn_func(q, k, v)


def test_numpy_bool_causal_and_numpy_scale_accepted():
    np = pytest.importorskip("numpy")
    q, k, v = qkv()
    with pytest.raises(ValueError, match=DEVICE_ERROR):  # past every argument check
        flash_attn_func(q, k, v, softmax_scale=np.float32(0.1), causal=np.bool_(True))


@pytest.mark.parametrize("scale", [True, "0.5", torch.tensor(0.5)], ids=["bool", "str", "tensor"])
def test_softmax_scale_must_be_a_real_number(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="softmax_scale must be a positive float or None"):
        flash_attn_func(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("nheads, nheads_kv", [(6, 4), (4, 3)])
def test_nheads_not_multiple_of_nheads_kv(nheads, nheads_kv):
    q, k, v = qkv(q_shape=(B, S, nheads, D), kv_shape=(B, S, nheads_kv, D))
    with pytest.raises(ValueError, match=rf"q's number of heads \({nheads}\) must be a multiple of "
                                         rf"k/v's number of heads \({nheads_kv}\)"):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("nheads, nheads_kv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_gqa_mqa_and_different_seqlens_pass_argument_checks(nheads, nheads_kv):
    q, k, v = qkv(q_shape=(B, S, nheads, D), kv_shape=(B, 3 * S, nheads_kv, D))
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v)


# ------------------------------------------------------------ causal, softmax_scale

@pytest.mark.parametrize("causal", ["yes", 1, None], ids=["str", "int", "None"])
def test_causal_must_be_bool(causal):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"causal must be a bool, got .*{type(causal).__qualname__}"):
        flash_attn_func(q, k, v, causal=causal)


@pytest.mark.parametrize("scale", [0, 0.0, -1, -1.0, math.nan, math.inf, -math.inf],
                         ids=["0", "0.0", "-1", "-1.0", "nan", "inf", "-inf"])
def test_softmax_scale_must_be_finite_positive(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"softmax_scale must be a finite positive number, got "):
        flash_attn_func(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", ["abc", [0.5], object()], ids=["str", "list", "object"])
def test_softmax_scale_not_a_number_is_type_error(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"softmax_scale must be a positive float or None, got "):
        flash_attn_func(q, k, v, softmax_scale=scale)


@pytest.mark.parametrize("scale", [None, 0.125, 2], ids=["None", "float", "int"])
def test_valid_softmax_scale_passes_argument_checks(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v, softmax_scale=scale, causal=True)


# ------------------------------------------------------------ device check

@pytest.mark.parametrize("return_lse", [False, True])
def test_cpu_tensors_rejected_with_cuda_hopper_message(return_lse):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v, return_lse=return_lse)


def test_empty_cpu_tensors_still_rejected():
    """Empty inputs skip the launch, but not the device check."""
    q, k, v = qkv(q_shape=(B, 0, H, D), kv_shape=(B, 0, H, D))
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v)


def _fake_cuda_tensor():
    return types.SimpleNamespace(device=torch.device("cuda", 0))


@pytest.fixture(autouse=True)
def _fresh_capability_cache(monkeypatch):
    # check_device caches each device's capability; the fakes below differ per test.
    monkeypatch.setattr(checks, "_CAPABILITY", {})


@pytest.mark.parametrize("cap, gpu", [((8, 0), "NVIDIA A100"), ((10, 0), "NVIDIA B200"), ((8, 9), "NVIDIA L4")])
def test_check_device_rejects_non_hopper_gpu(monkeypatch, cap, gpu):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    with pytest.raises(ValueError, match=rf"needs a Hopper GPU \(compute capability 9\.x\); k is on "
                                         rf"'{gpu}' with compute capability {cap[0]}\.{cap[1]}"):
        checks.check_device(_fake_cuda_tensor(), "k")


def test_check_device_accepts_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    checks.check_device(_fake_cuda_tensor(), "q")


# ------------------------------------------------------------ TMA addressability

def test_tma_rejects_non_contiguous_head_dim():
    t = torch.zeros(B, S, D, H, dtype=BF16).transpose(2, 3)
    assert t.shape == (B, S, H, D) and t.stride(-1) != 1
    with pytest.raises(ValueError, match=r"^k must be contiguous in its last \(headdim\) dimension, got strides"):
        checks.check_tma_addressable("k", t)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_tma_rejects_stride_not_multiple_of_16_bytes(dim):
    strides = [S * H * D + 64, H * D + 64, D + 64, 1]  # all 16-byte multiples (bf16: multiples of 8 elements)
    strides[dim] += 1
    buf = torch.zeros(B * strides[0] + S * strides[1] + H * strides[2] + D, dtype=BF16)
    t = buf.as_strided((B, S, H, D), strides)
    assert t.data_ptr() % 16 == 0
    with pytest.raises(ValueError, match=rf"^v\.stride\({dim}\) = {strides[dim]} elements "
                                         rf"\({2 * strides[dim]} bytes\) cannot be addressed by TMA: "
                                         r"strides must be positive multiples of 16 bytes"):
        checks.check_tma_addressable("v", t)
    strides[dim] -= 1  # the aligned version is accepted
    checks.check_tma_addressable("v", buf.as_strided((B, S, H, D), strides))


@pytest.mark.parametrize("offset", [1, 3, 4])
def test_tma_rejects_misaligned_data_pointer(offset):
    n = B * S * H * D
    buf = torch.zeros(n + 8, dtype=BF16)
    t = buf[offset:offset + n].view(B, S, H, D)  # every stride fine, base off by 2*offset bytes
    assert t.data_ptr() % 16 != 0
    with pytest.raises(ValueError, match=rf"^q's data pointer must be 16-byte aligned for TMA, got address "
                                         rf"0x[0-9a-f]+ \(storage offset {offset}\)"):
        checks.check_tma_addressable("q", t)


def test_tma_accepts_packed_qkv_views():
    packed = torch.zeros(B, S, 3, H, D, dtype=BF16)
    q, k, v = packed.unbind(2)
    assert not q.is_contiguous()
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tma_addressable(name, t)


def test_tma_accepts_bhsd_transposed_to_bshd():
    t = torch.zeros(B, H, S, D, dtype=BF16).transpose(1, 2)
    assert t.shape == (B, S, H, D) and not t.is_contiguous()
    checks.check_tma_addressable("q", t)


def test_tma_accepts_aligned_offset_into_buffer():
    n = B * S * H * D
    buf = torch.zeros(n + 8, dtype=BF16)
    t = buf[8:8 + n].view(B, S, H, D)  # 16-byte offset
    checks.check_tma_addressable("q", t)


# Through validate(), with the device check stubbed so the TMA rules are reached.

@pytest.fixture
def no_device_check(monkeypatch):
    monkeypatch.setattr(checks, "check_device", lambda t, name="q": None)


def test_validate_default_scale(no_device_check):
    q, k, v = qkv()
    assert checks.validate(q, k, v, None, False) == pytest.approx(1 / math.sqrt(D))
    assert checks.validate(q, k, v, 0.25, True) == 0.25


def test_validate_applies_tma_rules_to_each_input(no_device_check):
    q, k, v = qkv()
    bad_v = torch.zeros(B, S, D, H, dtype=BF16).transpose(2, 3)
    with pytest.raises(ValueError, match=r"^v must be contiguous in its last \(headdim\) dimension"):
        checks.validate(q, k, bad_v, None, False)


def test_validate_accepts_packed_qkv(no_device_check):
    q, k, v = torch.zeros(B, S, 3, H, D, dtype=BF16).unbind(2)
    assert checks.validate(q, k, v, None, True) == pytest.approx(1 / math.sqrt(D))


@pytest.fixture
def remembered(no_device_check, signature_memory):
    """validate's memory of passed signatures, for CPU tensors, fresh; the
    number of times the checks themselves ran."""
    return signature_memory("check_arguments")


def test_validate_remembers_a_passed_signature(remembered):
    q, k, v = qkv()
    assert checks.validate(q, k, v, None, True) == pytest.approx(1 / math.sqrt(D))
    # Other tensors of the same signature: the checks do not run again.
    q2, k2, v2 = qkv()
    assert checks.validate(q2, k2, v2, None, True) == pytest.approx(1 / math.sqrt(D))
    assert len(remembered) == 1
    assert checks.validate(q, k, v, 0.5, True) == 0.5
    assert len(remembered) == 2


@pytest.mark.parametrize("change, error, match", [
    (dict(causal=1), TypeError, r"^causal must be a bool"),  # 1 == True as a dict key
    (dict(softmax_scale=True), TypeError, r"^softmax_scale must be a positive float"),  # True == 1.0
    (dict(k="fp16"), ValueError, r"^q, k and v must have the same dtype"),
    (dict(v="misaligned"), ValueError, r"^v's data pointer must be 16-byte aligned"),
    (dict(q="strided"), ValueError, r"^q must be contiguous in its last \(headdim\) dimension"),
])
def test_a_remembered_signature_still_refuses_what_differs(remembered, change, error, match):
    q, k, v = qkv()
    assert checks.validate(q, k, v, 1.0, True) == 1.0
    args = dict(q=q, k=k, v=v, softmax_scale=1.0, causal=True)
    for name, how in change.items():
        if how == "fp16":
            args[name] = args[name].to(torch.float16)
        elif how == "misaligned":
            buf = torch.randn(args[name].numel() + 1).to(BF16)
            args[name] = buf[1:].view(args[name].shape)  # 2 bytes past a 16-byte boundary
        elif how == "strided":
            args[name] = torch.randn(B, S, D, H).to(BF16).transpose(2, 3)
        else:
            args[name] = how
    with pytest.raises(error, match=match):
        checks.validate(args["q"], args["k"], args["v"], args["softmax_scale"], args["causal"])


def _head_major(length: int, pad: int = 0) -> torch.Tensor:
    """k/v as transformers' KV cache holds them, [B, Hkv, length, D], seen as
    BSHD: every stride but the head dim's depends on the length. ``pad``
    elements after each head's keys (as_strided over a larger buffer)."""
    per_head = length * D + pad
    buf = torch.randn(B * H * per_head).to(BF16)
    return buf.as_strided((B, length, H, D), (H * per_head, D, per_head, 1))


def test_validate_remembers_a_class_of_key_lengths(remembered):
    # A decode step grows the cache by one key: a new length, new strides,
    # the same verdict (checks._kv_class). The checks run once for them all.
    q = torch.randn(B, 1, H, D).to(BF16)
    for length in (1000, 1001, 1002, 4097):
        k, v = _head_major(length), _head_major(length)
        assert checks.validate(q, k, v, None, True) == pytest.approx(1 / math.sqrt(D))
    assert len(remembered) == 1
    # Not the same class: k and v of different lengths, an empty cache, one key.
    with pytest.raises(ValueError, match=r"^k and v must have the same shape"):
        checks.validate(q, _head_major(1003), _head_major(1004), None, True)
    for length in (0, 1):
        checks.validate(q, _head_major(length), _head_major(length), None, True)
    assert len(remembered) == 4
    # A stride TMA cannot step (heads 1001 * 128 + 1 elements apart: not a
    # multiple of 16 bytes) is refused, though the length's class passed.
    with pytest.raises(ValueError, match=r"^k\.stride\(\d\) = \d+ elements .* cannot be addressed by TMA"):
        checks.validate(q, _head_major(1001, pad=1), _head_major(1001), None, True)


def test_kv_class_is_what_the_tma_rule_reads():
    # checks._kv_class keeps, per axis, _tma_stride_problems' verdict: the
    # two must agree on every layout (an extent-1 axis is never stepped).
    for shape, strides in [((2, 5, 4, 128), (2560, 128, 640, 1)), ((1, 5, 4, 128), (7, 128, 640, 1)),
                           ((2, 5, 4, 128), (2561, 128, 641, 1)), ((2, 5, 1, 128), (640, 128, 3, 1)),
                           ((2, 1, 4, 128), (512, 3, 128, 1)), ((2, 5, 4, 128), (0, 128, 640, 1))]:
        steppable = checks._kv_class(torch.Size(shape), strides, 2)[4:7]
        _, other = checks._tma_stride_problems(shape, strides, 2)
        assert all(steppable) == (other is None), (shape, strides)


def test_validate_remembers_no_cpu_tensors(no_device_check, monkeypatch):
    # The shipped cache is for CUDA tensors only: a stubbed device check in a
    # CPU test must not leave a CPU signature passing for later tests.
    monkeypatch.setattr(checks, "_PASSED", {})
    q, k, v = qkv()
    checks.validate(q, k, v, None, True)
    assert checks._PASSED == {}


# Regression: validation skips size-1 axes, and plan.tma_strides makes their
# strides aligned, so a descriptor is always buildable after validation.
def test_whatever_validation_accepts_triton_descriptor_accepts():
    # batch 1 with a batch stride of 4097 elements (8194 bytes): legal for torch, never stepped by the kernel.
    t = torch.zeros(B * S * H * D + 8, dtype=BF16).as_strided((1, S, H, D), (S * H * D + 1, H * D, D, 1))
    checks.check_tma_addressable("q", t)  # accepted
    plan._descriptor(t, plan.block_shapes(plan.CONFIGS[D])["q"])


def test_tma_rejects_expanded_heads_with_gqa_hint():
    k = torch.zeros(B, S, 1, D, dtype=BF16).expand(B, S, H, D)
    with pytest.raises(ValueError, match=r"k\.stride\(2\) = 0 elements .*expanded.*GQA/MQA"):
        checks.check_tma_addressable("k", k)


# ------------------------------------------------------------ flash-attn's signature

def test_arguments_after_v_are_keyword_only():
    import inspect
    params = list(inspect.signature(flash_attn_func).parameters.values())
    assert [p.name for p in params[:3]] == ["q", "k", "v"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[3:]), params
    q, k, v = qkv()
    # flash-attn 2's positional order is (q, k, v, dropout_p, softmax_scale, causal): refused, not misread.
    with pytest.raises(TypeError, match="positional"):
        flash_attn_func(q, k, v, 0.0)


def test_flash_attn_options_at_their_no_op_values_pass():
    q, k, v = qkv()
    for deterministic in (False, True):
        with pytest.raises(ValueError, match=DEVICE_ERROR):
            flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=0.1, causal=True, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, deterministic=deterministic, return_attn_probs=False)
    with pytest.raises(ValueError, match=DEVICE_ERROR):  # ints and a list, as callers write them
        flash_attn_func(q, k, v, dropout_p=0, window_size=[-1, -1], softcap=0)


@pytest.mark.parametrize("option, value, message", [
    ("dropout_p", 0.1, r"dropout_p must be 0\.0 \(hopper_flash has no dropout\), got 0\.1"),
    ("alibi_slopes", torch.ones(H), r"alibi_slopes must be None \(ALiBi is not supported\)"),
    ("return_attn_probs", True, r"return_attn_probs must be False .* use return_lse=True"),
])
def test_flash_attn_options_refused_by_name(option, value, message):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=message):
        flash_attn_func(q, k, v, **{option: value})


@pytest.mark.parametrize("softcap, error, message", [
    (-1.0, ValueError, r"softcap must be finite and >= 0 \(0\.0 for none\), got -1\.0"),
    (float("inf"), ValueError, r"softcap must be finite and >= 0"),
    (float("nan"), ValueError, r"softcap must be finite and >= 0"),
    (True, TypeError, r"softcap must be a real number \(0\.0 for none\), got bool"),
    ("30", TypeError, r"softcap must be a real number"),
    (torch.tensor(30.0), TypeError, r"softcap must be a real number"),
])
def test_bad_softcap_is_refused_by_name(softcap, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=message):
        flash_attn_func(q, k, v, softcap=softcap)
    q.requires_grad_()  # the autograd path checks it too, before the device
    with pytest.raises(error, match=message):
        flash_attn_func(q, k, v, softcap=softcap)


@pytest.mark.parametrize("softcap", [30.0, 50, 0.5])
def test_a_softcap_is_accepted_and_reaches_the_device_check(softcap):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v, causal=True, softcap=softcap)
    q.requires_grad_()
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v, causal=True, softcap=softcap)


@pytest.mark.parametrize("window_size, error, message", [
    ((128,), TypeError, r"window_size must be a pair of ints \(left, right\), -1 for no bound, got \(128,\)"),
    ((1.5, 0), TypeError, r"window_size must be a pair of ints"),
    ((True, 0), TypeError, r"window_size must be a pair of ints"),
    ("128", TypeError, r"window_size must be a pair of ints"),
    ((-2, 0), ValueError, r"window_size entries must be >= 0, or -1 for no bound on that side, got \(-2, 0\)"),
])
def test_bad_window_size_is_refused_by_name(window_size, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match=message):
        flash_attn_func(q, k, v, window_size=window_size)


@pytest.mark.parametrize("window_size, causal", [((128, 0), True), ((4, 4), False), ((-1, 0), False),
                                                 ((0, -1), False), ((1 << 40, 3), False)])
def test_a_window_reaches_the_device_check(window_size, causal):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v, causal=causal, window_size=window_size)


def test_a_window_under_autograd_goes_on_to_the_device_check():
    q, k, v = (t.requires_grad_() for t in qkv())
    with pytest.raises(ValueError, match=DEVICE_ERROR):
        flash_attn_func(q, k, v, causal=True, window_size=(16, 0))
    with torch.no_grad():
        with pytest.raises(ValueError, match=DEVICE_ERROR):
            flash_attn_func(q, k, v, causal=True, window_size=(16, 0))


def test_the_ops_take_a_window_a_softcap_and_a_sink():
    import hopper_flash.kvcache as kvcache
    import hopper_flash.ops as ops

    # Every op takes the attention sinks last: the forwards into their
    # kernels' normaliser (sinks.py), the backwards for the sinks' gradient,
    # their fourth result (the preprocess's partial sums).
    # The KV-cache op takes flash-attn's rotary arguments, cache_leftpad and FA3's packed queries and
    # attention_chunk after them, the varlen forward FA3's num_splits.
    rotary = {kvcache.fwd_kvcache: ["rotary_cos", "rotary_sin", "rotary_interleaved", "cache_leftpad", "cu_seqlens_q",
                                    "max_seqlen_q", "attention_chunk"], ops.varlen_fwd: ["num_splits"]}
    for op in (ops.fwd, ops.varlen_fwd, kvcache.fwd_kvcache, ops.bwd, ops.varlen_bwd):
        names = [a.name for a in op._opoverload._schema.arguments]
        assert names[-4 - len(rotary.get(op, [])):] == ["window_left", "window_right", "softcap", "sink",
                                                         *rotary.get(op, [])], names
    for op in (ops.bwd, ops.varlen_bwd):
        assert len(op._opoverload._schema.returns) == 4


def test_window_bounds_fold_causal_and_unbounded_sides():
    from hopper_flash.checks import window_bounds

    assert window_bounds((-1, -1), False) is None and window_bounds([-1, -1], True) is None
    assert window_bounds((-1, 7), True) is None  # causal sets right to 0; no left bound: plain causal
    assert window_bounds((5, 7), True) == (5, 0)
    assert window_bounds((5, 7), False) == (5, 7)
    assert window_bounds((-1, 0), False) == (-1, 0)
    assert window_bounds((1 << 30, 2), False) == (-1, 2)  # past any length: no bound
    assert window_bounds((1 << 30, 1 << 31), False) is None


def test_deterministic_must_be_a_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="deterministic must be a bool, got str"):
        flash_attn_func(q, k, v, deterministic="yes")


# ------------------------------------------------------------ one set of checks on every path
# Eager, through the custom op (autograd records the call) and under
# torch.compile, a bad argument gets the same exception and message. CPU
# tensors: every argument check runs before the device check.

def _eager(q, k, v, **kw):
    return flash_attn_func(q, k, v, **kw)


def _autograd(q, k, v, **kw):
    return flash_attn_func(q.detach().requires_grad_(), k, v, **kw)


def _compiled(q, k, v, **kw):
    torch._dynamo.reset()
    return torch.compile(lambda q, k, v: flash_attn_func(q, k, v, **kw), backend="eager")(q, k, v)


PATHS = {"eager": _eager, "autograd": _autograd, "compiled": _compiled}

BAD_CALLS = {
    "float32": (dict(dtype=torch.float32), {}, ValueError,
                r"^q\.dtype must be one of \(bfloat16, float16\), got float32$"),
    "head_dim_100": (dict(q_shape=(B, S, H, 100)), {}, ValueError,
                     r"^head dim \(q\.shape\[3\]\) must be one of \(64, 128, 256\) or a multiple of 8 below 256 "
                     r"\(run on the next of those\), got 100$"),
    # Other multiples of 8 run on the next kernel head dim's kernels, on every path: a well-formed call gets to
    # the device check.
    "head_dim_96": (dict(q_shape=(B, S, H, 96)), dict(causal=True), ValueError, "^" + DEVICE_ERROR + "$"),
    "causal_str": ({}, dict(causal="yes"), TypeError, r"^causal must be a bool, got builtins\.str$"),
    "scale_bool": ({}, dict(softmax_scale=True), TypeError,
                   r"^softmax_scale must be a positive float or None, got True$"),
    "scale_negative": ({}, dict(softmax_scale=-0.5), ValueError,
                       r"^softmax_scale must be a finite positive number, got -0\.5$"),
    "heads": (dict(q_shape=(B, S, 6, D), kv_shape=(B, S, 4, D)), {}, ValueError,
              r"^q's number of heads \(6\) must be a multiple of k/v's number of heads \(4\)$"),
    "dropout": ({}, dict(dropout_p=0.1), NotImplementedError, r"^dropout_p must be 0\.0"),
    "valid_but_cpu": ({}, dict(causal=True), ValueError, "^" + DEVICE_ERROR + "$"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", BAD_CALLS)
def test_every_path_gives_the_same_named_error(path, case):
    tensor_kw, call_kw, exc, message = BAD_CALLS[case]
    q, k, v = qkv(**tensor_kw)
    with pytest.raises(exc, match=message):
        PATHS[path](q, k, v, **call_kw)


def _meta(*shape, dtype=BF16):
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.mark.parametrize("dtype, head_dim, hkv, scale, exc, message", [
    (torch.float32, 128, H, 0.1, ValueError, r"^q\.dtype must be one of \(bfloat16, float16\), got float32$"),
    (BF16, 100, H, 0.1, ValueError, r"^head dim \(q\.shape\[3\]\) must be one of \(64, 128, 256\) or a multiple "
                                    r"of 8 below 256 \(run on the next of those\), got 100$"),
    (BF16, 128, 3, 0.1, ValueError, r"^q's number of heads \(4\) must be a multiple of k/v's number of heads"),
    (BF16, 128, H, -1.0, ValueError, r"^softmax_scale must be a finite positive number, got -1\.0$"),
    (BF16, 128, H, math.nan, ValueError, r"^softmax_scale must be a finite positive number, got nan$"),
])
def test_op_fake_implementation_checks_arguments(dtype, head_dim, hkv, scale, exc, message):
    """Calling the op itself (as a traced graph does) runs the same checks in its fake implementation."""
    q, k = _meta(B, S, H, head_dim, dtype=dtype), _meta(B, S, hkv, head_dim, dtype=dtype)
    with pytest.raises(exc, match=message):
        torch.ops.hopper_flash.fwd(q, k, k, scale, False)


def test_op_fake_implementation_checks_the_device():
    """Fake CPU tensors (torch.compile of a CPU call) are refused by name; meta ones only ask for shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(B, S, H, D, dtype=BF16)
        with pytest.raises(ValueError, match="^" + DEVICE_ERROR + "$"):
            torch.ops.hopper_flash.fwd(q, q, q, 0.1, False)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_checks_before_the_op_trace_without_graph_breaks(dynamic, scale):
    """The checks the public call runs before the op (all of them but the
    device's capability) must trace with fullgraph=True, also with dynamic
    shapes, where a float argument becomes a symbol."""
    def f(q, k, v, scale):  # scale an argument: a symbol under dynamic=True
        interface.check_flash_attn_options(dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                           deterministic=False, return_attn_probs=False)
        return q * checks.check_arguments(q, k, v, scale, True)

    torch._dynamo.reset()
    q, k, v = qkv(q_shape=(B, 300, 8, 128), kv_shape=(B, 200, 2, 128))
    out = torch.compile(f, fullgraph=True, dynamic=dynamic, backend="eager")(q, k, v, scale)
    assert torch.equal(out, q * (scale or 1 / math.sqrt(128)))


def test_grad_out_that_tma_cannot_address_is_copied_and_the_rest_kept():
    """The backward takes ``grad_out`` as autograd hands it: layouts TMA can
    address (``checks.tma_problem`` is None) go to the kernel as they are,
    others (the all-stride-0 expansion ``out.sum().backward()`` produces, a
    head axis expanded, a misaligned start) are copied first."""
    from hopper_flash import plan_backward

    out = torch.empty(2, 8, 4, 64, dtype=torch.bfloat16)
    kept = torch.randn(8, 2, 4, 64, dtype=torch.bfloat16).transpose(0, 1)  # batch-major view: addressable
    assert plan_backward.check_grad_out(kept, out) is kept
    buf = torch.randn(2 * 8 * 4 * 64 + 1, dtype=torch.bfloat16)
    for g in (torch.ones((), dtype=torch.bfloat16).expand(2, 8, 4, 64),
              torch.randn(2, 8, 1, 64, dtype=torch.bfloat16).expand(2, 8, 4, 64),
              buf[1:].view(2, 8, 4, 64)):
        assert checks.tma_problem("grad_out", g) is not None
        copied = plan_backward.check_grad_out(g, out)
        assert copied is not g and copied.is_contiguous() and torch.equal(copied, g)
        assert checks.tma_problem("grad_out", copied) is None
    thd_out = torch.empty(16, 4, 64, dtype=torch.bfloat16)
    misaligned_thd = buf[1:1 + 16 * 4 * 64].view(16, 4, 64)
    copied = plan_backward.check_grad_out_thd(misaligned_thd, thd_out)
    assert copied is not misaligned_thd and torch.equal(copied, misaligned_thd)
    assert checks.tma_problem("grad_out", copied.unsqueeze(0)) is None


# FlashAttention-3's further options (hopper/flash_attn_interface.py), on the three entry points.
FA3_REFUSED = [
    ("qv", torch.zeros(1), r"qv must be None \(FA3's extra query part"),
    ("q_descale", torch.ones(1), r"q_descale must be None \(FP8 inputs are not supported"),
    ("k_descale", torch.ones(1), r"k_descale must be None"),
    ("v_descale", torch.ones(1), r"v_descale must be None"),
    ("sm_margin", 8, r"sm_margin must be 0 \(the kernels plan for every SM\), got 8"),
]


def _fa3_calls():
    """Each entry point's call on CPU tensors (the device check comes after the options')."""
    q, k, v = qkv()
    cq = torch.tensor([0, q.shape[1]], dtype=torch.int32)
    yield "flash_attn_func", lambda **kw: flash_attn_func(q, k, v, **kw)
    yield "flash_attn_varlen_func", lambda **kw: hopper_flash.flash_attn_varlen_func(
        q[0], k[0], v[0], cq, cq, q.shape[1], q.shape[1], **kw)
    yield "flash_attn_with_kvcache", lambda **kw: hopper_flash.flash_attn_with_kvcache(q, k, v, **kw)


@pytest.mark.parametrize("option, value, message", FA3_REFUSED, ids=[o for o, _, _ in FA3_REFUSED])
def test_fa3_options_refused_by_name_on_every_entry_point(option, value, message):
    for name, call in _fa3_calls():
        with pytest.raises(NotImplementedError, match=message):
            call(**{option: value})


def test_fa3_options_at_their_no_op_values_pass():
    """FA3's defaults, as FA3 callers pass them, reach the device check; its
    scheduling hints too (flash_attn_func checks them but plans itself)."""
    defaults = dict(qv=None, q_descale=None, k_descale=None, v_descale=None, attention_chunk=0, sm_margin=0,
                    pack_gqa=None)
    for name, call in _fa3_calls():
        with pytest.raises(ValueError, match="q must be a CUDA tensor"):
            call(**defaults)
        with pytest.raises(ValueError, match="q must be a CUDA tensor"):
            call(num_splits=4, pack_gqa=True)
        with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
            call(num_splits=-1)
        with pytest.raises(TypeError, match="pack_gqa must be None or a bool"):
            call(pack_gqa=1)


def test_kvcache_refuses_rotary_positions_by_name():
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=r"rotary_seqlens must be None"):
        hopper_flash.flash_attn_with_kvcache(q, k, v, rotary_seqlens=torch.zeros(1, dtype=torch.int32))


def test_fa3_schedules_are_accepted_and_not_read():
    """FA3's ``scheduler_metadata`` (an int32 tensor from its
    ``get_scheduler_metadata``; hopper_flash's returns an empty one) passes
    on the functions FA3 gives it to, and the call goes on to its next
    check; anything but None or an int32 tensor is refused by name."""
    q, k, v = qkv()
    empty = hopper_flash.get_scheduler_metadata(B, S, S, H, H, D, torch.full((B,), S, dtype=torch.int32))
    assert empty.dtype == torch.int32 and empty.numel() == 0 and empty.device == q.device
    calls = [call for name, call in _fa3_calls() if name != "flash_attn_func"]  # (FA3's flash_attn_func has none)
    for call in calls:
        for metadata in (empty, torch.arange(9, dtype=torch.int32)):
            with pytest.raises(ValueError, match="q must be a CUDA tensor"):
                call(scheduler_metadata=metadata)
        for bad in (torch.zeros(4), [0, 1]):
            with pytest.raises(TypeError, match="scheduler_metadata must be None or an int32 tensor"):
                call(scheduler_metadata=bad)
    with pytest.raises(TypeError, match="cache_seqlens must be a torch.Tensor"):
        hopper_flash.get_scheduler_metadata(B, 1, S, H, H, D, [S] * B)
