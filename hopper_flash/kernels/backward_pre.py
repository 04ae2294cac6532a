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
def _bwd_preprocess_kernel(o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr,
                           so_b, so_s, so_h, sdo_b, sdo_s, sdo_h,
                           seqlen_q, seqlen_q_rounded, num_heads,
                           BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    valid = rows < seqlen_q
    rows64 = rows.to(tl.int64)
    o = tl.load(o_ptr + b * so_b + h * so_h + rows64[:, None] * so_s + cols[None, :], mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + b * sdo_b + h * sdo_h + rows64[:, None] * sdo_s + cols[None, :], mask=valid[:, None],
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    lse = tl.load(lse_ptr + (b * num_heads + h) * seqlen_q + rows64, mask=valid, other=0.0)
    lse2 = tl.where(lse == -float("inf"), 0.0, lse * 1.4426950408889634)
    lse2 = tl.where(valid, lse2, float("inf"))
    out = (b * num_heads + h) * seqlen_q_rounded + rows64
    tl.store(delta_ptr + out, delta)
    tl.store(lse2_ptr + out, lse2)


@triton.jit
def _bwd_postprocess_kernel(acc_ptr, dq_ptr, sdq_b, sdq_s, sdq_h, seqlen_q, seqlen_q_rounded, num_heads, scale,
                            BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    rows64 = rows.to(tl.int64)
    acc = tl.load(acc_ptr + ((b * num_heads + h) * seqlen_q_rounded + rows64)[:, None] * HEAD_DIM + cols[None, :])
    dq = (acc * scale).to(dq_ptr.dtype.element_ty)
    tl.store(dq_ptr + b * sdq_b + h * sdq_h + rows64[:, None] * sdq_s + cols[None, :], dq,
             mask=(rows < seqlen_q)[:, None])


def bwd_preprocess(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                   lse2: torch.Tensor, block_m: int) -> None:
    batch, seqlen_q, nheads, head_dim = out.shape
    seqlen_q_rounded = delta.shape[-1]
    block = 64
    assert seqlen_q_rounded % block == 0 and block_m % block == 0
    _bwd_preprocess_kernel[(seqlen_q_rounded // block, nheads, batch)](
        out, dout, lse, delta, lse2, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), seqlen_q, seqlen_q_rounded, nheads,
        BLOCK=block, HEAD_DIM=head_dim, num_warps=4)


def bwd_postprocess(dq_accum: torch.Tensor, dq: torch.Tensor, scale: float) -> None:
    batch, seqlen_q, nheads, head_dim = dq.shape
    seqlen_q_rounded = dq_accum.shape[2]
    block = 64
    _bwd_postprocess_kernel[(triton.cdiv(seqlen_q, block), nheads, batch)](
        dq_accum, dq, dq.stride(0), dq.stride(1), dq.stride(2), seqlen_q, seqlen_q_rounded, nheads, scale,
        BLOCK=block, HEAD_DIM=head_dim, num_warps=4)
