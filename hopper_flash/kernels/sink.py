"""The attention sink's gradient (``sinks.py``), in plain Triton: one
program per block of ``BLOCK`` rows of one head of one batch, any strides.

``_sink_grad_kernel``: ``-sum over rows of exp(s_h − LSE) · rowsum(dO ⊙
out)`` from a forward's sink-normalised ``out`` and ``LSE``; rows with ``LSE
<= s_h`` (those that saw no key) add nothing, whatever their ``dO`` holds.
Each program writes its block's partial sum (no atomics: the host sums them
in a fixed order, so deterministic backwards stay bitwise reproducible).

The row layouts: fixed length ``out [B, S, H, D]`` with ``lse [B, H, S]``,
varlen ``out [T, H, D]`` with ``lse [H, T]`` as batch 1 (``s*_b = 0``); the
LSE's row stride is 1 (the kernels write it contiguous). The strides of
``out`` and ``dO`` come in units of 8 elements (``*8`` parameters, as in
``backward_pre``): unspecialised integers would leave the compiler unsure
that rows start 16-byte aligned, and it would load them element by element
(the first version, with plain strides, was slower than torch's ops).
``HEAD_DIM`` is a power of two (``tl.arange``'s): a narrower head dim
(``plan.kernel_head_dim``) comes as ``OUT_DIM``, its rows masked there (0:
``HEAD_DIM``'s own).
"""
import triton
import triton.language as tl

_INTS = ["rows", "so8_b", "so8_s", "so8_h", "sd8_b", "sd8_s", "sd8_h", "sl_b", "sl_h"]


@triton.jit
def _row_offsets(b, h, r, s8_b, s8_s, s8_h, HEAD_DIM: tl.constexpr):
    """Element offsets of the ``[BLOCK, HEAD_DIM]`` tile of rows ``r`` of head ``h`` of batch ``b``."""
    cols = tl.arange(0, HEAD_DIM)
    return b * (s8_b * 8) + h * (s8_h * 8) + r.to(tl.int64)[:, None] * (s8_s * 8) + cols[None, :]


@triton.jit
def _row_mask(valid, HEAD_DIM: tl.constexpr, OUT_DIM: tl.constexpr):
    """The rows' live elements: ``valid`` rows, and where ``OUT_DIM`` > 0 its first features."""
    if OUT_DIM > 0:
        mask = valid[:, None] & (tl.arange(0, HEAD_DIM) < OUT_DIM)[None, :]
    else:
        mask = valid[:, None]
    return mask


@triton.jit(do_not_specialize=_INTS)
def _sink_grad_kernel(o_ptr, do_ptr, lse_ptr, sink_ptr, part_ptr, rows, so8_b, so8_s, so8_h, sd8_b, sd8_s, sd8_h,
                      sl_b, sl_h, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, OUT_DIM: tl.constexpr = 0):
    """``part`` ``[H, B, blocks]`` fp32: each block's share of ``ds_h``."""
    b = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(0)
    r = blk * BLOCK + tl.arange(0, BLOCK)
    valid = r < rows
    sink = tl.load(sink_ptr + h).to(tl.float32)
    lse = tl.load(lse_ptr + b * sl_b + h * sl_h + r, mask=valid, other=sink)
    live = _row_mask(valid, HEAD_DIM, OUT_DIM)
    o = tl.load(o_ptr + _row_offsets(b, h, r, so8_b, so8_s, so8_h, HEAD_DIM), mask=live, other=0.0)
    do = tl.load(do_ptr + _row_offsets(b, h, r, sd8_b, sd8_s, sd8_h, HEAD_DIM), mask=live, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    terms = tl.where(valid & (lse > sink), tl.exp(sink - lse) * delta, 0.0)
    tl.store(part_ptr + (h * tl.num_programs(2) + b) * tl.num_programs(0) + blk, -tl.sum(terms, axis=0))
