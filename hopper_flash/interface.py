"""The public call: argument checks, then dispatch to the planned kernel.

``flash_attn_func`` follows flash-attn's signature and layout: q is
``[batch, seqlen_q, nheads, headdim]``, k and v ``[batch, seqlen_k, nheads_kv,
headdim]``. Every unsupported input is answered with a ``ValueError`` (or
``TypeError``) that names the argument and says what is expected, before
anything touches the GPU.
"""
from __future__ import annotations

import math
import numbers
from typing import overload, Literal

import torch

from . import plan

# TMA addresses global memory in 16-byte units: the base and every stride
# but the last must be multiples of 16 bytes; the last stride must be 1.
_TMA_ALIGN_BYTES = 16
# TMA strides are encoded in 40 bits (bytes).
_TMA_MAX_STRIDE_BYTES = 1 << 40
# TMA box coordinates and extents are 32-bit per axis.
_TMA_MAX_DIM = (1 << 31) - 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions [batch, seqlen, nheads, headdim], "
                         f"got shape {tuple(t.shape)}")


def _check_tma_addressable(name: str, t: torch.Tensor) -> None:
    """TMA rules for a BSHD operand. Axes of extent 1 are never stepped by the
    kernel, so their strides are free (``plan.tma_strides`` replaces them)."""
    shape, strides, elem = t.shape, t.stride(), t.element_size()
    if strides[3] != 1:
        raise ValueError(f"{name} must be contiguous in its last (headdim) dimension, got strides {strides}; "
                         f"call .contiguous() first")
    if t.data_ptr() % _TMA_ALIGN_BYTES:
        raise ValueError(f"{name}'s data pointer must be {_TMA_ALIGN_BYTES}-byte aligned for TMA, "
                         f"got address {t.data_ptr():#x} (storage offset {t.storage_offset()})")
    for dim in range(3):
        if shape[dim] == 1:
            continue
        stride_bytes = strides[dim] * elem
        if stride_bytes <= 0 or stride_bytes % _TMA_ALIGN_BYTES or stride_bytes >= _TMA_MAX_STRIDE_BYTES:
            what = ("an expanded (stride 0) axis: pass the unexpanded tensor; k/v with fewer heads than q are "
                    "read natively (GQA/MQA)") if stride_bytes == 0 else (
                        f"strides must be positive multiples of {_TMA_ALIGN_BYTES} bytes below 2**40 bytes; "
                        f"call .contiguous() first")
            raise ValueError(f"{name}.stride({dim}) = {strides[dim]} elements ({stride_bytes} bytes) cannot be "
                             f"addressed by TMA: {what}")
        if shape[dim] > _TMA_MAX_DIM:
            raise ValueError(f"{name}.shape[{dim}] = {shape[dim]} exceeds TMA's 2**31 - 1 limit per axis")


_CAPABILITY: dict[int, tuple[int, int]] = {}


def check_device(t: torch.Tensor, name: str = "q") -> None:
    """Raise unless ``t`` lives on a Hopper (sm_90) CUDA device."""
    device = t.device
    if device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor on a Hopper GPU (sm_90), got device '{device}'")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    major, minor = _CAPABILITY[index]
    if major != 9:
        raise ValueError(f"hopper_flash needs a Hopper GPU (compute capability 9.x); {name} is on "
                         f"'{torch.cuda.get_device_name(t.device)}' with compute capability {major}.{minor}")


def _is_numpy_bool(x) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_")


def validate(q, k, v, softmax_scale, causal) -> float:
    """Check the arguments of ``flash_attn_func``; return the softmax scale to use."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have the same dtype, got q {_dtype_name(q.dtype)}, "
                         f"k {_dtype_name(k.dtype)}, v {_dtype_name(v.dtype)}")
    if q.dtype not in plan.SUPPORTED_DTYPES:
        supported = ", ".join(_dtype_name(d) for d in plan.SUPPORTED_DTYPES)
        raise ValueError(f"q.dtype must be one of ({supported}), got {_dtype_name(q.dtype)}")
    batch, seqlen_q, nheads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have q's batch size {batch}, got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v must have q's head dim {head_dim}, got {k.shape[3]}")
    if head_dim not in plan.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim (q.shape[3]) must be one of {plan.SUPPORTED_HEAD_DIMS}, got {head_dim}")
    nheads_kv = k.shape[2]
    if nheads_kv == 0:
        raise ValueError("k and v must have at least one head (k.shape[2] >= 1), got 0")
    if nheads % nheads_kv:
        raise ValueError(f"q's number of heads ({nheads}) must be a multiple of k/v's number of heads "
                         f"({nheads_kv})")
    if not isinstance(causal, bool) and not _is_numpy_bool(causal):
        raise TypeError(f"causal must be a bool, got {type(causal).__module__}.{type(causal).__qualname__}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    else:
        # A real number: not a bool (True would silently mean 1.0), a string or a tensor (a sync).
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a positive float or None, got {softmax_scale!r}")
        softmax_scale = float(softmax_scale)
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    check_device(q)
    if plan.triton_cdiv(seqlen_q, plan.CONFIGS[head_dim].block_m) * nheads * batch > plan.MAX_WORK_ITEMS:
        raise ValueError(f"batch ({batch}) x nheads ({nheads}) x query tiles of seqlen_q ({seqlen_q}) exceeds "
                         f"the limit of {plan.MAX_WORK_ITEMS} work items (the kernel numbers them in int32)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel():
            _check_tma_addressable(name, t)
    return softmax_scale


def forward(q, k, v, softmax_scale, causal, return_lse, out=None):
    """Validated forward; ``out`` lets tests hand in a poisoned buffer."""
    softmax_scale = validate(q, k, v, softmax_scale, causal)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    causal = bool(causal)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q's shape, dtype and device, got {tuple(out.shape)} {out.dtype} "
                         f"on {out.device}")
    elif out.numel():
        _check_tma_addressable("out", out)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    if out.numel() == 0:
        pass  # nothing to compute: no launch
    elif seqlen_k == 0:
        out.zero_()  # no key at all: zero output, -inf LSE, no launch
        if lse is not None:
            lse.fill_(-math.inf)
    else:
        # num_splits=0, pack_gqa=None: the decode heuristics (split-KV,
        # PackGQA) take over when seqlen_q is small next to seqlen_k; large
        # problems get the plain prefill kernel.
        if q.device.index != torch.cuda.current_device():
            with torch.cuda.device(q.device):
                plan.launch_forward(q, k, v, out, lse, softmax_scale, causal, num_splits=0, pack_gqa=None)
        else:
            plan.launch_forward(q, k, v, out, lse, softmax_scale, causal, num_splits=0, pack_gqa=None)
    return (out, lse) if return_lse else out


@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = ...,
                    causal: bool = ..., return_lse: Literal[False] = ...) -> torch.Tensor: ...


@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = ...,
                    causal: bool = ..., return_lse: Literal[True] = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False):
    """Exact attention forward on Hopper, flash-attn compatible.

    Args:
        q: ``[batch, seqlen_q, nheads, headdim]``.
        k, v: ``[batch, seqlen_k, nheads_kv, headdim]``; ``nheads`` must be a
            multiple of ``nheads_kv`` (GQA/MQA, read without a copy).
        softmax_scale: scale of ``q @ k^T`` before the softmax; default
            ``1 / sqrt(headdim)``.
        causal: mask aligned to the bottom-right corner, as flash-attn >= 2.1:
            query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
            Rows that see no key return zeros.
        return_lse: also return the log-sum-exp of the scaled scores,
            ``[batch, nheads, seqlen_q]`` float32, natural log (-inf for rows
            that see no key).

    Returns:
        ``out`` shaped like q (contiguous), or ``(out, lse)``.

    Views work without a copy as long as the head dim is contiguous and the
    other strides are multiples of 16 bytes (for example q, k, v sliced out of
    one packed ``[batch, seqlen, 3, nheads, headdim]`` tensor). Forward only:
    if autograd would need a backward, it raises instead of returning wrong
    gradients.
    """
    if torch.compiler.is_compiling() or torch.is_grad_enabled() and (
            getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
            or getattr(v, "requires_grad", False)):
        # Through the registered op: traceable, and autograd sees it.
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = ops.fwd(q, k, v, float(softmax_scale), bool(causal))
        return (out, lse) if return_lse else out
    return forward(q, k, v, softmax_scale, causal, return_lse)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` on Hopper, for
    ``[batch, heads, seqlen, headdim]`` inputs.

    The inputs are read through BSHD views (no copy when the head dim is
    contiguous) and the result is a ``[batch, heads, seqlen_q, headdim]`` view
    of a BSHD buffer. As in SDPA, ``is_causal`` is aligned to the top-left
    corner, so with unequal lengths it differs from ``flash_attn_func``'s
    bottom-right mask: that case, an explicit ``attn_mask`` and
    ``dropout_p > 0`` raise ``NotImplementedError``. Query heads different from
    key/value heads need ``enable_gqa=True``, as in SDPA.
    """
    if attn_mask is not None:
        raise NotImplementedError("hopper_flash.scaled_dot_product_attention: attn_mask is not supported; "
                                  "use is_causal=True for causal masking")
    if dropout_p != 0.0:
        raise NotImplementedError(f"hopper_flash.scaled_dot_product_attention: dropout_p must be 0.0 "
                                  f"(dropout is not supported), got {dropout_p}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, seqlen, headdim], got {shape}")
    if is_causal and query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            f"hopper_flash.scaled_dot_product_attention: is_causal with seqlen_q ({query.shape[2]}) != "
            f"seqlen_k ({key.shape[2]}) means SDPA's top-left mask, which is not supported; "
            f"flash_attn_func(causal=True) gives the bottom-right mask")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
                         f"for grouped-query attention, as with torch's SDPA")
    out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                          softmax_scale=scale, causal=bool(is_causal))
    return out.transpose(1, 2)


from . import ops  # noqa: E402  (registers the custom op; it calls forward above)
