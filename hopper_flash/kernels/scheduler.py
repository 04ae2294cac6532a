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
* **Dynamic** (persistent, ``DYNAMIC``; FA3's scheduler for causal and
  varlen): a CTA's first item is its program id; each later one comes from an
  atomic counter that the host zeroes per call (``next = counter++ + grid``),
  so a CTA that drew short items draws more, and the last wave is made of the
  shortest ones. A static deal can lose up to one item pair per CTA to that
  last wave (a simulation said 2-5% of causal prefill); on the H200 the
  dynamic order measured 3% faster at B4 H32 S2048 and B2 H16 S12345, under
  1% at S8192, and took the mixed-length varlen forward from 0.81x to 1.05x
  FA3's (BENCHMARKS.md, fifth session). Items are numbered longest first inside L2
  *sections*: the (batch, head) pairs are cut into runs of ``section`` heads
  (as many as keep their K and V in L2), and inside a section the head runs
  fastest, then the query tile, from the last (longest causal) tile down.
  The producer warp draws each next item while its loads are in flight,
  decodes it, and hands item and coordinates to the consumers through a
  two-slot ring in shared memory.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .compat import thread_barrier
from .pipeline import release, ring_slot, wait_empty, wait_full

# Slots of the ring through which the producer hands out items.
SCHED_STAGES = gl.constexpr(2)


@gluon.jit
def first_item(total_tiles, pair, PERSISTENT: gl.constexpr, DYNAMIC: gl.constexpr):
    """``(item, limit)`` that start a partition's item loop, ``while item <
    limit``: in the dynamic order this CTA's first item is its program id and
    the next ones are drawn (``limit`` is the item count); in the static deal
    ``item`` counts this CTA's items from 0 up to ``local_tile_count``."""
    if DYNAMIC:
        item = gl.program_id(0)
        limit = total_tiles
    else:
        item = gl.program_id(0) * 0
        limit = local_tile_count(total_tiles, pair, PERSISTENT)
    return item, limit


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
def work_coords(i, n_tiles, n_splits, num_heads, pair, PERSISTENT: gl.constexpr, PAIR_SELECT: gl.constexpr = False):
    """The ``i``-th work item of this CTA as (query tile, split, head, batch).
    ``PAIR_SELECT``: ``pair`` (1 or 2, plan.deal) is applied by a select
    instead of a run-time division."""
    pid = gl.program_id(0)
    if PERSISTENT:
        if PAIR_SELECT:
            two = pair == 2
            item = pair * (pid + gl.where(two, i >> 1, i) * gl.num_programs(0)) + gl.where(two, i & 1, 0)
        else:
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


@gluon.jit
def section_coords(item, n_tiles, num_heads, batch, section):
    """Item ``item`` of the dynamic order as (query tile, split, head, batch):
    sections of ``section`` (batch, head) pairs, head fastest inside one, then
    the query tile from the last down (the last section may hold fewer heads)."""
    per_section = section * n_tiles
    sec = item // per_section
    hb0 = sec * section
    heads = gl.minimum(section, num_heads * batch - hb0)
    r = item - sec * per_section
    hb = hb0 + r % heads
    return n_tiles - 1 - r // heads, item * 0, hb % num_heads, hb // num_heads


@gluon.jit
def draw_item(counter_ptr):
    """Producer: the next item for this CTA (the first is its program id)."""
    return gl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu") + gl.num_programs(0)


# A slot holds the item number and its decoded (query tile, head, batch): the
# producer decodes each item for its own loads anyway, and the consumers,
# which take it between two items while the tensor cores wait, then skip
# section_coords' three run-time divisions (a few hundred cycles of latency).
SCHED_FIELDS = gl.constexpr(4)


@gluon.jit
def publish_item(item, bm, h, b, sched_smem, sched_full, sched_empty, order):
    """Producer: hand ``item``, decoded as ``(bm, h, b)``, to the consumers as
    this CTA's item number ``order + 1`` (an item past the last tells them to
    stop; its coordinates are then not read)."""
    wait_empty(sched_empty, order, SCHED_STAGES)
    slot = ring_slot(order, SCHED_STAGES)
    fields: gl.constexpr = gl.BlockedLayout([SCHED_FIELDS], [32], [gl.num_warps()], [0])
    k = gl.arange(0, SCHED_FIELDS, layout=fields)
    packed = gl.where(k == 0, item, gl.where(k == 1, bm, gl.where(k == 2, h, b)))
    sched_smem.index(slot).store(packed)
    mbarrier.arrive(sched_full.index(slot), count=1)


@gluon.jit
def receive_item(sched_smem, sched_full, sched_empty, order):
    """Consumer: ``(item, bm, h, b)`` as ``publish_item`` handed them out at ``order``."""
    wait_full(sched_full, order, SCHED_STAGES)
    slot = ring_slot(order, SCHED_STAGES)
    # Every thread reads the whole slot (one vector load), and picks the fields in registers.
    fields: gl.constexpr = gl.BlockedLayout([SCHED_FIELDS], [32], [gl.num_warps()], [0])
    packed = sched_smem.index(slot).load(fields)
    k = gl.arange(0, SCHED_FIELDS, layout=fields)
    item = gl.sum(gl.where(k == 0, packed, 0), axis=0)
    bm = gl.sum(gl.where(k == 1, packed, 0), axis=0)
    h = gl.sum(gl.where(k == 2, packed, 0), axis=0)
    b = gl.sum(gl.where(k == 3, packed, 0), axis=0)
    # Every warp has read the slot before it is released for the next item.
    thread_barrier()
    release(sched_empty, order, SCHED_STAGES)
    return item, bm, h, b
