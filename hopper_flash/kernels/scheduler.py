"""Which work items a CTA runs, and in what order.

Work items are (query tile ``bm``, KV split ``split``, head ``h``, batch
``b``), numbered with the tile fastest, then the split, so that the tiles of
one head, which read the same K and V, run close together in time and share
L2. ``h`` is a query head, or a KV head under PackGQA (the tile then holds the
query rows of every head of the group). Without split-KV there is one split.

* **Non-persistent** (the seed's grid): one CTA per work item. Within a head,
  item ``j`` is query tile ``n_tiles - 1 - j``, so the longest causal tiles
  launch first and the grid drains with short ones.
* **Persistent**: a grid of at most one CTA per SM, each looping over items.
  With more items than SMs, items are dealt out in pairs
  (``pair == 2``), round-robin, and within a head they are ordered zig-zag
  (longest, shortest, second longest, second shortest, ...): under a causal
  mask the two tiles of a pair then cost the same number of KV tiles
  together, so a static deal balances without an atomic counter. With no more
  items than SMs (``pair == 1``) they are dealt singly, longest first, so every
  SM gets work: dealing 128 items in pairs would idle half of 132 SMs.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def local_tile_count(total_tiles, pair, PERSISTENT: gl.constexpr):
    """How many work items this CTA runs (the host launches at most
    ``cdiv(total_tiles, pair)`` persistent CTAs, so every CTA has one)."""
    if PERSISTENT:
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_groups = gl.cdiv(total_tiles, pair)
        my_groups = gl.cdiv(n_groups - pid, nprog)
        # The last pair is a single item when the total is odd (never for pair == 1).
        last_is_single = (total_tiles % pair == 1) & (pid + (my_groups - 1) * nprog == n_groups - 1)
        count = pair * my_groups - last_is_single.to(gl.int32)
    else:
        count = 1
    return count


@gluon.jit
def work_coords(i, n_tiles, n_splits, num_heads, pair, PERSISTENT: gl.constexpr):
    """The ``i``-th work item of this CTA as (query tile, split, head, batch)."""
    pid = gl.program_id(0)
    if PERSISTENT:
        item = pair * (pid + (i // pair) * gl.num_programs(0)) + i % pair
        j = item % n_tiles
        zigzag = gl.where(j % 2 == 0, n_tiles - 1 - j // 2, j // 2)
        bm = gl.where(pair == 2, zigzag, n_tiles - 1 - j)
    else:
        item = pid
        j = item % n_tiles
        bm = n_tiles - 1 - j
    rest = item // n_tiles
    split = rest % n_splits
    head_batch = rest // n_splits
    return bm, split, head_batch % num_heads, head_batch // num_heads
