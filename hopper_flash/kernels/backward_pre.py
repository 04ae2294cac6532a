"""The backward's two small kernels around the main one, in plain Triton.

* ``bwd_preprocess``: per query row, Δ = rowsum(dO ⊙ O) in fp32, and the
  forward's natural-log LSE in base 2, ``L2 = LSE·log2(e)``, into buffers
  padded to whole query tiles. A row that saw no key (LSE = −inf) gets
  L2 = 0, so the main kernel's exp2(−inf − 0) is 0 and never NaN; padding
  rows get L2 = +inf and Δ = 0, so they contribute nothing and the main
  kernel needs no query-tail mask.
* ``bwd_postprocess``: dQ = scale · dq_accum, rounded to the output dtype.
"""
import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)


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
def _bwd_preprocess_kernel(o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, cu_ptr, used_ptr,
                           so_b, so_s, so_h, sdo_b, sdo_s, sdo_h, slse_b, slse_h,
                           seqlen_q, seqlen_q_rounded, num_heads,
                           BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                           VARLEN: tl.constexpr, SEQUSED: tl.constexpr):
    """VARLEN: o/dO are THD (``so_b = sdo_b = 0``), lse is ``[H, total_q]``
    (``slse_b = 0``); the stats go to the sequence's padded rows."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start, length, stat0, owned = _sequence(b, cu_ptr, used_ptr, seqlen_q, seqlen_q_rounded, num_heads, BLOCK_M,
                                            VARLEN, SEQUSED)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    valid = rows < length
    rows64 = (start + rows).to(tl.int64)
    o = tl.load(o_ptr + b * so_b + h * so_h + rows64[:, None] * so_s + cols[None, :], mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + b * sdo_b + h * sdo_h + rows64[:, None] * sdo_s + cols[None, :], mask=valid[:, None],
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    lse = tl.load(lse_ptr + b * slse_b + h * slse_h + rows64, mask=valid, other=0.0)
    lse2 = tl.where(lse == -float("inf"), 0.0, lse * 1.4426950408889634)
    lse2 = tl.where(valid, lse2, float("inf"))
    out = stat0 + h * seqlen_q_rounded + rows
    keep = rows < owned
    tl.store(delta_ptr + out, delta, mask=keep)
    tl.store(lse2_ptr + out, lse2, mask=keep)


@triton.jit
def _bwd_postprocess_kernel(acc_ptr, dq_ptr, cu_ptr, used_ptr, sdq_b, sdq_s, sdq_h, seqlen_q, seqlen_q_rounded,
                            num_heads, scale, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            VARLEN: tl.constexpr, SEQUSED: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start, length, stat0, owned = _sequence(b, cu_ptr, used_ptr, seqlen_q, seqlen_q_rounded, num_heads, BLOCK_M,
                                            VARLEN, SEQUSED)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    valid = rows < length
    acc = tl.load(acc_ptr + (stat0 + h * seqlen_q_rounded + rows)[:, None] * HEAD_DIM + cols[None, :],
                  mask=valid[:, None], other=0.0)
    dq = (acc * scale).to(dq_ptr.dtype.element_ty)
    rows64 = (start + rows).to(tl.int64)
    tl.store(dq_ptr + b * sdq_b + h * sdq_h + rows64[:, None] * sdq_s + cols[None, :], dq, mask=valid[:, None])


def bwd_preprocess(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                   lse2: torch.Tensor, block_m: int, varlen=None) -> None:
    """Fixed length: BSHD ``out``/``dout``, ``lse [B, H, Sq]``, stats
    ``[B, H, Sq_r]``. ``varlen = (cu_seqlens_q, seqused_q, batch, max_seqlen_q)``:
    THD ``out``/``dout``, ``lse [H, total_q]``, stats ``[H, padded_total]``."""
    block = 64
    assert block_m % block == 0
    if varlen is None:
        batch, seqlen_q, nheads, head_dim = out.shape
        seqlen_q_rounded = delta.shape[-1]
        assert seqlen_q_rounded % block == 0
        cu = used = lse  # never read
        strides = (out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                   lse.stride(0), lse.stride(1))
        m_blocks = seqlen_q_rounded // block
    else:
        cu, used, batch, max_seqlen_q = varlen
        _, nheads, head_dim = out.shape
        seqlen_q = 0
        seqlen_q_rounded = delta.shape[-1]
        strides = (0, out.stride(0), out.stride(1), 0, dout.stride(0), dout.stride(1), 0, lse.stride(0))
        m_blocks = triton.cdiv(max_seqlen_q, block_m) * (block_m // block)
        used = cu if used is None else used
    _bwd_preprocess_kernel[(m_blocks, nheads, batch)](
        out, dout, lse, delta, lse2, cu, used, *strides, seqlen_q, seqlen_q_rounded, nheads,
        BLOCK=block, HEAD_DIM=head_dim, BLOCK_M=block_m, VARLEN=varlen is not None,
        SEQUSED=varlen is not None and varlen[1] is not None, num_warps=4)


def bwd_postprocess(dq_accum: torch.Tensor, dq: torch.Tensor, scale: float, block_m: int = 64, varlen=None) -> None:
    """``dq_accum`` is ``[rows, D]`` (fixed: rows = B·H·Sq_r; varlen:
    H·padded_total); ``seqlen_q_rounded`` is its per-head row count."""
    block = 64
    if varlen is None:
        batch, seqlen_q, nheads, head_dim = dq.shape
        seqlen_q_rounded = dq_accum.numel() // (head_dim * batch * nheads)
        cu = used = dq_accum  # never read
        strides = (dq.stride(0), dq.stride(1), dq.stride(2))
        m_blocks = triton.cdiv(seqlen_q, block)
    else:
        cu, used, batch, max_seqlen_q = varlen
        _, nheads, head_dim = dq.shape
        seqlen_q = 0
        seqlen_q_rounded = dq_accum.numel() // (head_dim * nheads)
        strides = (0, dq.stride(0), dq.stride(1))
        m_blocks = triton.cdiv(max_seqlen_q, block)
        used = cu if used is None else used
    _bwd_postprocess_kernel[(m_blocks, nheads, batch)](
        dq_accum, dq, cu, used, *strides, seqlen_q, seqlen_q_rounded, nheads, scale,
        BLOCK=block, HEAD_DIM=head_dim, BLOCK_M=block_m, VARLEN=varlen is not None,
        SEQUSED=varlen is not None and varlen[1] is not None, num_warps=4)
