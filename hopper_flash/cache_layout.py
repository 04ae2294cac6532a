"""How the kernels read a KV cache, and packed (varlen) queries over one.

* Pages (``[num_pages, page_size, Hkv, D]`` with a page table): read in
  place by the forward kernel where it can (``page_plan``: TMA boxes per
  page, or rows gathered under 16 keys from contiguous pools), else copied
  into a contiguous cache first.
* A contiguous cache ``[B_cache, S_cache, Hkv, D]`` read by the forward
  kernel's VARLEN mode: its rows are one sequence axis (``as_rows``), cache
  row ``r`` starting at ``r`` times the rows between two cache rows
  (``rows_per_slot``), and each sequence's keys an offset and a length on
  it (``slot_rows_args``), which is how ``cache_leftpad`` and FA3's packed
  queries read it.
* ``varlen_over_cache``: packed queries over either, through the VARLEN mode
  (``flash_attn_with_kvcache``'s ``cache_leftpad`` and ``cu_seqlens_q``,
  ``flash_attn_varlen_func``'s ``block_table``).

Nothing here reads a device value on the host.
"""
from __future__ import annotations

import torch

from . import chunked, dispatch, plan

# Page sizes served by TMA straight from the pages (the page is the TMA batch
# coordinate): multiples of a config's block_n, and powers of two from 16 up
# to block_n / 2, which load a tile as one box per page (kernels/forward.py,
# _load_kv_tile), so they keep the contiguous cache's tiles (pages of 16 keys
# with more producer registers, plan.register_split). Smaller pages are read
# from the pages too, the kernel's producer warpgroup copying each tile row
# by row (plan.gathers, the kernel's GATHER mode), where the pools are
# contiguous; other small-page pools are gathered into a contiguous per-batch
# cache first (correct, graph-capturable, not at memory speed).
MIN_TMA_PAGE = plan.GATHER_PAGE


def page_plan(page_size: int, head_dim: int, k_cache=None, v_cache=None) -> bool:
    """Whether a paged cache of ``page_size`` is read by the kernel from its
    pages: by TMA, or (smaller pages) gathered row by row from contiguous
    pools (``k_cache``, ``v_cache``; without them: by TMA only)."""
    head_dim_v = v_cache.shape[3] if v_cache is not None else head_dim
    block_n = plan.CONFIGS[plan.kernel_head_dim(head_dim, head_dim_v)].block_n
    if page_size % block_n == 0 or (page_size >= MIN_TMA_PAGE and block_n % page_size == 0):
        return True
    # A gathered row is the kernel's head dim wide: other head dims (k's or v's) are copied.
    return (plan.gathers(page_size, head_dim) and head_dim in plan.SUPPORTED_HEAD_DIMS and head_dim_v == head_dim
            and k_cache is not None and plan.contiguous_pools(k_cache, v_cache))


def pages_copied(k_cache, v_cache, page_table):
    """Pages the kernel cannot read in place (``page_plan``): each row's pages
    copied into one contiguous cache row ``[batch, max_pages * page_size,
    Hkv, D]`` (correct, graph-capturable, not at memory speed). Entries past
    a row's live pages may be anything: clamped to a valid page."""
    idx = page_table.long().clamp(0, k_cache.shape[0] - 1)
    rows = page_table.shape[1] * k_cache.shape[1]
    return (k_cache[idx].reshape(page_table.shape[0], rows, *k_cache.shape[2:]),
            v_cache[idx].reshape(page_table.shape[0], rows, *v_cache.shape[2:]))


def cache_capacity(k_cache, page_table):
    return page_table.shape[1] * k_cache.shape[1] if page_table is not None else k_cache.shape[1]


def live_pages_invalid(page_table, k_cache, lens) -> bool:
    """Whether an entry of ``page_table`` ``[batch, max_pages]`` that covers
    one of the first ``lens[b]`` keys of its row names no page of the pool
    ``k_cache`` (the opt-in contract checks; reads device values: a sync).
    Entries past a row's live pages may be anything."""
    used = torch.arange(page_table.shape[1], device=page_table.device)[None, :] * k_cache.shape[1] < lens[:, None]
    pages = page_table.long()
    return bool((used & ((pages < 0) | (pages >= k_cache.shape[0]))).any())


def rows_per_slot(k_cache, v_cache) -> int | None:
    """The rows (of the sequence axis's stride) from one cache row's start to
    the next's, where both caches agree on it and their rows do not overlap;
    None otherwise (a cache batch stride that is no whole number of row
    strides, say)."""
    per = []
    for t in (k_cache, v_cache):
        batch_stride, row_stride = t.stride(0), t.stride(1)
        if t.shape[0] == 1:
            per.append(None)  # any spacing: one cache row
        elif row_stride > 0 and batch_stride % row_stride == 0 and batch_stride // row_stride >= t.shape[1]:
            per.append(batch_stride // row_stride)
        else:
            return None
    known = {p for p in per if p is not None}
    if len(known) > 1:
        return None
    return known.pop() if known else k_cache.shape[1]


def as_rows(t, per_slot: int):
    """``[B_cache, S_cache, Hkv, D]`` as one sequence axis ``[rows, Hkv, D]``:
    cache row ``r`` starts at row ``r * per_slot`` (rows between two cache
    rows, if any, are the memory between them)."""
    b, s, h, d = t.shape
    return t.as_strided(((b - 1) * per_slot + s, h, d), (t.stride(1), t.stride(2), t.stride(3)))


def slot_rows_args(k_cache, v_cache, batch: int, cache_batch_idx, cache_leftpad, seqused):
    """A contiguous cache ``[B_cache, S_cache, Hkv, D]`` as the K/V of the
    forward kernel's VARLEN mode with ``seqused_k`` (flash-attn's leftpad is
    likewise a K offset of its varlen machinery): both caches as one sequence
    axis of cache rows (``as_rows``), sequence ``b`` starting at its cache
    row (``cache_batch_idx[b]``, default ``b``) times the rows per slot plus
    ``cache_leftpad[b]`` (default 0) and living for ``seqused[b] -
    cache_leftpad[b]`` keys (its bottom-right causal mask and window counted
    from there, as in flash-attn). Caches whose rows cannot be one axis
    (``rows_per_slot``) are copied first. Returns ``(k, v, cu_k [B + 1],
    seqused_k [B])``, computed on the device (no sync)."""
    per_slot = rows_per_slot(k_cache, v_cache)
    if per_slot is None:
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
        per_slot = k_cache.shape[1]
    dev = k_cache.device
    rows = cache_batch_idx if cache_batch_idx is not None else torch.arange(batch, dtype=torch.int32, device=dev)
    starts = rows * per_slot
    if cache_leftpad is not None:
        starts = starts + cache_leftpad
        seqused = seqused - cache_leftpad
    # [B + 1] like any cu_seqlens (the kernel reads cu_k[b] alone where seqused_k is given)
    cu_k = torch.nn.functional.pad(starts, (0, 1))
    return as_rows(k_cache, per_slot), as_rows(v_cache, per_slot), cu_k, seqused


def varlen_over_cache(q, cu_seqlens_q, max_seqlen_q: int, seqused_q, k_cache, v_cache, seqused, cache_batch_idx,
                      cache_leftpad, page_table, softmax_scale: float, causal, return_lse, window=None, softcap=0.0,
                      sink=None, max_seqlen_k: int | None = None, pack_gqa=None, num_splits: int = 0,
                      chunk: int = 0):
    """Packed (THD) queries ``q`` ``[total_q, H, D]`` (sequence ``b`` at
    ``cu_seqlens_q[b]``) over a KV cache, each sequence's keys the first
    ``seqused[b]`` of its cache row (from ``cache_leftpad[b]`` on) or of its
    pages, by the forward kernel's VARLEN mode: pages read in place where it
    can (``page_plan``; else each row's pages are copied into a contiguous
    cache first), contiguous caches as one sequence axis
    (``slot_rows_args``), with PackGQA (``pack_gqa``, None for
    ``plan.choose_varlen_pack_gqa``) and split-KV (``num_splits``, 0 for
    the heuristic on the host's bounds, ``plan._plan_varlen``). Returns
    ``(out [total_q, H, Dv], lse [H, total_q] or None)``; nothing is read
    on the host.
    ``max_seqlen_k``: a bound on the key lengths (default: the cache's
    capacity). ``chunk``: FA3's ``attention_chunk``: each sequence's chunks
    run as sequences of their own, over pages read in place where ``chunk``
    is a multiple of the page size (``chunked.paged_segments``, with
    ``seqused_q`` or without), else over the contiguous cache or the pages
    copied into one (``chunked.cache_segments``, no ``seqused_q``)."""
    batch = cu_seqlens_q.shape[0] - 1
    capacity = cache_capacity(k_cache, page_table)
    bound = capacity if max_seqlen_k is None else min(int(max_seqlen_k), capacity)
    if page_table is not None:
        page_table = page_table.contiguous()
        page_size = k_cache.shape[1]
        in_place = k_cache.shape[0] == 0 or page_plan(page_size, q.shape[2], k_cache, v_cache)
        if in_place and chunk and chunk % page_size == 0:
            # Every chunk starts at a page: the segments are a paged batch of their own.
            seg, page_table = chunked.paged_segments(cu_seqlens_q, seqused_q, max_seqlen_q, seqused, bound, chunk,
                                                     page_table, page_size)
            cu_seqlens_q, max_seqlen_q, bound, seqused_q, seqused = (seg.cu_seqlens_q, seg.max_seqlen_q,
                                                                     seg.max_seqlen_k, seg.seqused_q, seg.seqused_k)
            chunk = 0
        if in_place and not chunk:
            return dispatch.forward_varlen_validated(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q,
                                                     bound, seqused_q, seqused, softmax_scale, causal,
                                                     return_lse, window=window, softcap=softcap, sink=sink,
                                                     page_table=page_table, pack_gqa=pack_gqa,
                                                     num_splits=num_splits)
        # (A chunk starting inside a page: the pages copied, then the contiguous chunk route.)
        k_cache, v_cache = pages_copied(k_cache, v_cache, page_table)
    k3, v3, cu_k, used_k = slot_rows_args(k_cache, v_cache, batch, cache_batch_idx, cache_leftpad, seqused)
    if chunk:
        assert seqused_q is None
        seg = chunked.cache_segments(cu_seqlens_q, max_seqlen_q, cu_k[:-1], used_k, bound, chunk)
        cu_seqlens_q, cu_k, max_seqlen_q, bound, used_k = (seg.cu_seqlens_q, seg.cu_seqlens_k, seg.max_seqlen_q,
                                                           seg.max_seqlen_k, seg.seqused_k)
    return dispatch.forward_varlen_validated(q, k3, v3, cu_seqlens_q, cu_k, max_seqlen_q, bound, seqused_q,
                                             used_k, softmax_scale, causal, return_lse, window=window,
                                             softcap=softcap, sink=sink, pack_gqa=pack_gqa,
                                             num_splits=num_splits)
