"""Split-KV combine: merge the fp32 partial outputs of the KV splits by LSE.

Split ``s`` of a row wrote its normalised output ``O_s`` and natural-log
``lse_s`` (``kernels/forward.py``, ``SPLIT``). The row's result is
``sum_s exp(lse_s - lse) * O_s`` with ``lse = log(sum_s exp(lse_s))``. A split
that saw no key wrote ``O_s = 0`` and ``lse_s = -inf`` (weight 0), and a
split slot that no item wrote (``split_table.py``) holds ``lse_s = -inf``
and an output never read; a row whose splits are all ``-inf`` saw no key at
all and gets ``O = 0``, ``LSE = -inf``.

Attention sinks (``SINK``, ``sinks.py``): the row's head's logit joins the
merge as one more split with no output, ``lse_s = sink`` and ``O_s = 0``: it
takes its share of the weights and adds nothing (the split kernel leaves it
out). A row that saw no key then gets ``O = 0`` and ``LSE = sink``.

Plain Triton: the traffic is ``splits * rows * D * 4`` bytes, small next to the
K/V the split kernel reads, so the kernel only has to be simple and correct.
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_splits", "batch", "seqlen_q", "num_heads", "stride_ob", "stride_oq", "stride_oh"])
def combine_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, sink_ptr, n_splits, batch, seqlen_q, num_heads,
                   stride_ob, stride_oq, stride_oh,
                   HEAD_DIM: tl.constexpr, S_MAX: tl.constexpr, WRITE_LSE: tl.constexpr,
                   DEPENDENT: tl.constexpr, SINK: tl.constexpr = False, OUT_DIM: tl.constexpr = 0):
    if DEPENDENT:
        # Launched by programmatic dependent launch right after the split
        # kernel, which triggers it at its start (forward.py): the launch and
        # the scheduling overlap the split grid's run. Wait for that grid to
        # finish, its partials written and visible, before reading them.
        # (False only where nothing can launch it so: Triton's interpreter.)
        tl.extra.cuda.gdc_wait()
        # And the kernel after this one, where launched dependent on it (the
        # next decode call's split kernel), may be scheduled from now on; its
        # own wait holds it until this grid is done.
        tl.extra.cuda.gdc_launch_dependents()
    # One program per output row (b, q, h), in the partials' [B, Sq, H] order.
    row = tl.program_id(0)
    h = row % num_heads
    bq = row // num_heads
    q = bq % seqlen_q
    b = bq // seqlen_q
    rows_per_split = batch * seqlen_q * num_heads

    # lse_part is [splits, B, H, Sq].
    s_idx = tl.arange(0, S_MAX)
    lse_s = tl.load(lse_part_ptr + ((s_idx * batch + b) * num_heads + h).to(tl.int64) * seqlen_q + q,
                    mask=s_idx < n_splits, other=-float("inf"))
    m = tl.max(lse_s, axis=0)
    if SINK:
        sink = tl.load(sink_ptr + h).to(tl.float32)
        m = tl.maximum(m, sink)  # finite: the sink is
        total = tl.sum(tl.exp(lse_s - m), axis=0) + tl.exp(sink - m)
    else:
        m = tl.where(m == -float("inf"), 0.0, m)  # all splits empty: every weight is exp(-inf) = 0
        total = tl.sum(tl.exp(lse_s - m), axis=0)
    inv = tl.where(total == 0.0, 0.0, 1.0 / total)

    d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s in range(n_splits):
        l_s = tl.load(lse_part_ptr + ((s * batch + b) * num_heads + h).to(tl.int64) * seqlen_q + q)
        w = tl.exp(l_s - m) * inv
        # A split of weight 0 is not read: an empty split wrote O_s = 0, and
        # a split that never ran (a sequence with fewer splits than the
        # launch, split_table.py) wrote nothing, its LSE -inf from the fill.
        o_s = tl.load(o_part_ptr + (s * rows_per_split + row).to(tl.int64) * HEAD_DIM + d,
                      mask=l_s > -float("inf"), other=0.0)
        acc += w * o_s
    out_off = b.to(tl.int64) * stride_ob + q.to(tl.int64) * stride_oq + h.to(tl.int64) * stride_oh
    if OUT_DIM > 0:
        # The output's head dim is narrower than the kernel's (plan.kernel_head_dim): its features only.
        tl.store(out_ptr + out_off + d, acc.to(out_ptr.dtype.element_ty), mask=d < OUT_DIM)
    else:
        tl.store(out_ptr + out_off + d, acc.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        lse = tl.where(total == 0.0, -float("inf"), m + tl.log(total))
        tl.store(lse_ptr + (b * num_heads + h).to(tl.int64) * seqlen_q + q, lse)


@triton.jit(do_not_specialize=["n_splits", "rows", "seqlen", "nheads", "so_s", "so_b", "so_l", "so_h", "sl_s",
                               "sl_b", "sl_l", "sl_h", "sout_b", "sout_l", "sout_h", "slo_b", "slo_l", "slo_h"])
def combine_strided_kernel(o_part_ptr, lse_part_ptr, out_ptr, lse_ptr, n_splits, rows, seqlen, nheads,
                           so_s, so_b, so_l, so_h, sl_s, sl_b, sl_l, sl_h, sout_b, sout_l, sout_h,
                           slo_b, slo_l, slo_h,
                           HEAD_DIM: tl.constexpr, D_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
                           VEC: tl.constexpr, OUT_VEC: tl.constexpr):
    """``flash_attn_combine``'s merge (``hopper_flash/combine.py``), FA3's
    layout: ``o_part`` [splits, B, L, H, HEAD_DIM] and ``lse_part`` [splits,
    B, L, H] with any strides but a contiguous head dim, ``out`` [B, L, H,
    HEAD_DIM] and ``lse`` [B, L, H] likewise. BLOCK_M rows (b, l, h) a
    program, rows in that order; the same merge as ``combine_kernel`` above,
    with the splits' maximum taken in a first pass over their LSEs (their
    count is not bounded here). ``VEC`` / ``OUT_VEC``: every stride of
    ``o_part`` / ``out`` but the head dim's a multiple of it (the caller
    checks), so rows move in vectors (a hint on the offsets themselves: on
    the strides alone it does not reach the loads)."""
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = r < rows
    h = (r % nheads).to(tl.int64)
    bl = r // nheads
    l = (bl % seqlen).to(tl.int64)
    b = (bl // seqlen).to(tl.int64)
    o_row = b * so_b + l * so_l + h * so_h
    lse_row = b * sl_b + l * sl_l + h * sl_h

    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    for s in range(n_splits):
        s_off = tl.cast(s, tl.int64) * sl_s  # (a split's stride times its index can pass 2**31)
        m = tl.maximum(m, tl.load(lse_part_ptr + s_off + lse_row, mask=live, other=-float("inf")))
    m = tl.where(m == -float("inf"), 0.0, m)  # a row whose splits are all empty: every weight 0

    d = tl.arange(0, D_POW2)
    d_ok = d < HEAD_DIM
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_POW2], tl.float32)
    for s in range(n_splits):
        w = tl.exp(tl.load(lse_part_ptr + tl.cast(s, tl.int64) * sl_s + lse_row, mask=live, other=-float("inf")) - m)
        total += w
        # A split of weight 0 is not read (it saw no key; its O may be NaN).
        o_off = tl.multiple_of(tl.cast(s, tl.int64) * so_s + o_row, VEC)
        o_s = tl.load(o_part_ptr + o_off[:, None] + d[None, :],
                      mask=((w > 0.0) & live)[:, None] & d_ok[None, :], other=0.0)
        acc += w[:, None] * o_s
    inv = tl.where(total == 0.0, 0.0, 1.0 / total)
    out_row = tl.multiple_of(b * sout_b + l * sout_l + h * sout_h, OUT_VEC)
    tl.store(out_ptr + out_row[:, None] + d[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
             mask=live[:, None] & d_ok[None, :])
    lse = tl.where(total == 0.0, -float("inf"), m + tl.log(total))
    tl.store(lse_ptr + b * slo_b + l * slo_l + h * slo_h, lse, mask=live)
