"""Argument checks shared by every path into the kernels.

Three layers, in the order they run, so an error always names the first
argument that is wrong:

- ``check_arguments``: everything decided by shapes, dtypes and Python values.
  It reads no data and no device, so it runs on meta and fake tensors: before
  the custom op, inside the op's fake implementation (torch.compile) and in
  the eager path alike, and CPU tests reach all of it.
- ``check_device``: a CUDA tensor on a Hopper GPU.
- ``check_tma``: strides and data pointers TMA can address; needs real
  tensors (a data pointer), so it runs where the kernel is launched.

``validate`` runs all three, and remembers the CUDA argument signatures
that passed them (``_signature``: everything the three read, the key
length and K/V strides only by class, ``_kv_class``), so a model's repeated
calls, and a decode loop's growing cache, skip them; ``validate_varlen``
does the same for packed (THD) batches (``_varlen_signature``: a
continuous-batching step's layers share one). This module imports
only ``plan``; the public API (``interface``), the custom ops (``ops``) and
the eager entry points (``dispatch``) sit above it.
"""
from __future__ import annotations

import math
import numbers
from functools import lru_cache

import torch

from . import plan

# TMA addresses global memory in 16-byte units: the base and every stride
# but the last must be multiples of 16 bytes; the last stride must be 1.
_TMA_ALIGN_BYTES = 16
# TMA strides are encoded in 40 bits (bytes).
_TMA_MAX_STRIDE_BYTES = 1 << 40
# TMA box coordinates and extents are 32-bit per axis.
_TMA_MAX_DIM = (1 << 31) - 1


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph: the opt-in
    contract checks (a host sync each) are skipped then."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def capture_id() -> int | None:
    """Which CUDA graph capture the current stream is in: 0 when it is not
    capturing, else the capture's id (the driver's, unique per capture in
    the process), or None when capturing and the driver cannot say.

    What a capture computes exists only in its graph: a value derived by
    one capture's kernels may be reused by later calls of the same capture
    (they replay together), never outside it, eagerly or in another one."""
    if not capturing():
        return 0
    return _stream_capture_id(torch.cuda.current_stream().cuda_stream)


@lru_cache(maxsize=None)
def _capture_info_function():
    """The driver's ``cuStreamGetCaptureInfo`` and how many optional
    parameters follow its first three (stream, status and id, the same in
    every version; the optional outputs are passed NULL), or None."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name, optional in (("cuStreamGetCaptureInfo_v2", 3), ("cuStreamGetCaptureInfo_v3", 4),
                           ("cuStreamGetCaptureInfo", 0)):
        function = getattr(driver, name, None)
        if function is not None:
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                                 *[ctypes.c_void_p] * optional]
            return function, optional
    return None


def _stream_capture_id(stream: int) -> int | None:
    import ctypes

    found = _capture_info_function()
    if found is None:
        return None
    function, optional = found
    status, ident = ctypes.c_int(0), ctypes.c_uint64(0)
    result = function(ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(ident), *[None] * optional)
    active = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
    return int(ident.value) if result == 0 and status.value == active and ident.value else None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions [batch, seqlen, nheads, headdim], "
                         f"got shape {tuple(t.shape)}")


def _is_numpy_bool(x) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_")


def check_causal(causal) -> bool:
    if not isinstance(causal, bool) and not _is_numpy_bool(causal):
        raise TypeError(f"causal must be a bool, got {type(causal).__module__}.{type(causal).__qualname__}")
    return bool(causal)


def _is_zero_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == 0


def check_fa3_options(*, qv=None, q_descale=None, k_descale=None, v_descale=None, sm_margin=0,
                      num_splits=0, pack_gqa=None) -> None:
    """FlashAttention-3's further options (``hopper/flash_attn_interface.py``):
    features hopper_flash lacks pass at their no-op values and are refused
    by name otherwise; ``num_splits`` and ``pack_gqa``, FA3's scheduling
    hints, are checked for type (where a function does not honour them its
    docstring says so: the attention computed is the same)."""
    if qv is not None:
        raise NotImplementedError("qv must be None (FA3's extra query part for multi-head latent attention is "
                                  "not supported)")
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None:
            raise NotImplementedError(f"{name} must be None (FP8 inputs are not supported: q, k and v are bf16 or "
                                      f"fp16)")
    if not _is_zero_number(sm_margin):
        raise NotImplementedError(f"sm_margin must be 0 (the kernels plan for every SM), got {sm_margin!r}")
    check_num_splits(num_splits)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None or a bool, got {type(pack_gqa).__name__}")


def check_scheduler_metadata(scheduler_metadata) -> None:
    """FA3's ``scheduler_metadata`` (``get_scheduler_metadata``'s precomputed
    schedule): None, or an int32 tensor, accepted and not read. It only
    tells FA3 how to split the work, never what the attention is, and
    hopper_flash plans each call itself; so code written for FA3's
    schedules (vLLM, SGLang) runs unchanged."""
    if scheduler_metadata is None:
        return
    if not isinstance(scheduler_metadata, torch.Tensor) or scheduler_metadata.dtype != torch.int32:
        got = scheduler_metadata.dtype if isinstance(scheduler_metadata, torch.Tensor) else \
            type(scheduler_metadata).__name__
        raise TypeError(f"scheduler_metadata must be None or an int32 tensor (get_scheduler_metadata's), got {got}")


# FA3's options (qv, the three descales, attention_chunk, sm_margin) as the common call leaves
# them: one tuple comparison passes it.
FA3_DEFAULTS = (None, None, None, None, 0, 0)


def check_num_splits(num_splits) -> int:
    """FA3's ``num_splits``: an int >= 0 (0: the heuristic, 1: no split).
    The default returns at once: this runs on every varlen call."""
    if type(num_splits) is int and num_splits >= 0:
        return num_splits
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: heuristic), got {num_splits!r}")
    return int(num_splits)


def check_softcap(softcap) -> float:
    """flash-attn's ``softcap``: 0 for none, else a finite positive real, the
    cap of ``cap * tanh(score / cap)`` (kernels/softmax.py). Returns a float.
    The default returns at once: this runs on every attention call."""
    if softcap == 0.0 and type(softcap) is float:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"softcap must be a real number (0.0 for none), got {type(softcap).__name__}")
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap >= 0.0):
        raise ValueError(f"softcap must be finite and >= 0 (0.0 for none), got {softcap!r}")
    return softcap


def check_learnable_sink(sink, nheads: int, device) -> None:
    """flash-attn's ``learnable_sink``: None, or a floating tensor
    ``[nheads]`` (one logit per query head) on q's device. Safe on fake
    tensors."""
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor of one logit per query head, or None; "
                        f"got {type(sink).__name__}")
    if not sink.is_floating_point():
        raise ValueError(f"learnable_sink must be a floating-point tensor, got dtype {dtype_name(sink.dtype)}")
    if sink.dim() != 1 or sink.shape[0] != nheads:
        raise ValueError(f"learnable_sink must have shape [nheads] = ({nheads},) (one logit per query head), "
                         f"got {tuple(sink.shape)}")
    if sink.device != device:
        raise ValueError(f"learnable_sink must be on q's device {device}, got {sink.device}")


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """The scale to use: ``1/sqrt(head_dim)`` for None, else a finite positive real."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    # A real number: not a bool (True would silently mean 1.0), a string or a tensor (a sync).
    # (A SymFloat is what the op's fake implementation sees for a traced float under dynamic shapes.)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"softmax_scale must be a positive float or None, got {softmax_scale!r}")
    if not isinstance(softmax_scale, (float, torch.SymFloat)):
        softmax_scale = float(softmax_scale)  # ints, numpy scalars
    # Comparisons rather than math.isfinite: torch.compile(dynamic=True) traces a float as a symbol.
    if not 0 < softmax_scale < math.inf:  # false for NaN too
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    return softmax_scale


_UNBOUNDED_WINDOW = 1 << 30


def window_bounds(window_size, causal) -> tuple[int, int] | None:
    """flash-attn's ``window_size=(left, right)`` as the kernels take it, or
    None for no window. Query ``i`` sees key ``j`` iff ``i + off - left <= j
    <= i + off + right`` (``off = seqlen_k - seqlen_q``, bottom-right aligned);
    -1 leaves a side unbounded; ``causal`` (checked here) sets ``right`` to 0,
    as in flash-attn. ``(-1, -1)``, and ``(-1, anything)`` under ``causal``,
    are no window (plain or causal attention). The default ``(-1, -1)``
    returns at once: this runs on every attention call."""
    if window_size == (-1, -1):
        return None
    causal = check_causal(causal)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for no bound, got {window_size!r}")
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for no bound on that side, got {window_size!r}")
    # Bounds past any sequence length are no bound (and keep the kernels' int32 arithmetic in range).
    left, right = (-1 if w >= _UNBOUNDED_WINDOW else w for w in (left, right))
    if causal:
        right = 0
        if left == -1:
            return None  # plain causal
    elif left == -1 and right == -1:
        return None
    return left, right


def op_window(left: int, right: int, causal) -> tuple[int, int] | None:
    """A custom op's ``window_left, window_right`` as ``window_bounds``'s
    pair, or None, checked as ``window_size`` is (the ops are public:
    ``torch.ops.hopper_flash.*`` may be called with any ints), naming the
    op's arguments."""
    try:
        return window_bounds((left, right), causal)
    except (TypeError, ValueError) as e:
        raise type(e)(f"window_left={left!r}, window_right={right!r}: {e}") from None


def _check_same_device_and_dtype(q, k, v) -> None:
    """q, k and v on one device, of one supported dtype (fixed-length and varlen)."""
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have the same dtype, got q {dtype_name(q.dtype)}, "
                         f"k {dtype_name(k.dtype)}, v {dtype_name(v.dtype)}")
    if q.dtype not in plan.SUPPORTED_DTYPES:
        supported = ", ".join(dtype_name(d) for d in plan.SUPPORTED_DTYPES)
        raise ValueError(f"q.dtype must be one of ({supported}), got {dtype_name(q.dtype)}")


# Head dims without kernels of their own run on the next head dim's
# (plan.kernel_head_dim): multiples of 8 (TMA's 16-byte rows) below the
# largest.
HEAD_DIM_MULTIPLE = 8


def head_dim_message(name: str, head_dim) -> str:
    """The error for a head dim no kernel serves (``name``: where it was read)."""
    return (f"head dim ({name}) must be one of {plan.SUPPORTED_HEAD_DIMS} or a multiple of "
            f"{HEAD_DIM_MULTIPLE} below {max(plan.SUPPORTED_HEAD_DIMS)} (run on the next of those), "
            f"got {head_dim}")


def other_head_dim(head_dim) -> bool:
    """Whether ``head_dim`` has no kernels of its own but runs on the next
    head dim's (``plan.kernel_head_dim``): a multiple of 8 below the
    largest. The kernels read such tensors as they are: TMA's boxes span
    the kernel's head dim, reading zeros past the last feature (which add
    nothing to the scores and give output features nobody reads) and
    clipping the stores there."""
    return (head_dim not in plan.SUPPORTED_HEAD_DIMS and head_dim % HEAD_DIM_MULTIPLE == 0
            and 0 < head_dim < max(plan.SUPPORTED_HEAD_DIMS))


def supported_head_dim(head_dim) -> bool:
    """A kernel's head dim, or ``other_head_dim``."""
    return head_dim in plan.SUPPORTED_HEAD_DIMS or other_head_dim(head_dim)


def _check_kv_shapes(k, v) -> None:
    """k and v agree but for the head dim (v's may differ from q's and k's,
    as in FA3: DeepSeek's 192 for q and k, 128 for v)."""
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")


def _check_heads_and_head_dim(q, k, v, heads_axis: int, kv_heads_axis: int | None = None) -> None:
    """k's head dim equals q's; q's and v's are supported (a kernel's, or
    ``other_head_dim``; they may differ, and run on the kernels of the wider:
    ``plan.kernel_head_dim``); k has heads, and q's are a multiple of them
    (GQA/MQA). ``heads_axis``: 2 for BSHD, 1 for THD; ``kv_heads_axis``:
    k's, where it differs (2 for THD queries over page pools); the head dim
    is the last axis."""
    head_dim, dim_axis = q.shape[-1], q.dim() - 1
    if k.shape[-1] != head_dim:
        raise ValueError(f"k must have q's head dim {head_dim}, got {k.shape[-1]}")
    if not supported_head_dim(head_dim):
        raise ValueError(head_dim_message(f"q.shape[{dim_axis}]", head_dim))
    if not supported_head_dim(v.shape[-1]):
        raise ValueError(head_dim_message(f"v.shape[{dim_axis}]", v.shape[-1]))
    kv_heads_axis = heads_axis if kv_heads_axis is None else kv_heads_axis
    nheads, nheads_kv = q.shape[heads_axis], k.shape[kv_heads_axis]
    if nheads_kv == 0:
        raise ValueError(f"k and v must have at least one head (k.shape[{kv_heads_axis}] >= 1), got 0")
    if nheads % nheads_kv:
        raise ValueError(f"q's number of heads ({nheads}) must be a multiple of k/v's number of heads "
                         f"({nheads_kv})")


def check_arguments(q, k, v, softmax_scale, causal) -> float:
    """Every check that needs no data and no device; returns the softmax scale.

    Safe on meta and fake tensors (torch.compile tracing, the op's fake
    implementation)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    _check_same_device_and_dtype(q, k, v)
    batch, seqlen_q, nheads, head_dim = q.shape
    _check_kv_shapes(k, v)
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have q's batch size {batch}, got {k.shape[0]}")
    _check_heads_and_head_dim(q, k, v, heads_axis=2)
    check_causal(causal)
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    # int(): under dynamic shapes the head dim is a SymInt (unhashable); the kernel specialises on it anyway.
    block_m = plan.CONFIGS[plan.kernel_head_dim(int(head_dim), int(v.shape[3]))].block_m
    if plan.triton_cdiv(seqlen_q, block_m) * nheads * batch > plan.MAX_WORK_ITEMS:
        raise ValueError(f"batch ({batch}) x nheads ({nheads}) x query tiles of seqlen_q ({seqlen_q}) exceeds "
                         f"the limit of {plan.MAX_WORK_ITEMS} work items (the kernel numbers them in int32)")
    return softmax_scale


_CAPABILITY: dict[int, tuple[int, int]] = {}


def check_cuda(t: torch.Tensor, name: str = "q") -> None:
    """Raise unless ``t`` is a CUDA tensor: the part of ``check_device`` that
    Dynamo can trace (no driver query)."""
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor on a Hopper GPU (sm_90), got device '{t.device}'")


def check_op_device(q: torch.Tensor) -> None:
    """Before a custom op's call: ``check_device``, or under tracing only
    ``check_cuda`` (Dynamo cannot trace the driver's capability query; the
    op's fake implementation runs the whole device check, outside Dynamo)."""
    if torch.compiler.is_compiling():
        check_cuda(q)
    else:
        check_device(q)


def check_device(t: torch.Tensor, name: str = "q") -> None:
    """Raise unless ``t`` lives on a Hopper (sm_90) CUDA device. Reads only
    ``t.device``, so it works on fake tensors too."""
    check_cuda(t, name)
    device = t.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    major, minor = _CAPABILITY[index]
    if major != 9:
        raise ValueError(f"hopper_flash needs a Hopper GPU (compute capability 9.x); {name} is on "
                         f"'{torch.cuda.get_device_name(t.device)}' with compute capability {major}.{minor}")


def _steppable(stride_bytes: int) -> bool:
    """TMA can step an axis by this stride: positive, a multiple of 16 bytes,
    below 2**40 bytes. The one statement of the rule
    (``_tma_stride_problems``, ``_kv_class``)."""
    return 0 < stride_bytes < _TMA_MAX_STRIDE_BYTES and not stride_bytes % _TMA_ALIGN_BYTES


@lru_cache(maxsize=4096)
def _tma_stride_problems(shape: tuple[int, ...], strides: tuple[int, ...],
                         elem_bytes: int) -> tuple[str | None, str | None]:
    """What stops TMA from addressing a BSHD tensor of this shape and these
    strides: ``(last, other)``, the last dimension's problem and the first of
    the other axes', as message templates over ``{name}`` (None where there
    is none). Axes of extent 1 are never stepped by the kernel, so their
    strides are free (``plan.tma_strides`` replaces them). Cached: a training
    loop meets the same few layouts."""
    last = None
    if strides[3] != 1:
        last = (f"{{name}} must be contiguous in its last (headdim) dimension, got strides {strides}; "
                f"call .contiguous() first")
    for dim in range(3):
        if shape[dim] == 1:
            continue
        stride_bytes = strides[dim] * elem_bytes
        if not _steppable(stride_bytes):
            what = ("an expanded (stride 0) axis: pass the unexpanded tensor; k/v with fewer heads than q are "
                    "read natively (GQA/MQA)") if stride_bytes == 0 else (
                        f"strides must be positive multiples of {_TMA_ALIGN_BYTES} bytes below 2**40 bytes; "
                        f"call .contiguous() first")
            return last, (f"{{name}}.stride({dim}) = {strides[dim]} elements ({stride_bytes} bytes) cannot be "
                          f"addressed by TMA: {what}")
        if shape[dim] > _TMA_MAX_DIM:
            return last, f"{{name}}.shape[{dim}] = {shape[dim]} exceeds TMA's 2**31 - 1 limit per axis"
    return last, None


def tma_problem(name: str, t: torch.Tensor) -> str | None:
    """Why TMA cannot address the BSHD operand ``t`` (the message names it
    ``name``), or None; an empty tensor is never loaded or stored. The one
    statement of the rules, checked in this order: the last dimension's
    stride, the data pointer's alignment, the other axes. ``check_tma_addressable``
    raises on it, and the backward copies a ``grad_out`` it rejects
    (``plan_backward``)."""
    if not t.numel():
        return None
    last, other = _tma_stride_problems(tuple(t.shape), t.stride(), t.element_size())
    if last is not None:
        return last.format(name=name)
    if t.data_ptr() % _TMA_ALIGN_BYTES:
        return (f"{name}'s data pointer must be {_TMA_ALIGN_BYTES}-byte aligned for TMA, "
                f"got address {t.data_ptr():#x} (storage offset {t.storage_offset()})")
    return None if other is None else other.format(name=name)


def check_tma_addressable(name: str, t: torch.Tensor) -> None:
    """TMA rules for a BSHD operand (``tma_problem``), as a ValueError."""
    problem = tma_problem(name, t)
    if problem is not None:
        raise ValueError(problem)


# Argument signatures ``validate`` has passed, and the scale each resolved to
# (``validate_varlen``'s, tagged "varlen": its three resolved values);
# only for tensors on devices of this type (the CPU tests stub the device
# check for CPU tensors, which must not be remembered as passing).
_PASSED: dict[tuple, float] = {}
_PASSED_LIMIT = 1024
_PASSED_DEVICE_TYPE = "cuda"


@lru_cache(maxsize=1024)  # every layer of a decode step meets its step's shape and strides
def _kv_class(shape, strides, elem_bytes: int) -> tuple:
    """What ``validate``'s checks read of k or v, without the key length or
    the strides themselves, which a growing KV cache changes every step (a
    ``torch.cat`` to one more key): batch, heads and head dim; the length's
    class (0: nothing to launch; 1: its stride is never stepped; past TMA's
    per-axis limit; any other); the last stride; and per other axis whether
    TMA can step it (``_tma_stride_problems``' rule: an extent-1 axis, or a
    positive multiple of 16 bytes below 2**40). Every tensor of one class
    passes the checks if one does. The launch reads the length and the
    strides per call (the plan by the KV tile count, the descriptors), so a
    prepared call (``plan.PreparedForward``) serves the whole class."""
    batch, n, heads, _ = shape  # not 4-D: a ValueError, and no signature
    s0, s1, s2, _ = strides
    return (shape[3], strides[3], batch, heads, batch == 1 or _steppable(s0 * elem_bytes),
            n == 1 or _steppable(s1 * elem_bytes), heads == 1 or _steppable(s2 * elem_bytes),
            0 if n == 0 else 1 if n == 1 else 3 if n > _TMA_MAX_DIM else 2)


def _signature(q, k, v, softmax_scale, causal) -> tuple | None:
    """Everything ``validate``'s verdict depends on: q's shape, strides,
    dtype and device; k's and v's class (``_kv_class``), whether their
    lengths agree, their dtypes and devices; the three data pointers'
    16-byte alignment; and the Python values (with their types: ``causal=1``
    fails where ``True`` passes, though the two are equal as keys). None
    where it cannot be read (not tensors, too few dimensions, sparse
    layouts): the checks then say what is wrong (``validate`` also leaves
    unhashable Python values to them)."""
    try:
        ks, vs, kst, vst, dtype = k.shape, v.shape, k.stride(), v.stride(), k.dtype
        k_class = _kv_class(ks, kst, dtype.itemsize)
        # v laid out as k (transformers' caches, flash-attn's): one class, read once
        v_class = k_class if vs == ks and vst == kst else _kv_class(vs, vst, dtype.itemsize)
        return (q.shape, q.stride(), q.dtype, dtype, v.dtype, q.device, k.device, v.device, k_class, v_class,
                ks[1] == vs[1], q.data_ptr() % _TMA_ALIGN_BYTES, k.data_ptr() % _TMA_ALIGN_BYTES,
                v.data_ptr() % _TMA_ALIGN_BYTES, type(softmax_scale), softmax_scale, type(causal), causal)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def validate(q, k, v, softmax_scale, causal, key=None) -> float:
    """All checks of the forward's arguments, in order; returns the softmax scale.

    A signature that passed once (``_signature``: the checks read nothing
    else) passes again without the checks: this is host time on every
    eager call, and a model's layers repeat a few signatures. ``key``: the
    arguments' ``_signature``, where the caller has it already."""
    key, scale = _recall(_signature(q, k, v, softmax_scale, causal) if key is None else key)
    if scale is not None:
        return scale
    softmax_scale = check_arguments(q, k, v, softmax_scale, causal)
    check_device(q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tma_addressable(name, t)
    _remember(key, q.device, softmax_scale)
    return softmax_scale


def _recall(key) -> tuple:
    """``(key, what it passed with)``, or ``(key, None)`` where it never
    passed; ``(None, None)`` for an unhashable key (an unhashable Python
    value among the arguments: the checks name it)."""
    try:
        return key, _PASSED.get(key)
    except TypeError:
        return None, None


def _remember(key, device: torch.device, value) -> None:
    """Remember a signature that passed, for tensors on ``_PASSED_DEVICE_TYPE``."""
    if key is not None and device.type == _PASSED_DEVICE_TYPE:
        if len(_PASSED) >= _PASSED_LIMIT:
            _PASSED.clear()
        _PASSED[key] = value


# ---------------------------------------------------------------- varlen (THD)

def _check_thd(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must have 3 dimensions [total_tokens, nheads, headdim] (packed varlen layout), "
                         f"got shape {tuple(t.shape)}")


def check_max_seqlen(name: str, value) -> int:
    """A host-side bound: a positive Python int (a SymInt under tracing), never a tensor (reading one is a sync)."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int (a host-side bound on every sequence's length; "
                        f"a tensor would need a device sync), got {type(value).__name__}")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def _check_index_vector(name: str, t, length: int, device: torch.device, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor ({what}), got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype int32 ({what}), got {dtype_name(t.dtype)}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D ({what}), got shape {tuple(t.shape)}")
    if t.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries ({what}), got {t.shape[0]}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")


PREFIX_SUMS = "int32 prefix sums of the sequence lengths, [batch + 1], starting at 0"


def check_cu_seqlens_q(cu_seqlens_q, device) -> int:
    """``cu_seqlens_q``: an int32 ``[batch + 1]`` tensor (``batch >= 1``) on
    ``device``, the batch size it gives (every varlen call's first check of
    it: flash_attn_varlen_func's, paged or not, and flash_attn_with_kvcache's
    packed queries)."""
    if not isinstance(cu_seqlens_q, torch.Tensor):
        raise TypeError(f"cu_seqlens_q must be a torch.Tensor ({PREFIX_SUMS}), got {type(cu_seqlens_q).__name__}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q must be 1-D with batch + 1 >= 2 entries ({PREFIX_SUMS}), got shape "
                         f"{tuple(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    _check_index_vector("cu_seqlens_q", cu_seqlens_q, batch + 1, device, PREFIX_SUMS)
    return batch


def check_varlen_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                           softmax_scale, causal):
    """Every check of ``flash_attn_varlen_func``'s arguments that needs no
    device data; returns ``(softmax_scale, max_seqlen_q, max_seqlen_k)``.

    What only the device knows (monotonic prefix sums starting at 0, ending at
    the totals; lengths within ``max_seqlen_*``; ``seqused`` within its slot)
    is the caller's contract, checked on request by ``check_varlen_contract``.
    Safe on meta and fake tensors."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_thd(name, t)
    _check_same_device_and_dtype(q, k, v)
    total_q, nheads, head_dim = q.shape
    _check_kv_shapes(k, v)
    _check_heads_and_head_dim(q, k, v, heads_axis=1)
    batch = check_cu_seqlens_q(cu_seqlens_q, q.device)
    _check_index_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, q.device,
                        PREFIX_SUMS + ", as many as cu_seqlens_q")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            _check_index_vector(name, t, batch, q.device, "int32 live length of each sequence, [batch]")
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = check_max_seqlen("max_seqlen_k", max_seqlen_k)
    # What is knowable without a sync: lengths that sum to the total and are
    # each at most max_seqlen cannot exceed batch * max_seqlen in all. (With
    # seqused the slots may be longer than the live part: no such bound.)
    if seqused_q is None and total_q > batch * max_seqlen_q:
        raise ValueError(f"q has {total_q} tokens, more than batch ({batch}) x max_seqlen_q ({max_seqlen_q}): "
                         f"max_seqlen_q must be at least the longest sequence in cu_seqlens_q")
    total_k = k.shape[0]
    if seqused_k is None and total_k > batch * max_seqlen_k:
        raise ValueError(f"k has {total_k} tokens, more than batch ({batch}) x max_seqlen_k ({max_seqlen_k}): "
                         f"max_seqlen_k must be at least the longest sequence in cu_seqlens_k")
    check_causal(causal)
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    block_m = plan.CONFIGS[plan.kernel_head_dim(int(head_dim), int(v.shape[2]))].block_m
    if plan.triton_cdiv(max_seqlen_q, block_m) * nheads * batch > plan.MAX_WORK_ITEMS:
        raise ValueError(f"batch ({batch}) x nheads ({nheads}) x query tiles of max_seqlen_q ({max_seqlen_q}) "
                         f"exceeds the limit of {plan.MAX_WORK_ITEMS} work items (the kernel numbers them in int32)")
    return softmax_scale, max_seqlen_q, max_seqlen_k


def _index_signature(t) -> tuple | None:
    """What the checks read of an index vector (``cu_seqlens_*``,
    ``seqused_*``); raises AttributeError for what is not a tensor."""
    return None if t is None else (t.shape, t.dtype, t.device)


def _varlen_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                      softmax_scale, causal) -> tuple | None:
    """Everything ``validate_varlen``'s verdict depends on: q's, k's and v's
    shapes, strides, dtypes, devices and 16-byte alignment; each index
    vector's shape, dtype and device (or its absence); the Python values
    with their types. None where it cannot be read (the checks then name
    what is wrong). Within one step of transformers' continuous batching
    every layer's call has one signature."""
    try:
        return ("varlen", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
                q.device, k.device, v.device, q.data_ptr() % _TMA_ALIGN_BYTES, k.data_ptr() % _TMA_ALIGN_BYTES,
                v.data_ptr() % _TMA_ALIGN_BYTES, _index_signature(cu_seqlens_q), _index_signature(cu_seqlens_k),
                _index_signature(seqused_q), _index_signature(seqused_k), type(max_seqlen_q), max_seqlen_q,
                type(max_seqlen_k), max_seqlen_k, type(softmax_scale), softmax_scale, type(causal), causal)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                    softmax_scale, causal) -> tuple:
    """``check_varlen_arguments``, the device check and TMA's rules for q, k
    and v; returns ``(softmax_scale, max_seqlen_q, max_seqlen_k)``. A
    signature that passed once (``_varlen_signature``) passes again without
    them, as in ``validate``."""
    key, passed = _recall(_varlen_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            seqused_q, seqused_k, softmax_scale, causal))
    if passed is not None:
        return passed
    passed = check_varlen_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                    seqused_k, softmax_scale, causal)
    check_device(q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tma_addressable_thd(name, t)
    _remember(key, q.device, passed)
    return passed


def check_tma_addressable_thd(name: str, t: torch.Tensor) -> None:
    """TMA rules for a THD operand (read as ``[1, total, H, D]``)."""
    check_tma_addressable(name, t.unsqueeze(0))


def prefix_sum_problems(side: str, cu: torch.Tensor, used, total: int | None, bound: int) -> list[str]:
    """What is wrong with one side's device values (reads them: a sync):
    ``cu_seqlens_{side}`` from 0 and non-decreasing, ending within ``total``
    rows (None: no such bound), ``seqused_{side}`` within its slots, every
    live length at most ``bound`` (``max_seqlen_{side}``)."""
    bad = []
    c = cu.long()
    slots = c[1:] - c[:-1]
    lens = used.long() if used is not None else slots
    if int(c[0]) != 0:
        bad.append(f"cu_seqlens_{side}[0] must be 0, got {int(c[0])}")
    if bool((slots < 0).any()):
        bad.append(f"cu_seqlens_{side} must be non-decreasing, got {c.tolist()}")
    if total is not None and int(c[-1]) > total:
        bad.append(f"cu_seqlens_{side}[-1] ({int(c[-1])}) exceeds the {total} tokens of {side}")
    if used is not None and bool(((lens < 0) | (lens > slots)).any()):
        bad.append(f"seqused_{side} must lie in [0, slot length], got {lens.tolist()} for slots "
                   f"{slots.tolist()}")
    if lens.numel() and int(lens.max()) > bound:
        bad.append(f"max_seqlen_{side} ({bound}) is below the longest sequence ({int(lens.max())})")
    return bad


def check_varlen_contract(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                          seqused_k) -> None:
    """The opt-in check of the device values (one host sync): prefix sums
    from 0, non-decreasing, ending within the tensors; every live length at
    most ``max_seqlen_*``; ``seqused`` within its slot. Enabled by
    ``check_contract=True`` or ``HOPPER_FLASH_CHECK_VARLEN=1``."""
    bad = (prefix_sum_problems("q", cu_seqlens_q, seqused_q, q.shape[0], max_seqlen_q)
           + prefix_sum_problems("k", cu_seqlens_k, seqused_k, k.shape[0], max_seqlen_k))
    if bad:
        raise ValueError("flash_attn_varlen_func contract violated: " + "; ".join(bad))
