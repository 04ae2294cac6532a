"""Attention sinks' two row passes (``sinks.py``), in plain Triton: one
program per block of ``BLOCK`` rows of one head of one batch, any strides.

* ``_sink_renorm_kernel``: ``LSE' = logaddexp(LSE, s_h)`` and ``out' = out ·
  exp(LSE − LSE')`` in one read of ``out`` and ``LSE`` (the same as torch's
  elementwise ops, which took several full-size fp32 passes).
* ``_sink_grad_kernel``: the sink's gradient, ``-sum over rows of
  exp(s_h − LSE') · exp(LSE − LSE') · rowsum(dO ⊙ out)`` with the kernels'
  own ``out`` and ``LSE``; rows that saw no key (``LSE = −inf``) add nothing,
  whatever their ``dO`` holds. Each program writes its block's partial sum
  (no atomics: the host sums them in a fixed order, so deterministic
  backwards stay bitwise reproducible).

The row layouts: fixed length ``out [B, S, H, D]`` with ``lse [B, H, S]``,
varlen ``out [T, H, D]`` with ``lse [H, T]`` as batch 1 (``s*_b = 0``); the
LSE's row stride is 1 (the kernels write it contiguous).
"""
import triton
import triton.language as tl

_INTS = ["rows", "so_b", "so_s", "so_h", "sd_b", "sd_s", "sd_h", "sl_b", "sl_h"]


@triton.jit
def _rows_of(ptr, b, h, r, valid, s_b, s_s, s_h, HEAD_DIM: tl.constexpr):
    """The ``[BLOCK, HEAD_DIM]`` tile of rows ``r`` of head ``h`` of batch ``b``, as fp32 (0 past the end)."""
    cols = tl.arange(0, HEAD_DIM)
    offs = b * s_b + h * s_h + r.to(tl.int64)[:, None] * s_s + cols[None, :]
    return tl.load(ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)


@triton.jit
def _lse_with_sink(lse, sink):
    """``logaddexp(lse, sink)``, finite (the sink is); ``lse`` may be −inf."""
    hi = tl.maximum(lse, sink)
    return hi + tl.log(tl.exp(lse - hi) + tl.exp(sink - hi))


@triton.jit(do_not_specialize=_INTS)
def _sink_renorm_kernel(o_ptr, lse_ptr, sink_ptr, o2_ptr, lse2_ptr, rows, so_b, so_s, so_h, sd_b, sd_s, sd_h,
                        sl_b, sl_h, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``o2``/``lse2`` have ``o``'s/``lse``'s strides (``sd_*`` unused)."""
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = r < rows
    lse_offs = b * sl_b + h * sl_h + r
    lse = tl.load(lse_ptr + lse_offs, mask=valid, other=-float("inf"))
    lse_sink = _lse_with_sink(lse, tl.load(sink_ptr + h))
    factor = tl.exp(lse - lse_sink)  # 0 where lse is -inf
    o = _rows_of(o_ptr, b, h, r, valid, so_b, so_s, so_h, HEAD_DIM)
    cols = tl.arange(0, HEAD_DIM)
    offs = b * so_b + h * so_h + r.to(tl.int64)[:, None] * so_s + cols[None, :]
    tl.store(o2_ptr + offs, (o * factor[:, None]).to(o2_ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(lse2_ptr + lse_offs, lse_sink, mask=valid)


@triton.jit(do_not_specialize=_INTS)
def _sink_grad_kernel(o_ptr, do_ptr, lse_ptr, sink_ptr, part_ptr, rows, so_b, so_s, so_h, sd_b, sd_s, sd_h,
                      sl_b, sl_h, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``part`` ``[B, blocks, H]`` fp32: each block's share of ``-ds_h``."""
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0)
    r = blk * BLOCK + tl.arange(0, BLOCK)
    valid = r < rows
    lse = tl.load(lse_ptr + b * sl_b + h * sl_h + r, mask=valid, other=-float("inf"))
    sink = tl.load(sink_ptr + h)
    lse_sink = _lse_with_sink(lse, sink)
    o = _rows_of(o_ptr, b, h, r, valid, so_b, so_s, so_h, HEAD_DIM)
    do = _rows_of(do_ptr, b, h, r, valid, sd_b, sd_s, sd_h, HEAD_DIM)
    delta = tl.sum(o * do, axis=1)
    terms = tl.where(valid & (lse != -float("inf")), tl.exp(sink - lse_sink) * tl.exp(lse - lse_sink) * delta, 0.0)
    tl.store(part_ptr + (b * tl.num_programs(0) + blk) * tl.num_programs(1) + h, tl.sum(terms, axis=0))
