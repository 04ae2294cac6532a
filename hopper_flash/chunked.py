"""Chunked attention (FlashAttention-3's ``attention_chunk``, Llama 4's local
layers) as a variable-length batch of chunk segments, on the varlen kernels.

With a chunk size ``C``, query ``i`` of a sequence, at key position ``a = i
+ len_k - len_q`` (bottom-right alignment, as the causal mask), sees only
the keys of its own chunk ``floor(a / C) * C .. floor(a / C) * C + C - 1``,
intersected with the causal mask and a sliding window as usual. Queries
with ``a < 0`` lie in a chunk before every key and see none (zeros, LSE
-inf; FA3 has no defined answer there).

Every query of chunk ``c`` sees the same key range, so the call is exactly
a varlen batch whose sequences are the chunks: chunk ``c``'s queries
against chunk ``c``'s keys, both contiguous in the original rows. Within
such a segment the bottom-right offset ``len_k - len_q`` equals the
original one minus ``c * C`` in both coordinates, so ``a - j`` is the same
for every pair: the causal mask and the window carry over unchanged, and
soft-capping, sinks and the LSE are per row anyway. The backward is the
varlen backward's (FA3's own kernels have no chunked backward). Nothing is
copied: the segments are prefix sums over the same q, k and v rows.

Each sequence becomes these segments, in row order (a fixed number per
sequence, most of them empty for most sequences):

- queries with ``a < 0`` (no key; only where ``len_q > len_k`` can be);
- keys before the first query's chunk, with no query (only where ``len_k -
  len_q >= C`` can be: a query block over a longer cache);
- chunk ``first + t`` for ``t < n_chunks``, ``first`` the first query's
  chunk (``n_chunks``: the most chunks a sequence's queries can span, from
  the host bounds; empty past the keys);
- with ``seqused``, the slot's rows past it, as the segment's own unused
  rows (``seqused`` 0: zero output, no gradient).

The lengths are computed on the device from ``cu_seqlens``/``seqused``
(no host sync, CUDA-graph capturable, traced by torch.compile); the host
knows from the shapes which head slots can be non-empty and bounds the
segments' lengths (``Segments``).

Over a paged cache (``paged_segments``) a segment's keys are a run of its
sequence's pages: a chunk starts at a multiple of ``C`` keys, so where ``C``
is a multiple of the page size every chunk starts at a page, and the
segment's page-table row is its sequence's row from that page on (gathered
on the device, each entry clamped to the sequence's last live page). The
keys before the first query's chunk belong to a segment without queries,
which reads none."""
from __future__ import annotations

from typing import NamedTuple

import torch


class Segments(NamedTuple):
    """The chunk segments as a varlen batch: int32 prefix sums over q's and
    k's rows, host bounds on every segment's live length, and (where the
    call had ``seqused``) each segment's live length: a tail segment's is 0,
    so its rows stay the kernels' gaps (zero output, zero gradient), not a
    sequence whose length no bound covers."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor | None  # None over pages (paged_segments: seqused_k alone)
    max_seqlen_q: int
    max_seqlen_k: int
    seqused_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None


def check_attention_chunk(attention_chunk) -> int:
    """``attention_chunk`` as an int >= 0 (0 or None: no chunking), or a
    clear error."""
    if attention_chunk is None:
        return 0
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, int):
        raise TypeError(f"attention_chunk must be an int (0 for none), got {type(attention_chunk).__name__}")
    if attention_chunk < 0:
        raise ValueError(f"attention_chunk must be >= 0 (0 for none), got {attention_chunk}")
    return attention_chunk


def n_chunks(max_seqlen_q: int, max_seqlen_k: int, chunk: int) -> int:
    """Chunk segments per sequence: from its first query's chunk to its last
    key's (the last query's), at most ``ceil(max_seqlen_k / C)`` chunks, and
    at most ``(max_seqlen_q - 1) // C + 2`` (the queries' key positions are
    ``len_q`` consecutive ones; a decode's single query spans one)."""
    return max(1, min(-(-max_seqlen_k // chunk), (max(max_seqlen_q, 1) - 1) // chunk + 2))


def segment_lengths(len_q: torch.Tensor, len_k: torch.Tensor, chunk: int, chunks: int, *, blind_queries: bool,
                    skipped_keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_lens, k_lens)``, int64 ``[batch, slots]``: each sequence's
    segments in row order (the module docstring's list but the tail; a head
    slot only where its flag says it can be non-empty). ``len_q``/``len_k``:
    the live lengths ``[batch]`` on the device."""
    len_q, len_k = len_q.long(), len_k.long()
    offset = len_k - len_q
    first_pos = offset.clamp(min=0)                    # the first query that sees keys: its key position
    first = torch.div(first_pos, chunk, rounding_mode="floor")
    has_q = len_q > 0
    starts = (first[:, None] + torch.arange(chunks, device=len_q.device)[None, :]) * chunk
    ends = torch.minimum(starts + chunk, len_k[:, None])
    q_cols = [torch.where(has_q[:, None], (ends - torch.maximum(starts, first_pos[:, None])).clamp(min=0), 0)]
    k_cols = [torch.where(has_q[:, None], (ends - starts).clamp(min=0), 0)]
    if skipped_keys:  # keys before the first query's chunk; a sequence without queries has every key there
        q_cols.insert(0, torch.zeros_like(len_q)[:, None])
        k_cols.insert(0, torch.where(has_q, first * chunk, len_k)[:, None])
    if blind_queries:  # queries at a < 0
        q_cols.insert(0, (-offset).clamp(min=0)[:, None])
        k_cols.insert(0, torch.zeros_like(len_q)[:, None])
    return torch.cat(q_cols, dim=1), torch.cat(k_cols, dim=1)


def as_batch(out: torch.Tensor, lse: torch.Tensor | None, batch: int, seqlen_q: int):
    """A varlen result over ``batch * seqlen_q`` packed rows back in the
    fixed-length layouts: ``out`` ``[batch, seqlen_q, H, Dv]`` (a view) and
    ``lse`` ``[batch, H, seqlen_q]`` (contiguous, as flash-attn returns it)."""
    nheads = out.shape[1]
    out = out.view(batch, seqlen_q, nheads, out.shape[-1])
    if lse is not None:
        lse = lse.view(nheads, batch, seqlen_q).permute(1, 0, 2).contiguous()
    return out, lse


def _prefix_sums(lengths: torch.Tensor) -> torch.Tensor:
    """int32 ``[n + 1]`` prefix sums (from 0) of the flattened lengths."""
    flat = lengths.reshape(-1)
    return torch.nn.functional.pad(flat.cumsum(0), (1, 0)).to(torch.int32)


def _with_tail(lens: torch.Tensor, slot: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """``lens`` ``[batch, slots]`` with one more slot per sequence: its rows
    past ``used`` in a slot of ``slot`` rows (``seqused``'s gap)."""
    return torch.cat([lens, (slot - used).long()[:, None]], dim=1)


def _live_with_tail(lens: torch.Tensor) -> torch.Tensor:
    """int32 ``[batch * (slots + 1)]``: the segments' live lengths, the tail
    slot (``_with_tail``) holding none."""
    return torch.cat([lens, torch.zeros_like(lens[:, :1])], dim=1).reshape(-1).to(torch.int32)


def _page_rows(page_table: torch.Tensor, first_pages: torch.Tensor, width: int,
               last_pages: torch.Tensor | None = None) -> torch.Tensor:
    """int32 ``[batch, n, width]``: for each ``first_pages[b, i]`` the
    ``width`` entries of ``page_table[b]`` from that page on, each clamped to
    ``last_pages[b]`` (a row's last live page) where given and to the row's
    end."""
    batch, n = first_pages.shape
    pages = first_pages[:, :, None] + torch.arange(width, device=first_pages.device)
    if last_pages is not None:
        pages = torch.minimum(pages, last_pages[:, None, None])
    pages = pages.clamp_(max=page_table.shape[1] - 1)
    return page_table.gather(1, pages.reshape(batch, n * width)).view(batch, n, width)


def fixed_segments(batch: int, seqlen_q: int, seqlen_k: int, chunk: int, device) -> Segments:
    """``flash_attn_func``'s ``[batch, seqlen, ...]`` rows as chunk segments
    (every sequence alike, so the head slots and the bounds are exact)."""
    len_q = torch.full((batch,), seqlen_q, dtype=torch.int64, device=device)
    len_k = torch.full((batch,), seqlen_k, dtype=torch.int64, device=device)
    offset = seqlen_k - seqlen_q
    skipped = (max(offset, 0) // chunk) * chunk
    chunks = -(-seqlen_k // chunk) - skipped // chunk  # from the first query's chunk to the last key's
    q_lens, k_lens = segment_lengths(len_q, len_k, chunk, chunks, blind_queries=offset < 0,
                                     skipped_keys=skipped > 0)
    return Segments(_prefix_sums(q_lens), _prefix_sums(k_lens), max(-offset, min(chunk, seqlen_q), 1),
                    max(skipped, min(chunk, seqlen_k), 1))


def varlen_segments(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_q, seqused_k,
                    max_seqlen_q: int, max_seqlen_k: int, chunk: int) -> Segments:
    """A varlen batch's sequences as chunk segments. The lengths stay on the
    device, so the host bounds are the call's own ``max_seqlen_*`` but where
    the shapes tell more: the same ``cu_seqlens`` for q and k without
    ``seqused`` means every sequence has as many queries as keys (self
    attention, packed training), so no head slot and segments of at most
    ``chunk`` queries."""
    slot_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    slot_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    len_q = slot_q if seqused_q is None else seqused_q
    len_k = slot_k if seqused_k is None else seqused_k
    self_attention = cu_seqlens_q is cu_seqlens_k and seqused_q is None and seqused_k is None
    q_lens, k_lens = segment_lengths(len_q, len_k, chunk, n_chunks(max_seqlen_q, max_seqlen_k, chunk),
                                     blind_queries=not self_attention, skipped_keys=not self_attention)
    max_q = min(chunk, max_seqlen_q) if self_attention else max_seqlen_q
    if seqused_q is None and seqused_k is None:
        return Segments(_prefix_sums(q_lens), _prefix_sums(k_lens), max_q, max_seqlen_k)
    # The rows past seqused: one more slot per sequence, with nothing live in it.
    return Segments(_prefix_sums(_with_tail(q_lens, slot_q, len_q)), _prefix_sums(_with_tail(k_lens, slot_k, len_k)),
                    max_q, max_seqlen_k, _live_with_tail(q_lens), _live_with_tail(k_lens))


def last_chunk_start(live_k: torch.Tensor, chunk: int) -> torch.Tensor:
    """int32 ``[batch]``: where the chunk of each row's last key starts
    (counted from the row's first live key; 0 for a row without keys). A
    single query per row sits at its row's last key position, so it sees
    exactly the keys from there on: the decode route with each row's keys
    starting there (``kvcache``: a left pad, or a page table shifted by it)
    computes the chunked call with split-KV and PackGQA, where the chunk
    segments would run a varlen launch of mostly empty sequences."""
    return torch.div((live_k - 1).clamp(min=0), chunk, rounding_mode="floor").mul(chunk).to(torch.int32)


def shifted_pages(page_table: torch.Tensor, start: torch.Tensor, page_size: int, width: int) -> torch.Tensor:
    """int32 ``[batch, width]``: each row of ``page_table`` from page
    ``start[b] / page_size`` on (``start`` a multiple of the page size),
    entries past the row clamped to its last entry."""
    first = torch.div(start.long(), page_size, rounding_mode="floor")[:, None]
    return _page_rows(page_table, first, width)[:, 0]


def last_chunk_leftpad(seqused: torch.Tensor, chunk: int, cache_leftpad: torch.Tensor | None) -> torch.Tensor:
    """int32 ``[batch]``: each contiguous cache row's first key of its last
    chunk, as the decode route's left pad (``cache_leftpad`` plus
    ``last_chunk_start`` of the keys after it). One launch on the GPU
    (``kernels/last_chunk.py``)."""
    if not seqused.is_cuda:
        pad = 0 if cache_leftpad is None else cache_leftpad
        return (pad + last_chunk_start(seqused - pad, chunk)).to(torch.int32)
    out = torch.empty_like(seqused)
    _launch_last_chunk(seqused, cache_leftpad, out, None, None, None, chunk, 1, 0)
    return out


def last_chunk_pages(seqused: torch.Tensor, chunk: int, page_table: torch.Tensor, page_size: int,
                     width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seqused, page_table)`` of each paged row's last chunk (``chunk`` a
    multiple of ``page_size``): its live keys from the chunk's start, and
    its ``width`` page-table entries from the chunk's first page
    (``shifted_pages``). One launch on the GPU (``kernels/last_chunk.py``)."""
    if not seqused.is_cuda:
        start = last_chunk_start(seqused, chunk)
        return seqused - start, shifted_pages(page_table, start, page_size, width)
    used = torch.empty_like(seqused)
    table = torch.empty((seqused.shape[0], width), dtype=torch.int32, device=seqused.device)
    _launch_last_chunk(seqused, None, None, used, page_table, table, chunk, page_size, width)
    return used, table


def _launch_last_chunk(seqused, leftpad, pad_out, used_out, page_table, table_out, chunk: int, page_size: int,
                       width: int) -> None:
    from . import plan
    from .kernels.last_chunk import last_chunk_kernel

    if seqused.shape[0] == 0:
        return
    paged = page_table is not None
    args = (seqused, leftpad if leftpad is not None else seqused, pad_out if pad_out is not None else seqused,
            used_out if used_out is not None else seqused, page_table if paged else seqused,
            table_out if paged else seqused, chunk, page_size, width, page_table.shape[1] if paged else 1,
            page_table.stride(0) if paged else 0)
    constexprs = {"LEFTPAD": leftpad is not None, "PAGED": paged, "BLOCK": 128}
    plan.launch_triton(last_chunk_kernel, (seqused.shape[0], 1, 1), args, constexprs, num_warps=1)


def paged_segments(cu_seqlens_q: torch.Tensor, seqused_q, max_seqlen_q: int, k_lens: torch.Tensor,
                   max_seqlen_k: int, chunk: int, page_table: torch.Tensor,
                   page_size: int) -> tuple[Segments, torch.Tensor]:
    """Packed queries over a paged cache (sequence ``b``'s keys: the first
    ``k_lens[b]`` keys of the pages ``page_table[b]`` names) as chunk
    segments, with ``chunk`` a multiple of ``page_size``: the segments as a
    paged varlen batch (``seqused_k`` their key lengths, no
    ``cu_seqlens_k``) and their page table, int32 ``[segments,
    ceil(min(chunk, max_seqlen_k) / page_size)]``. With ``seqused_q`` each
    sequence's rows past it are one more segment, with nothing live."""
    assert chunk % page_size == 0, (chunk, page_size)
    slot_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    len_q = slot_q if seqused_q is None else seqused_q
    q_lens, seg_k = segment_lengths(len_q, k_lens, chunk, n_chunks(max_seqlen_q, max_seqlen_k, chunk),
                                    blind_queries=True, skipped_keys=True)
    starts = seg_k.cumsum(1) - seg_k  # each segment's first key in its sequence: a chunk's is a multiple of chunk
    live_k = torch.where(q_lens > 0, seg_k, 0)  # (the keys before the first query's chunk: no query reads them)
    max_k = max(1, min(chunk, max_seqlen_k))
    width = -(-max_k // page_size)
    table = _page_rows(page_table, starts // page_size, width, (k_lens.long() - 1).clamp(min=0) // page_size)
    if seqused_q is None:
        return (Segments(_prefix_sums(q_lens), None, max_seqlen_q, max_k, None, live_k.reshape(-1).to(torch.int32)),
                table.reshape(-1, width))
    # The rows past seqused_q: one more slot per sequence, with nothing live (its page row: the first slot's).
    return (Segments(_prefix_sums(_with_tail(q_lens, slot_q, len_q)), None, max_seqlen_q, max_k,
                     _live_with_tail(q_lens), _live_with_tail(live_k)),
            torch.cat([table, table[:, :1]], dim=1).reshape(-1, width))


def cache_segments(cu_seqlens_q: torch.Tensor, max_seqlen_q: int, k_starts: torch.Tensor, k_lens: torch.Tensor,
                   max_seqlen_k: int, chunk: int) -> Segments:
    """Packed queries over a KV cache's rows as chunk segments: sequence
    ``b``'s keys are the rows ``k_starts[b] .. k_starts[b] + k_lens[b] - 1``
    (``cache_layout.slot_rows_args``: cache rows in any order, which the
    kernels read as ``cu_seqlens_k[s]`` and ``seqused_k[s]`` alone). The
    queries tile q (prefix sums); each segment's keys start where its
    sequence's earlier segments' end, as ``cu_seqlens_k`` (not a prefix sum
    here) with their lengths as ``seqused_k``."""
    len_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    q_lens, seg_k = segment_lengths(len_q, k_lens, chunk, n_chunks(max_seqlen_q, max_seqlen_k, chunk),
                                    blind_queries=True, skipped_keys=True)
    starts = k_starts.long()[:, None] + (seg_k.cumsum(1) - seg_k)
    return Segments(_prefix_sums(q_lens), torch.nn.functional.pad(starts.reshape(-1), (0, 1)).to(torch.int32),
                    max_seqlen_q, max_seqlen_k, None, seg_k.reshape(-1).to(torch.int32))
