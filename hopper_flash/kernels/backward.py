"""The attention backward's main kernel: dK and dV of one KV tile, and its
share of dQ.

Math (per batch and query head; FA3's formulation, see
``shared/notes/backward.md``): with S = Q·Kᵀ unscaled, ``c = scale·log2(e)``
and ``L2 = LSE·log2(e)`` (the forward's natural-log LSE, rescaled by the
preprocess), P = exp2(S·c − L2) is the forward's softmax, recomputed from the
saved LSE rather than by rerunning the forward. Then

    dV = Pᵀ·dO,   dP = dO·Vᵀ,   dS = P ⊙ (dP − Δ) with Δ = rowsum(dO ⊙ O),
    dK = scale · dSᵀ·Q,   dQ = scale · dS·K.

The scale never multiplies S or dS: it is in ``c``, in dK once after the
loop, and in dQ in the postprocess (``backward_pre.py``).

Logit soft-capping (``SOFTCAP``, kernels/softmax.py): S becomes
``T = tanh(S · scale/cap)`` before the mask, ``c = cap·log2(e)``, and dS
gains the factor ``1 − T²`` (``softcap_grad``); dK and dQ keep ``scale``.

One CTA owns one tile of ``BLOCK_N`` keys of one KV head and walks the
query tiles that see those keys, for every query head that shares the KV
head (GQA/MQA: the group's dK and dV sums stay in registers, with no fp32
workspace and no atomics for them). Every head-dim operand is one TMA box
of the whole head dim. Three partitions:

* the **producer** (1 warp, few registers) loads K and V once and then, per
  step, Q and dO into rings (``STAGES`` and ``DO_STAGES`` deep);
* the **consumers** are the default partition, 8 warps = two warpgroups,
  which share a step in one of two ways (``SPLIT_D``):

  - D <= 128, split keys (``_bwd_consumer_split_keys``, 128 keys): the
    scores are computed transposed, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ as
    ``[BLOCK_N keys, BLOCK_M queries]`` tiles with warps ``[8, 1]``:
    warpgroup ``w`` owns keys ``64w .. 64w + 63``, so the Pᵀ and dSᵀ it
    holds are the A operands of its own rows of dV += Pᵀ·dO and
    dK += dSᵀ·Q, fed from registers. dQ = dS·K sums over all 128 keys, so
    dSᵀ goes through shared memory (two stages), and dQ is split between
    the warpgroups by head-dim columns (warps ``[4, 2]``; D = 64 takes 128
    queries per step and splits dQ by rows, warps ``[8, 1]``).
  - D = 256, split head dim (``_bwd_consumer_split_d``, 64 keys): 128 keys'
    dK and dV would not fit in registers, so both warpgroups share 64 keys
    and each owns half the head-dim columns of dK, dV and dQ (and half the
    queries of Sᵀ, dPᵀ); Pᵀ and dSᵀ go through shared memory.

dQ of one query tile gets contributions from every KV tile, i.e. from many
CTAs: each stages its fp32 share in shared memory and adds it into
``dq_accum`` with a TMA reduce-add (``compat.tma_atomic_add``). In
``DETERMINISTIC`` mode the adds to one (head, query tile) happen in KV-tile
order: a per-tile semaphore counts the KV tiles that have added, and CTA
``n`` waits for it to read ``n``. The KV tiles that see a query tile are
always a prefix ``0 .. k`` (causal masks only keys after the diagonal), and
of one head's CTAs those with a lower ``n`` are launched first (below), so
the wait ends.

**Grid order.** One CTA per (KV tile, KV head, batch), on
grid axis 0 in the forward's dynamic order (``scheduler.section_coords``):
the (batch, KV head) pairs in L2 sections of ``section``, the head fastest
inside one, then the KV tile from 0 up. Under a causal mask KV tile 0 is the
longest (every query tile sees it), so the GPU's block dispatcher, which
hands out CTAs in order to SMs as they free up, runs the longest first and
ends on the shortest; with the KV tile fastest, as before, the last heads'
longest tiles started in the last wave. A varlen batch takes its sequences
in the order the preprocess ranked them (``backward_pre``: most query rows
first), not in the caller's: otherwise a long sequence placed last starts
its longest tiles (every query tile of the sequence, times the GQA group)
in the last wave (0.4-0.6% measured, ``scripts/varlen_bwd_order_model.py``).
Deterministic mode keeps the caller's order.

**Persistent grid (``PERSISTENT``: fast mode, D = 128, varlen or short
causal rows; ``plan_backward.persistent_grid``).** The varlen grid covers
``max_seqlen_k`` for every sequence, so on a mixed batch many of its CTAs
fall past their sequence's keys and would only start and exit; and on
short rows a CTA's launch and its first K/V load are a large part of a
tile's time. There, at most one CTA per SM takes the items in the same
order: the first its program id, the next ones from a counter (varlen:
after the sequence order; ``scheduler.draw_item``, zeroed by the
preprocess every call), which the producer hands to the consumers
(``_bwd_producer_loop``, ``_bwd_consumer_loop``). A tile past its
sequence's keys then costs a decode, and the next tile's K and V load under
the current tile's epilogue: the consumers release them (``kv_empty``) and
write dK/dV through the dQ staging tiles. 1.0-1.3% faster on the varlen
block, 2-6% on causal rows of 1024-4096 queries; at D = 64 4-5% slower, on
long fixed rows even or 1% slower (BENCHMARKS.md, forty-first and
forty-second sessions; those keep one CTA per tile).

The partitions (``_bwd_producer``, ``_bwd_consumer``, their loops on the
persistent grid) and the step helpers take aggregates: ``BwdMode``
(compile-time switches), ``BwdProblem`` (descriptors, pointers, scalars),
``BwdGrid`` (what decodes an item into its tile), ``KvTile`` (one KV tile
and the query tiles that see it), ``BwdRings`` (shared memory and its
barriers) and ``BwdLoop`` (the persistent grid's own).

Masking (bottom-right causal, ``off = seqlen_k − seqlen_q``): key j is
visible to query i iff ``j <= i + off`` and ``j < seqlen_k``. Query rows past
``seqlen_q`` need no mask: TMA zero-fills them and the preprocess gives them
``L2 = +inf`` (so P = 0) and Δ = 0. Rows that see no key have LSE = −inf,
which the preprocess maps to 0; all their keys are masked, so P = 0.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.language.nvidia.hopper.tma import tensor_descriptor

from .compat import (aggregate, init_fields, smem_reinterpret, thread_barrier, tma_atomic_add, tma_load, tma_store,
                     tma_store_wait_complete)
from .scheduler import SCHED_FIELDS, SCHED_STAGES, draw_item, publish_item, receive_item, section_coords
from .mask import apply_mask_keys_by_queries, tile_needs_mask
from .opaque import opaque_zero
from .pipeline import release, release_each, ring_slot, wait_empty, wait_full
from .softmax import LOG2E, softcap, softcap_grad


# The consumer partition: two warpgroups (each arrives on the Q/dO empty
# barriers per thread in the split-keys step, `release_each`).
CONSUMER_THREADS = gl.constexpr(256)


@gluon.jit
def bwd_query_tile_range(n, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         IS_CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr = -1, WINDOW_RIGHT: gl.constexpr = -1):
    """Query tiles ``[m_lo, m_hi)`` that see some key of KV tile ``n``.

    Causal: query i sees key n·BLOCK_N first when i + off >= n·BLOCK_N, so
    tiles below that row's tile see none of this tile's keys. Empty when the
    KV tile lies past every query's diagonal (the CTA stores zero dK/dV).

    A sliding window (mask.py) bounds both ends: query i sees a key of the
    tile iff ``i + off - left <= last key`` and ``i + off + right >= first
    key``. ``bwd_first_kv_tile`` inverts the upper bound (deterministic
    mode's order), so the two must change together."""
    m_hi = gl.cdiv(seqlen_q, BLOCK_M)
    if WINDOW_LEFT >= 0 or WINDOW_RIGHT >= 0:
        off = seqlen_k - seqlen_q
        if WINDOW_RIGHT >= 0:
            m_lo = gl.minimum(gl.maximum(n * BLOCK_N - off - WINDOW_RIGHT, 0) // BLOCK_M, m_hi)
        else:
            m_lo = m_hi * 0
        if WINDOW_LEFT >= 0:
            last_row = gl.minimum((n + 1) * BLOCK_N, seqlen_k) - 1 - off + WINDOW_LEFT
            m_hi = gl.where(last_row < 0, 0, gl.minimum(last_row // BLOCK_M + 1, m_hi))
        m_hi = gl.maximum(m_hi, m_lo)
    elif IS_CAUSAL:
        first_row = gl.maximum(n * BLOCK_N - (seqlen_k - seqlen_q), 0)
        m_lo = gl.minimum(first_row // BLOCK_M, m_hi)
    else:
        m_lo = m_hi * 0
    return m_lo, m_hi


@gluon.jit
def bwd_sequence(b, cu_q_ptr, cu_k_ptr, used_q_ptr, used_k_ptr, seqlen_q, seqlen_k, seqlen_q_rounded, num_heads,
                 BLOCK_M: gl.constexpr, VARLEN: gl.constexpr, SEQUSED_Q: gl.constexpr, SEQUSED_K: gl.constexpr):
    """Where batch ``b``'s sequence lives: ``(tb, q_start, k_start, lq, lk, stat0)``.

    ``tb`` is the TMA batch coordinate and ``q_start``/``k_start`` the first
    row of the sequence on the sequence axis; ``lq``/``lk`` its live lengths;
    ``stat0`` the row of its first query (head 0) in the padded fp32 buffers
    (L2, Δ, dQ accumulator), whose head stride is ``seqlen_q_rounded``.

    VARLEN (THD tensors viewed as batch 1): the sequence starts at
    ``cu[b]``, lives for ``seqused[b]`` or ``cu[b+1] - cu[b]`` rows, and its
    padded stats start at ``(cu_q[b] + b·BLOCK_M)`` rounded down to a whole
    tile (FA3's rule): every sequence's tiles then cover rows of its own, so
    no tile of the stats or of the dQ reduce overlaps a neighbour's
    (``seqlen_q_rounded`` is then the padded total, ``plan_backward``)."""
    if VARLEN:
        q_start = gl.load(cu_q_ptr + b)
        k_start = gl.load(cu_k_ptr + b)
        if SEQUSED_Q:
            lq = gl.load(used_q_ptr + b)
        else:
            lq = gl.load(cu_q_ptr + b + 1) - q_start
        if SEQUSED_K:
            lk = gl.load(used_k_ptr + b)
        else:
            lk = gl.load(cu_k_ptr + b + 1) - k_start
        tb = b * 0
        stat0 = ((q_start + b * BLOCK_M) // BLOCK_M * BLOCK_M).to(gl.int64)
    else:
        q_start = b * 0
        k_start = b * 0
        lq = seqlen_q
        lk = seqlen_k
        tb = b
        stat0 = (b * num_heads).to(gl.int64) * seqlen_q_rounded
    return tb, q_start, k_start, lq, lk, stat0


@gluon.jit
def _zero_rows(buf, row0, limit, ROWS: gl.constexpr, COLS: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Zero the rows of the shared tile ``buf`` ([ROWS, COLS]; row ``r`` is
    sequence row ``row0 + r``) at or past ``limit``.

    Varlen tiles read past their sequence, into a neighbour or into rows past
    ``seqused`` that may hold NaN or Inf: their P and dS are 0, but
    0 · NaN = NaN in the dV, dK and dQ products. The caller fences and
    synchronises before a wgmma reads the tile."""
    CH: gl.constexpr = NUM_WARPS * 32 * 8 // COLS  # one 16-byte vector per thread per chunk
    TPW_D: gl.constexpr = COLS // 8 if COLS // 8 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [NUM_WARPS, 1], [1, 0])
    for c in gl.static_range(ROWS // CH):
        if row0 + (c + 1) * CH > limit:
            chunk = buf.slice(c * CH, CH, dim=0)
            rows = row0 + c * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
            x = chunk.load(layout)
            x = gl.where((rows < limit)[:, None], x, gl.zeros_like(x))
            chunk.store(x)


@gluon.jit
def _zero_tile_tail(bufs, slot, row0, limit, ROWS: gl.constexpr, COLS: gl.constexpr, NUM_WARPS: gl.constexpr):
    """``_zero_rows`` over ring slot ``slot``, fenced and synchronised for the
    wgmmas, when the tile crosses ``limit``."""
    if row0 + ROWS > limit:
        _zero_rows(bufs.index(slot).reshape([ROWS, COLS]), row0, limit, ROWS, COLS, NUM_WARPS)
        fence_async_shared()
        thread_barrier()


@gluon.jit
def _store_rows(buf, ptr, row_start, n_rows, stride_row, col_off, ROWS: gl.constexpr, COLS: gl.constexpr,
                NUM_WARPS: gl.constexpr, COL_LIMIT: gl.constexpr = 0):
    """Store rows ``0 .. n_rows - 1`` of the shared tile ``buf`` to
    ``ptr + (row_start + r)·stride_row + col_off + c``: a varlen dK/dV tile
    stops at its sequence's end instead of a TMA box overwriting the next
    sequence's rows (which another CTA writes). ``COL_LIMIT``: columns
    ``c < COL_LIMIT`` only (a head dim narrower than the tile's,
    ``BwdMode.O_DIM``); 0: all."""
    CH: gl.constexpr = NUM_WARPS * 32 * 8 // COLS
    TPW_D: gl.constexpr = COLS // 8 if COLS // 8 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_D, TPW_D], [NUM_WARPS, 1], [1, 0])
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    for c in gl.static_range(ROWS // CH):
        if c * CH < n_rows:
            rows = c * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, layout))
            x = buf.slice(c * CH, CH, dim=0).load(layout)
            offs = (row_start + rows).to(gl.int64)[:, None] * stride_row + col_off + cols[None, :]
            live = (rows < n_rows)[:, None]
            if COL_LIMIT > 0:
                live = live & (cols < COL_LIMIT)[None, :]
            gl.store(ptr + offs, x, mask=live)


@gluon.jit
def _stage_dq(dq_smem, dq):
    """Store a dQ share (a wgmma accumulator, fp32) into its TMA staging
    tile with the rows of each 8-row group interleaved: accumulator row
    ``8g + 4h + j`` (h < 2, j < 4) goes to tile row ``8g + 2j + h``.

    Why: in the accumulator layout a warp's 64-bit store covers 8 rows × 32
    bytes, and the hardware serves it in two half-warp phases of 4 rows. In
    the 128-byte-swizzled fp32 tile, rows ``r`` and ``r ^ 1`` put the same
    32 bytes of columns in the same banks, so each phase took two
    wavefronts (ncu: 4 per store where 2 are ideal, 8.7% of the kernel's
    shared-memory wavefronts at D = 128). Interleaved, the 4 rows of a phase
    are tile rows 0, 2, 4, 6 (or 1, 3, 5, 7) of the group: distinct banks.
    ``dq_accum`` therefore holds each query tile with its rows interleaved
    the same way (every KV tile adds in the same order); the postprocess
    (``backward_pre.dq_accum_row``) reads them back in query order."""
    M: gl.constexpr = dq.shape[0]
    N: gl.constexpr = dq.shape[1]
    x = gl.permute(gl.reshape(dq, [M // 8, 2, 4, N]), (0, 2, 1, 3))
    dq_smem.store(gl.reshape(x, [M, N]))


@gluon.jit
def _dq_wait_turn(sem, n):
    """Deterministic mode: block until KV tiles 0 .. n-1 added their dQ shares."""
    while gl.atomic_add(sem, 0, sem="acquire", scope="gpu") != n:
        pass


@gluon.jit
def _dq_pass_turn(sem):
    """Deterministic mode: this CTA's adds are complete in global memory (not
    merely done reading shared memory): let the next KV tile add."""
    tma_store_wait_complete()
    thread_barrier()
    gl.atomic_add(sem, 1, sem="release", scope="gpu")


@gluon.jit
def bwd_first_kv_tile(m, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      WINDOW_LEFT: gl.constexpr):
    """The lowest KV tile that adds to query tile ``m``'s dQ: 0, or under a
    window's left bound the tile of the first row's leftmost key (the
    smallest ``n`` with ``bwd_query_tile_range(n)``'s ``m_hi > m``).
    Deterministic mode counts a tile's turn from it."""
    if WINDOW_LEFT >= 0:
        first = gl.maximum(m * BLOCK_M + (seqlen_k - seqlen_q) - WINDOW_LEFT, 0) // BLOCK_N
    else:
        first = m * 0
    return first


@gluon.jit
def _dq_add_in_order(dq_desc, dq_row, dq_col, dq_smem, sem, n):
    """Deterministic mode: add this CTA's dQ share after KV tiles 0 .. n-1."""
    _dq_wait_turn(sem, n)
    tma_atomic_add(dq_desc, [dq_row, dq_col], dq_smem)
    _dq_pass_turn(sem)


@aggregate
class BwdMode:
    """The compile-time switches of one backward specialisation
    (``plan_backward.kernel_constexprs``)."""
    BLOCK_M: gl.constexpr  # queries per step
    BLOCK_N: gl.constexpr  # keys per CTA
    HEAD_DIM: gl.constexpr
    STAGES: gl.constexpr  # Q ring depth
    DO_STAGES: gl.constexpr  # dO ring depth
    IS_CAUSAL: gl.constexpr
    DETERMINISTIC: gl.constexpr
    VARLEN: gl.constexpr
    SPLIT_D: gl.constexpr  # D = 256: the warpgroups split the head dim, not the keys
    WINDOW_LEFT: gl.constexpr  # a sliding window (mask.py); -1: no bound on that side
    WINDOW_RIGHT: gl.constexpr
    SOFTCAP: gl.constexpr  # logit soft-capping (module docstring)
    # VARLEN's dK and dV, stored by address: their head dim where narrower
    # than HEAD_DIM (plan.kernel_head_dim; the boxes read zeros past it),
    # else 0.
    O_DIM: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, DO_STAGES, IS_CAUSAL, DETERMINISTIC, VARLEN, SPLIT_D,
                 WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, O_DIM):
        init_fields(self, locals(), constexpr=True)


@aggregate
class BwdProblem:
    """The launch's tensors and run-time values: the nine TMA descriptors,
    the dQ semaphores (deterministic mode), dK/dV as pointers (varlen stores),
    and the per-launch scalars."""
    q_desc: tensor_descriptor
    k_desc: tensor_descriptor
    v_desc: tensor_descriptor
    do_desc: tensor_descriptor
    dk_desc: tensor_descriptor
    dv_desc: tensor_descriptor
    dq_desc: tensor_descriptor  # fp32 dq_accum, one staging tile per box
    lse2_desc: tensor_descriptor
    delta_desc: tensor_descriptor
    sem_ptr: gl.tensor
    dk_ptr: gl.tensor
    dv_ptr: gl.tensor
    stride_kv_row: gl.tensor
    stride_kv_head: gl.tensor
    seqlen_q_rounded: gl.tensor  # rows per head of the padded fp32 buffers
    kv_group: gl.tensor  # query heads per KV head
    qk_scale: gl.tensor  # softmax_scale · log2(e); SOFTCAP: cap · log2(e)
    softmax_scale: gl.tensor

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse2_desc, delta_desc, sem_ptr,
                 dk_ptr, dv_ptr, stride_kv_row, stride_kv_head, seqlen_q_rounded, kv_group, qk_scale, softmax_scale):
        init_fields(self, locals())


@aggregate
class KvTile:
    """This CTA's work: KV tile ``n`` of KV head ``hk`` of one sequence, and
    the query tiles ``[m_lo, m_hi)`` that see it (see ``bwd_sequence`` for
    ``tb``, ``q_start``, ``k_start``, ``lq``, ``lk`` and ``stat0``). ``live``:
    the tile holds keys of its sequence (varlen; always true otherwise)."""
    tb: gl.tensor
    q_start: gl.tensor
    k_start: gl.tensor
    lq: gl.tensor
    lk: gl.tensor
    stat0: gl.tensor
    hk: gl.tensor
    n: gl.tensor
    m_lo: gl.tensor
    m_hi: gl.tensor
    live: gl.tensor

    @gluon.constexpr_function
    def __init__(self, tb, q_start, k_start, lq, lk, stat0, hk, n, m_lo, m_hi, live):
        init_fields(self, locals())


@aggregate
class BwdRings:
    """Shared memory and its barriers: K and V (one tile each, reused for the
    dK/dV epilogue), the Q and dO rings with their L2 and Δ vectors, the two
    [keys, queries] tiles (dSᵀ stages, or Pᵀ and dSᵀ), the fp32 dQ staging."""
    k_bufs: gl.shared_memory_descriptor
    v_bufs: gl.shared_memory_descriptor
    q_bufs: gl.shared_memory_descriptor
    do_bufs: gl.shared_memory_descriptor
    lse2_bufs: gl.shared_memory_descriptor
    delta_bufs: gl.shared_memory_descriptor
    ds_bufs: gl.shared_memory_descriptor
    dq_smem: gl.shared_memory_descriptor
    kv_bar: gl.shared_memory_descriptor
    q_full: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    do_full: gl.shared_memory_descriptor
    do_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k_bufs, v_bufs, q_bufs, do_bufs, lse2_bufs, delta_bufs, ds_bufs, dq_smem, kv_bar, q_full,
                 q_empty, do_full, do_empty):
        init_fields(self, locals())


@gluon.jit
def _dq_turn(tile: KvTile, m, mode: BwdMode):
    """Deterministic mode: this KV tile's place among those that add to
    query tile ``m``'s dQ (0 for the first, ``bwd_first_kv_tile``)."""
    return tile.n - bwd_first_kv_tile(m, tile.lq, tile.lk, mode.BLOCK_M, mode.BLOCK_N, mode.WINDOW_LEFT)


@gluon.jit
def _wait_kv(k_t, v_t, rings: BwdRings, tile: KvTile, mode: BwdMode, NUM_WARPS: gl.constexpr, phase=0):
    """Wait for this CTA's K and V tiles (none when ``tile.live`` is false: a
    varlen tile past its sequence's keys loads nothing). Varlen: keys past
    the sequence are masked in Sᵀ, but dQ = dS·K and dPᵀ = V·dOᵀ would still
    meet their NaN (see _zero_rows), so they are zeroed."""
    if tile.live:
        mbarrier.wait(rings.kv_bar, phase)
        if mode.VARLEN:
            if (tile.n + 1) * mode.BLOCK_N > tile.lk:
                _zero_rows(k_t, tile.n * mode.BLOCK_N, tile.lk, mode.BLOCK_N, mode.HEAD_DIM, NUM_WARPS)
                _zero_rows(v_t, tile.n * mode.BLOCK_N, tile.lk, mode.BLOCK_N, mode.HEAD_DIM, NUM_WARPS)
                fence_async_shared()
                thread_barrier()

@gluon.jit
def _p_and_ds(k_t, v_t, rings: BwdRings, tile: KvTile, step, q_slot, do_slot, m, qk_scale, tanh_scale, st_zero,
              mode: BwdMode, NUM_WARPS: gl.constexpr):
    """A step's first half, the same for both consumers: wait for Q and dO,
    Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (in ``st_zero``'s layout), then Pᵀ (fp32,
    masked) and dSᵀ = Pᵀ ⊙ (dPᵀ − Δ) from fp32 P before any rounding.
    Returns ``(q_t, do_t, pt, dst)``. SOFTCAP: Sᵀ is capped first
    (``tanh_scale`` = scale/cap) and dSᵀ gains the factor 1 − Tᵀ², which
    keeps the capped Sᵀ alive over the dPᵀ wait.

    128-query tiles (D = 64) keep the per-query statistics out of the
    registers: L2 and Δ (32 values per thread each at 128 queries) would
    not fit beside Sᵀ, dPᵀ, dK and dV without spills. Their accumulators
    start at −L2/c and −Δ instead, so the wgmmas produce Sᵀ − L2/c and
    dPᵀ − Δ, and each vector is dead once its wgmma is issued. The rounding
    is that of the FMA it replaces: Sᵀ·c − L2 is rounded at the scale of L2
    either way (c = ``qk_scale`` > 0). Both vectors are loaded, after the
    waits for Q and dO, before Sᵀ is issued: loaded between the two wgmmas,
    Δ's shared-memory loads queued behind Sᵀ's operand reads (the largest
    stretch of the step under Nsight Compute against FA3's, forty-fifth
    session; this order is 0.7-3% faster, BENCHMARKS.md). 64-query tiles
    keep the FMA and the subtraction: loading L2 before Sᵀ is issued made
    D = 128 2-3% slower (BENCHMARKS.md, seventh session)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, st_zero.type.layout)  # one value per query
    # (Not under SOFTCAP: tanh needs the raw Sᵀ; plan_backward gives it 64-query tiles.)
    STATS_IN_ACC: gl.constexpr = mode.BLOCK_M == 128 and not mode.SOFTCAP
    wait_full(rings.q_full, step, mode.STAGES)
    if mode.VARLEN:
        # The last query tile of a varlen sequence reads rows of the next one
        # (or NaN past seqused): zero them before any product.
        _zero_tile_tail(rings.q_bufs, q_slot, m * mode.BLOCK_M, tile.lq, mode.BLOCK_M, mode.HEAD_DIM, NUM_WARPS)
    q_t = rings.q_bufs.index(q_slot).reshape([mode.BLOCK_M, mode.HEAD_DIM])
    if STATS_IN_ACC:
        # Both vectors out of shared memory before either wgmma is issued:
        # their loads do not queue behind the wgmmas' operand reads.
        do_t = _wait_do(rings, tile, step, do_slot, m, mode, NUM_WARPS)
        lse2 = rings.lse2_bufs.index(q_slot).load(col_layout)
        delta = rings.delta_bufs.index(do_slot).load(col_layout)
        st = warpgroup_mma(k_t, q_t.permute((1, 0)), st_zero - (lse2 * (1.0 / qk_scale))[None, :], is_async=True)
        dpt = warpgroup_mma(v_t, do_t.permute((1, 0)), st_zero - delta[None, :], is_async=True)
    else:
        st = warpgroup_mma(k_t, q_t.permute((1, 0)), st_zero, is_async=True)
        do_t = _wait_do(rings, tile, step, do_slot, m, mode, NUM_WARPS)
        dpt = warpgroup_mma(v_t, do_t.permute((1, 0)), st_zero, is_async=True)
        lse2 = rings.lse2_bufs.index(q_slot).load(col_layout)
    st = warpgroup_mma_wait(1, deps=[st])
    if mode.SOFTCAP:
        st = softcap(st, tanh_scale)
    if tile_needs_mask(tile.n, m, tile.lq, tile.lk, mode.BLOCK_M, mode.BLOCK_N, mode.IS_CAUSAL, 1, mode.WINDOW_LEFT,
                       mode.WINDOW_RIGHT):
        st = apply_mask_keys_by_queries(st, tile.n * mode.BLOCK_N, m * mode.BLOCK_M, tile.lq, tile.lk, mode.IS_CAUSAL,
                                        mode.WINDOW_LEFT, mode.WINDOW_RIGHT)
    if STATS_IN_ACC:
        pt = gl.exp2(st * qk_scale)
        dpt = warpgroup_mma_wait(0, deps=[dpt])
        dst = pt * dpt
    else:
        pt, dst = _p_and_ds_from_stats(st, dpt, lse2, rings.delta_bufs, do_slot, qk_scale, mode.SOFTCAP,
                                       k_t.dtype)
    return q_t, do_t, pt, dst


@gluon.jit
def _wait_do(rings: BwdRings, tile: KvTile, step, do_slot, m, mode: BwdMode, NUM_WARPS: gl.constexpr):
    """Wait for the step's dO tile (and its Δ) and return it as [BLOCK_M, D];
    VARLEN: the rows past the sequence zeroed first, as Q's are."""
    wait_full(rings.do_full, step, mode.DO_STAGES)
    if mode.VARLEN:
        _zero_tile_tail(rings.do_bufs, do_slot, m * mode.BLOCK_M, tile.lq, mode.BLOCK_M, mode.HEAD_DIM, NUM_WARPS)
    return rings.do_bufs.index(do_slot).reshape([mode.BLOCK_M, mode.HEAD_DIM])


@gluon.jit
def _p_and_ds_from_stats(st, dpt, lse2, delta_bufs, do_slot, qk_scale, SOFTCAP: gl.constexpr,
                         dtype: gl.constexpr):
    """Pᵀ = exp2(c·Sᵀ − L2) from the masked Sᵀ, then dSᵀ = Pᵀ ⊙ (dPᵀ − Δ)
    once the in-flight dPᵀ wgmma completes (Δ loaded while it runs): the
    64-query steps' statistics path (see _p_and_ds), also the D = 256
    consumers'. Returns ``(pt, dst)``.

    In the SASS the dPᵀ wait comes before the exponentials, not after them:
    ptxas hoists a wgmma wait to the top of its basic block (here the block
    after the mask branch). Computing Pᵀ inside the branch's arms, which
    puts the wait after the exponentials, measured 3-4% slower at D = 128
    (thirteenth session, BENCHMARKS.md)."""
    col_layout: gl.constexpr = gl.SliceLayout(0, st.type.layout)  # one value per query
    pt = gl.exp2(st * qk_scale - lse2[None, :])
    if SOFTCAP:
        # Pᵀ ⊙ (1 − Tᵀ²) and Pᵀ rounded for its wgmma, before the wait: what
        # stays live over it is one fp32 tile and one 16-bit one (keeping Tᵀ
        # instead, two fp32 tiles, spilled 24-232 bytes at D = 128 and 256).
        pt_d = softcap_grad(pt, st)
        pt = pt.to(dtype)
    else:
        pt_d = pt
    delta = delta_bufs.index(do_slot).load(col_layout)
    dpt = warpgroup_mma_wait(0, deps=[dpt])
    return pt, pt_d * (dpt - delta[None, :])


@gluon.jit
def _bwd_producer(prob: BwdProblem, rings: BwdRings, tile: KvTile, mode: BwdMode):
    step = 0  # a run-time value (an argument's literal would be a constexpr): the rings' order is loop-carried
    _bwd_producer_tile(prob, rings, tile, step, mode)


@gluon.jit
def _bwd_producer_tile(prob: BwdProblem, rings: BwdRings, tile: KvTile, step, mode: BwdMode):
    """One KV tile's loads: K and V, then Q and dO (with L2 and Δ) per step,
    the rings from order ``step`` on; returns the order after them."""
    # A varlen KV tile past its sequence's keys (``live`` false) loads
    # nothing and computes nothing; the consumers skip the wait too.
    if tile.live:
        mbarrier.expect(rings.kv_bar, prob.k_desc.block_type.nbytes + prob.v_desc.block_type.nbytes)
        kv_row = tile.k_start + tile.n * mode.BLOCK_N
        tma_load(prob.k_desc, [tile.tb, kv_row, tile.hk, 0], rings.kv_bar, rings.k_bufs.index(0))
        tma_load(prob.v_desc, [tile.tb, kv_row, tile.hk, 0], rings.kv_bar, rings.v_bufs.index(0))
    for g in range(prob.kv_group):
        h = tile.hk * prob.kv_group + g
        stat_row = (tile.stat0 + h * prob.seqlen_q_rounded).to(gl.int32)
        for m in range(tile.m_lo, tile.m_hi):
            slot = ring_slot(step, mode.STAGES)
            # L2 travels with Q (S needs both), Δ with dO (dS needs both).
            wait_empty(rings.q_empty, step, mode.STAGES)
            mbarrier.expect(rings.q_full.index(slot), prob.q_desc.block_type.nbytes + prob.lse2_desc.block_type.nbytes)
            q_row = tile.q_start + m * mode.BLOCK_M
            tma_load(prob.q_desc, [tile.tb, q_row, h, 0], rings.q_full.index(slot), rings.q_bufs.index(slot))
            tma_load(prob.lse2_desc, [stat_row + m * mode.BLOCK_M], rings.q_full.index(slot),
                     rings.lse2_bufs.index(slot))
            if mode.DO_STAGES == mode.STAGES:
                do_slot = slot
            else:
                do_slot = ring_slot(step, mode.DO_STAGES)
            wait_empty(rings.do_empty, step, mode.DO_STAGES)
            mbarrier.expect(rings.do_full.index(do_slot),
                            prob.do_desc.block_type.nbytes + prob.delta_desc.block_type.nbytes)
            tma_load(prob.do_desc, [tile.tb, q_row, h, 0], rings.do_full.index(do_slot), rings.do_bufs.index(do_slot))
            tma_load(prob.delta_desc, [stat_row + m * mode.BLOCK_M], rings.do_full.index(do_slot),
                     rings.delta_bufs.index(do_slot))
            step += 1
    return step


@gluon.jit
def _bwd_consumer(prob: BwdProblem, rings: BwdRings, tile: KvTile, mode: BwdMode):
    """The two consumer warpgroups: the keys split between them (D <= 128),
    or the head dim (SPLIT_D, D = 256). ``tile.lq`` and ``tile.lk`` are this
    sequence's live lengths (the masks' lengths)."""
    if mode.SPLIT_D:
        _bwd_consumer_split_d(prob, rings, tile, mode)
    else:
        gl.static_assert(mode.DO_STAGES == mode.STAGES, "one ring depth for Q and dO")
        step = 0  # run-time, as in _bwd_producer
        _bwd_consumer_split_keys(prob, rings, tile, step, 0, mode)


@gluon.jit
def _bwd_consumer_split_keys(prob: BwdProblem, rings: BwdRings, tile: KvTile, step, kv_phase, mode: BwdMode,
                             kv_empty=None, PERSISTENT: gl.constexpr = False):
    """D <= 128: each warpgroup owns 64 keys, its rows of Sᵀ, dPᵀ, dK and dV.
    ``step`` is the Q/dO rings' order at the tile's start (returned
    advanced), ``kv_phase`` the K/V barrier's phase. ``PERSISTENT`` (the
    persistent grid, ``plan_backward.persistent_grid``: more tiles to come on
    this CTA): the K/V tiles are released on ``kv_empty`` once read, and
    dK/dV go out through the dQ staging tiles, so the next tile's K and V
    load under the epilogue."""
    dtype: gl.constexpr = prob.dk_desc.dtype
    # Sᵀ, dPᵀ: [BLOCK_N keys, BLOCK_M queries], 64 keys per warpgroup.
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                        instr_shape=[16, mode.BLOCK_M, 16])
    # dK, dV: [BLOCK_N keys, D], the same 64 keys per warpgroup.
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                        instr_shape=[16, mode.HEAD_DIM, 16])
    # Pᵀ and dSᵀ as register A operands of dV and dK: same thread mapping as
    # st_layout (both are wgmma accumulators with the same warps), so the
    # conversion moves no data.
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    # dQ: [BLOCK_M, D] over all BLOCK_N keys. 64 queries: warpgroup w
    # computes columns w·D/2 ... (w+1)·D/2 - 1; 128 queries: rows 64w ... 64w + 63.
    DQ_WARPS: gl.constexpr = [8, 1] if mode.BLOCK_M == 128 else [4, 2]
    DQ_N: gl.constexpr = mode.HEAD_DIM if mode.BLOCK_M == 128 else mode.HEAD_DIM // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=DQ_WARPS,
                                                        instr_shape=[16, DQ_N, 16])
    NUM_WARPS: gl.constexpr = 8
    DQ_BUFS: gl.constexpr = rings.dq_smem.shape[0]

    k_t = rings.k_bufs.index(0).reshape([mode.BLOCK_N, mode.HEAD_DIM])
    v_t = rings.v_bufs.index(0).reshape([mode.BLOCK_N, mode.HEAD_DIM])
    st_zero = gl.zeros([mode.BLOCK_N, mode.BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([mode.BLOCK_M, mode.HEAD_DIM], gl.float32, dq_layout)
    dk = gl.zeros([mode.BLOCK_N, mode.HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([mode.BLOCK_N, mode.HEAD_DIM], gl.float32, kv_layout)

    _wait_kv(k_t, v_t, rings, tile, mode, NUM_WARPS, kv_phase)
    tanh_scale = prob.softmax_scale * LOG2E / prob.qk_scale  # SOFTCAP: scale / cap (else unused)
    for g in range(prob.kv_group):
        h = tile.hk * prob.kv_group + g
        stat_base = tile.stat0 + h * prob.seqlen_q_rounded
        for m in range(tile.m_lo, tile.m_hi):
            slot = ring_slot(step, mode.STAGES)
            q_t, do_t, pt, dst = _p_and_ds(k_t, v_t, rings, tile, step, slot, slot, m, prob.qk_scale, tanh_scale,
                                           st_zero, mode, NUM_WARPS)
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            dv = warpgroup_mma(pt_op, do_t, dv, is_async=True)

            dst16 = dst.to(dtype)
            ds_smem = rings.ds_bufs.index(step % 2)
            ds_smem.store(dst16)
            fence_async_shared()
            # The dQ reduce of two steps before has finished reading this
            # step's staging tile (two tiles alternate; the last step's
            # reduce may still be reading the other). Deterministic mode has
            # one tile: its reduce completes within the step (_dq_pass_turn).
            tma.store_wait(DQ_BUFS - 1)
            # Every warp's part of dSᵀ is in shared memory. Passing this
            # barrier also means both warpgroups finished the previous step
            # (each waits for all its wgmmas by the end of a step), so that
            # step's Q and dO slots are free, and the dS stage written next
            # step is unread.
            thread_barrier()
            if step > 0:
                # Every consumer thread arrives (the barrier above already
                # orders them; `release` would add two more).
                release_each(rings.q_empty, step - 1, mode.STAGES)
                release_each(rings.do_empty, step - 1, mode.STAGES)

            dst_op = gl.convert_layout(dst16, op_layout)
            dq = warpgroup_mma(ds_smem.permute((1, 0)), k_t, dq_zero, is_async=True)
            dk = warpgroup_mma(dst_op, q_t, dk, is_async=True)
            # dV and dQ are done, dK may still run while dQ goes out.
            dv, dq, pt_op = warpgroup_mma_wait(1, deps=[dv, dq, pt_op])
            dq_buf = rings.dq_smem.index(step % DQ_BUFS)
            _stage_dq(dq_buf, dq)
            fence_async_shared()
            thread_barrier()
            dq_row = (stat_base + m * mode.BLOCK_M).to(gl.int32)
            if mode.DETERMINISTIC:
                sem = prob.sem_ptr + (stat_base // mode.BLOCK_M + m)
                _dq_add_in_order(prob.dq_desc, dq_row, 0, dq_buf, sem, _dq_turn(tile, m, mode))
            else:
                tma_atomic_add(prob.dq_desc, [dq_row, 0], dq_buf)
            dk, dst_op = warpgroup_mma_wait(0, deps=[dk, dst_op])
            step += 1

    # ---- Epilogue: dK (scaled once, here) and dV through K's and V's shared
    # memory, which no wgmma reads any more, then TMA stores clipped at
    # seqlen_k. A KV tile that no query sees stores zeros.
    if PERSISTENT:
        # Through the two dQ staging tiles instead (64 KB: dK and dV in 16
        # bits, exactly, at D = 128), once the last dQ reduces have read
        # them; K and V are released first, for the next tile's loads.
        tma.store_wait(0)
        thread_barrier()
        mbarrier.arrive(kv_empty, count=1)
        dk_buf = smem_reinterpret(rings.dq_smem.index(0), dtype, prob.dk_desc.block_type.shape, prob.dk_desc.layout)
        dv_buf = smem_reinterpret(rings.dq_smem.index(1), dtype, prob.dv_desc.block_type.shape, prob.dv_desc.layout)
        dk_buf.reshape([mode.BLOCK_N, mode.HEAD_DIM]).store((dk * prob.softmax_scale).to(dtype))
        dv_buf.reshape([mode.BLOCK_N, mode.HEAD_DIM]).store(dv.to(dtype))
        _store_dk_dv(rings, prob, tile, mode, NUM_WARPS, dk_buf, dv_buf)
    else:
        thread_barrier()
        k_t.store((dk * prob.softmax_scale).to(dtype))
        v_t.store(dv.to(dtype))
        _store_dk_dv(rings, prob, tile, mode, NUM_WARPS, rings.k_bufs.index(0), rings.v_bufs.index(0))
    return step


@gluon.jit
def _store_dk_dv(rings: BwdRings, prob: BwdProblem, tile: KvTile, mode: BwdMode, NUM_WARPS: gl.constexpr, dk_buf,
                 dv_buf):
    """Write the dK and dV tiles the consumers left in ``dk_buf`` and
    ``dv_buf`` (K's and V's shared memory, or on the persistent grid the dQ
    staging tiles; stored, not yet fenced), and wait for the writes."""
    if mode.VARLEN:
        # A TMA box would run into the next sequence's rows, which another CTA
        # writes: plain stores, predicated on the sequence's live keys.
        thread_barrier()
        row0 = tile.k_start + tile.n * mode.BLOCK_N
        col0 = tile.hk * prob.stride_kv_head
        n_rows = tile.lk - tile.n * mode.BLOCK_N
        _store_rows(dk_buf.reshape([mode.BLOCK_N, mode.HEAD_DIM]), prob.dk_ptr, row0, n_rows,
                    prob.stride_kv_row, col0, mode.BLOCK_N, mode.HEAD_DIM, NUM_WARPS, mode.O_DIM)
        _store_rows(dv_buf.reshape([mode.BLOCK_N, mode.HEAD_DIM]), prob.dv_ptr, row0, n_rows,
                    prob.stride_kv_row, col0, mode.BLOCK_N, mode.HEAD_DIM, NUM_WARPS, mode.O_DIM)
    else:
        fence_async_shared()
        thread_barrier()
        tma_store(prob.dk_desc, [tile.tb, tile.n * mode.BLOCK_N, tile.hk, 0], dk_buf)
        tma_store(prob.dv_desc, [tile.tb, tile.n * mode.BLOCK_N, tile.hk, 0], dv_buf)
    tma.store_wait(0)


@gluon.jit
def _bwd_consumer_split_d(prob: BwdProblem, rings: BwdRings, tile: KvTile, mode: BwdMode):
    """D = 256: the two warpgroups share the CTA's 64 keys and split the head dim.

    Every head-dim operand is one full-width tile (Q, dO: [64 queries, D];
    K, V: [64 keys, D]). Per step, for warpgroup ``w``:

    * Sᵀ and dPᵀ ([64 keys, 64 queries], contracting all D columns): the
      warpgroup computes queries ``32w .. 32w + 31``;
    * Pᵀ and dSᵀ go to shared memory (``ds_bufs`` 0 and 1): each warpgroup
      needs all 64 queries of them as the A operand of
    * dV += Pᵀ·dO and dK += dSᵀ·Q ([64 keys, D]), of which the warpgroup
      computes columns ``w·D/2 .. (w+1)·D/2 - 1``, and dQ = dS·K, in two
      halves of D/2 columns (each split between the warpgroups), each staged
      in fp32 and added into ``dq_accum`` with a TMA reduce-add.

    dK and dV of 64 keys x 256 columns are 128 registers per thread, and no
    column is computed twice. dO is released once both warpgroups' dV
    wgmmas are done, while dK and dQ still run, so its next tile loads under
    them (one dO stage; Q has two). The next step's Sᵀ is issued once the
    first dQ half is staged, so the tensor cores run it while dQ goes out,
    and waited for at the step's end (+5-8%, seventh/eighth sessions; kept
    in flight over the loop's back-edge instead, it made ptxas serialise
    every wgmma). Measured alternatives (BENCHMARKS.md,
    sixth session): 128-column chunks for every operand (each warpgroup
    computing half of each chunk) ran at the same speed; dQ as fp32
    reductions from registers instead of the staging tile (FA3's D = 256
    path) was 17% slower."""
    dtype: gl.constexpr = prob.dk_desc.dtype
    NUM_WARPS: gl.constexpr = 8
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, mode.BLOCK_M // 2, 16])
    # dK, dV ([BLOCK_N, D]) and dQ ([BLOCK_M, D]): half the columns per warpgroup.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                         instr_shape=[16, mode.HEAD_DIM // 2, 16])
    col_layout: gl.constexpr = gl.SliceLayout(0, st_layout)  # one value per query

    k_t = rings.k_bufs.index(0).reshape([mode.BLOCK_N, mode.HEAD_DIM])
    v_t = rings.v_bufs.index(0).reshape([mode.BLOCK_N, mode.HEAD_DIM])
    # dQ in two halves of DQ_W columns, each through the fp32 staging tile
    # and a TMA reduce-add (the staging of all D columns would not fit).
    DQ_W: gl.constexpr = prob.dq_desc.block_type.shape[1]
    gl.static_assert(2 * DQ_W == mode.HEAD_DIM, "dQ in two halves")
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, DQ_W // 2, 16])
    pt_smem = rings.ds_bufs.index(0)
    ds_smem = rings.ds_bufs.index(1)
    st_zero = gl.zeros([mode.BLOCK_N, mode.BLOCK_M], gl.float32, st_layout)
    dq_zero = gl.zeros([mode.BLOCK_M, DQ_W], gl.float32, dq_layout)
    dk = gl.zeros([mode.BLOCK_N, mode.HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([mode.BLOCK_N, mode.HEAD_DIM], gl.float32, acc_layout)

    _wait_kv(k_t, v_t, rings, tile, mode, NUM_WARPS)
    tanh_scale = prob.softmax_scale * LOG2E / prob.qk_scale  # SOFTCAP: scale / cap (else unused)
    # One flat loop over (query head of the group, query tile) steps, so that
    # each step can issue the next step's Sᵀ (below).
    n_m = tile.m_hi - tile.m_lo
    total = prob.kv_group * n_m
    if total > 0:
        wait_full(rings.q_full, 0, mode.STAGES)
        if mode.VARLEN:
            _zero_tile_tail(rings.q_bufs, 0, tile.m_lo * mode.BLOCK_M, tile.lq, mode.BLOCK_M, mode.HEAD_DIM, NUM_WARPS)
    # Issued even when there is no step (on an unloaded slot, result unused):
    # a wgmma issued in one branch of an ``if`` would carry its token through it.
    st = warpgroup_mma(k_t, rings.q_bufs.index(0).reshape([mode.BLOCK_M, mode.HEAD_DIM]).permute((1, 0)), st_zero,
                       is_async=True)
    st = warpgroup_mma_wait(0, deps=[st])
    for step in range(total):
        z = opaque_zero()  # (K's and V's descriptors built in the loop: kept live across it they spill at D=256)
        k_t = rings.k_bufs.index(z).reshape([mode.BLOCK_N, mode.HEAD_DIM])
        v_t = rings.v_bufs.index(z).reshape([mode.BLOCK_N, mode.HEAD_DIM])
        g = step // n_m
        m = tile.m_lo + step - g * n_m
        stat_base = tile.stat0 + (tile.hk * prob.kv_group + g) * prob.seqlen_q_rounded
        q_slot = ring_slot(step, mode.STAGES)
        do_slot = ring_slot(step, mode.DO_STAGES)
        q_t = rings.q_bufs.index(q_slot).reshape([mode.BLOCK_M, mode.HEAD_DIM])
        do_t = _wait_do(rings, tile, step, do_slot, m, mode, NUM_WARPS)
        dpt = warpgroup_mma(v_t, do_t.permute((1, 0)), st_zero, is_async=True)
        lse2 = rings.lse2_bufs.index(q_slot).load(col_layout)
        if mode.SOFTCAP:
            st = softcap(st, tanh_scale)
        if tile_needs_mask(tile.n, m, tile.lq, tile.lk, mode.BLOCK_M, mode.BLOCK_N, mode.IS_CAUSAL, 1,
                           mode.WINDOW_LEFT, mode.WINDOW_RIGHT):
            st = apply_mask_keys_by_queries(st, tile.n * mode.BLOCK_N, m * mode.BLOCK_M, tile.lq, tile.lk,
                                            mode.IS_CAUSAL, mode.WINDOW_LEFT, mode.WINDOW_RIGHT)
        pt, dst = _p_and_ds_from_stats(st, dpt, lse2, rings.delta_bufs, do_slot, prob.qk_scale, mode.SOFTCAP,
                                       dtype)
        pt_smem.store(pt.to(dtype))
        ds_smem.store(dst.to(dtype))
        fence_async_shared()
        # The previous step's second dQ reduce has finished reading dq_smem.
        tma.store_wait(0)
        # Both warpgroups' halves of Pᵀ and dSᵀ are in shared memory (and
        # both finished the previous step's wgmmas, which read them).
        thread_barrier()

        dv = warpgroup_mma(pt_smem, do_t, dv, is_async=True)
        dk = warpgroup_mma(ds_smem, q_t, dk, is_async=True)
        dq0 = warpgroup_mma(ds_smem.permute((1, 0)), k_t.slice(0, DQ_W, dim=1), dq_zero, is_async=True)
        dq1 = warpgroup_mma(ds_smem.permute((1, 0)), k_t.slice(DQ_W, DQ_W, dim=1), dq_zero, is_async=True)
        dv = warpgroup_mma_wait(3, deps=[dv])
        # Both warpgroups are done with dO: its slot refills under dK and dQ.
        thread_barrier()
        release(rings.do_empty, step, mode.DO_STAGES)
        dk, dq0 = warpgroup_mma_wait(1, deps=[dk, dq0])
        dq_row = (stat_base + m * mode.BLOCK_M).to(gl.int32)
        sem = prob.sem_ptr + (stat_base // mode.BLOCK_M + m)
        if mode.DETERMINISTIC:
            _dq_wait_turn(sem, _dq_turn(tile, m, mode))
        _stage_dq(rings.dq_smem.index(0), dq0)
        fence_async_shared()
        # Also: both warpgroups' dK wgmmas, the last readers of this Q, are done.
        thread_barrier()
        release(rings.q_empty, step, mode.STAGES)
        tma_atomic_add(prob.dq_desc, [dq_row, 0], rings.dq_smem.index(0))
        # The next step's Sᵀ (its Q is in the other ring slot), so that the
        # tensor cores run it while dQ goes out; after the last step it runs
        # on a slot nobody loads, and its result is dropped.
        nxt = step + 1
        if nxt < total:
            wait_full(rings.q_full, nxt, mode.STAGES)
            if mode.VARLEN:
                g_n = nxt // n_m
                _zero_tile_tail(rings.q_bufs, ring_slot(nxt, mode.STAGES), (tile.m_lo + nxt - g_n * n_m) * mode.BLOCK_M,
                                tile.lq, mode.BLOCK_M, mode.HEAD_DIM, NUM_WARPS)
        q_next = rings.q_bufs.index(ring_slot(nxt, mode.STAGES)).reshape([mode.BLOCK_M, mode.HEAD_DIM])
        st_next = warpgroup_mma(k_t, q_next.permute((1, 0)), st_zero, is_async=True)
        dq1 = warpgroup_mma_wait(1, deps=[dq1])
        # dQ's first half has been read out of the staging tile.
        tma.store_wait(0)
        thread_barrier()
        _stage_dq(rings.dq_smem.index(0), dq1)
        fence_async_shared()
        thread_barrier()
        tma_atomic_add(prob.dq_desc, [dq_row, DQ_W], rings.dq_smem.index(0))
        if mode.DETERMINISTIC:
            _dq_pass_turn(sem)
        # The next Sᵀ completes within the step: a wgmma result carried in
        # flight over the loop's back-edge makes ptxas serialise every wgmma.
        st = warpgroup_mma_wait(0, deps=[st_next])

    # ---- Epilogue, as in _bwd_consumer_split_keys.
    thread_barrier()
    k_t.store((dk * prob.softmax_scale).to(dtype))
    v_t.store(dv.to(dtype))
    _store_dk_dv(rings, prob, tile, mode, NUM_WARPS, rings.k_bufs.index(0), rings.v_bufs.index(0))


@aggregate
class BwdGrid:
    """What turns an item number (a CTA's index in the grid order, module
    docstring) into its KV tile: the grid's extents and the varlen
    sequences' tables. The persistent grid draws items from a counter:
    varlen, after the sequence order (``order_ptr + batch``), else
    ``order_ptr``."""
    kv_tiles: gl.tensor
    heads_kv: gl.tensor
    batch: gl.tensor
    section: gl.tensor
    order_ptr: gl.tensor
    cu_q_ptr: gl.tensor
    cu_k_ptr: gl.tensor
    used_q_ptr: gl.tensor
    used_k_ptr: gl.tensor
    seqlen_q: gl.tensor
    seqlen_k: gl.tensor
    seqlen_q_rounded: gl.tensor
    num_heads: gl.tensor
    SEQUSED_Q: gl.constexpr
    SEQUSED_K: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, kv_tiles, heads_kv, batch, section, order_ptr, cu_q_ptr, cu_k_ptr, used_q_ptr, used_k_ptr,
                 seqlen_q, seqlen_k, seqlen_q_rounded, num_heads, SEQUSED_Q, SEQUSED_K):
        init_fields(self, {k: v for k, v in locals().items() if k not in ("SEQUSED_Q", "SEQUSED_K")})
        self.SEQUSED_Q = gl.constexpr(SEQUSED_Q)
        self.SEQUSED_K = gl.constexpr(SEQUSED_K)


@aggregate
class BwdLoop:
    """The persistent grid's shared memory: the K/V tiles' empty barrier and
    the ring through which the producer hands items to the consumers
    (``scheduler.publish_item``)."""
    kv_empty: gl.shared_memory_descriptor
    sched_smem: gl.shared_memory_descriptor
    sched_full: gl.shared_memory_descriptor
    sched_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, kv_empty, sched_smem, sched_full, sched_empty):
        init_fields(self, locals())


@gluon.jit
def _bwd_tile(item, g: BwdGrid, mode: BwdMode):
    """Item ``item`` of the grid order as a KvTile: its KV tile, KV head and
    sequence, and the query tiles that see it."""
    t, _, hk, b = section_coords(item, g.kv_tiles, g.heads_kv, g.batch, g.section)
    if mode.VARLEN and not mode.DETERMINISTIC:
        # The sequences with the longest tiles first (deterministic mode, 1.8x
        # slower anyway, keeps the caller's order: the load cost its D = 64
        # causal kernel a spill inside the step loop, CPU census).
        b = gl.load(g.order_ptr + b)
    n = g.kv_tiles - 1 - t  # section_coords counts tiles down (the forward's longest-first); here 0 is longest
    tb, q_start, k_start, lq, lk, stat0 = bwd_sequence(b, g.cu_q_ptr, g.cu_k_ptr, g.used_q_ptr, g.used_k_ptr,
                                                       g.seqlen_q, g.seqlen_k, g.seqlen_q_rounded, g.num_heads,
                                                       mode.BLOCK_M, mode.VARLEN, g.SEQUSED_Q, g.SEQUSED_K)
    m_lo, m_hi = bwd_query_tile_range(n, lq, lk, mode.BLOCK_M, mode.BLOCK_N, mode.IS_CAUSAL, mode.WINDOW_LEFT,
                                      mode.WINDOW_RIGHT)
    # Varlen: the grid covers max_seqlen_k; tiles past this sequence's keys idle.
    live = n * mode.BLOCK_N < lk
    m_hi = m_lo + (m_hi - m_lo) * live.to(gl.int32)
    return KvTile(tb, q_start, k_start, lq, lk, stat0, hk, n, m_lo, m_hi, live)


@gluon.jit
def _bwd_producer_loop(prob: BwdProblem, rings: BwdRings, loop: BwdLoop, g: BwdGrid, mode: BwdMode):
    """Persistent grid, producer: this CTA's items, the first its program
    id, each next one drawn from the counter once an item's loads are issued,
    and handed to the consumers. A tile's K and V load once the consumers
    have released the last tile's (in its epilogue); a tile past its
    sequence's keys loads nothing."""
    total = g.kv_tiles * g.heads_kv * g.batch
    item = gl.program_id(0)
    step = 0  # the Q/dO rings' order
    kv_i = 0  # live tiles so far: the K/V barriers' phase
    i = 0
    while item < total:
        tile = _bwd_tile(item, g, mode)
        if tile.live:
            mbarrier.wait(loop.kv_empty, (kv_i & 1) ^ 1)
        step = _bwd_producer_tile(prob, rings, tile, step, mode)
        kv_i += tile.live.to(gl.int32)
        if mode.VARLEN:
            item = draw_item(g.order_ptr + g.batch)  # after the sequences' order
        else:
            item = draw_item(g.order_ptr)
        publish_item(item, item * 0, item * 0, item * 0, loop.sched_smem, loop.sched_full, loop.sched_empty, i)
        i += 1


@gluon.jit
def _bwd_consumer_loop(prob: BwdProblem, rings: BwdRings, loop: BwdLoop, g: BwdGrid, mode: BwdMode):
    """Persistent grid, consumers: the items the producer hands out, each
    decoded again here (a tile past its sequence's keys is skipped)."""
    total = g.kv_tiles * g.heads_kv * g.batch
    item = gl.program_id(0)
    step = 0
    kv_i = 0
    i = 0
    while item < total:
        tile = _bwd_tile(item, g, mode)
        if tile.live:
            step = _bwd_consumer_split_keys(prob, rings, tile, step, kv_i & 1, mode, loop.kv_empty, True)
            kv_i += 1
        item, _b0, _b1, _b2 = receive_item(loop.sched_smem, loop.sched_full, loop.sched_empty, i)
        i += 1
    tma.store_wait(0)


# As in the forward, lengths and head counts are run-time values: one compiled
# kernel per (dtype, head dim, causal, deterministic, varlen mode) serves every shape.
@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "seqlen_q_rounded", "num_heads", "kv_group",
                              "stride_kv_row", "stride_kv_head", "kv_tiles", "batch", "section"])
def attention_backward_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse2_desc, delta_desc,
                              sem_ptr, cu_q_ptr, cu_k_ptr, used_q_ptr, used_k_ptr, order_ptr, dk_ptr, dv_ptr,
                              stride_kv_row, stride_kv_head,
                              seqlen_q, seqlen_k, seqlen_q_rounded, num_heads, kv_group,
                              kv_tiles, batch, section, qk_scale, softmax_scale,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                              STAGES: gl.constexpr, DO_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                              DETERMINISTIC: gl.constexpr, SPLIT_D: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                              VARLEN: gl.constexpr = False, SEQUSED_Q: gl.constexpr = False,
                              SEQUSED_K: gl.constexpr = False, WINDOW_LEFT: gl.constexpr = -1,
                              WINDOW_RIGHT: gl.constexpr = -1, SOFTCAP: gl.constexpr = False,
                              PERSISTENT: gl.constexpr = False, O_DIM: gl.constexpr = 0):
    """VARLEN: q/k/v/dO are THD tensors viewed as ``[1, total, H, D]``,
    sequence ``b`` = grid axis 2 (see ``bwd_sequence``), ``seqlen_q`` and
    ``seqlen_k`` unused (the grid covers ``max_seqlen_k``; a CTA past its
    sequence's keys does nothing), ``seqlen_q_rounded`` the padded total of
    the fp32 buffers, dK/dV written through ``dk_ptr``/``dv_ptr`` with the
    given row and head strides, ``order_ptr`` the sequences from the most
    query rows to the fewest (the preprocess's ``order``; not read in
    deterministic mode), then the persistent grid's item counter. Otherwise
    the pointers and strides are unused, but for ``order_ptr``: the
    persistent grid's item counter."""
    if SPLIT_D:
        gl.static_assert(BLOCK_N == 64, "SPLIT_D: two warpgroups share 64 keys")
    else:
        gl.static_assert(BLOCK_N == 128, "64 keys per consumer warpgroup")
    gl.static_assert(q_desc.block_type.shape[3] == HEAD_DIM, "every head-dim operand is one TMA box wide")
    dtype: gl.constexpr = q_desc.dtype
    mode = BwdMode(BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, DO_STAGES, IS_CAUSAL, DETERMINISTIC, VARLEN, SPLIT_D,
                   WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, O_DIM)
    # Grid: axis 0 only, (KV tile, KV head, batch) in the section order
    # (module docstring). Deterministic mode relies on a head's lower tiles
    # starting first.
    grid = BwdGrid(kv_tiles, num_heads // kv_group, batch, section, order_ptr, cu_q_ptr, cu_k_ptr, used_q_ptr,
                   used_k_ptr, seqlen_q, seqlen_k, seqlen_q_rounded, num_heads, SEQUSED_Q, SEQUSED_K)
    # One CTA per item: this CTA's tile. (The persistent grid's loops decode
    # their own; its kernels compile without this decode, SASS-identical.)
    tile = _bwd_tile(gl.program_id(0), grid, mode)

    k_bufs = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [DO_STAGES] + do_desc.block_type.shape, do_desc.layout)
    lse2_bufs = gl.allocate_shared_memory(gl.float32, [STAGES] + lse2_desc.block_type.shape, lse2_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [DO_STAGES] + delta_desc.block_type.shape,
                                           delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    # Two dSᵀ stages (split keys), or Pᵀ and dSᵀ (SPLIT_D).
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    # fp32 staging of one step's dQ share (SPLIT_D: half of it) for the TMA
    # reduce-add. The split-keys consumers alternate two tiles, so a step waits
    # for the reduce of two steps before rather than the last one (+1-3%,
    # BENCHMARKS.md, nineteenth session); SPLIT_D has no room for a second,
    # and deterministic mode no use for one (each reduce completes within its
    # step; a second tile grew its stack under triton 3.9).
    DQ_BUFS: gl.constexpr = 1 if SPLIT_D or DETERMINISTIC else 2
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS] + dq_desc.block_type.shape, dq_desc.layout)

    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_full = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(max(STAGES, DO_STAGES)):
        if i < STAGES:
            mbarrier.init(q_full.index(i), count=1)
            # SPLIT_D: one arrive from the consumer partition (`release`);
            # split keys: one per consumer thread (`release_each`).
            mbarrier.init(q_empty.index(i), count=1 if SPLIT_D else CONSUMER_THREADS)
        if i < DO_STAGES:
            mbarrier.init(do_full.index(i), count=1)
            mbarrier.init(do_empty.index(i), count=1 if SPLIT_D else CONSUMER_THREADS)

    prob = BwdProblem(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse2_desc, delta_desc, sem_ptr,
                      dk_ptr, dv_ptr, stride_kv_row, stride_kv_head, seqlen_q_rounded, kv_group, qk_scale,
                      softmax_scale)
    rings = BwdRings(k_bufs, v_bufs, q_bufs, do_bufs, lse2_bufs, delta_bufs, ds_bufs, dq_smem, kv_bar, q_full,
                     q_empty, do_full, do_empty)
    if PERSISTENT:
        # At most one CTA per SM, each looping over items (module docstring).
        gl.static_assert(not DETERMINISTIC and HEAD_DIM == 128, "persistent: fast mode, D = 128")
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        sched_smem = gl.allocate_shared_memory(gl.int32, [SCHED_STAGES, SCHED_FIELDS],
                                               gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        sched_full = gl.allocate_shared_memory(gl.int64, [SCHED_STAGES, 1], mbarrier.MBarrierLayout())
        sched_empty = gl.allocate_shared_memory(gl.int64, [SCHED_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_empty, count=1)
        for i in gl.static_range(SCHED_STAGES):
            mbarrier.init(sched_full.index(i), count=1)
            mbarrier.init(sched_empty.index(i), count=1)
        loop = BwdLoop(kv_empty, sched_smem, sched_full, sched_empty)
        gl.warp_specialize([(_bwd_consumer_loop, (prob, rings, loop, grid, mode)),
                            (_bwd_producer_loop, (prob, rings, loop, grid, mode))], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([(_bwd_consumer, (prob, rings, tile, mode)), (_bwd_producer, (prob, rings, tile, mode))],
                           [1], [PRODUCER_REGS])
