"""The attention forward kernel: the seed's pipeline in Gluon.

Read beside ``shared/seed/flash_atten_v4_nonpersistent.co``; names follow it.

A work item is one 128-row query tile of one (batch, head). The seed runs one
CTA per item; here, by default (``PERSISTENT``), a grid of one CTA per SM
loops over items (``scheduler.py``), so one item's epilogue and the next
item's Q and first K/V loads overlap instead of paying a CTA start each time.
A CTA runs three partitions (``gl.warp_specialize``), each walking the same
items:

* the **producer** (1 warp, few registers) only issues TMA loads: each item's
  Q, into a ring of ``Q_STAGES`` items (two where shared memory allows, so
  the next item's Q lands while this one runs), then its K and V tiles into
  two separate rings of ``K_STAGES`` / ``V_STAGES`` slots, each slot guarded
  by a *full* barrier (the load landed) and an *empty* barrier (every
  consumer is done with it). The rings' slot order runs on across items.
  In the dynamic order (``DYNAMIC``, scheduler.py) it also draws each CTA's
  next item, decodes it, and hands it to the consumers with its coordinates
  (the decoding's run-time divisions would otherwise sit on the consumers'
  path between two items, while the tensor cores wait);
* two or three **consumers** (one warpgroup each, most of the registers)
  own 64 query rows each: ``BLOCK_M`` = 128, or 192 at head dim 64 (FA3's
  tiles there: while one runs its softmax, two keep the tensor cores busy,
  and each K/V tile serves 192 rows; ``plan.choose_wide`` picks them for
  long plain prefill). They are the same function with ``CID`` 0, 1 (, 2);
  none waits for another in the steady state, so their softmax phases can
  overlap the others' tensor-core work, as the seed's two ``p > 0`` groups do.
  Left alone they do not drift apart in plain non-causal prefill: they start
  every item together and stay in step. There (``_offset_start``) consumer
  ``c`` issues an item's first QK only once consumer ``c - 1``'s has
  completed, so the next one's QK runs while this one's softmax leaves the
  tensor cores free, and the offset carries on through the item (the H200:
  +4-5% at D=128 S=8192 non-causal and GQA, +1% at D=64 and D=256; under a
  causal mask it measured 2-5% slower on short sequences, so causal items
  start together as before). It is an initial offset, not FA3's ping-pong,
  which passes a turn every step (measured slower here).

KV tiles are visited from the diagonal tile down to tile 0, so only the first
tile (and, for an unaligned diagonal, the second) needs a mask. On the wide
tiles under a causal mask (or a right-bounded window) the tile's diagonal KV
tile can lie wholly past a warpgroup's own 64 rows: that warpgroup releases it
unread (``OWN_DIAGONAL``) and starts at its own diagonal. In the steady
state a consumer issues QK of tile ``it`` and PV of tile ``it - 1`` as two
async wgmma groups, waits for the QK group alone, releases the K slot at once,
then runs the softmax and waits for PV. The source waits for PV after the
softmax, but ptxas (triton 3.6's) hoists a wgmma wait to the top of its basic
block, so unless something ends the block after the softmax, the softmax
starts once PV has completed and only the other consumers' GEMMs hide it.
``PV_AFTER_SOFTMAX`` (head dim 256) ends it there: the step waits for the
*next* PV's V tile after its softmax (the wait is a retry loop, hence a
branch), so the PV wait follows the exponentials and PV runs beside them. On
the H200 that is +2-6% at head dim 256 (and was +2-3% on the wide tiles), but
3-4% slower on the two-consumer tiles of head dim 64 (BENCHMARKS.md,
thirteenth and twenty-first sessions), which keep the plain form. Head dim
128 (two consumers, every mode) and the wide tiles take FA3's place instead,
``MAX_BEFORE_PV``: the same wait right after the row maximum, so the maximum
runs beside this warpgroup's own PV and the PV wait comes before the
exponentials, among which ptxas interleaves the O rescale's multiplies.
Nsight Compute had our consumer warps stalled at the hoisted PV wait for
about a seventh of their time, FA3's hardly at all; on the H200 this
placement is +1.6-2.2% on long causal rows at head dim 128, +4% non-causal
at S=8192, +3-8% on chunked prefill, within noise at S=2048 (thirty-sixth
session), and +2-4% on the wide tiles against the softmax-beside-PV form
(thirty-seventh); at head dim 256 and on head dim 64's two-consumer tiles
it measured 0.6-2% slower than their forms, which they keep. Where every
CTA of a launch runs one work item (``ONE_ITEM``: chunked prefill's short
query on a long cache, at most one item per SM), head dim 128 waits for the
V of the PV it issues right before that issue, after QK's (FA3's place,
``V_AT_ISSUE``), and keeps the wait after the maximum only as a fence on
the same landed tile: Nsight Compute had the first consumer stalled ~5% of
its step on the next V there; +4.4-9.6% on chunked rows, but 2-3.7% slower
where CTAs run several items (forty-seventh session). At head dims
128 and 256 the row maximum itself is a tree in each thread
(``softmax._row_max``, ``TREE_MAX``), not ``gl.max``'s 32-deep chain:
+1.9-2.8% on causal rows at head dim 128 (forty-sixth session).

Decode and chunked prefill run the same kernel in other *modes*
(constexpr switches; ``plan.py`` picks them):

* ``SEQUSED``: each batch's key length is read from an int32 device tensor
  (``cache_seqlens`` after the append), K/V may be a larger cache
  ``[B_cache, S_cache, Hkv, D]`` (``KV_BATCH``: row ``cache_batch_idx[b]``),
  or pages ``[num_pages, PAGE_SIZE, Hkv, D]`` addressed through a page table
  (the page is the TMA batch coordinate; a page of 16 to ``BLOCK_N / 2``
  keys is one TMA box, and a tile loads one per page). Pages of fewer than
  16 keys (``GATHER``) are too many boxes per tile: there the producer is a
  whole warpgroup that copies a tile row by row with ``cp.async``, each row
  from the page the table names (``_gather_kv_tile``). What lies past a
  row's live length is never trusted: scores there are masked (``where``
  also drops NaN) and V rows there are zeroed in shared memory before PV,
  since 0 * NaN = NaN. With ``LEFTPAD`` (flash-attn's ``cache_leftpad``, no
  pages) batch ``b``'s keys start at row ``cu_k[b]`` of its cache row: the
  tiles are read from there and the mask counts from there.
* ``PACK_G`` > 1 (PackGQA): the query rows of the ``PACK_G`` heads that share
  a KV head share one tile, head fastest: the TMA box ``[1, 64 / G, G, D]``
  over BSHD is exactly that tile, so K and V are read once per KV head.
  A group that is not a power of two (``PACK_VIEW``: 5 of Llama 4's 40/8)
  has no such box (TMA boxes are powers of two): the host hands the kernel
  Q already packed, ``[B, Sq * G, Hkv, D]`` (``plan.packed_q``: q itself,
  restrided, at one query per row; a copy otherwise), a tile is then the
  plain box ``[1, 64, 1, D]`` at packed row ``bm * BLOCK_M`` of KV head
  ``hk``, and O goes by address, as in ``VARLEN``. A packed batch with one
  query per sequence (``Q_TOKENS``) needs no copy either: q restrided to
  ``[total_q, G, Hkv, D]``, loaded at its token's batch coordinate; nor
  does any other packed batch or fixed-length batch whose q has its heads
  adjacent (``Q_ROWS``: contiguous, or a slice of a fused QKV projection,
  its tokens ``q_heads`` head dims apart): the producer copies each Q
  part's rows from q with ``cp.async``, as ``GATHER`` copies K/V rows
  (``_copy_q_rows``).
* ``SPLIT``: the KV tiles of an item are split across ``num_splits`` items;
  each writes a normalised fp32 partial O and its LSE straight from
  registers, and ``combine.py`` merges them (``VARLEN``: over the packed
  rows, which the combine takes as one sequence). With ``SPLIT_TABLE``
  (``VARLEN``, skewed keys; ``split_table.py``) each sequence has its own
  split count: the items run over a table of (sequence, split) entries,
  longest first, that a small kernel writes on the device before the
  launch (``sched_ptr``; ``num_splits`` is then the table's length).
* ``VARLEN``: q, k, v and O are packed (THD) tensors viewed as
  ``[1, total, H, D]``; sequence ``b`` starts at row ``cu_q[b]`` / ``cu_k[b]``
  and lives for ``seqused_q[b]`` (``SEQUSED_Q``) or ``cu_q[b+1] - cu_q[b]``
  query rows and ``seqused_k[b]`` (``SEQUSED``) or ``cu_k[b+1] - cu_k[b]``
  keys; ``seqlen_q`` is the host's ``max_seqlen_q`` (the tile count) and a
  work item past its sequence's rows is skipped by all partitions. Tiles read
  past their sequence (a neighbour's rows, or anything past ``seqused``):
  extra query rows are computed and dropped, extra keys are masked and their
  V rows zeroed as in ``SEQUSED``; O is stored with plain row-predicated
  16-byte stores after a round trip through shared memory (a TMA box would
  overwrite the neighbour's output), and the LSE goes to flash-attn's varlen
  layout ``[H, total_q]``. With pages (``PAGE_SIZE``, vLLM's layout) K and
  V are page pools as in ``SEQUSED`` and sequence ``b``'s keys are the
  first ``seqused_k[b]`` of its page-table row. With ``PACK_G`` a tile
  holds ``BLOCK_M / G`` queries of the group's heads, as in the decode
  modes: a sequence has ``cdiv(len_q * G, BLOCK_M)`` tiles, and O's packed
  row ``p`` is stored at query ``p // G`` of head ``q_head0 + p % G``.
* In these modes a consumer warpgroup whose 64 rows hold no query row (a
  decode tile has ``seqlen_q * G`` live rows) only keeps the barrier rings
  turning, so the tensor cores serve the live warpgroup alone.

The code: the partitions are ``_producer`` and ``_consumer``; per work item
``_producer_item`` issues the loads and ``_consumer_item`` /
``_consumer_tile`` run one warpgroup's rows. Their shared state travels in
three aggregates: ``Mode`` (the compile-time switches), ``Problem`` (run-time
lengths, counts, scales and the side tensors) and ``Rings`` (the shared
memory and its barriers).

Tensors are addressed through rank-4 TMA descriptors over ``[B, S, H, D]``
with boxes ``[1, rows, 1, D]``: the sequence axis is bounded per batch, so a
tail tile reads zeros past ``seqlen`` and its stores are clipped there, and
any 16-byte-aligned batch/sequence/head strides work without a copy.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .compat import aggregate, cp_async_load, init_fields, thread_barrier, tma_load, tma_store
from .mask import apply_mask, kv_split_range, kv_tile_count, kv_window_tiles, tile_needs_mask
from .opaque import opaque
from .pipeline import release, release_read, ring_slot, wait_empty, wait_full, wait_landed
from .scheduler import (SCHED_FIELDS, SCHED_STAGES, draw_item, first_item, publish_item, receive_item,
                        section_coords, work_coords)
from .split_table import BATCH_SHIFT, SPLIT_BITS
from .softmax import LOG2E, softcap, softmax_exp, softmax_finish, softmax_first, softmax_max, softmax_step

# Rows of the query tile owned by one consumer warpgroup (wgmma's M).
WG_M = gl.constexpr(64)
# The smallest page read by TMA, one box per page (cache_layout.MIN_TMA_PAGE);
# smaller pages are gathered row by row (Mode.GATHER).
GATHER_MIN_PAGE = gl.constexpr(16)


@gluon.jit
def _q_slot(q_bars, qi, c, NC: gl.constexpr):
    """Index of consumer ``c``'s part of the Q of this CTA's ``qi``-th item in
    the Q buffers and barriers (``NC`` consumers, one part each): a ring of
    ``q_bars.shape[0] // NC`` items (with two, the next item's Q loads while
    this one runs)."""
    Q_STAGES: gl.constexpr = q_bars.shape[0] // NC
    return (qi % Q_STAGES) * NC + c


@gluon.jit
def _q_phase(q_bars, qi, NC: gl.constexpr):
    Q_STAGES: gl.constexpr = q_bars.shape[0] // NC
    return (qi // Q_STAGES) & 1


@aggregate
class Mode:
    """The compile-time switches of one specialisation, as the kernel's
    constexpr arguments name them (``plan.kernel_constexprs``), plus what
    follows from them. Every partition gets the same one."""
    BLOCK_M: gl.constexpr  # query rows per work item: 64 per consumer warpgroup
    BLOCK_N: gl.constexpr  # keys per K/V tile
    HEAD_DIM: gl.constexpr
    K_STAGES: gl.constexpr
    V_STAGES: gl.constexpr
    IS_CAUSAL: gl.constexpr
    WRITE_LSE: gl.constexpr
    PERSISTENT: gl.constexpr
    O_IN_Q: gl.constexpr
    PACK_G: gl.constexpr
    # PackGQA with Q packed by the host (plan.Mode.pack_view; any group):
    # q_desc is over [B, Sq * PACK_G, Hkv, D], O goes by address.
    PACK_VIEW: gl.constexpr
    # VARLEN with PACK_VIEW and one query per sequence (plan.Mode.q_tokens):
    # q_desc is q restrided, [total_q, PACK_G, Hkv, D], the token its batch
    # coordinate (no copy of q).
    Q_TOKENS: gl.constexpr
    # PACK_VIEW without a packed copy (plan.Mode.q_rows): the producer
    # copies each Q part row by row from q itself ([total_q, H, D], or [B,
    # Sq, H, D] outside VARLEN; heads adjacent, tokens q_heads head dims
    # apart) with cp.async (_copy_q_rows); q_desc only lays out the parts in
    # shared memory.
    Q_ROWS: gl.constexpr
    SPLIT: gl.constexpr
    SEQUSED: gl.constexpr
    KV_BATCH: gl.constexpr
    PAGE_SIZE: gl.constexpr
    VARLEN: gl.constexpr
    SEQUSED_Q: gl.constexpr
    DYNAMIC: gl.constexpr
    NC: gl.constexpr  # consumer warpgroups: BLOCK_M // 64
    # Decode and varlen modes: a warpgroup whose rows hold no query row skips
    # the tensor-core work (_consumer_idle).
    SKIP_IDLE: gl.constexpr
    OFFSET_START: gl.constexpr  # _offset_start
    # The steady step waits for the next PV's V after its softmax, so that
    # ptxas's hoisted PV wait falls after the exponentials (module docstring);
    # set with MAX_BEFORE_PV too, which waits for it after the row maximum:
    # either way not at the loop head.
    PV_AFTER_SOFTMAX: gl.constexpr
    # FA3's place for the PV wait (head dim 128, and the wide tiles): after
    # the row maximum, before the exponentials. The step waits for the next
    # PV's V between the two, which ends the basic block there (module
    # docstring).
    MAX_BEFORE_PV: gl.constexpr
    # ``ONE_ITEM`` launches at head dim 128 (module docstring): the steady
    # step waits for the V of the PV it issues right before issuing it, and
    # again after the maximum, on the landed tile, as ptxas's fence only.
    V_AT_ISSUE: gl.constexpr
    # The row maximum reduced as a tree in each thread (softmax._row_max):
    # head dims 128 and 256.
    TREE_MAX: gl.constexpr
    # A sliding window (mask.py): the keys row r sees are r + off - WINDOW_LEFT
    # .. r + off + WINDOW_RIGHT; -1 leaves that side unbounded (both: none).
    WINDOW_LEFT: gl.constexpr
    WINDOW_RIGHT: gl.constexpr
    # Pages of fewer than GATHER_MIN_PAGE keys: K/V tiles copied row by row by
    # a producer warpgroup (_gather_kv_tile) instead of by TMA.
    GATHER: gl.constexpr
    PRODUCER_WARPS: gl.constexpr
    # Logit soft-capping (softmax.softcap): scores become cap * tanh(s * scale / cap)
    # before the mask; Problem's two scales then mean scale / cap and cap.
    SOFTCAP: gl.constexpr
    # Attention sinks (sinks.py): each row's normaliser gets its head's
    # logit from ``sink_ptr`` (fp32, bf16 or fp16; softmax_finish). Not with
    # SPLIT: the combine adds it there, once per row.
    SINK: gl.constexpr
    # Every CTA of the launch runs exactly one work item (plan.Mode.one_item).
    ONE_ITEM: gl.constexpr
    # VARLEN's O, stored by address: its head dim where narrower than
    # HEAD_DIM (plan.kernel_head_dim; the boxes read zeros past it), else 0.
    O_DIM: gl.constexpr
    # SEQUSED over a contiguous cache whose row b starts at key cu_k[b]
    # (flash-attn's cache_leftpad): its keys are cu_k[b] .. seqused[b] - 1,
    # the mask and the window counted from cu_k[b].
    LEFTPAD: gl.constexpr
    # The static deal's coordinates without run-time divisions (_num_splits):
    # plain causal prefill (windows, soft-capping and sinks included), none
    # of the decode modes.
    PLAIN_COORDS: gl.constexpr
    # SPLIT with a split count per sequence (VARLEN; split_table.py): an
    # item's split coordinate is its table entry's count and index
    # (_split_count, _split_index), its batch the entry's sequence.
    SPLIT_TABLE: gl.constexpr
    # Three consumers under a causal mask or a right-bounded window: a
    # warpgroup whose own 64 rows end before the tile's last row passes the
    # KV tiles past its own diagonal without computing them (_own_kv_end).
    OWN_DIAGONAL: gl.constexpr
    # Launched by programmatic dependent launch (plan.Mode.pdl: every split
    # run, and others whose grid has a CTA on every SM): every partition
    # waits for the grid before it (_wait_prior_grid), and the run lets the
    # grid after it be scheduled (attention_forward_kernel).
    DEPENDENT: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, BLOCK_M, BLOCK_N, HEAD_DIM, K_STAGES, V_STAGES, IS_CAUSAL, WRITE_LSE, PERSISTENT, O_IN_Q,
                 PACK_G, SPLIT, SEQUSED, KV_BATCH, PAGE_SIZE, VARLEN, SEQUSED_Q, DYNAMIC, WINDOW_LEFT, WINDOW_RIGHT,
                 SOFTCAP, SINK, ONE_ITEM, O_DIM, LEFTPAD, PACK_VIEW, Q_TOKENS, Q_ROWS, SPLIT_TABLE, DEPENDENT):
        init_fields(self, locals(), constexpr=True)
        self.NC = gl.constexpr(BLOCK_M // 64)
        self.SKIP_IDLE = gl.constexpr(PACK_G > 1 or SPLIT or SEQUSED or VARLEN)
        self.OWN_DIAGONAL = gl.constexpr(self.NC == 3 and (IS_CAUSAL or WINDOW_RIGHT >= 0) and PACK_G == 1
                                         and not (SPLIT or SEQUSED or VARLEN))
        self.OFFSET_START = gl.constexpr(_offset_start(IS_CAUSAL, PACK_G, SPLIT, SEQUSED, VARLEN))
        self.PLAIN_COORDS = gl.constexpr(IS_CAUSAL and not (PACK_G > 1 or SPLIT or SEQUSED or KV_BATCH
                                                            or PAGE_SIZE > 0 or VARLEN))
        self.MAX_BEFORE_PV = gl.constexpr((HEAD_DIM == 128 and self.NC == 2) or self.NC == 3)
        self.PV_AFTER_SOFTMAX = gl.constexpr(HEAD_DIM == 256 or self.MAX_BEFORE_PV)
        self.V_AT_ISSUE = gl.constexpr(ONE_ITEM and self.MAX_BEFORE_PV and self.NC == 2)  # head dim 128
        self.TREE_MAX = gl.constexpr(HEAD_DIM >= 128)
        self.GATHER = gl.constexpr(0 < PAGE_SIZE and PAGE_SIZE < GATHER_MIN_PAGE)
        self.PRODUCER_WARPS = gl.constexpr(4 if self.GATHER else 1)


@aggregate
class Problem:
    """The run-time side of a launch: lengths, counts and scales, and the
    tensors besides Q, K, V and O (each unused one aliases O; see
    ``plan.launch_forward``)."""
    seqlen_q: gl.tensor  # varlen: the host's max_seqlen_q (the tile count)
    seqlen_k: gl.tensor
    num_heads: gl.tensor
    kv_group: gl.tensor  # query heads per KV head
    batch: gl.tensor
    num_splits: gl.tensor  # SPLIT_TABLE: the table's entries
    pair: gl.tensor  # static deal: items per CTA turn (scheduler.work_coords)
    section: gl.tensor  # dynamic order: heads per L2 section (scheduler.section_coords)
    total_tiles: gl.tensor  # work items
    page_stride: gl.tensor
    total_q: gl.tensor  # varlen: rows of the packed Q (the LSE's row stride)
    q_heads: gl.tensor  # Q_ROWS: q's token stride in head dims (num_heads if contiguous; plan.rows_of_q)
    # softmax_scale * log2(e) and softmax_scale; under SOFTCAP softmax_scale / cap
    # (tanh's argument scale) and cap (plan.kernel_scales).
    qk_scale: gl.tensor
    softmax_scale: gl.tensor
    lse_ptr: gl.tensor
    seqused_ptr: gl.tensor
    kv_batch_ptr: gl.tensor
    page_table_ptr: gl.tensor
    o_part_ptr: gl.tensor
    lse_part_ptr: gl.tensor
    cu_q_ptr: gl.tensor
    cu_k_ptr: gl.tensor
    used_q_ptr: gl.tensor
    sched_ptr: gl.tensor  # DYNAMIC: the item counter; SPLIT_TABLE: the table
    q_ptr: gl.tensor  # Q_ROWS: q, [total_q, H, D] (or [B, Sq, H, D]), heads adjacent, tokens q_heads heads apart
    k_ptr: gl.tensor  # GATHER: the page pools, [num_pages, PAGE_SIZE, Hkv, D] contiguous
    v_ptr: gl.tensor
    sink_ptr: gl.tensor  # SINK: [H], one logit per query head (fp32, bf16 or fp16)

    @gluon.constexpr_function
    def __init__(self, seqlen_q, seqlen_k, num_heads, kv_group, batch, num_splits, pair, section, total_tiles,
                 page_stride, total_q, q_heads, qk_scale, softmax_scale, lse_ptr, seqused_ptr, kv_batch_ptr,
                 page_table_ptr, o_part_ptr, lse_part_ptr, cu_q_ptr, cu_k_ptr, used_q_ptr, sched_ptr, q_ptr, k_ptr,
                 v_ptr, sink_ptr):
        init_fields(self, locals())


@aggregate
class Rings:
    """The shared memory every partition addresses, and its barriers: Q (a
    ring of items, one part per consumer), K and V (rings of tiles), O's
    staging, the dynamic order's item ring and the offset start's turns."""
    q_smem: gl.shared_memory_descriptor
    o_smem: gl.shared_memory_descriptor
    k_bufs: gl.shared_memory_descriptor
    v_bufs: gl.shared_memory_descriptor
    q_full: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_full: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_full: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    sched_smem: gl.shared_memory_descriptor
    sched_full: gl.shared_memory_descriptor
    sched_empty: gl.shared_memory_descriptor
    turn_full: gl.shared_memory_descriptor
    turn_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_smem, o_smem, k_bufs, v_bufs, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                 sched_smem, sched_full, sched_empty, turn_full, turn_empty):
        init_fields(self, locals())


@gluon.jit
def _item_kv(b, bm, split, seqlen_q, seqlen_k, k_start, prob: Problem, mode: Mode):
    """K/V side of a work item: the cache row, the KV tiles ``[n_lo, n_hi)`` it
    visits (from ``k_start``) and the key length its mask uses (0 for an
    empty split)."""
    if mode.SEQUSED:
        seqlen_k = gl.load(prob.seqused_ptr + b)
        if mode.LEFTPAD:
            seqlen_k -= k_start
    if mode.KV_BATCH:
        kb = gl.load(prob.kv_batch_ptr + b)
    else:
        kb = b
    n_lo, n_hi, seqlen_k = kv_split_range(bm, _split_index(split, mode), _split_count(split, prob, mode), seqlen_q,
                                          seqlen_k, mode.BLOCK_M, mode.BLOCK_N, mode.IS_CAUSAL, mode.PACK_G,
                                          mode.WINDOW_LEFT, mode.WINDOW_RIGHT)
    return kb, n_lo, n_hi, seqlen_k


@gluon.jit
def _item_heads(h, kv_group, PACK_G: gl.constexpr):
    """(first query head of the item, its KV head)."""
    if PACK_G > 1:
        q_head0 = h * PACK_G
        hk = h
    else:
        q_head0 = h
        hk = h // kv_group  # GQA/MQA: q heads share kv heads without a copy
    return q_head0, hk


@gluon.jit
def _item_rows(bm, b, prob: Problem, mode: Mode):
    """Where work item ``(bm, b)`` lives, as every partition sees it: ``(tb,
    q_start, k_start, lq, live)``: the TMA batch coordinate, the first query
    and key rows on the sequence axis, the query length and whether the tile
    holds any query row (VARLEN; always true otherwise)."""
    if mode.VARLEN:
        q_start = gl.load(prob.cu_q_ptr + b)
        if mode.PAGE_SIZE > 0:
            k_start = b * 0  # sequence b's keys: its page-table row (_kv_coords)
        else:
            k_start = gl.load(prob.cu_k_ptr + b)
        if mode.SEQUSED_Q:
            lq = gl.load(prob.used_q_ptr + b)
        else:
            lq = gl.load(prob.cu_q_ptr + b + 1) - q_start
        tb = b * 0
        live = bm * mode.BLOCK_M < lq * mode.PACK_G
    else:
        q_start = b * 0
        if mode.LEFTPAD:
            k_start = gl.load(prob.cu_k_ptr + b)
        else:
            k_start = b * 0
        lq = prob.seqlen_q
        tb = b
        live = True
    return tb, q_start, k_start, lq, live


@gluon.jit
def _item_at(i, item, n_tiles, prob: Problem, mode: Mode):
    """(bm, split, h, b) of this CTA's ``i``-th work item: the static deal's
    (scheduler.work_coords), or item number ``item`` of the dynamic order."""
    if mode.DYNAMIC:
        bm, split, h, b = section_coords(item, n_tiles, _item_head_count(prob, mode), prob.batch, prob.section)
    else:
        bm, split, h, b = work_coords(i, n_tiles, _num_splits(prob, mode), _item_head_count(prob, mode),
                                      prob.pair, mode.PERSISTENT, mode.PLAIN_COORDS)
        if mode.SPLIT_TABLE:
            bm, split, b = _table_item(bm, b, n_tiles, prob)
    return bm, split, h, b


@gluon.jit
def _table_item(bm, entry, n_tiles, prob: Problem):
    """SPLIT_TABLE: the item of query tile ``bm`` at table entry ``entry``
    (work_coords' batch coordinate: the items run over the entries, head
    fastest after the tile) as ``(bm, split, b)``; ``split`` holds the
    sequence's split count and the item's split (_split_count,
    _split_index). An entry past the table's last (-1) becomes a tile past
    every sequence's rows, which no partition runs."""
    code = gl.load(prob.sched_ptr + entry)
    dead = code < 0
    b = gl.where(dead, 0, code >> BATCH_SHIFT)
    split = gl.where(dead, 1 << SPLIT_BITS, code & ((1 << BATCH_SHIFT) - 1))
    return gl.where(dead, n_tiles, bm), split, b


@gluon.jit
def _split_index(split, mode: Mode):
    """The KV split an item's ``split`` coordinate names."""
    if mode.SPLIT_TABLE:
        s = split & ((1 << SPLIT_BITS) - 1)
    else:
        s = split
    return s


@gluon.jit
def _split_count(split, prob: Problem, mode: Mode):
    """The split count of the item's sequence: the launch's, or (SPLIT_TABLE) its own."""
    if mode.SPLIT_TABLE:
        n = split >> SPLIT_BITS
    else:
        n = _num_splits(prob, mode)
    return n


@gluon.jit
def _item_head_count_of(num_heads, PACK_G: gl.constexpr):
    """The heads work items run over: query heads, or KV heads under PackGQA."""
    return num_heads // PACK_G


@gluon.jit
def _item_head_count(prob: Problem, mode: Mode):
    return _item_head_count_of(prob.num_heads, mode.PACK_G)


@gluon.jit
def _num_splits(prob: Problem, mode: Mode):
    """The split count of an item's coordinates and KV range: a constant 1
    in the dynamic order and, in the static deal, in ``PLAIN_COORDS`` modes
    (there with the pair count applied by a select, scheduler.work_coords'
    ``PAIR_SELECT``), so that the divisions by them fold away. A run-time
    division is a chain of some twenty instructions, and the coordinates are
    on the path between two items while the tensor cores wait: +2-5% on
    short causal prefill (BENCHMARKS.md, thirty-fifth session). Not in the
    other static modes: in the offset-start kernels (plain non-causal
    prefill) it changed the steady loop and timed 2-4% slower at D=128, and
    under triton 3.6 it left two paged decode specialisations 8 bytes of
    stack, while the decode rows timed unchanged; their SASS stays as it
    was. SPLIT_TABLE's coordinates have no split either: the table entry
    takes the batch coordinate's place (_table_item)."""
    if mode.DYNAMIC or mode.PLAIN_COORDS or mode.SPLIT_TABLE:
        n = 1
    else:
        n = prob.num_splits
    return n


@gluon.jit
def _item_seqlen_k(b, k_start, prob: Problem, mode: Mode):
    """The key length of batch ``b`` before ``_item_kv``'s own ``SEQUSED`` read."""
    if mode.VARLEN:
        if mode.SEQUSED:
            lk = prob.seqlen_k  # _item_kv reads seqused_k[b]
        else:
            lk = gl.load(prob.cu_k_ptr + b + 1) - k_start
    else:
        lk = prob.seqlen_k
    return lk


@gluon.jit
def _item_bounds(b, bm, split, h, lq, k_start, prob: Problem, mode: Mode):
    """Everything the producer and the consumers need of a live work item
    beyond its coordinates: ``(q_head0, hk, kb, n_lo, n_hi, lk)``, the first
    query head and the KV head, the cache row, the KV tiles ``[n_lo, n_hi)``
    and the key length the mask uses."""
    q_head0, hk = _item_heads(h, prob.kv_group, mode.PACK_G)
    lk = _item_seqlen_k(b, k_start, prob, mode)
    kb, n_lo, n_hi, lk = _item_kv(b, bm, split, lq, lk, k_start, prob, mode)
    return q_head0, hk, kb, n_lo, n_hi, lk


@gluon.jit
def _kv_coords(b, kb, bn, hk, k_start, prob: Problem, mode: Mode):
    """TMA coordinates of KV tile ``bn``: a cache row, or a page of the page
    table (``k_start``: the sequence's first key row, 0 unless VARLEN or LEFTPAD). Pages
    shorter than a tile are looked up per box by ``_load_kv_tile``."""
    row = bn * mode.BLOCK_N
    if mode.PAGE_SIZE > 0 and mode.PAGE_SIZE < mode.BLOCK_N:
        coords = [0, 0, hk, 0]
    elif mode.PAGE_SIZE > 0:
        page = gl.load(prob.page_table_ptr + b.to(gl.int64) * prob.page_stride + row // mode.PAGE_SIZE)
        coords = [page, row % mode.PAGE_SIZE, hk, 0]
    else:
        coords = [kb, k_start + row, hk, 0]
    return coords


@gluon.jit
def _load_kv_tile(desc, coords, bar, buf, b, bn, seqlen_k, prob: Problem, mode: Mode):
    """Issue the TMA loads of KV tile ``bn`` into slot ``buf`` on barrier
    ``bar``: one box at ``coords``, or, where pages are shorter than a tile
    (the host's box is then one page, ``plan.block_shapes``), one box per
    page, each at the page its rows live in. So pages of 16-64 keys keep the
    128-key tiles of contiguous caches. A page that holds no live key
    (``seqlen_k``: this batch's) may have any table entry, even one past
    the table's row: it is not read, page 0 stands in, and its keys are
    masked and their V rows zeroed as for any key past the live length."""
    BOX: gl.constexpr = desc.block_type.shape[1]
    if BOX == mode.BLOCK_N:
        tma_load(desc, coords, bar, buf)
    else:
        for j in gl.static_range(mode.BLOCK_N // BOX):
            row = bn * mode.BLOCK_N + j * BOX
            page = gl.load(prob.page_table_ptr + b.to(gl.int64) * prob.page_stride + row // BOX,
                           mask=row < seqlen_k, other=0)
            tma_load(desc, [page, 0, coords[2], 0], bar, buf.slice(j * BOX, BOX, dim=1))


@gluon.constexpr_function
def _gather_layout(producer_warps):
    """GATHER's register layout of a K/V tile: four threads per row, 16
    bytes each per copy, so a copy instruction of a warp reads 64 contiguous
    bytes (two sectors of one line) from each of eight rows, and a thread
    keeps BLOCK_N / (8 * PRODUCER_WARPS) rows (four). Eight threads per row
    (whole lines) spilled the producer's 40 registers."""
    return gl.BlockedLayout([1, 8], [8, 4], [producer_warps, 1], [1, 0])


@gluon.jit
def _gather_rows(b, bn, hk, seqlen_k, prob: Problem, mode: Mode):
    """GATHER: ``(row, live)`` of KV tile ``bn`` of batch ``b``, KV head
    ``hk``: the pool row (an int32 row number of the pool ``[num_pages *
    PAGE_SIZE * Hkv, D]``: rows, not elements, so no pool has 2**31) each key
    is copied from, looked up in the page table, and whether the key is live
    (below ``seqlen_k``, this batch's). Keys past it are not looked up: no
    table entry past the live pages is trusted. The K and V tiles of one
    step share the lookup."""
    layout: gl.constexpr = _gather_layout(mode.PRODUCER_WARPS)
    num_kv_heads = prob.num_heads // prob.kv_group
    rows = bn * mode.BLOCK_N + gl.arange(0, mode.BLOCK_N, layout=gl.SliceLayout(1, layout))
    live = rows < seqlen_k
    page = gl.load(prob.page_table_ptr + b.to(gl.int64) * prob.page_stride + rows // mode.PAGE_SIZE, mask=live,
                   other=0)
    return (page * mode.PAGE_SIZE + rows % mode.PAGE_SIZE) * num_kv_heads + hk, live


@gluon.jit
def _gather_kv_tile(base, row, live, bar, buf, mode: Mode):
    """GATHER: copy a K or V tile from the page pool at ``base`` into slot
    ``buf`` row by row with cp.async (``row``, ``live``: ``_gather_rows``),
    and arrive on ``bar`` once this thread's copies have landed (the full
    barriers count one arrive per producer thread). cp.async fills the rows
    of keys that are not live with zeros, so no NaN there reaches PV."""
    layout: gl.constexpr = _gather_layout(mode.PRODUCER_WARPS)
    cols = gl.arange(0, mode.HEAD_DIM, layout=gl.SliceLayout(0, layout))
    cp_async_load(buf.reshape([mode.BLOCK_N, mode.HEAD_DIM]),
                  base + row.to(gl.int64)[:, None] * mode.HEAD_DIM + cols[None, :],
                  mask=live[:, None])
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _copy_q_rows(buf, bar, row0, q_seq, q_first, q_end, hk, q_heads, mode: Mode):
    """Q_ROWS: copy Q part ``buf`` (the item's packed rows ``row0 ..
    row0 + 64``) from q with cp.async, and arrive on ``bar`` once this
    thread's copies have landed (Q_ROWS's full barriers count one arrive per
    producer thread, as GATHER's K/V ones do). Packed row ``p`` is query
    ``q_first + p // G`` of head ``hk * G + p % G`` of ``q_seq`` (the item's
    sequence of q: a token's heads ``HEAD_DIM`` apart, tokens ``q_heads``
    heads apart); rows of queries at or past ``q_end`` (the sequence's end)
    are zero-filled, never read.

    A step copies eight rows per producer warp in GATHER's layout (the
    swizzle's period: a slice of fewer rows is refused), four 16-byte copies
    a thread at head dim 128, and computes its addresses only when it comes
    (``opaque``), so the one-warp producer keeps one step's addresses live
    in its 24 registers."""
    layout: gl.constexpr = _gather_layout(mode.PRODUCER_WARPS)
    ROWS: gl.constexpr = 8 * mode.PRODUCER_WARPS
    part = buf.reshape([WG_M, mode.HEAD_DIM])
    # Rows as int32 offsets from the part's first query's row of head
    # hk * G (``base``, in 64 bits): packed row p is row p - first * G from
    # there (a multiple of G subtracted, so p % G is unchanged).
    first = row0 // mode.PACK_G
    base = q_seq + ((q_first + first).to(gl.int64) * q_heads + hk * mode.PACK_G) * mode.HEAD_DIM
    live = q_end - q_first - first  # queries of the sequence from the part's first on
    cols = gl.arange(0, mode.HEAD_DIM, layout=gl.SliceLayout(0, layout))
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    for s in gl.static_range(WG_M // ROWS):
        # The step's first row through an opaque move in program order: the
        # compiler cannot compute every step's addresses up front (the eight
        # steps' addresses at once spilled the producer's 24 registers).
        r = opaque(row0 - first * mode.PACK_G + s * ROWS) + rows
        offs = ((r // mode.PACK_G) * q_heads + r % mode.PACK_G) * mode.HEAD_DIM
        cp_async_load(part.slice(s * ROWS, ROWS, dim=0), base + offs[:, None] + cols[None, :],
                      mask=(r // mode.PACK_G < live)[:, None])
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _issue_kv_tile(desc, pool, where, bar, buf, b, bn, seqlen_k, prob: Problem, mode: Mode):
    """Producer: the loads of one K or V tile into slot ``buf``, landing on
    ``bar``: by TMA (``desc`` at coordinates ``where``; one box, or one per
    page), or gathered row by row from the page pool at ``pool`` (GATHER;
    ``where`` is the tile's ``_gather_rows``)."""
    if mode.GATHER:
        row, live = where
        _gather_kv_tile(pool, row, live, bar, buf, mode)
    else:
        KV_BOXES: gl.constexpr = mode.BLOCK_N // desc.block_type.shape[1]  # TMA boxes per tile (_load_kv_tile)
        mbarrier.expect(bar, desc.block_type.nbytes * KV_BOXES)
        _load_kv_tile(desc, where, bar, buf, b, bn, seqlen_k, prob, mode)


@gluon.jit
def _wait_tile(full_bars, order, STAGES: gl.constexpr, mode: Mode):
    """Consumer side: wait until K or V tile ``order`` has landed. A GATHER
    tile was written by the producer's cp.async (the generic proxy) and is
    read by wgmma (the async proxy): the proxy fence orders the two, as the
    PTX memory model asks. (CUTLASS's sm90 cp.async + GMMA mainloops and
    FA3's PagedKVNonTMA path go from the barrier wait to the wgmma without
    it; not timed without it here.)"""
    wait_landed(full_bars, order, STAGES)
    if mode.GATHER:
        fence_async_shared()


@gluon.jit
def _zero_v_tail(v, col0, seqlen_k, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Zero the rows of V tile ``v`` (keys ``col0 ..``) at or past ``seqlen_k``.

    Their P is 0, but an uninitialised cache may hold NaN or Inf there and
    0 * NaN = NaN in PV. Both consumers may do it: they write the same values.
    The fence orders these generic-proxy writes before the wgmma's reads.

    Keep it inlined. Triton 3.7+ spills ~56 B in the per-batch-length modes
    around it, and ``@gluon.jit(noinline=True)`` removes that spill on the CPU
    census, but in a called function ``thread_barrier`` lowers to a CTA-wide
    ``bar.sync 0`` that the other partitions never reach: every such launch
    deadlocked on the H200 (c222318, reverted)."""
    CH: gl.constexpr = 2048 // HEAD_DIM  # 16 elements per thread per chunk
    TPW_D: gl.constexpr = HEAD_DIM // 8 if HEAD_DIM // 8 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [4, 1], [1, 0])
    for c in gl.static_range(BLOCK_N // CH):
        if col0 + (c + 1) * CH > seqlen_k:
            chunk = v.slice(c * CH, CH, dim=0)
            rows = col0 + c * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
            x = chunk.load(layout)
            x = gl.where((rows < seqlen_k)[:, None], x, gl.zeros_like(x))
            chunk.store(x)
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _producer_item(q_desc, k_desc, v_desc, rings: Rings, prob: Problem, bm, split, h, b, kv0, qi, mode: Mode):
    """The loads of work item ``(bm, split, h, b)``: its Q parts, then its K
    and V tiles (none for a VARLEN tile past its sequence's rows). ``kv0``
    counts the K/V tiles of earlier items (the rings' running order) and
    ``qi`` the items that loaded a Q (its barriers' phase); both come back
    advanced past this item."""
    tb, q_start, k_start, lq, live = _item_rows(bm, b, prob, mode)
    if live:
        q_head0, hk, kb, n_lo, n_hi, lk = _item_bounds(b, bm, split, h, lq, k_start, prob, mode)
        if mode.VARLEN:
            kb = tb

        # Q as one box per consumer part, each on its own barrier pair: a
        # consumer that finished with its part of the previous item's Q gets
        # the next one without waiting for the others.
        for c in gl.static_range(mode.NC):
            q_idx = _q_slot(rings.q_full, qi, c, mode.NC)
            # Passes on the fresh barriers for the first pass through the Q ring.
            mbarrier.wait(rings.q_empty.index(q_idx), _q_phase(rings.q_full, qi, mode.NC) ^ 1)
            if mode.Q_ROWS:  # the packed view's rows, copied from q itself
                # q's tokens prob.q_heads heads apart, batch b's tokens (fixed lengths) after batch b - 1's.
                # q_heads through an opaque move where it is used: kept live from the kernel's entry it cost
                # a consumer 32 bytes of spills (head dim 128, non-causal, pages of 16 keys, triton 3.6).
                if mode.VARLEN:
                    q_first = q_start
                else:
                    q_first = tb * lq
                _copy_q_rows(rings.q_smem.index(q_idx), rings.q_full.index(q_idx), bm * mode.BLOCK_M + c * WG_M,
                             prob.q_ptr, q_first, q_first + lq, hk, opaque(prob.q_heads), mode)
            else:
                mbarrier.expect(rings.q_full.index(q_idx), q_desc.block_type.nbytes)
                if mode.Q_TOKENS:  # one query per sequence: its token's rows of q restrided
                    q_coords = [q_start, bm * mode.BLOCK_M + c * WG_M, hk, 0]
                elif mode.PACK_VIEW:  # the packed view's rows, undivided
                    q_coords = [tb, q_start * mode.PACK_G + bm * mode.BLOCK_M + c * WG_M, hk, 0]
                else:
                    q_coords = [tb, q_start + (bm * mode.BLOCK_M + c * WG_M) // mode.PACK_G, q_head0, 0]
                tma_load(q_desc, q_coords, rings.q_full.index(q_idx), rings.q_smem.index(q_idx))

        # K and V in separate rings: QK of tile `it` may start while V of tile
        # `it` is still in flight, since PV of `it` only runs one step later.
        n_kv = n_hi - n_lo
        for it in range(n_kv):
            bn = n_hi - 1 - it  # diagonal (or tail) first
            if mode.GATHER:
                # One page lookup for the K and the V tile, in flight while
                # the producer waits for a free K slot.
                where = _gather_rows(b, bn, hk, lk, prob, mode)
            else:
                where = _kv_coords(b, kb, bn, hk, k_start, prob, mode)
            order = kv0 + it
            wait_empty(rings.k_empty, order, mode.K_STAGES)
            k_slot = ring_slot(order, mode.K_STAGES)
            _issue_kv_tile(k_desc, prob.k_ptr, where, rings.k_full.index(k_slot), rings.k_bufs.index(k_slot), b, bn,
                           lk, prob, mode)

            wait_empty(rings.v_empty, order, mode.V_STAGES)
            v_slot = ring_slot(order, mode.V_STAGES)
            _issue_kv_tile(v_desc, prob.v_ptr, where, rings.v_full.index(v_slot), rings.v_bufs.index(v_slot), b, bn,
                           lk, prob, mode)
        kv0 += n_kv
        qi += 1
    return kv0, qi


@gluon.jit
def _draw_next(n_tiles, prob: Problem, mode: Mode):
    """Dynamic order, producer: the next item for this CTA and its ``(bm,
    split, h, b)``. VARLEN draws again past items whose query tile lies
    beyond their sequence's rows."""
    item = draw_item(prob.sched_ptr)
    bm, split, h, b = _item_at(0, item, n_tiles, prob, mode)
    if mode.VARLEN:
        b = gl.minimum(b, prob.batch - 1)  # an item past the last reads nothing out of bounds
        while _no_rows(item, bm, b, prob, mode):
            _skip_dead_run(item, n_tiles, prob, mode)
            item = draw_item(prob.sched_ptr)
            bm, split, h, b = _item_at(0, item, n_tiles, prob, mode)
            b = gl.minimum(b, prob.batch - 1)
    return item, bm, split, h, b


@gluon.jit
def _no_rows(item, bm, b, prob: Problem, mode: Mode):
    """VARLEN: item ``item`` (query tile ``bm`` of batch ``b``) exists but
    lies past its sequence's rows."""
    tb, q_start, k_start, lq, live = _item_rows(bm, b, prob, mode)
    return (item < prob.total_tiles) & (bm * mode.BLOCK_M >= lq * mode.PACK_G)


@gluon.jit
def _skip_dead_run(item, n_tiles, prob: Problem, mode: Mode):
    """VARLEN, dynamic order: ``item`` is dead (its query tile lies past its
    sequence's rows). Where its L2 section holds one sequence, every item of
    the section from it down to the sequence's last tile is dead too (the
    section's items run head fastest, then the query tile from the last
    down): move the shared counter past them with one atomic max, so that no
    CTA draws them one by one (``draw_item``: next = counter + grid)."""
    item_heads = _item_head_count(prob, mode)  # heads of the items: KV heads under PackGQA
    per_section = prob.section * n_tiles
    sec = item // per_section
    hb0 = sec * prob.section
    heads = gl.minimum(prob.section, item_heads * prob.batch - hb0)
    b = hb0 // item_heads
    one_sequence = (b == (hb0 + heads - 1) // item_heads) & (item < prob.total_tiles)
    tb, q_start, k_start, lq, live = _item_rows(item * 0, gl.minimum(b, prob.batch - 1), prob, mode)
    first_live = sec * per_section + (n_tiles - gl.cdiv(lq * mode.PACK_G, mode.BLOCK_M)) * heads
    if one_sequence:
        gl.atomic_max(prob.sched_ptr, first_live - gl.num_programs(0), sem="relaxed", scope="gpu")


@gluon.jit
def _wait_prior_grid():
    """``griddepcontrol.wait``: block until the grid this one was launched
    dependent on has finished and its writes are visible (a no-op when the
    launch was not programmatic). In a run so launched (``DEPENDENT``)
    every partition runs it before its first global access, read or write:
    nothing before it may touch memory that kernel writes or reads."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _let_next_grid_launch():
    """``griddepcontrol.launch_dependents``: the grid launched dependent on
    this one may be scheduled once every CTA of this one has run this or
    exited. Where it runs is a schedule, not a guarantee: the dependent's
    own wait still waits for this whole grid."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, rings: Rings, prob: Problem, mode: Mode):
    if mode.DEPENDENT:
        _wait_prior_grid()  # launched dependent on the kernel before (attention_forward_kernel)
    n_tiles = gl.cdiv(prob.seqlen_q * mode.PACK_G, mode.BLOCK_M)
    kv0 = 0  # K/V loads issued for earlier work items: the rings' running order
    qi = 0  # work items run so far (VARLEN skips items past their sequence): the Q barriers' phase
    # This CTA's items: the dynamic order's first is its program id and the
    # next ones are drawn here; the static deal's i-th is item i of its deal.
    item, limit = first_item(prob.total_tiles, prob.pair, mode.PERSISTENT, mode.DYNAMIC)
    # The dynamic order decodes its first item here and each next one as it
    # draws it (_draw_next); the static deal decodes each at the loop head.
    bm, split, h, b = _item_at(0, item, n_tiles, prob, mode)
    i = 0
    while item < limit:
        if not mode.DYNAMIC:
            bm, split, h, b = _item_at(i, item, n_tiles, prob, mode)
        kv0, qi = _producer_item(q_desc, k_desc, v_desc, rings, prob, bm, split, h, b, kv0, qi, mode)
        if mode.DYNAMIC:
            # The next item is drawn once this one's loads are issued: the
            # consumers need it only after this item's epilogue.
            item, bm, split, h, b = _draw_next(n_tiles, prob, mode)
            publish_item(item, bm, h, b, rings.sched_smem, rings.sched_full, rings.sched_empty, i)
        else:
            item = i + 1
        i += 1


@gluon.jit
def _pass_kv(rings: Rings, kv0, n_pass, mode: Mode):
    """Release ``n_pass`` K/V tiles from ring order ``kv0`` on, unread. Each
    slot is released only after its load landed, so the release lands in
    the phase the producer waits for (an early one would count towards the
    slot's previous use)."""
    for it in range(n_pass):
        wait_full(rings.k_full, kv0 + it, mode.K_STAGES)
        release(rings.k_empty, kv0 + it, mode.K_STAGES)
        wait_full(rings.v_full, kv0 + it, mode.V_STAGES)
        release(rings.v_empty, kv0 + it, mode.V_STAGES)


@gluon.jit
def _consumer_idle(rings: Rings, i, kv0, n_kv, CID: gl.constexpr, mode: Mode):
    """A work item whose rows of this warpgroup hold no query row: keep the
    rings turning (``_pass_kv``)."""
    q_idx = _q_slot(rings.q_full, i, CID, mode.NC)
    mbarrier.wait(rings.q_full.index(q_idx), _q_phase(rings.q_full, i, mode.NC))
    _pass_kv(rings, kv0, n_kv, mode)
    mbarrier.arrive(rings.q_empty.index(q_idx), count=1)


@gluon.jit
def _own_kv_end(bm, n_lo, n_hi, seqlen_q, seqlen_k, CID: gl.constexpr, mode: Mode):
    """OWN_DIAGONAL: the end of the KV tiles this warpgroup's 64 rows see,
    within the item's ``[n_lo, n_hi)`` and never below ``n_lo + 1`` (rows
    that see no key still run one fully masked tile). On a 192-row tile of
    128-key tiles the tile's last KV tile is wholly hidden from the first
    warpgroup's rows on every tile, and from the second's on every other one
    (equal lengths); the item visits it first (the diagonal), so passing it
    shortens the item by one step for those warpgroups."""
    sub = bm * mode.NC + CID
    if mode.WINDOW_LEFT >= 0 or mode.WINDOW_RIGHT >= 0:
        lo, hi = kv_window_tiles(sub, seqlen_q, seqlen_k, WG_M, mode.BLOCK_N, 1, mode.WINDOW_LEFT,
                                 mode.WINDOW_RIGHT)
    else:
        hi = kv_tile_count(sub, seqlen_q, seqlen_k, WG_M, mode.BLOCK_N, True, 1)
    return gl.maximum(gl.minimum(hi, n_hi), n_lo + 1)


@gluon.constexpr_function
def _offset_start(is_causal, pack_g, split, seqused, varlen):
    """Whether consumer ``c`` issues an item's first QK only after consumer
    ``c - 1``'s has completed (module docstring): plain non-causal prefill,
    where every consumer runs every item (no idle rows to skip)."""
    return not (is_causal or pack_g > 1 or split or seqused or varlen)


@gluon.jit
def _pass_turn(turn_full, turn_empty, i, CID: gl.constexpr):
    """Consumer ``CID``'s first QK of its ``i``-th item is complete: let
    consumer ``CID + 1`` issue its own. A one-slot ring per pair of
    neighbours: the wait on ``turn_empty`` keeps this consumer from
    signalling item ``i + 1`` before the next one has taken item ``i``'s
    turn (a skipped phase would desynchronise the pair)."""
    mbarrier.wait(turn_empty.index(CID), (i & 1) ^ 1)
    mbarrier.arrive(turn_full.index(CID), count=1)


@gluon.jit
def _take_turn(turn_full, turn_empty, i, CID: gl.constexpr):
    """Consumer ``CID`` waits for consumer ``CID - 1``'s first QK of item ``i``."""
    mbarrier.wait(turn_full.index(CID - 1), i & 1)
    mbarrier.arrive(turn_empty.index(CID - 1), count=1)


@gluon.jit
def _consumer_tile(rings: Rings, prob: Problem, o_desc, b, q_head0, bm, split, n_lo, n_hi, i, kv0, seqlen_q, seqlen_k,
                   q_start, CID: gl.constexpr, mode: Mode):
    """One work item for one consumer warpgroup: its 64 (packed) rows of tile
    ``bm``, KV tiles ``[n_lo, n_hi)``; ``b`` is the TMA batch coordinate,
    ``seqlen_q`` and ``seqlen_k`` this item's lengths (what its masks use).
    ``i`` counts this CTA's earlier items (the Q barriers' phase) and ``kv0``
    the K/V tiles they used (the rings' running order)."""
    dtype: gl.constexpr = o_desc.dtype
    # wgmma accumulator layouts for one warpgroup: S is [64, BLOCK_N], O is [64, HEAD_DIM].
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, mode.BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, mode.HEAD_DIM, 16])
    # P feeds PV straight from registers (the seed's acc_s_cast).
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

    n_kv = n_hi - n_lo
    # The exponentials' scale: softmax_scale * log2(e), or cap * log2(e) on tanh's output.
    if mode.SOFTCAP:
        exp_scale = prob.softmax_scale * LOG2E
    else:
        exp_scale = prob.qk_scale
    q_idx = _q_slot(rings.q_full, i, CID, mode.NC)
    q = rings.q_smem.index(q_idx).reshape([WG_M, mode.HEAD_DIM])
    row0 = bm * mode.BLOCK_M + CID * WG_M
    s_zero = gl.zeros([WG_M, mode.BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(rings.q_full.index(q_idx), _q_phase(rings.q_full, i, mode.NC))
    if mode.Q_ROWS:
        fence_async_shared()  # cp.async's rows (generic proxy) before the wgmma reads them (async proxy)

    # ---- QK prologue: the first tile visited (the diagonal; non-causal: the
    # tail tile), always masked. ----
    bn = n_hi - 1
    _wait_tile(rings.k_full, kv0, mode.K_STAGES, mode)
    k = rings.k_bufs.index(ring_slot(kv0, mode.K_STAGES)).reshape([mode.BLOCK_N, mode.HEAD_DIM])
    if mode.OFFSET_START and CID > 0:
        _take_turn(rings.turn_full, rings.turn_empty, i, CID)
    s = warpgroup_mma(q, k.permute((1, 0)), s_zero, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    if mode.OFFSET_START and CID < mode.NC - 1:
        _pass_turn(rings.turn_full, rings.turn_empty, i, CID)
    release_read(rings.k_empty, kv0, mode.K_STAGES)
    if mode.SOFTCAP:
        s = softcap(s, prob.qk_scale)  # before the mask: tanh(-inf) would be -1
    s = apply_mask(s, row0, bn * mode.BLOCK_N, seqlen_q, seqlen_k, mode.IS_CAUSAL, mode.PACK_G, mode.WINDOW_LEFT,
                   mode.WINDOW_RIGHT)
    p, scores_max, logsum = softmax_first(s, exp_scale, mode.TREE_MAX)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    if mode.SEQUSED or mode.VARLEN:
        # The first tile visited is the only one that can reach past the live
        # length (VARLEN: into the next sequence's keys, or past seqused).
        # Zeroed here, before the O accumulator is live, so the few registers
        # it takes do not compete with the steady state's; and only when it
        # does reach past, since the zeroing's shared-memory round trip and
        # barriers would otherwise cost every item (the condition is uniform
        # across the warpgroup, so its barriers stay matched).
        if (bn + 1) * mode.BLOCK_N > seqlen_k:
            _wait_tile(rings.v_full, kv0, mode.V_STAGES, mode)
            v_tail = rings.v_bufs.index(ring_slot(kv0, mode.V_STAGES)).reshape([mode.BLOCK_N, mode.HEAD_DIM])
            _zero_v_tail(v_tail, bn * mode.BLOCK_N, seqlen_k, mode.BLOCK_N, mode.HEAD_DIM)

    # The output accumulator is born after the prologue so it does not share
    # the prologue's live range with S.
    acc_o = gl.zeros([WG_M, mode.HEAD_DIM], gl.float32, o_layout)
    if mode.PV_AFTER_SOFTMAX and not mode.V_AT_ISSUE:
        # V of the first tile, for the first PV (each step then waits for the
        # V of the next PV inside the step).
        _wait_tile(rings.v_full, kv0, mode.V_STAGES, mode)

    # ---- Steady state: QK[it] and PV[it - 1] as two async groups. ----
    for it in range(1, n_kv):
        bn = n_hi - 1 - it
        # Unlike the seed, which waits for V between issuing QK and PV, both
        # groups are issued back to back once K and V have landed: on the H200
        # the seed's order measured 0.99-1.00x cuDNN at S=8192/16384 against
        # 1.02-1.04x for this one (BENCHMARKS.md, development runs).
        _wait_tile(rings.k_full, kv0 + it, mode.K_STAGES, mode)
        k = rings.k_bufs.index(ring_slot(kv0 + it, mode.K_STAGES)).reshape([mode.BLOCK_N, mode.HEAD_DIM])
        if not mode.PV_AFTER_SOFTMAX:
            _wait_tile(rings.v_full, kv0 + it - 1, mode.V_STAGES, mode)
        v = rings.v_bufs.index(ring_slot(kv0 + it - 1, mode.V_STAGES)).reshape([mode.BLOCK_N, mode.HEAD_DIM])
        qk = warpgroup_mma(q, k.permute((1, 0)), s_zero, is_async=True)
        if mode.V_AT_ISSUE:
            _wait_tile(rings.v_full, kv0 + it - 1, mode.V_STAGES, mode)
        pv = warpgroup_mma(p_op, v, acc_o, is_async=True)

        # One group may stay in flight: the older one, QK, is complete here.
        s = warpgroup_mma_wait(1, deps=[qk])
        # QK no longer reads K: release the slot while softmax and PV run.
        release_read(rings.k_empty, kv0 + it, mode.K_STAGES)

        if mode.SOFTCAP:
            s = softcap(s, prob.qk_scale)
        if tile_needs_mask(bn, bm, seqlen_q, seqlen_k, mode.BLOCK_M, mode.BLOCK_N, mode.IS_CAUSAL, mode.PACK_G,
                           mode.WINDOW_LEFT, mode.WINDOW_RIGHT):
            s = apply_mask(s, row0, bn * mode.BLOCK_N, seqlen_q, seqlen_k, mode.IS_CAUSAL, mode.PACK_G,
                           mode.WINDOW_LEFT, mode.WINDOW_RIGHT)
        if mode.MAX_BEFORE_PV:
            # The row maximum runs beside this warpgroup's PV; the next PV's V
            # is waited for here, so ptxas's PV wait stays below it, and the O
            # rescale's multiplies interleave with the exponentials. Not folded
            # into the branch below: written in its order (exponentials before
            # the PV wait in the source) the same operations compile to another
            # schedule, not the one timed (SASS compared on the CPU).
            scores_max, m_scaled, scores_scale = softmax_max(s, scores_max, exp_scale, mode.TREE_MAX)
            if mode.V_AT_ISSUE:
                _wait_tile(rings.v_full, kv0 + it - 1, mode.V_STAGES, mode)  # landed: ptxas's fence only
            else:
                _wait_tile(rings.v_full, kv0 + it, mode.V_STAGES, mode)
            acc_o, p_op = warpgroup_mma_wait(0, deps=[pv, p_op])
            release_read(rings.v_empty, kv0 + it - 1, mode.V_STAGES)
            acc_o = acc_o * gl.convert_layout(scores_scale, o_row_layout)[:, None]
            p, logsum = softmax_exp(s, m_scaled, scores_scale, logsum, exp_scale)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        else:
            p, scores_max, logsum, scores_scale = softmax_step(s, scores_max, logsum, exp_scale, mode.TREE_MAX)
            if mode.PV_AFTER_SOFTMAX:
                # The next PV's V, waited here for ptxas's sake: the wait's retry
                # loop ends the basic block, so the PV wait below stays after the
                # exponentials instead of being hoisted above them.
                _wait_tile(rings.v_full, kv0 + it, mode.V_STAGES, mode)

            # p_op is a register operand of the PV in flight: keep it alive until
            # the group completes, then overwrite it with this tile's P.
            acc_o, p_op = warpgroup_mma_wait(0, deps=[pv, p_op])
            release_read(rings.v_empty, kv0 + it - 1, mode.V_STAGES)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            acc_o = acc_o * gl.convert_layout(scores_scale, o_row_layout)[:, None]

    if not mode.O_IN_Q:
        # Every QK of this item is complete: the producer may load the next
        # item's Q into this half while the last PV and the epilogue run.
        mbarrier.arrive(rings.q_empty.index(q_idx), count=1)

    # ---- Final PV, overlapped with the row-sum finalisation. ----
    if not mode.PV_AFTER_SOFTMAX or mode.V_AT_ISSUE:  # else waited for by the last step, or before the loop
        _wait_tile(rings.v_full, kv0 + n_kv - 1, mode.V_STAGES, mode)
    v = rings.v_bufs.index(ring_slot(kv0 + n_kv - 1, mode.V_STAGES)).reshape([mode.BLOCK_N, mode.HEAD_DIM])
    pv = warpgroup_mma(p_op, v, acc_o, is_async=True)
    if mode.SINK:
        # Each row's head's sink logit (PackGQA: the rows of a tile span the group's heads).
        sink_g = (row0 + gl.arange(0, WG_M, layout=scores_max.type.layout)) % mode.PACK_G
        sink = gl.load(prob.sink_ptr + q_head0 + sink_g).to(gl.float32)
    else:
        sink = scores_max  # (unused)
    inv_logsum, lse = softmax_finish(scores_max, logsum, prob.softmax_scale, sink, mode.SINK)
    acc_o, p_op = warpgroup_mma_wait(0, deps=[pv, p_op])
    release_read(rings.v_empty, kv0 + n_kv - 1, mode.V_STAGES)
    acc_o = acc_o * gl.convert_layout(inv_logsum, o_row_layout)[:, None]

    lse_rows = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
    lse_q = lse_rows // mode.PACK_G
    lse_head = q_head0 + lse_rows % mode.PACK_G
    lse_live = lse_q < seqlen_q
    if mode.SPLIT:
        # ---- Partial output: fp32 O [splits, B, Sq, H, D] and LSE [splits, B, H, Sq]
        # straight from registers; combine.py merges them. VARLEN: the packed
        # rows as one sequence, O [splits, 1, total_q, H, D] and LSE
        # [splits, 1, H, total_q], sequence b's rows from q_start. ----
        o_rows = row0 + gl.arange(0, WG_M, layout=o_row_layout)
        o_q = o_rows // mode.PACK_G
        if mode.VARLEN:
            o_row0 = _split_index(split, mode) * prob.total_q + q_start
            lse_row0 = _split_index(split, mode) * prob.num_heads
            lse_len = prob.total_q
            lse_q0 = q_start
        else:
            o_row0 = (split * prob.batch + b) * seqlen_q
            lse_row0 = (split * prob.batch + b) * prob.num_heads
            lse_len = seqlen_q
            lse_q0 = 0
        o_off = ((o_row0 + o_q).to(gl.int64) * prob.num_heads + q_head0 + o_rows % mode.PACK_G) * mode.HEAD_DIM
        cols = gl.arange(0, mode.HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_live = o_q < seqlen_q
        gl.store(prob.o_part_ptr + o_off[:, None] + cols[None, :], acc_o, mask=o_live[:, None])
        lse_off = (lse_row0 + lse_head).to(gl.int64) * lse_len + lse_q0 + lse_q
        gl.store(prob.lse_part_ptr + lse_off, lse, mask=lse_live)
        if mode.O_IN_Q:
            mbarrier.arrive(rings.q_empty.index(q_idx), count=1)
    elif mode.VARLEN or mode.PACK_VIEW:
        # ---- Varlen epilogue: O into the sequence's rows only (``o_part_ptr``
        # is O, contiguous THD; a TMA box would overwrite the neighbour's
        # rows); LSE [H, total_q]. PACK_VIEW (fixed lengths): O [B, Sq, H, D]
        # contiguous (``o_part_ptr`` aliases it; no TMA box is a tile of a
        # group that is not a power of two); LSE [B, H, Sq].
        # O goes through this warpgroup's staging
        # rows (its own buffer, or its Q rows when O_IN_Q, as in the TMA
        # epilogue) and back into registers along D, so every thread stores
        # 16-byte vectors of whole rows: straight from the wgmma layout each
        # thread would hold pairs of columns and issue 4-byte stores. ----
        if mode.O_IN_Q:
            o_half = rings.q_smem.index(q_idx)
        else:
            o_half = rings.o_smem.index(CID)
        o_rows_smem = o_half.reshape([WG_M, mode.HEAD_DIM])
        o_rows_smem.store(acc_o.to(dtype))
        TPW_D: gl.constexpr = mode.HEAD_DIM // 8 if mode.HEAD_DIM // 8 < 32 else 32
        row_major: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [4, 1], [1, 0])
        o_vals = o_rows_smem.load(row_major)
        o_rows = row0 + gl.arange(0, WG_M, layout=gl.SliceLayout(1, row_major))
        o_q = o_rows // mode.PACK_G  # PackGQA: packed row p is query p // G of head q_head0 + p % G
        # O's rows are O_DIM features wide where its head dim is narrower
        # than the kernel's (the features past it are never stored).
        o_width: gl.constexpr = mode.O_DIM if mode.O_DIM > 0 else mode.HEAD_DIM
        if mode.VARLEN:
            o_row0 = q_start
        else:
            o_row0 = b * seqlen_q
        o_off = ((o_row0 + o_q).to(gl.int64) * prob.num_heads + q_head0 + o_rows % mode.PACK_G) * o_width
        cols = gl.arange(0, mode.HEAD_DIM, layout=gl.SliceLayout(0, row_major))
        o_live = o_q < seqlen_q
        o_mask = o_live[:, None]
        if mode.O_DIM > 0:
            o_mask = o_mask & (cols < mode.O_DIM)[None, :]
        gl.store(prob.o_part_ptr + o_off[:, None] + cols[None, :], o_vals, mask=o_mask)
        if mode.WRITE_LSE:
            if mode.VARLEN:
                lse_off = lse_head.to(gl.int64) * prob.total_q + q_start + lse_q
            else:
                lse_off = (b * prob.num_heads + lse_head).to(gl.int64) * seqlen_q + lse_q
            gl.store(prob.lse_ptr + lse_off, lse, mask=lse_live)
        if mode.O_IN_Q:
            # The next item's Q lands in these rows by TMA (the async proxy)
            # after the release: order this warpgroup's reads before it.
            fence_async_shared()
            mbarrier.arrive(rings.q_empty.index(q_idx), count=1)
    else:
        # ---- Epilogue: registers -> shared memory -> TMA store (clipped at seqlen_q). ----
        if mode.O_IN_Q:
            # O is staged in this warpgroup's own Q rows: its last QK completed
            # above, and the other warpgroup never reads them. This is what lets
            # head dim 256 fit in shared memory. The rows hold Q again only after
            # the store has read them.
            o_half = rings.q_smem.index(q_idx)
        else:
            # A buffer of its own; the previous item's store from it must be done.
            o_half = rings.o_smem.index(CID)
            tma.store_wait(0)
        o_half.reshape([WG_M, mode.HEAD_DIM]).store(acc_o.to(dtype))
        fence_async_shared()
        tma_store(o_desc, [b, row0 // mode.PACK_G, q_head0, 0], o_half)

        if mode.WRITE_LSE:
            lse_off = (b * prob.num_heads + lse_head).to(gl.int64) * seqlen_q + lse_q
            gl.store(prob.lse_ptr + lse_off, lse, mask=lse_q < seqlen_q)

        if mode.O_IN_Q:
            tma.store_wait(0)
            mbarrier.arrive(rings.q_empty.index(q_idx), count=1)


@gluon.jit
def _consumer_item(rings: Rings, prob: Problem, o_desc, bm, split, h, b, kv0, qi, CID: gl.constexpr, mode: Mode):
    """Work item ``(bm, split, h, b)`` for this warpgroup; ``kv0`` and ``qi``
    as in ``_producer_item``, returned advanced past it."""
    tb, q_start, k_start, lq, live = _item_rows(bm, b, prob, mode)
    if live:
        q_head0, hk, kb, n_lo, n_hi, lk = _item_bounds(b, bm, split, h, lq, k_start, prob, mode)
        if mode.SKIP_IDLE and bm * mode.BLOCK_M + CID * WG_M >= lq * mode.PACK_G:
            _consumer_idle(rings, qi, kv0, n_hi - n_lo, CID, mode)
        elif mode.OWN_DIAGONAL:
            # The tiles past this warpgroup's diagonal come first in the ring order.
            own_hi = _own_kv_end(bm, n_lo, n_hi, lq, lk, CID, mode)
            _pass_kv(rings, kv0, n_hi - own_hi, mode)
            _consumer_tile(rings, prob, o_desc, tb, q_head0, bm, split, n_lo, own_hi, qi, kv0 + n_hi - own_hi, lq,
                           lk, q_start, CID, mode)
        else:
            _consumer_tile(rings, prob, o_desc, tb, q_head0, bm, split, n_lo, n_hi, qi, kv0, lq, lk, q_start, CID,
                           mode)
        kv0 += n_hi - n_lo
        qi += 1
    return kv0, qi


@gluon.jit
def _consumer(rings: Rings, prob: Problem, o_desc, CID: gl.constexpr, mode: Mode):
    if mode.DEPENDENT:
        _wait_prior_grid()  # launched dependent on the kernel before (attention_forward_kernel)
    n_tiles = gl.cdiv(prob.seqlen_q * mode.PACK_G, mode.BLOCK_M)
    kv0 = 0
    qi = 0  # items run (see _producer)
    # This CTA's items, as the producer walks them (see there).
    item, limit = first_item(prob.total_tiles, prob.pair, mode.PERSISTENT, mode.DYNAMIC)
    # As in _producer: in the dynamic order only the first item is decoded here.
    bm, split, h, b = _item_at(0, item, n_tiles, prob, mode)
    i = 0
    while item < limit:
        if not mode.DYNAMIC:
            bm, split, h, b = _item_at(i, item, n_tiles, prob, mode)
        kv0, qi = _consumer_item(rings, prob, o_desc, bm, split, h, b, kv0, qi, CID, mode)
        if mode.DYNAMIC:
            # Decoded by the producer (scheduler.publish_item); split is 0.
            item, bm, h, b = receive_item(rings.sched_smem, rings.sched_full, rings.sched_empty, i)
        else:
            item = i + 1
        i += 1
    if mode.DEPENDENT and not mode.SPLIT:
        # The kernel after this one, where launched dependent on it (the
        # next call's forward), may be scheduled as this CTA's last O store
        # drains: its CTAs take the SMs ours leave, rather than after this
        # whole grid's completion (a split run triggers at its start, for
        # its combine: attention_forward_kernel).
        _let_next_grid_launch()
    tma.store_wait(0)


# Lengths and head counts stay run-time values: one compiled kernel per
# (dtype, head dim, causal, lse, mode) serves every shape, which lets the host
# cache it and skip Triton's per-call specialisation (see plan.launch_forward).
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_heads", "kv_group", "batch", "num_splits", "pair",
                              "page_stride", "total_q", "section", "q_heads"])
def attention_forward_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr,
                             seqused_ptr, kv_batch_ptr, page_table_ptr, o_part_ptr, lse_part_ptr,
                             cu_q_ptr, cu_k_ptr, used_q_ptr, sched_ptr, q_ptr, k_ptr, v_ptr, sink_ptr,
                             seqlen_q, seqlen_k, num_heads, kv_group, batch, qk_scale, softmax_scale,
                             num_splits, pair, page_stride, total_q, section, q_heads,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                             K_STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                             IS_CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                             PERSISTENT: gl.constexpr, O_IN_Q: gl.constexpr,
                             PACK_G: gl.constexpr, SPLIT: gl.constexpr, SEQUSED: gl.constexpr,
                             KV_BATCH: gl.constexpr, PAGE_SIZE: gl.constexpr,
                             VARLEN: gl.constexpr = False, SEQUSED_Q: gl.constexpr = False,
                             DYNAMIC: gl.constexpr = False, Q_STAGES: gl.constexpr = 1,
                             WINDOW_LEFT: gl.constexpr = -1, WINDOW_RIGHT: gl.constexpr = -1,
                             SOFTCAP: gl.constexpr = False, SINK: gl.constexpr = False,
                             RING_PTX: gl.constexpr = 0, ONE_ITEM: gl.constexpr = False, O_DIM: gl.constexpr = 0,
                             LEFTPAD: gl.constexpr = False, PACK_VIEW: gl.constexpr = False,
                             Q_TOKENS: gl.constexpr = False, Q_ROWS: gl.constexpr = False,
                             SPLIT_TABLE: gl.constexpr = False, DEPENDENT: gl.constexpr = False):
    # RING_PTX: which form of ``hopper_flash.ptx_rings`` compiled this
    # specialisation (0: triton's named barriers around the K/V ring kept);
    # unused here, it keys the compiled kernel.
    # Consumer warpgroups of 64 rows each: two, or three (FA3's 192-row tiles at head dim 64).
    NC: gl.constexpr = BLOCK_M // WG_M
    gl.static_assert(BLOCK_M == NC * WG_M and (NC == 2 or NC == 3), "two or three consumer warpgroups of 64 rows")
    gl.static_assert(not DYNAMIC or (PERSISTENT and not SPLIT), "the dynamic order runs a persistent grid, no split")
    gl.static_assert(Q_STAGES == 1 or not O_IN_Q, "O staged in Q's rows leaves no room for a second Q")
    gl.static_assert(not (VARLEN and KV_BATCH), "varlen runs without cache_batch_idx")
    gl.static_assert(not (VARLEN and PAGE_SIZE > 0 and not SEQUSED), "paged varlen reads seqused_k's lengths")
    gl.static_assert(not (SINK and SPLIT), "a split run's sink is the combine's")
    gl.static_assert(not LEFTPAD or (SEQUSED and not VARLEN and PAGE_SIZE == 0),
                     "a left pad offsets a contiguous cache row's keys (SEQUSED, no pages)")
    gl.static_assert(PACK_VIEW or WG_M % PACK_G == 0, "a packed box's group must not straddle two warpgroups")
    gl.static_assert(not PACK_VIEW or PACK_G > 1, "a packed view packs")
    gl.static_assert(not Q_TOKENS or (VARLEN and PACK_VIEW), "q by token: a packed batch's packed view")
    gl.static_assert(not Q_ROWS or (PACK_VIEW and not Q_TOKENS), "q by rows: a packed view")
    gl.static_assert(not SPLIT_TABLE or (SPLIT and VARLEN and not DYNAMIC), "a split table: a split packed batch")
    gl.static_assert(not (0 < PAGE_SIZE and PAGE_SIZE < GATHER_MIN_PAGE) or (HEAD_DIM <= 128 and BLOCK_M == 128),
                     "pages are gathered at head dims 64 and 128, two consumers (plan.gathers)")
    gl.static_assert(PAGE_SIZE % BLOCK_N == 0 or (BLOCK_N % PAGE_SIZE == 0 and PAGE_SIZE >= GATHER_MIN_PAGE
                                                  and k_desc.block_type.shape[1] == PAGE_SIZE)
                     or (PAGE_SIZE < GATHER_MIN_PAGE and k_desc.block_type.shape[1] == BLOCK_N),
                     "pages of whole tiles, of 16 keys and more loaded one TMA box per page, or smaller ones "
                     "gathered (the descriptors then only lay out the tiles)")
    dtype: gl.constexpr = q_desc.dtype
    mode = Mode(BLOCK_M, BLOCK_N, HEAD_DIM, K_STAGES, V_STAGES, IS_CAUSAL, WRITE_LSE, PERSISTENT, O_IN_Q, PACK_G,
                SPLIT, SEQUSED, KV_BATCH, PAGE_SIZE, VARLEN, SEQUSED_Q, DYNAMIC, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                SINK, ONE_ITEM, O_DIM, LEFTPAD, PACK_VIEW, Q_TOKENS, Q_ROWS, SPLIT_TABLE, DEPENDENT or SPLIT)
    # Programmatic dependent launch, both ways, where DEPENDENT (plan.
    # launched_dependent: a split run, or one whose grid has a CTA on every
    # SM): the run is launched dependent on the kernel before it, so its
    # CTAs may be scheduled, and run up to the partitions' griddepcontrol.
    # wait (_wait_prior_grid), while that one still runs. A split run's
    # combine (plan.launch_combine), launched so too, may be scheduled from
    # the split grid's start, its own wait holding it until this grid is
    # done and its writes visible: the combine's launch is hidden (0.8 us of
    # a B=1 decode call, BENCHMARKS.md, twenty-fourth session), and so is
    # the next call's split grid behind that combine (0.7-1.2 us of a
    # one-query decode call, H100, seventy-fifth session). A run without a
    # split lets the next grid launch only once its consumers are past their
    # last item (_consumer): with this trigger at every run's start, 128-
    # and 512-query chunk rows (128 CTAs on 132 SMs) measured 2.6-3.3%
    # slower under graph replay (the same session); triggered late, grids on
    # every SM gained 0.9-2% and those chunk rows still lost up to 1.6%,
    # and (one round) as much launched plainly with the waits in (H100,
    # seventy-seventh session), so runs launched plainly have neither.
    if SPLIT:
        _let_next_grid_launch()

    # Work items are (query tile, split, head, batch), flattened with the tile
    # fastest: the seed's 3-D grid order without the 65535 limit of grid axes
    # y and z. Which CTA runs which item is scheduler.py's business; every
    # partition walks the same items in the same order.
    # SPLIT_TABLE: the table's entries take the place of split and batch.
    total_tiles = gl.cdiv(seqlen_q * PACK_G, BLOCK_M) * num_splits * _item_head_count_of(num_heads, PACK_G)
    if not SPLIT_TABLE:
        total_tiles *= batch

    # Q as NC [1, 64, 1, D] parts (packed: [1, 64 / G, G, D], or the plain box over the packed view), one per
    # consumer warpgroup, for Q_STAGES items: part c of the item in slot j is
    # buffer NC·j + c (_q_slot).
    q_smem = gl.allocate_shared_memory(dtype, [NC * Q_STAGES] + q_desc.block_type.shape, q_desc.layout)
    # A K/V slot holds a whole tile, whose TMA box may be a page of fewer rows (_load_kv_tile).
    k_bufs = gl.allocate_shared_memory(dtype, [K_STAGES, 1, BLOCK_N, 1, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [V_STAGES, 1, BLOCK_N, 1, HEAD_DIM], v_desc.layout)
    if O_IN_Q or SPLIT:
        o_smem = q_smem  # O is staged in its own Q rows (see _consumer_tile), or not at all (SPLIT)
    else:
        o_smem = gl.allocate_shared_memory(dtype, [NC] + o_desc.block_type.shape, o_desc.layout)

    # q_full[NC·j + c] / q_empty[NC·j + c]: Q part c of slot j landed / consumer c is done with it.
    q_full = gl.allocate_shared_memory(gl.int64, [NC * Q_STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NC * Q_STAGES, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    # Full: the producer's expect-tx arrive, or (GATHER, and Q_ROWS for Q) one cp.async arrive per producer thread.
    kv_arrivals: gl.constexpr = 32 * mode.PRODUCER_WARPS if mode.GATHER else 1
    q_arrivals: gl.constexpr = 32 * mode.PRODUCER_WARPS if Q_ROWS else 1
    for c in gl.static_range(NC * Q_STAGES):
        mbarrier.init(q_full.index(c), count=q_arrivals)
        mbarrier.init(q_empty.index(c), count=1)  # the consumer's arrive
    for i in gl.static_range(K_STAGES):
        mbarrier.init(k_full.index(i), count=kv_arrivals)
        mbarrier.init(k_empty.index(i), count=NC)  # one arrive per consumer warpgroup
    for i in gl.static_range(V_STAGES):
        mbarrier.init(v_full.index(i), count=kv_arrivals)
        mbarrier.init(v_empty.index(i), count=NC)
    # DYNAMIC: the ring through which the producer hands out the next item
    # (scheduler.py); a slot is full after the producer's arrive, empty after
    # every consumer's.
    sched_smem = gl.allocate_shared_memory(gl.int32, [SCHED_STAGES, SCHED_FIELDS],
                                           gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    sched_full = gl.allocate_shared_memory(gl.int64, [SCHED_STAGES, 1], mbarrier.MBarrierLayout())
    sched_empty = gl.allocate_shared_memory(gl.int64, [SCHED_STAGES, 1], mbarrier.MBarrierLayout())
    if DYNAMIC:
        for i in gl.static_range(SCHED_STAGES):
            mbarrier.init(sched_full.index(i), count=1)
            mbarrier.init(sched_empty.index(i), count=NC)
    # The offset start's one-slot rings, one per pair of neighbouring consumers
    # (_pass_turn / _take_turn).
    turn_full = gl.allocate_shared_memory(gl.int64, [NC - 1, 1], mbarrier.MBarrierLayout())
    turn_empty = gl.allocate_shared_memory(gl.int64, [NC - 1, 1], mbarrier.MBarrierLayout())
    if mode.OFFSET_START:
        for c in gl.static_range(NC - 1):
            mbarrier.init(turn_full.index(c), count=1)
            mbarrier.init(turn_empty.index(c), count=1)

    rings = Rings(q_smem, o_smem, k_bufs, v_bufs, q_full, q_empty, k_full, k_empty, v_full, v_empty, sched_smem,
                  sched_full, sched_empty, turn_full, turn_empty)
    prob = Problem(seqlen_q, seqlen_k, num_heads, kv_group, batch, num_splits, pair, section, total_tiles, page_stride,
                   total_q, q_heads, qk_scale, softmax_scale, lse_ptr, seqused_ptr, kv_batch_ptr, page_table_ptr,
                   o_part_ptr, lse_part_ptr, cu_q_ptr, cu_k_ptr, used_q_ptr, sched_ptr, q_ptr, k_ptr, v_ptr, sink_ptr)
    # The default partition is consumer 0 (the launch's num_warps = 4).
    if NC == 2:
        gl.warp_specialize(
            [(_consumer, (rings, prob, o_desc, 0, mode)), (_consumer, (rings, prob, o_desc, 1, mode)),
             (_producer, (q_desc, k_desc, v_desc, rings, prob, mode))],
            [4, mode.PRODUCER_WARPS],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
    else:
        gl.warp_specialize(
            [(_consumer, (rings, prob, o_desc, 0, mode)), (_consumer, (rings, prob, o_desc, 1, mode)),
             (_consumer, (rings, prob, o_desc, 2, mode)), (_producer, (q_desc, k_desc, v_desc, rings, prob, mode))],
            [4, 4, mode.PRODUCER_WARPS],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )
