"""The backward's small kernels around the main one, in plain Triton.

* ``bwd_preprocess``: per query row, Δ = rowsum(dO ⊙ O) in fp32, and the
  forward's natural-log LSE in base 2, ``L2 = LSE·log2(e)``, into buffers
  padded to whole query tiles; it also zeroes the same rows of ``dq_accum``
  (one launch instead of a memset and this kernel). A row that saw no key (LSE = −inf) gets
  L2 = 0, so the main kernel's exp2(−inf − 0) is 0 and never NaN; padding
  rows get L2 = +inf and Δ = 0, so they contribute nothing and the main
  kernel needs no query-tail mask. With ``SINK`` (attention sinks,
  ``sinks.py``) it also writes each block's share of the sink's gradient,
  ``-sum exp(s_h - LSE') · Δ`` over its rows that saw a key (``LSE' >
  s_h``), to ``part [H, B, blocks]``: Δ is at hand, so the gradient needs no
  pass of its own over O and dO. No atomics: the host sums the partials in a
  fixed order, so deterministic backwards stay bitwise reproducible.
* ``bwd_postprocess``: dQ = scale · dq_accum, rounded to the output dtype.
  The main kernel adds each query tile into ``dq_accum`` with the rows of
  every 8-row group interleaved (``backward._stage_dq``, for bank-conflict-free
  staging); ``dq_accum_row`` maps a query row to where it lies.

* ``zero_tail`` (varlen): zeroes the gradient rows past the last sequence
  (``cu_seqlens[-1]`` to the tensor's end), which no other kernel writes,
  so the gradients can be allocated empty instead of zero-filled (a full
  memset of dQ, dK and dV: 1.7% of the mixed-batch backward on the H200).

Their host-side launches are ``plan_backward.bwd_preprocess``,
``plan_backward.bwd_postprocess`` and ``plan_backward.zero_tail``.
"""
import triton
import triton.language as tl


@triton.jit
def _sequence(b, cu_ptr, used_ptr, seqlen_q, seqlen_q_rounded, num_heads, BLOCK_M: tl.constexpr,
              VARLEN: tl.constexpr, SEQUSED: tl.constexpr):
    """(first row on the sequence axis, live length, stat row of head 0, and
    how many rows of the padded stats belong to the sequence): the host-side
    twin of ``backward.bwd_sequence``."""
    if VARLEN:
        start = tl.load(cu_ptr + b)
        if SEQUSED:
            length = tl.load(used_ptr + b)
        else:
            length = tl.load(cu_ptr + b + 1) - start
        stat0 = ((start + b * BLOCK_M) // BLOCK_M * BLOCK_M).to(tl.int64)
        # Only the sequence's own tiles: the rows after its last tile may be
        # the next sequence's first tile.
        owned = tl.cdiv(length, BLOCK_M) * BLOCK_M
    else:
        start = 0
        length = seqlen_q
        stat0 = b * num_heads * seqlen_q_rounded
        owned = seqlen_q_rounded
    return start, length, stat0, owned


@triton.jit
def _rank_sequence(b, length, cu_ptr, used_ptr, order_ptr, batch, SEQUSED: tl.constexpr,
                   RANK_BLOCK: tl.constexpr = 256):
    """Varlen: write ``b`` to ``order[r]``, ``r`` = how many sequences have
    more live query rows than ``b``'s ``length``, or as many and a lower
    index. Over all ``b`` that is a permutation whatever the lengths (a
    strict order on (length, index)): the sequences from the most query rows
    to the fewest, ties in the caller's order. The main kernel's grid takes
    them so (``backward.py``, grid order): a sequence's longest KV tile sees
    all of its query tiles. ``batch`` loads per sequence, one program per
    sequence: small next to the backward for any batch size."""
    rank = 0
    for j0 in range(0, batch, RANK_BLOCK):
        j = j0 + tl.arange(0, RANK_BLOCK)
        inside = j < batch
        if SEQUSED:
            lj = tl.load(used_ptr + j, mask=inside, other=0)
        else:
            lj = tl.load(cu_ptr + j + 1, mask=inside, other=0) - tl.load(cu_ptr + j, mask=inside, other=0)
        ahead = inside & ((lj > length) | ((lj == length) & (j < b)))
        rank += tl.sum(ahead.to(tl.int32), axis=0)
    tl.store(order_ptr + rank, b.to(tl.int32))


# Lengths and strides are not specialised: one compiled kernel per dtype,
# head dim and mode serves every shape, launched like the main kernel
# (``plan.launch_triton``). The strides of O, dO and dQ are passed in units of 8
# elements (``*8`` parameters; they are multiples of 16 bytes,
# ``plan_backward._strides8``),
# so the compiler still knows every row starts 16-byte aligned and loads and
# stores it in 16-byte vectors, as the JIT's divisibility specialisation did.
_PRE_INTS = ["so8_b", "so8_s", "so8_h", "sdo8_b", "sdo8_s", "sdo8_h", "slse_b", "slse_h", "seqlen_q",
             "seqlen_q_rounded", "num_heads"]
_POST_INTS = ["sdq8_b", "sdq8_s", "sdq8_h", "seqlen_q", "seqlen_q_rounded", "num_heads"]


@triton.jit(do_not_specialize=_PRE_INTS)
def _bwd_preprocess_kernel(o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, acc_ptr, cu_ptr, used_ptr, sink_ptr,
                           part_ptr, order_ptr, so8_b, so8_s, so8_h, sdo8_b, sdo8_s, sdo8_h, slse_b, slse_h,
                           seqlen_q, seqlen_q_rounded, num_heads,
                           BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           VARLEN: tl.constexpr, SEQUSED: tl.constexpr, SINK: tl.constexpr,
                           OUT_DIM: tl.constexpr = 0):
    """VARLEN: o/dO are THD (``so_b = sdo_b = 0``), lse is ``[H, total_q]``
    (``slse_b = 0``); the stats go to the sequence's padded rows. HEAD_DIM:
    the kernel's (dq_accum's rows); OUT_DIM: O's and dO's where narrower
    (``plan.kernel_head_dim``), else 0. SINK:
    ``sink_ptr`` the sinks ``[H]``, ``part_ptr`` fp32 ``[H, B, blocks]``
    (neither read otherwise). VARLEN: the programs of block 0, head 0 also
    rank the sequences for the main kernel's grid into ``order_ptr`` (int32
    ``[B + 1]``, ``_rank_sequence``; the last, the grid's item counter, 0)."""
    so_b, so_s, so_h = so8_b * 8, so8_s * 8, so8_h * 8
    sdo_b, sdo_s, sdo_h = sdo8_b * 8, sdo8_s * 8, sdo8_h * 8
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start, length, stat0, owned = _sequence(b, cu_ptr, used_ptr, seqlen_q, seqlen_q_rounded, num_heads, BLOCK_M,
                                            VARLEN, SEQUSED)
    if not VARLEN:
        if (pid_m == 0) & (h == 0) & (b == 0):
            tl.store(order_ptr, 0)  # the persistent grid's item counter, alone in ``order_ptr``
    if VARLEN:
        if (pid_m == 0) & (h == 0):
            _rank_sequence(b, length, cu_ptr, used_ptr, order_ptr, tl.num_programs(2), SEQUSED)
            if b == 0:
                # The main kernel's persistent grid (fast mode) draws its
                # items from a counter after the order: zero it every call.
                tl.store(order_ptr + tl.num_programs(2), 0)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    valid = rows < length
    rows64 = (start + rows).to(tl.int64)
    live = valid[:, None]
    if OUT_DIM > 0:
        live = live & (cols < OUT_DIM)[None, :]
    o = tl.load(o_ptr + b * so_b + h * so_h + rows64[:, None] * so_s + cols[None, :], mask=live, other=0.0)
    do = tl.load(do_ptr + b * sdo_b + h * sdo_h + rows64[:, None] * sdo_s + cols[None, :], mask=live, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    lse = tl.load(lse_ptr + b * slse_b + h * slse_h + rows64, mask=valid, other=0.0)
    lse2 = tl.where(lse == -float("inf"), 0.0, lse * 1.4426950408889634)
    lse2 = tl.where(valid, lse2, float("inf"))
    if SINK:
        # (The forward's LSE' is logaddexp(LSE, s) >= s; equal where no key was seen.)
        sink = tl.load(sink_ptr + h).to(tl.float32)
        terms = tl.where(valid & (lse > sink), tl.exp(sink - lse) * delta, 0.0)
        tl.store(part_ptr + (h * tl.num_programs(2) + b) * tl.num_programs(0) + pid_m, -tl.sum(terms, axis=0))
    out = stat0 + h * seqlen_q_rounded + rows
    keep = rows < owned
    tl.store(delta_ptr + out, delta, mask=keep)
    tl.store(lse2_ptr + out, lse2, mask=keep)
    # dq_accum's rows are the stats' rows (64-row blocks of whole query tiles,
    # so the kernel's 8-row interleave stays inside them). Varlen: rows past
    # every sequence's tiles are neither zeroed, added to nor read.
    tl.store(acc_ptr + out.to(tl.int64)[:, None] * HEAD_DIM + cols[None, :],
             tl.zeros([BLOCK, HEAD_DIM], tl.float32), mask=keep[:, None])


@triton.jit
def dq_accum_row(row):
    """Where query row ``row`` of a tile-aligned ``dq_accum`` block lies: row
    ``8g + 4h + j`` (h < 2, j < 4) is stored at ``8g + 2j + h``, the
    main kernel's staging order (``backward._stage_dq``)."""
    return (row & ~7) | ((row & 3) << 1) | ((row >> 2) & 1)


@triton.jit(do_not_specialize=_POST_INTS)
def _bwd_postprocess_kernel(acc_ptr, dq_ptr, cu_ptr, used_ptr, sdq8_b, sdq8_s, sdq8_h, seqlen_q, seqlen_q_rounded,
                            num_heads, scale, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            VARLEN: tl.constexpr, SEQUSED: tl.constexpr, OUT_DIM: tl.constexpr = 0):
    """dQ from ``dq_accum`` (rows of the kernel's HEAD_DIM) into ``dq``
    (OUT_DIM features a row where narrower, ``plan.kernel_head_dim``)."""
    sdq_b, sdq_s, sdq_h = sdq8_b * 8, sdq8_s * 8, sdq8_h * 8
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start, length, stat0, owned = _sequence(b, cu_ptr, used_ptr, seqlen_q, seqlen_q_rounded, num_heads, BLOCK_M,
                                            VARLEN, SEQUSED)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    valid = rows < length
    # stat0 and seqlen_q_rounded are whole query tiles, so the 8-row groups
    # of ``rows`` are the kernel's.
    acc = tl.load(acc_ptr + (stat0 + h * seqlen_q_rounded + dq_accum_row(rows))[:, None] * HEAD_DIM + cols[None, :],
                  mask=valid[:, None], other=0.0)
    dq = (acc * scale).to(dq_ptr.dtype.element_ty)
    rows64 = (start + rows).to(tl.int64)
    live = valid[:, None]
    if OUT_DIM > 0:
        live = live & (cols < OUT_DIM)[None, :]
    tl.store(dq_ptr + b * sdq_b + h * sdq_h + rows64[:, None] * sdq_s + cols[None, :], dq, mask=live)


@triton.jit(do_not_specialize=["batch", "total", "s8_row", "s8_head", "num_heads"])
def _zero_tail_kernel(x_ptr, y_ptr, cu_ptr, batch, total, s8_row, s8_head, num_heads, BLOCK: tl.constexpr,
                      HEAD_DIM: tl.constexpr, PAIR: tl.constexpr, OUT_DIM: tl.constexpr = 0):
    """Zero rows ``cu[batch] .. total`` of THD gradients ``x`` (and ``y``
    with ``PAIR``: dV beside dK, same strides), the rows past the last
    sequence that no backward kernel writes. The tail's length lives on the
    device, so the grid covers every row and a block wholly below
    ``cu[batch]`` returns at once: the host never reads it back. Strides in
    units of 8 elements, as the pre/postprocess take them (16-byte stores)."""
    s_row, s_head = s8_row * 8, s8_head * 8
    row0 = tl.program_id(0) * BLOCK
    end = tl.load(cu_ptr + batch)
    if row0 + BLOCK > end:
        rows = row0 + tl.arange(0, BLOCK)
        keep = (rows >= end) & (rows < total)
        cols = tl.arange(0, HEAD_DIM)
        offs = rows.to(tl.int64)[:, None] * s_row + cols[None, :]
        zeros = tl.zeros([BLOCK, HEAD_DIM], x_ptr.dtype.element_ty)
        live = keep[:, None]
        if OUT_DIM > 0:  # rows of OUT_DIM features, narrower than HEAD_DIM (a power of two)
            live = live & (cols < OUT_DIM)[None, :]
        for h in range(num_heads):
            tl.store(x_ptr + h * s_head + offs, zeros, mask=live)
            if PAIR:
                tl.store(y_ptr + h * s_head + offs, zeros, mask=live)
