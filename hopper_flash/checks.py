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

``validate`` runs all three. This module imports only ``plan``; the public
API (``interface``), the custom ops (``ops``) and the eager entry points
(``dispatch``) sit above it.
"""
from __future__ import annotations

import math
import numbers

import torch

from . import plan

# TMA addresses global memory in 16-byte units: the base and every stride
# but the last must be multiples of 16 bytes; the last stride must be 1.
_TMA_ALIGN_BYTES = 16
# TMA strides are encoded in 40 bits (bytes).
_TMA_MAX_STRIDE_BYTES = 1 << 40
# TMA box coordinates and extents are 32-bit per axis.
_TMA_MAX_DIM = (1 << 31) - 1


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


def check_arguments(q, k, v, softmax_scale, causal) -> float:
    """Every check that needs no data and no device; returns the softmax scale.

    Safe on meta and fake tensors (torch.compile tracing, the op's fake
    implementation)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must have the same dtype, got q {dtype_name(q.dtype)}, "
                         f"k {dtype_name(k.dtype)}, v {dtype_name(v.dtype)}")
    if q.dtype not in plan.SUPPORTED_DTYPES:
        supported = ", ".join(dtype_name(d) for d in plan.SUPPORTED_DTYPES)
        raise ValueError(f"q.dtype must be one of ({supported}), got {dtype_name(q.dtype)}")
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
    check_causal(causal)
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    # int(): under dynamic shapes the head dim is a SymInt (unhashable); the kernel specialises on it anyway.
    if plan.triton_cdiv(seqlen_q, plan.CONFIGS[int(head_dim)].block_m) * nheads * batch > plan.MAX_WORK_ITEMS:
        raise ValueError(f"batch ({batch}) x nheads ({nheads}) x query tiles of seqlen_q ({seqlen_q}) exceeds "
                         f"the limit of {plan.MAX_WORK_ITEMS} work items (the kernel numbers them in int32)")
    return softmax_scale


_CAPABILITY: dict[int, tuple[int, int]] = {}


def check_cuda(t: torch.Tensor, name: str = "q") -> None:
    """Raise unless ``t`` is a CUDA tensor: the part of ``check_device`` that
    Dynamo can trace (no driver query)."""
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor on a Hopper GPU (sm_90), got device '{t.device}'")


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


def check_tma_addressable(name: str, t: torch.Tensor) -> None:
    """TMA rules for a BSHD operand. Axes of extent 1 are never stepped by the
    kernel, so their strides are free (``plan.tma_strides`` replaces them)."""
    if not t.numel():
        return  # nothing is loaded or stored
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


def validate(q, k, v, softmax_scale, causal) -> float:
    """All checks of the forward's arguments, in order; returns the softmax scale."""
    softmax_scale = check_arguments(q, k, v, softmax_scale, causal)
    check_device(q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tma_addressable(name, t)
    return softmax_scale
