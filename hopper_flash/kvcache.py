"""``flash_attn_with_kvcache``: decode and chunked prefill against a KV cache.

Follows flash-attn's semantics and names. One decode step is

1. the optional in-place append of the new keys/values ``k``, ``v`` into the
   cache at ``cache_seqlens`` (one Triton kernel, ``kernels/append.py``, no
   host sync; a declared mutation of the custom op), which also applies
   flash-attn's rotary embedding to the new keys and to ``q`` where
   ``rotary_cos``/``rotary_sin`` are given, then
2. attention of ``q`` over the first ``cache_seqlens + seqlen_new`` keys of
   each cache row, run by the forward kernel in its decode modes
   (``plan.launch_forward``): per-batch lengths read on the device, split-KV
   with a combine kernel, PackGQA, paged K/V.

Nothing on this path reads a device value on the host, so a step can be
captured in a CUDA graph and replayed with new ``cache_seqlens``.

**Prepared calls.** An eager call without rotary embedding, packed
queries, chunking (but for a decode step: below), sinks or contract check
whose arguments have the signature of one that ran before
(``prepared_key``: every tensor's shape, strides, dtype, device and
16-byte alignment, and the Python values; a contiguous cache's length and
the strides that follow it left free, as ``flash_attn_func``'s key leaves
k's) skips the checks and the plan and launches the kernels it launched
then for its KV tile count (``plan.PreparedForward``, from C where it
can), with this call's addresses, cache length and strides: as
``flash_attn_func``'s eager calls do. A cache that grows a key per step (a
view ``k_cache[:, :L]``, or transformers' caches re-made one key longer)
keeps its prepared call. With ``k``/``v`` the append runs first, as on the
full path, and the attention reads the lengths after it. A chunked decode
step (``attention_chunk``, one query per row: the decode route over each
row's last chunk, ``kvcache_forward_validated``) derives that chunk from
its own lengths first, in one small launch (``kernels/last_chunk.py``), as
the full path does. A decode loop without CUDA graphs pays that per layer
and step.

**Caller's contract** (as in flash-attn; not checked by default because
checking needs a host sync): ``cache_seqlens[b] + seqlen_new`` is at most the
cache's capacity (``S_cache``, or ``max_pages * page_size``),
``0 <= cache_leftpad[b] <= cache_seqlens[b]``, every
``cache_batch_idx`` entry is a valid cache row, and every page-table entry that
covers a live key is a valid page index. Pass ``check_contract=True`` (or set
``HOPPER_FLASH_CHECK_KVCACHE=1``) to validate these at the cost of one sync.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os

import torch

from . import checks, chunked, dispatch, plan
from .cache_layout import (cache_capacity, live_pages_invalid, page_plan, pages_copied, rows_per_slot,
                           varlen_over_cache)
from .checks import check_device
from .checks import check_tma_addressable as _check_tma_addressable

def _dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def _check_4d(name, t, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions {what}, got shape {tuple(t.shape)}")


def _check_index(name, t, shape_desc, expect_shape, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype int32, got {_dtype_name(t.dtype)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    if tuple(t.shape) != tuple(expect_shape):
        raise ValueError(f"{name} must have shape {shape_desc} = {tuple(expect_shape)}, got {tuple(t.shape)}")


def validate_packed_queries(q, cu_seqlens_q, max_seqlen_q, k) -> tuple[int, int]:
    """FA3's packed queries: q ``[total_q, nheads, headdim]`` with int32
    ``cu_seqlens_q`` ``[batch + 1]`` on q's device and ``max_seqlen_q`` a
    positive int (a host-side bound, as in ``flash_attn_varlen_func``); no
    new keys to append. Returns ``(batch, max_seqlen_q)``."""
    checks._check_thd("q", q)
    batch = checks.check_cu_seqlens_q(cu_seqlens_q, q.device)
    max_seqlen_q = checks.check_max_seqlen("max_seqlen_q", max_seqlen_q)
    if q.shape[0] > batch * max_seqlen_q:
        raise ValueError(f"q has {q.shape[0]} tokens, more than batch ({batch}) x max_seqlen_q ({max_seqlen_q}): "
                         f"max_seqlen_q must be at least the longest sequence in cu_seqlens_q")
    if k is not None:
        raise NotImplementedError("appending new keys (k, v) with packed queries (cu_seqlens_q) is not supported: "
                                  "write them into the cache first, or pass q as [batch, seqlen_q, nheads, headdim]")
    return batch, max_seqlen_q


def validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale,
                     causal, num_splits, pack_gqa, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                     cache_leftpad=None, cu_seqlens_q=None, max_seqlen_q=None):
    """Check everything that can be checked without reading device memory
    (with ``cu_seqlens_q``: ``validate_packed_queries``)."""
    if cu_seqlens_q is None:
        _check_4d("q", q, "[batch, seqlen_q, nheads, headdim]")
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q goes with cu_seqlens_q (packed queries); q [batch, seqlen_q, nheads, "
                             "headdim] has its own")
        batch = q.shape[0]
    else:
        batch, _ = validate_packed_queries(q, cu_seqlens_q, max_seqlen_q, k)
    paged = page_table is not None
    layout = "[num_pages, page_size, nheads_kv, headdim]" if paged else "[batch_cache, seqlen_cache, nheads_kv, headdim]"
    _check_4d("k_cache", k_cache, layout)
    _check_4d("v_cache", v_cache, layout)
    if q.dtype not in plan.SUPPORTED_DTYPES:
        supported = ", ".join(_dtype_name(d) for d in plan.SUPPORTED_DTYPES)
        raise ValueError(f"q.dtype must be one of ({supported}), got {_dtype_name(q.dtype)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {_dtype_name(q.dtype)}, got {_dtype_name(t.dtype)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    nheads, head_dim = q.shape[-2:]
    if head_dim not in plan.SUPPORTED_HEAD_DIMS and not checks.other_head_dim(head_dim):
        raise ValueError(checks.head_dim_message(f"q.shape[{q.dim() - 1}]", head_dim))
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must have the same shape but for the head dim, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    nheads_kv, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache must have q's head dim {head_dim}, got {k_cache.shape[3]}")
    # v's may differ from q's and k's (FA3's hdim_v); equal, it passed q's check (every decode call comes here)
    if head_dim_v != head_dim and not checks.supported_head_dim(head_dim_v):
        raise ValueError(checks.head_dim_message("v_cache.shape[3]", head_dim_v))
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"q's number of heads ({nheads}) must be a multiple of k_cache's ({nheads_kv})")
    if paged:
        pt_shape = (batch, page_table.shape[1]) if isinstance(page_table, torch.Tensor) and page_table.dim() == 2 \
            and page_table.shape[1] > 0 else (batch, "max_pages >= 1")
        _check_index("page_table", page_table, "[batch, max_pages]", pt_shape, q.device)
        page_size = k_cache.shape[1]
        if page_size < 1 or page_size & (page_size - 1) or page_size > 1024:
            raise ValueError(f"page size (k_cache.shape[1]) must be a power of two from 1 to 1024 "
                             f"(1, 16, 64, 128, 256 are tested), got {page_size}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with page_table (index the page table instead)")
    else:
        if cache_batch_idx is None and k_cache.shape[0] < batch:
            raise ValueError(f"k_cache must have at least q's batch size {batch} rows, got {k_cache.shape[0]}")
    if cache_batch_idx is not None:
        _check_index("cache_batch_idx", cache_batch_idx, "[batch]", (batch,), q.device)
    validate_leftpad(batch, q.device, k_cache, v_cache, cache_leftpad, page_table, cu_seqlens_q is not None)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, numbers.Integral):
            raise TypeError(f"cache_seqlens must be an int or an int32 tensor [batch], got "
                            f"{type(cache_seqlens).__name__}")
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
    elif cache_seqlens is not None:
        _check_index("cache_seqlens", cache_seqlens, "[batch]", (batch,), q.device)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append), got "
                         f"k={'None' if k is None else 'a tensor'} and v={'None' if v is None else 'a tensor'}")
    if k is not None:
        for name, t, dim in (("k", k, head_dim), ("v", v, head_dim_v)):
            _check_4d(name, t, "[batch, seqlen_new, nheads_kv, headdim]")
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} must have q's dtype and device ({_dtype_name(q.dtype)}, {q.device}), "
                                 f"got {_dtype_name(t.dtype)} on {t.device}")
            if tuple(t.shape) != (batch, t.shape[1], nheads_kv, dim):
                raise ValueError(f"{name} must have shape [batch, seqlen_new, nheads_kv, headdim] = "
                                 f"({batch}, seqlen_new, {nheads_kv}, {dim}), got {tuple(t.shape)}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must have as many new tokens, got {k.shape[1]} and {v.shape[1]}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    checks.check_num_splits(num_splits)
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None or a bool, got {type(pack_gqa).__name__}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a positive float or None, got {softmax_scale!r}")
        softmax_scale = float(softmax_scale)
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale}")
    validate_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved, cache_capacity(k_cache, page_table))
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor, got device {q.device}")
    check_device(q)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.numel():
            _check_tma_addressable(name, t if t.dim() == 4 else t.unsqueeze(0))
    return softmax_scale


def validate_leftpad(batch: int, device, k_cache, v_cache, cache_leftpad, page_table, packed: bool = False) -> None:
    """``cache_leftpad``: None, or int32 ``[batch]`` on q's device, without
    pages (as in flash-attn); with packed queries over a cache whose rows
    number fewer than 2**31 (``cache_layout.slot_rows_args``' row offsets
    are int32)."""
    if cache_leftpad is None:
        return
    if page_table is not None:  # a paged row starts at its first page's first key
        raise ValueError("cache_leftpad cannot be combined with page_table (as in flash-attn; leave the padding "
                         "out of the page table instead)")
    _check_index("cache_leftpad", cache_leftpad, "[batch]", (batch,), device)
    if packed and k_cache.shape[0] * (rows_per_slot(k_cache, v_cache) or k_cache.shape[1]) >= 2 ** 31:
        raise ValueError(f"cache_leftpad needs fewer than 2**31 cache rows in all (k_cache's batch x its row "
                         f"spacing: {k_cache.shape[0]} x {k_cache.shape[1]} or more)")


def check_contract(k_cache, cache_seqlens_new, cache_batch_idx, page_table, cache_leftpad=None,
                   cache_seqlens=None, packed=None) -> None:
    """The opt-in device-value check (one host sync). ``cache_seqlens``:
    the lengths before the append (bounding ``cache_leftpad``); ``packed``:
    ``(total_q, cu_seqlens_q, max_seqlen_q)`` of packed queries."""
    cap = cache_capacity(k_cache, page_table)
    bad = []
    if packed is not None:
        total_q, cu_seqlens_q, max_seqlen_q = packed
        bad += checks.prefix_sum_problems("q", cu_seqlens_q, None, total_q, max_seqlen_q)
    lens = cache_seqlens_new
    if cache_leftpad is not None and bool(((cache_leftpad < 0) | (cache_leftpad > cache_seqlens)).any()):
        bad.append(f"cache_leftpad must lie in [0, cache_seqlens], got {cache_leftpad.tolist()} for "
                   f"cache_seqlens {cache_seqlens.tolist()}")
    if bool(((lens < 0) | (lens > cap)).any()):
        bad.append(f"cache_seqlens + seqlen_new must lie in [0, {cap}] (the cache's capacity), got "
                   f"{lens.tolist()}")
    if cache_batch_idx is not None and bool(((cache_batch_idx < 0) | (cache_batch_idx >= k_cache.shape[0])).any()):
        bad.append(f"cache_batch_idx entries must lie in [0, {k_cache.shape[0]}), got {cache_batch_idx.tolist()}")
    if page_table is not None and live_pages_invalid(page_table, k_cache, lens):
        bad.append(f"page_table entries covering live keys must lie in [0, {k_cache.shape[0]})")
    if bad:
        raise ValueError("flash_attn_with_kvcache contract violated: " + "; ".join(bad))


def validate_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved, capacity: int) -> None:
    """flash-attn's rotary arguments: ``rotary_cos``/``rotary_sin``
    ``[seqlen_ro, rotary_dim / 2]`` on q's device, in q's dtype or float32,
    with ``rotary_dim <= headdim`` and ``seqlen_ro`` at least the cache's
    capacity (flash-attn's rule), and the new keys given (they are what is
    rotated into the cache)."""
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together, got "
                         f"rotary_cos={'None' if rotary_cos is None else 'a tensor'} and "
                         f"rotary_sin={'None' if rotary_sin is None else 'a tensor'}")
    if k is None:
        raise ValueError("rotary_cos/rotary_sin need the new keys k and v: the rotation is applied to the keys "
                         "appended to the cache and to q (as in flash-attn); rotate q yourself without an append")
    head_dim = q.shape[3]
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must have 2 dimensions [seqlen_ro, rotary_dim / 2], got shape {tuple(t.shape)}")
        if t.dtype not in (q.dtype, torch.float32):
            raise ValueError(f"{name} must have q's dtype {_dtype_name(q.dtype)} or float32, got "
                             f"{_dtype_name(t.dtype)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(rotary_cos.shape)} and "
                         f"{tuple(rotary_sin.shape)}")
    seqlen_ro, half = rotary_cos.shape
    if not 1 <= half <= head_dim // 2:
        raise ValueError(f"rotary_cos.shape[1] (rotary_dim / 2) must lie in [1, {head_dim // 2}] (rotary_dim <= "
                         f"headdim {head_dim}), got {half}")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos must have at least the cache's capacity ({capacity}) rows (positions), "
                         f"got {seqlen_ro}")


def _rows_last_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def append_launch(k_cache, v_cache, k, v, seqlens, cache_batch_idx, page_table, q=None, q_out=None, rotary=None,
                  seqused=None):
    """The append kernel's launch (``kernels/append.py``) as ``(grid, args,
    constexprs)``: ``k``, ``v`` [B, S_new, Hkv, D] into the caches at
    ``seqlens[b] + j``. ``rotary``: None, or ``(cos, sin, interleaved,
    q_pos_step)``, with which the new keys are rotated on the way and ``q``
    is rotated into ``q_out`` (both [B, Sq, H, D]). ``seqused``: None, or
    an int32 vector [B] the kernel fills with ``seqlens + S_new``. Tensors'
    head dims are contiguous (``_rows_last_contiguous``); strides are in
    elements."""
    batch, s_new, nheads_kv, head_dim = k.shape
    head_dim_v = v.shape[3]
    # A power of two: the kernel's rows, masked at head_dim (k, q) and head_dim_v (v).
    width = plan.kernel_head_dim(head_dim, head_dim_v)
    nheads = q.shape[2] if rotary is not None else nheads_kv
    heads = max(nheads, nheads_kv)
    block_h = min(1 << (heads - 1).bit_length(), max(1, 2048 // width))
    rows = batch * s_new + (batch * q.shape[1] if rotary is not None else 0)
    grid = (rows, -(-heads // block_h), 1)
    cos, sin, interleaved, q_pos_step = rotary if rotary is not None else (seqlens, seqlens, False, False)
    q_in, q_o = (q, q_out) if rotary is not None else (k, k)
    paged = page_table is not None
    # Where the kernel reads no tensor it is handed another's pointer (its
    # constexprs never dereference it), so every launch has one signature.
    args = (k, v, k_cache, v_cache, seqlens,
            cache_batch_idx if cache_batch_idx is not None else seqlens,
            page_table if paged else seqlens, seqused if seqused is not None else seqlens, q_in, q_o, cos, sin,
            batch, s_new, q_in.shape[1], nheads_kv, nheads, head_dim, head_dim_v,
            *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            page_table.stride(0) if paged else 0, k_cache.shape[1] if paged else 1,
            *q_in.stride()[:3], *q_o.stride()[:3],
            cos.stride(0) if rotary is not None else 0, cos.shape[0] if rotary is not None else 1,
            cos.shape[1] if rotary is not None else 0)
    constexprs = dict(HEAD_DIM=width, BLOCK_H=block_h, PAGED=paged, BATCH_IDX=cache_batch_idx is not None,
                      ROTARY=rotary is not None, INTERLEAVED=bool(interleaved), Q_POS_STEP=bool(q_pos_step),
                      SEQUSED_OUT=seqused is not None)
    return grid, args, constexprs


def _append(q, k_cache, v_cache, k, v, seqlens, cache_batch_idx, page_table, rotary):
    """Launch the append (and the rotation); returns what the attention
    reads: the queries (``q`` itself, or its rotated copy) and the lengths
    after the append (a fresh int32 vector the append kernel writes, or
    ``seqlens`` itself where nothing is appended): one kernel, where a torch
    add for the lengths would be a second launch on every decode step."""
    from .kernels.append import append_kernel

    k, v = _rows_last_contiguous(k), _rows_last_contiguous(v)
    seqused = torch.empty_like(seqlens) if k.shape[1] else None
    q_out = None
    if rotary is not None:
        cos, sin = rotary[:2]
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:  # the kernel takes one row stride for both
            cos, sin = cos.contiguous(), sin.contiguous()
        rotary = (cos, sin, *rotary[2:])
        q = _rows_last_contiguous(q)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid, args, constexprs = append_launch(k_cache, v_cache, k, v, seqlens, cache_batch_idx, page_table, q, q_out,
                                           rotary, seqused)
    seqused = seqlens if seqused is None else seqused
    if grid[0] == 0:  # (no new token and no query: seqused is an empty batch's)
        return q, seqused
    if all(-2 ** 31 <= a < 2 ** 31 for a in args if type(a) is int):
        plan.launch_triton(append_kernel, grid, args, constexprs, num_warps=4)
    else:  # strides past int32: Triton's JIT types them as 64-bit (the cached fast launch would not)
        append_kernel[grid](*args, **constexprs, num_warps=4)
    return (q_out if q_out is not None else q), seqused


def prepared_key(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale, causal,
                 num_splits, pack_gqa, return_lse, window, softcap, cache_leftpad=None, chunk: int = 0) -> tuple | None:
    """The signature of a call that may take a prepared launch (the module
    docstring): what ``validate_kvcache`` and the plan read of it, the
    pointers' 16-byte alignment (the kernels specialise on it) included,
    but a contiguous cache's length (below). None where a tensor is not a
    plain one (a subclass takes the full path) or has no strides (the
    checks say what is wrong)."""
    tensors = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cache_leftpad)
    if any(t is not None and type(t) is not torch.Tensor for t in tensors):
        return None
    try:
        if page_table is None:
            # A contiguous cache: its length, and the strides that follow it,
            # left free (checks._kv_class, as flash_attn_func's key leaves k's):
            # the plan reads the length by its KV tile count (the prepared
            # call's launches are kept by it) and the launch reads both per
            # call, so a cache that grows (a new tensor per step, or a view
            # k_cache[:, :L]) keeps its prepared call.
            ks, kst, vs, vst = k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride()
            k_class = checks._kv_class(ks, kst, k_cache.element_size())
            same = vs == ks and vst == kst  # (v laid out as k: one class, read once)
            cache = ((k_class, k_cache.dtype, k_cache.device, k_cache.data_ptr() % 16),
                     (k_class if same else checks._kv_class(vs, vst, v_cache.element_size()), v_cache.dtype,
                      v_cache.device, v_cache.data_ptr() % 16), same or ks[1] == vs[1])
            tensors = (q, k, v, cache_seqlens, cache_batch_idx, cache_leftpad)
        else:
            cache = ("paged",)  # (the pool's shape and strides are in parts: its rows are pages)
        parts = [None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors]
    except (RuntimeError, TypeError, ValueError):  # (ValueError: not 4-D, _kv_class; the checks name it)
        return None
    return ("kvcache", *cache, *parts, type(softmax_scale), softmax_scale, type(causal), causal, num_splits,
            type(pack_gqa), pack_gqa, return_lse, window, softcap, chunk)


def _lengths_after_append(cache_seqlens, s_new: int):
    """The live lengths after an append of ``s_new`` keys, as a torch op:
    for the opt-in contract check, which reads them before the append runs
    (the attention reads the vector the append kernel writes, ``_append``)."""
    return cache_seqlens + s_new if s_new else cache_seqlens


def _prepared_layout(cfg, kc, pt, page_table, cache_batch_idx, seqlens, cache_seqlens, leftpad=None,
                     cache_leftpad=None) -> plan.CacheLayout | None:
    """The ``plan.CacheLayout`` under which this call's launch (on ``kc``,
    ``pt``, ``leftpad``) can be replayed by a prepared call with another
    call's addresses, or None where it cannot: the lengths were built or
    copied for this call (``seqlens``, the lengths before any append, are
    not ``cache_seqlens``), so were the left pads (``leftpad`` is not the
    caller's ``cache_leftpad``), the pages were copied (``pt`` is not the
    table) or are gathered from per-call pools, or cache rows go with
    pages."""
    if seqlens is not cache_seqlens or pt is not page_table or leftpad is not cache_leftpad:
        return None
    if pt is not None and (cache_batch_idx is not None or plan.gathers(kc.shape[1], cfg.head_dim)):
        return None
    # (A contiguous cache's length is each call's own: seqlen_k 0, prepared_key.)
    return plan.CacheLayout(seqlen_k=pt.shape[1] * kc.shape[1] if pt is not None else 0,
                            kv_batch=pt is None and cache_batch_idx is not None, paged=pt is not None,
                            page_stride=pt.stride(0) if pt is not None else 0, leftpad=leftpad is not None)


def prepared_call(key, cache_seqlens, cache_batch_idx, page_table, q, k_cache, v_cache, k=None, v=None,
                  cache_leftpad=None):
    """The outputs of the call prepared under ``key`` (``prepared_key``), or
    None where there is none (or it is no longer usable): with ``k``, ``v``,
    their append first (launched as the full path launches it), the
    attention then over the lengths after it."""
    call = plan.prepared(key)
    launch = call.launch_for(k_cache) if call is not None else None
    if launch is None:
        return None  # (before the append: the full path appends)
    seqused = cache_seqlens
    if k is not None:
        with plan.on_device(q):
            _, seqused = _append(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, None)
    layout = call.cache
    if layout.chunk:  # a chunked decode step: its rows' last chunks, from this call's lengths (the full path's way)
        with plan.on_device(q):
            if layout.paged:
                seqused, page_table = chunked.last_chunk_pages(seqused, layout.chunk, page_table, k_cache.shape[1],
                                                               layout.chunk_width)
            else:
                cache_leftpad = chunked.last_chunk_leftpad(seqused, layout.chunk, cache_leftpad)
    return call(q, k_cache, v_cache, (seqused.data_ptr(), cache_batch_idx.data_ptr() if layout.kv_batch else None,
                                      page_table.data_ptr() if layout.paged else None,
                                      cache_leftpad.data_ptr() if layout.leftpad else None), launch)


def kvcache_forward(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale, causal,
                    num_splits, pack_gqa, return_lse, check=None, window=None, softcap=0.0, sink=None,
                    rotary_cos=None, rotary_sin=None, rotary_interleaved=True, cache_leftpad=None,
                    cu_seqlens_q=None, max_seqlen_q=None, chunk: int = 0, prepare_key=None):
    """Validated append + attention; returns ``(out, lse or None)``
    (``[batch, seqlen_q, nheads, headdim_v]`` and ``[batch, nheads,
    seqlen_q]``, or with packed queries ``[total_q, nheads, headdim_v]`` and
    ``[nheads, total_q]``).
    ``window``: ``checks.window_bounds``'s ``(left, right)`` or None;
    ``softcap``: ``checks.check_softcap``'s float; ``sink``: attention
    sinks (checked, ``checks.check_learnable_sink``) or None;
    ``rotary_*``: flash-attn's rotary embedding (``kernels/append.py``);
    ``cache_leftpad``: int32 ``[batch]``, each row's first live key
    (``cache_layout.varlen_over_cache``); ``cu_seqlens_q``, ``max_seqlen_q``: packed
    queries (``validate_packed_queries``); ``chunk``: FA3's ``attention_chunk``
    (``cache_layout.varlen_over_cache``), 0 for none; ``prepare_key``: where
    the launch is direct and can be replayed, remember it under this key
    (``prepared_key``)."""
    softmax_scale = validate_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                                     softmax_scale, causal, num_splits, pack_gqa, rotary_cos, rotary_sin,
                                     rotary_interleaved, cache_leftpad, cu_seqlens_q, max_seqlen_q)
    return kvcache_forward_validated(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                                     softmax_scale, causal, num_splits, pack_gqa, return_lse, check, window, softcap,
                                     sink, rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad, cu_seqlens_q,
                                     max_seqlen_q, chunk, prepare_key)


def kvcache_forward_validated(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table,
                              softmax_scale: float, causal, num_splits, pack_gqa, return_lse, check=None, window=None,
                              softcap=0.0, sink=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                              cache_leftpad=None, cu_seqlens_q=None, max_seqlen_q=None, chunk: int = 0,
                              prepare_key=None):
    """``kvcache_forward`` on arguments that passed ``validate_kvcache`` (or,
    for the paged varlen call, ``paged.check_paged_varlen_arguments``), the
    softmax scale resolved: the checks run once per call."""
    if prepare_key is not None and not all(t is None or t.is_contiguous()
                                           for t in (cache_seqlens, cache_batch_idx, page_table, cache_leftpad)):
        prepare_key = None  # a prepared call passes the caller's tensors' addresses: copies would not be them
    caller_leftpad = cache_leftpad
    # (A pool without pages holds no live key under the contract: nothing to see, nothing TMA could describe.)
    capacity = cache_capacity(k_cache, page_table) if k_cache.shape[0] else 0
    packed = cu_seqlens_q is not None
    if packed:
        batch, seqlen_q, (nheads, head_dim) = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q), q.shape[1:]
        cu_seqlens_q = cu_seqlens_q.contiguous()
    else:
        batch, seqlen_q, nheads, head_dim = q.shape
    # The kernels (the append's, the attention's) read these as dense int32
    # vectors and rows.
    if cache_seqlens is None:
        seqlens = torch.full((batch,), capacity - (k.shape[1] if k is not None else 0), dtype=torch.int32,
                             device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        seqlens = cache_seqlens.contiguous()
    else:
        seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if cache_batch_idx is not None:
        cache_batch_idx = cache_batch_idx.contiguous()
    if page_table is not None:
        page_table = page_table.contiguous()
    s_new = k.shape[1] if k is not None else 0
    # The lengths the attention reads (int32, contiguous): with new keys the
    # append kernel's, below (packed queries take no new keys, validate_kvcache).
    seqused = seqlens
    check = _contract_checked(check)
    if cache_leftpad is not None:
        cache_leftpad = cache_leftpad.contiguous()
    if check and not checks.capturing():  # (a host sync: not while a CUDA graph is captured)
        check_contract(k_cache, _lengths_after_append(seqlens, s_new), cache_batch_idx, page_table, cache_leftpad,
                       seqlens, (q.shape[0], cu_seqlens_q, seqlen_q) if packed else None)
    if packed and seqlen_q and q.shape[0] == batch * seqlen_q:
        # Every sequence has max_seqlen_q queries (lengths of at most that
        # summing to batch times it, the contract): a decode step (SGLang's
        # cu_seqlens_q = arange, max_seqlen_q = 1) or a fixed draft length,
        # run as q [batch, max_seqlen_q, H, D] with split-KV and PackGQA.
        out, lse = kvcache_forward_validated(q.view(batch, seqlen_q, nheads, head_dim), k_cache, v_cache, None, None,
                                             seqused, cache_batch_idx, page_table, softmax_scale, causal, num_splits,
                                             pack_gqa, return_lse, False, window, softcap, sink,
                                             cache_leftpad=cache_leftpad, chunk=chunk)
        return (out.view(q.shape[0], nheads, out.shape[3]),
                lse.permute(1, 0, 2).reshape(nheads, q.shape[0]) if lse is not None else None)
    rotary = None
    if rotary_cos is not None:
        # flash-attn's rule: under a causal or local mask query row i sits at
        # cache_seqlens + i, otherwise every row at cache_seqlens. Its
        # windows reaching past the cache's capacity are no window ("local").
        local = window is not None and any(0 <= w < capacity for w in window)
        rotary = (rotary_cos, rotary_sin, rotary_interleaved, bool(causal) or local)
    if s_new or rotary is not None:
        with plan.on_device(q):
            q, seqused = _append(q, k_cache, v_cache, k, v, seqlens, cache_batch_idx, page_table, rotary)
    last_chunk = None  # (chunk, the shifted table's width): the decode route over each row's last chunk
    if chunk and capacity and seqlen_q == 1 and not packed:
        # One query per row sees its row's last chunk alone: the decode route
        # over the keys from that chunk's start (a left pad; pages: the
        # table shifted by it, where every chunk starts at a page).
        if page_table is None:
            last_chunk = (chunk, 0)
            cache_leftpad, chunk = chunked.last_chunk_leftpad(seqused, chunk, cache_leftpad), 0
        elif chunk % k_cache.shape[1] == 0 and page_plan(k_cache.shape[1], head_dim, k_cache, v_cache):
            width = min(page_table.shape[1], chunk // k_cache.shape[1])
            last_chunk = (chunk, width)
            seqused, page_table = chunked.last_chunk_pages(seqused, chunk, page_table, k_cache.shape[1], width)
            chunk = 0
    if chunk and capacity:
        # FA3's attention_chunk: the varlen mode over the cache with each
        # sequence's chunks as sequences (varlen_over_cache), q's rows packed.
        rows, cu = (q, cu_seqlens_q) if packed else (
            q.flatten(0, 1), torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seqlen_q)
        out, lse = varlen_over_cache(rows, cu, max(seqlen_q, 1), None, k_cache, v_cache, seqused, cache_batch_idx,
                                     cache_leftpad, page_table, softmax_scale, causal, return_lse, window, softcap,
                                     sink, pack_gqa=pack_gqa, num_splits=num_splits, chunk=chunk)
        return (out, lse) if packed else chunked.as_batch(out, lse, batch, seqlen_q)

    if packed:
        if capacity == 0:  # a cache with no rows at all (TMA cannot describe it): nothing to see
            out = torch.zeros(plan.out_shape(q, v_cache), dtype=q.dtype, device=q.device)
            lse = torch.empty((nheads, q.shape[0]), dtype=torch.float32, device=q.device) if return_lse else None
            if lse is not None:
                dispatch.fill_empty_lse(lse, sink)
            return out, lse
        return varlen_over_cache(q, cu_seqlens_q, seqlen_q, None, k_cache, v_cache, seqused, cache_batch_idx,
                                 cache_leftpad, page_table, softmax_scale, causal, return_lse, window, softcap, sink,
                                 pack_gqa=pack_gqa, num_splits=num_splits)
    out = torch.empty(plan.out_shape(q, v_cache), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    if out.numel() == 0:
        return out, lse
    if capacity == 0:
        # A cache with no rows at all (TMA cannot describe it): nothing to see.
        out.zero_()
        if lse is not None:
            dispatch.fill_empty_lse(lse, sink)
        return out, lse
    head_dim_v = v_cache.shape[3]
    cfg = plan.CONFIGS[plan.kernel_head_dim(head_dim, head_dim_v)]
    kc, vc, pt = k_cache, v_cache, page_table
    if page_table is not None:
        if not page_plan(k_cache.shape[1], head_dim, k_cache, v_cache):
            kc, vc = pages_copied(k_cache, v_cache, page_table)
            pt = None
    args = (q, kc, vc, out, lse, softmax_scale, causal, cfg)
    if cache_leftpad is not None and cache_leftpad.data_ptr() % 16:
        cache_leftpad = cache_leftpad.clone()  # (a fresh allocation: the kernel is specialised on 16-byte pointers)
    kwargs = dict(seqused_k=seqused, kv_batch=cache_batch_idx if pt is None else None, page_table=pt,
                  num_splits=num_splits, pack_gqa=pack_gqa, window=window, softcap=softcap,
                  sink=plan.sink_arg(sink), leftpad=cache_leftpad)
    with plan.on_device(q):
        lp = plan.launch_forward(*args, **kwargs)
    if prepare_key is not None and q.device.type == checks._PASSED_DEVICE_TYPE:
        # Prepared at the signature's second launch (plan.sighted), the first
        # counting even where it went through the JIT; only after a direct one.
        if last_chunk is None:
            layout = _prepared_layout(cfg, kc, pt, page_table, cache_batch_idx, seqlens, cache_seqlens, cache_leftpad,
                                      caller_leftpad)
        else:  # (the last chunks' lengths, table and pads are derived per call: prepared_call derives its own)
            layout = _prepared_layout(cfg, kc, pt, pt, cache_batch_idx, seqlens, cache_seqlens, cache_leftpad,
                                      cache_leftpad)
            if layout is not None:
                layout = dataclasses.replace(layout, chunk=last_chunk[0], chunk_width=last_chunk[1])
        if layout is not None and plan.sighted(prepare_key) and lp is not None:
            plan.remember_prepared(prepare_key, lp, q, kc, out, lse, softmax_scale, softcap, cache=layout)
    return out, lse


@torch.library.custom_op("hopper_flash::fwd_kvcache", mutates_args=("k_cache", "v_cache"), device_types="cuda")
def fwd_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_batch_idx: torch.Tensor | None,
                page_table: torch.Tensor | None, softmax_scale: float, causal: bool, num_splits: int,
                pack_gqa: int, window_left: int = -1, window_right: int = -1,
                softcap: float = 0.0, sink: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
                rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = True,
                cache_leftpad: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                max_seqlen_q: int = 0, attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Append + attention; returns ``(out, lse)``. ``pack_gqa``: -1 auto, 0 off, 1 on;
    ``window_left``/``window_right``: ``checks.window_bounds``'s, -1 -1 for none;
    ``softcap``: logit soft-capping, 0.0 for none; ``sink``: attention sinks;
    ``rotary_*``: flash-attn's rotary embedding of the new keys and q;
    ``cache_leftpad``: each row's first live key; ``cu_seqlens_q``,
    ``max_seqlen_q``: packed queries (FA3's; 0: none); ``attention_chunk``:
    FA3's chunked attention (0: none)."""
    window = checks.op_window(window_left, window_right, causal)
    checks.check_learnable_sink(sink, q.shape[-2], q.device)
    out, lse = kvcache_forward(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale,
                               causal, num_splits, None if pack_gqa < 0 else bool(pack_gqa), True, window=window,
                               softcap=checks.check_softcap(softcap), sink=sink, rotary_cos=rotary_cos,
                               rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                               cache_leftpad=cache_leftpad, cu_seqlens_q=cu_seqlens_q,
                               max_seqlen_q=max_seqlen_q if cu_seqlens_q is not None else None,
                               chunk=attention_chunk)
    return out, lse


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale, causal,
                      num_splits, pack_gqa, window_left=-1, window_right=-1, softcap=0.0, sink=None, rotary_cos=None,
                      rotary_sin=None, rotary_interleaved=True, cache_leftpad=None, cu_seqlens_q=None,
                      max_seqlen_q=0, attention_chunk=0):
    checks.op_window(window_left, window_right, causal)
    chunked.check_attention_chunk(attention_chunk)
    checks.check_softcap(softcap)
    checks.check_learnable_sink(sink, q.shape[-2], q.device)
    if cu_seqlens_q is not None:
        batch, _ = validate_packed_queries(q, cu_seqlens_q, max_seqlen_q, k)
    else:
        batch = q.shape[0]
    if rotary_cos is not None or rotary_sin is not None:  # shapes, dtypes, devices: checkable at trace time
        validate_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved, cache_capacity(k_cache, page_table))
    validate_leftpad(batch, q.device, k_cache, v_cache, cache_leftpad, page_table, cu_seqlens_q is not None)
    out = torch.empty(plan.out_shape(q, v_cache), dtype=q.dtype, device=q.device)
    if cu_seqlens_q is not None:  # flash-attn's varlen LSE layout
        return out, torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    batch, seqlen_q, nheads, _ = q.shape
    return out, torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, pack_gqa=None,
                            return_softmax_lse=False, check_contract=None, learnable_sink=None, cu_seqlens_q=None,
                            max_seqlen_q=None, cu_seqlens_k_new=None, qv=None, rotary_seqlens=None, q_descale=None,
                            k_descale=None, v_descale=None, attention_chunk=0, scheduler_metadata=None,
                            sm_margin=0):
    """Attention of ``q`` over a KV cache, with an optional in-place append.

    Args:
        q: ``[batch, seqlen_q, nheads, headdim]`` (bf16/fp16, headdim 64/128/256),
            or with ``cu_seqlens_q`` packed: ``[total_q, nheads, headdim]``.
        k_cache, v_cache: ``[batch_cache, seqlen_cache, nheads_kv, headdim]``,
            or paged ``[num_pages, page_size, nheads_kv, headdim]`` with
            ``page_table``. ``nheads`` must be a multiple of ``nheads_kv``.
            v_cache's head dim may differ from q's and k_cache's (as in
            ``flash_attn_func``; the output has v's).
        k, v: optional new keys/values ``[batch, seqlen_new, nheads_kv,
            headdim]``, written into the caches in place at ``cache_seqlens``.
        cache_seqlens: int or int32 tensor ``[batch]``: each cache row's live
            length before the append (None: the whole cache is live).
        cache_batch_idx: int32 ``[batch]``: the cache row of each batch entry.
        page_table / block_table (FA2's name): int32 ``[batch, max_pages]``.
        causal: bottom-right mask: query ``i`` sees key ``j`` iff
            ``j <= i + seqlen_k - seqlen_q`` with ``seqlen_k`` the live length
            after the append.
        window_size: ``(left, right)`` sliding window, flash-attn's: query
            ``i`` sees keys ``i + off - left .. i + off + right`` (``off =
            seqlen_k - seqlen_q`` per row, -1 = no bound; ``causal`` makes
            ``right`` 0). Each distinct window compiles once.
        softcap: logit soft-capping as in ``flash_attn_func`` (0.0: none).
        learnable_sink: attention sinks as in ``flash_attn_func`` (a
            floating ``[nheads]`` tensor; inference: no gradient).
        rotary_cos, rotary_sin: optional ``[seqlen_ro, rotary_dim / 2]``
            (q's dtype or float32; ``seqlen_ro`` at least the cache's
            capacity): flash-attn's rotary embedding, given with ``k``/``v``.
            The first ``rotary_dim`` features of the new keys are rotated at
            their cache positions ``cache_seqlens + j`` before they are
            written; q's rows are rotated at ``cache_seqlens + i`` under a
            causal or local mask, else all at ``cache_seqlens`` (q itself is
            not modified).
        rotary_interleaved: pairs features ``(0, 1), (2, 3), ...`` (True,
            GPT-J) or ``(0, rotary_dim / 2), ...`` (False, GPT-NeoX).
        cache_leftpad: int32 ``[batch]``: each cache row's first live key
            (flash-attn's; contiguous caches only, not with pages). Row ``b``
            attends to keys ``cache_leftpad[b] .. seqlen_k - 1``: its causal
            mask and window count from there (``seqlen_k - cache_leftpad``
            keys), while new keys are still written, and rotated, at their
            cache positions ``cache_seqlens + j``. The decode modes read
            each row from its pad on (split-KV and PackGQA as without one);
            with packed queries, the varlen mode.
        cu_seqlens_q, max_seqlen_q: FA3's packed queries: int32 ``[batch +
            1]`` prefix sums on q's device and a host-side bound on every
            query length (as in ``flash_attn_varlen_func``); sequence ``b``'s
            queries attend to its cache row's keys, bottom-right causal
            against its own length, without an append (``k``/``v`` None)
            or rotary embedding. Where every sequence has ``max_seqlen_q``
            queries (``total_q == batch * max_seqlen_q``, known from shapes:
            a decode step) the call is the unpacked one's, split-KV and
            PackGQA included; otherwise the forward kernel's varlen mode runs
            it (PackGQA and split-KV as ``pack_gqa`` and ``num_splits`` say). The output is then
            ``[total_q, nheads, headdim_v]`` and the LSE ``[nheads,
            total_q]``.
        cu_seqlens_k_new: FA3's packed new keys: accepted where no new keys
            are given (k None), where FA3 ignores it too.
        alibi_slopes: flash-attn's, accepted only as None.
        attention_chunk: FA3's chunked attention as in ``flash_attn_func``
            (each row's keys counted from its left pad), after the append.
            A decode step (one query per row) runs the decode route over
            each row's last chunk (its start as a left pad, or the page
            table shifted to it), with split-KV and PackGQA; longer queries
            run as the varlen mode over the cache's rows with each row's
            chunks as segments (``cache_layout.varlen_over_cache``). With
            ``page_table`` the pages are read
            in place where the chunk is a multiple of the page size (each
            chunk then starts at a page); otherwise each row's pages are
            copied into a contiguous row first (correct, not at memory
            speed).
        qv, rotary_seqlens, q_descale, k_descale, v_descale, sm_margin:
            FlashAttention-3's options, accepted at their no-op values (None,
            0) only; other values raise ``NotImplementedError``.
        scheduler_metadata: FA3's precomputed schedule
            (``get_scheduler_metadata``): None or an int32 tensor, accepted
            and not read (every call is planned here; the schedule never
            changes the result).
        num_splits: KV splits (0: heuristic); pack_gqa: None = heuristic.
        return_softmax_lse: also return the LSE ``[batch, nheads, seqlen_q]``
            (packed queries: ``[nheads, total_q]``).
        check_contract: validate the device values (lengths within the cache,
            left pads within the lengths, valid rows and pages) at the cost of
            one host sync; default from
            ``HOPPER_FLASH_CHECK_KVCACHE``. See the module docstring.
    """
    if page_table is not None and block_table is not None:
        raise ValueError("pass page_table or block_table (FA2's name for it), not both")
    if block_table is not None:
        page_table = block_table
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes must be None (ALiBi is not supported)")
    chunk = 0
    if (qv, q_descale, k_descale, v_descale, attention_chunk, sm_margin) != checks.FA3_DEFAULTS:
        chunk = chunked.check_attention_chunk(attention_chunk)
        checks.check_fa3_options(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                 sm_margin=sm_margin)
    if rotary_seqlens is not None:
        raise NotImplementedError("rotary_seqlens must be None (the rotary embedding starts at cache_seqlens)")
    if scheduler_metadata is not None:
        checks.check_scheduler_metadata(scheduler_metadata)  # (accepted, not read: each call is planned here)
    if cu_seqlens_k_new is not None and k is not None:
        raise NotImplementedError("cu_seqlens_k_new (packed new keys) is not supported: pass k and v as "
                                  "[batch, seqlen_new, nheads_kv, headdim], or write them into the cache first")
    if cu_seqlens_q is None and max_seqlen_q is not None:
        raise ValueError("max_seqlen_q goes with cu_seqlens_q (packed queries); q [batch, seqlen_q, nheads, "
                         "headdim] has its own")
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    checks.check_num_splits(num_splits)
    window = checks.window_bounds(window_size, causal)
    softcap = checks.check_softcap(softcap)
    if learnable_sink is not None and isinstance(q, torch.Tensor) and q.dim() == (3 if cu_seqlens_q is not None
                                                                                   else 4):
        # Checked before anything runs (the append mutates the cache); a bad
        # q is reported by q's own checks below.
        checks.check_learnable_sink(learnable_sink, q.shape[-2], q.device)
    if torch.compiler.is_compiling() or torch.is_grad_enabled() and getattr(q, "requires_grad", False):
        if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
            packed = isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1  # (else the fake says so)
            batch = cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
            cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        out, lse = fwd_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, float(scale),
                               bool(causal), int(num_splits), -1 if pack_gqa is None else int(bool(pack_gqa)),
                               *(window or (-1, -1)), softcap,
                               None if learnable_sink is None else learnable_sink.detach(),  # (no gradient)
                               rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad, cu_seqlens_q,
                               0 if cu_seqlens_q is None else checks.check_max_seqlen("max_seqlen_q", max_seqlen_q),
                               chunk)
        return (out, lse) if return_softmax_lse else out
    key = None
    if (rotary_cos is None and rotary_sin is None and cu_seqlens_q is None
            and (not chunk or isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] == 1)
            and learnable_sink is None and isinstance(cache_seqlens, torch.Tensor)
            and not _contract_checked(check_contract)):
        # (A chunked call is prepared only as a decode step: one query per row.)
        key = prepared_key(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale,
                           causal, num_splits, pack_gqa, bool(return_softmax_lse), window, softcap, cache_leftpad,
                           chunk)
        if key is not None:
            result = prepared_call(key, cache_seqlens, cache_batch_idx, page_table, q, k_cache, v_cache, k, v,
                                   cache_leftpad)
            if result is not None:
                return result
    out, lse = kvcache_forward(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, softmax_scale,
                               causal, num_splits, pack_gqa, return_softmax_lse, check_contract, window, softcap,
                               learnable_sink, rotary_cos, rotary_sin, rotary_interleaved, cache_leftpad,
                               cu_seqlens_q, max_seqlen_q, chunk, key)
    return (out, lse) if return_softmax_lse else out


def _contract_checked(check_contract) -> bool:
    """Whether this call checks the caller's contract (``check_contract``;
    None: ``HOPPER_FLASH_CHECK_KVCACHE``): a host sync, so never a prepared
    call."""
    if check_contract is None:
        return os.environ.get("HOPPER_FLASH_CHECK_KVCACHE", "0") not in ("", "0")
    return bool(check_contract)
