"""Which query tiles a CTA runs, and in what order.

Work items are (query tile ``bm``, head ``h``, batch ``b``), numbered with the
tile fastest so that the tiles of one head, which read the same K and V, run
close together in time and share L2.

* **Non-persistent** (the seed's grid): one CTA per work item. Within a head,
  item ``j`` is query tile ``n_tiles - 1 - j``, so the longest causal tiles
  launch first and the grid drains with short ones.
* **Persistent**: a grid of at most one CTA per SM, each looping over items.
  Items are dealt out in pairs, round-robin, and within a head they are
  ordered zig-zag (longest, shortest, second longest, second shortest, ...):
  under a causal mask the two tiles of a pair then cost the same number of KV
  tiles together, so a static deal balances without an atomic counter.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def local_tile_count(total_tiles, PERSISTENT: gl.constexpr):
    """How many work items this CTA runs (the host launches at most
    ``cdiv(total_tiles, 2)`` persistent CTAs, so every CTA has one)."""
    if PERSISTENT:
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_pairs = gl.cdiv(total_tiles, 2)
        my_pairs = gl.cdiv(n_pairs - pid, nprog)
        # The last pair is a single item when the total is odd.
        last_is_single = (total_tiles % 2 == 1) & (pid + (my_pairs - 1) * nprog == n_pairs - 1)
        count = 2 * my_pairs - last_is_single.to(gl.int32)
    else:
        count = 1
    return count


@gluon.jit
def tile_coords(i, n_tiles, num_heads, PERSISTENT: gl.constexpr):
    """The ``i``-th work item of this CTA as (query tile, head, batch)."""
    pid = gl.program_id(0)
    if PERSISTENT:
        item = 2 * (pid + (i // 2) * gl.num_programs(0)) + i % 2
        j = item % n_tiles
        bm = gl.where(j % 2 == 0, n_tiles - 1 - j // 2, j // 2)
    else:
        item = pid
        j = item % n_tiles
        bm = n_tiles - 1 - j
    head_batch = item // n_tiles
    return bm, head_batch % num_heads, head_batch // num_heads
