"""A decode step's last chunk (FA3's ``attention_chunk``), one launch.

A single query per cache row sits at its row's last key, so under chunked
attention it sees exactly the keys of that key's chunk: the row's live keys
from ``start = floor((live - 1) / chunk) * chunk`` on (0 for a row without
keys; ``live``: the row's keys after its left pad). ``kvcache.py`` then runs
the plain decode route over those keys alone, told where they start:

* contiguous caches: as a left pad, ``cache_leftpad[b] + start`` (the
  ``LEFTPAD`` mode of the forward kernel);
* paged caches, ``chunk`` a multiple of the page size: as the page-table
  row from page ``start / page_size`` on, ``width`` entries, each past the
  row's end clamped to its last entry, and ``seqused[b] - start`` live keys.

One program per row. The same as ``chunked.last_chunk_start`` and
``chunked.shifted_pages`` (torch ops, the CPU path and the GPU tests'
reference), in one launch instead of about a dozen small ones: a decode
step's host time and, under graph replay, its GPU time between kernels.
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["chunk", "page_size", "width", "n_pages", "table_stride"])
def last_chunk_kernel(seqused_ptr, leftpad_ptr, pad_out_ptr, used_out_ptr, table_ptr, table_out_ptr,
                      chunk, page_size, width, n_pages, table_stride,
                      LEFTPAD: tl.constexpr, PAGED: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    used = tl.load(seqused_ptr + b)
    if LEFTPAD:
        pad = tl.load(leftpad_ptr + b)
    else:
        pad = used * 0
    start = (tl.maximum(used - pad - 1, 0) // chunk) * chunk
    if PAGED:
        tl.store(used_out_ptr + b, used - start)
        first = start // page_size
        row = table_ptr + b.to(tl.int64) * table_stride
        for j0 in range(0, width, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            entry = tl.load(row + tl.minimum(first + j, n_pages - 1), mask=j < width)
            tl.store(table_out_ptr + b.to(tl.int64) * width + j, entry, mask=j < width)
    else:
        tl.store(pad_out_ptr + b, pad + start)
