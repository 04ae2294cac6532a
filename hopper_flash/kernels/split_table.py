"""Split-KV with a split count per sequence: the forward kernel's
``SPLIT_TABLE`` mode, for packed batches whose keys are skewed.

A uniform split count cuts every sequence's keys into as many pieces. In a
batch of many short decodes beside one long one that is wrong at both ends:
pieces small enough for the long sequence leave the short ones a KV tile or
less per item, and the item overhead (Q load, a partial output per row)
dominates; pieces sized for the short ones leave the long sequence's items
far longer than the mean load per SM, and the grid waits for them.
FA3 gives each sequence its own count (its ``prepare_varlen_num_blocks``);
so does this mode.

The host picks ``blocks_per_split`` (the long sequence's KV tiles over the
launch's largest count, ``plan.varlen_skew_table``), and this kernel,
launched right before the forward kernel, reads each sequence's key length
on the device (no host sync) and writes the table of the launch's items:
sequence ``b`` gets ``clamp(ceil(tiles_b / blocks_per_split), 1,
max_splits)`` entries, one per split ``s``, encoded as ``b << BATCH_SHIFT |
count << SPLIT_BITS | s``. Sequences with more than one split come first,
then the rest: the grid runs items in table order as SMs free up, and
the split sequences' items, each about ``blocks_per_split`` tiles long,
are the longest (an unsplit sequence has fewer tiles than that), so the
longest start first. Entries past the last are -1 (the host bounds the
count without reading lengths, so the table is a little longer): the
forward kernel runs nothing for them.

A sequence with fewer splits than the launch's largest count leaves the
higher split slots of its rows' partials unwritten: the other programs of
this launch fill the partial LSEs with -inf first, and the combine never
reads the output partial of a split whose LSE is -inf
(``kernels/combine.py``).

Plain Triton, one program for the table (sequences in blocks of
``BLOCK_B``, two passes), the others for the fill.
"""
import triton
import triton.language as tl

SPLIT_BITS = tl.constexpr(7)
BATCH_SHIFT = tl.constexpr(14)
# A table entry holds a split index and a split count below 2**SPLIT_BITS,
# and a sequence index below 2**(31 - BATCH_SHIFT).
MAX_SPLITS = (1 << 7) - 1
MAX_BATCH = 1 << (31 - 14)
FILL_BLOCK = 4096  # partial LSEs per fill program


@triton.jit
def _split_counts(cu_k_ptr, used_k_ptr, b, live, blocks_per_split, max_splits, BLOCK_N: tl.constexpr,
                  SEQUSED: tl.constexpr):
    """The split counts of sequences ``b`` (0 where not ``live``)."""
    if SEQUSED:
        length = tl.load(used_k_ptr + b, mask=live, other=0)
    else:
        length = tl.load(cu_k_ptr + b + 1, mask=live, other=0) - tl.load(cu_k_ptr + b, mask=live, other=0)
    tiles = (tl.maximum(length, 0) + BLOCK_N - 1) // BLOCK_N
    splits = tl.minimum(tl.maximum((tiles + blocks_per_split - 1) // blocks_per_split, 1), max_splits)
    return tl.where(live, splits, 0)


@triton.jit(do_not_specialize=["batch", "n_items", "blocks_per_split", "max_splits", "n_lse"])
def split_table_kernel(cu_k_ptr, used_k_ptr, table_ptr, lse_part_ptr, batch, n_items, blocks_per_split, max_splits,
                       n_lse, BLOCK_N: tl.constexpr, SEQUSED: tl.constexpr, BLOCK_B: tl.constexpr,
                       S_MAX: tl.constexpr, FILL: tl.constexpr):
    pid = tl.program_id(0)
    if pid > 0:
        # The fill: partial LSEs [splits, 1, H, total_q] (n_lse of them) to -inf.
        i = (pid - 1).to(tl.int64) * FILL + tl.arange(0, FILL)
        tl.store(lse_part_ptr + i, tl.full([FILL], float("-inf"), tl.float32), mask=i < n_lse)
    else:
        lanes = tl.arange(0, BLOCK_B)
        # Pass 1: how many items the split sequences take (they come first).
        n_first = 0
        for b0 in range(0, batch, BLOCK_B):
            b = b0 + lanes
            splits = _split_counts(cu_k_ptr, used_k_ptr, b, b < batch, blocks_per_split, max_splits, BLOCK_N,
                                   SEQUSED)
            n_first += tl.sum(tl.where(splits > 1, splits, 0), axis=0)
        # Pass 2: each sequence's entries at its place in its group.
        at_first = n_first * 0
        at_rest = n_first
        s = tl.arange(0, S_MAX)
        for b0 in range(0, batch, BLOCK_B):
            b = b0 + lanes
            live = b < batch
            splits = _split_counts(cu_k_ptr, used_k_ptr, b, live, blocks_per_split, max_splits, BLOCK_N, SEQUSED)
            first = splits > 1
            n_f = tl.where(first, splits, 0)
            n_r = tl.where(live & (splits == 1), 1, 0)
            start = tl.where(first, at_first + tl.cumsum(n_f, axis=0) - n_f, at_rest + tl.cumsum(n_r, axis=0) - n_r)
            pos = start[:, None] + s[None, :]
            code = (b << BATCH_SHIFT | splits << SPLIT_BITS)[:, None] | s[None, :]
            # (pos < n_items: a length past the caller's contract cannot write past the table)
            tl.store(table_ptr + pos, code, mask=live[:, None] & (s[None, :] < splits[:, None]) & (pos < n_items))
            at_first += tl.sum(n_f, axis=0)
            at_rest += tl.sum(n_r, axis=0)
        # The entries past the last run nothing.
        for i0 in range(at_rest, n_items, BLOCK_B):
            i = i0 + lanes
            tl.store(table_ptr + i, tl.full([BLOCK_B], -1, tl.int32), mask=i < n_items)
