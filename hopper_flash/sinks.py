"""Learnable attention sinks (flash-attn's ``learnable_sink``; gpt-oss's
``sinks``, transformers' ``s_aux``): one logit ``s_h`` per query head that
joins every row's softmax as a key with no value. A row's weights become

    p_ij = exp(x_ij) / (sum_j exp(x_ij) + exp(s_h))

(``x`` the scaled, soft-capped, masked scores), so the output shrinks by the
share the sink takes, and nothing else changes. The sink logit is not
scaled by ``softmax_scale`` (as in gpt-oss).

The forward kernels take the sink in their normaliser
(``kernels/softmax.softmax_finish``; split-KV runs in the combine,
``kernels/combine.py``): ``out`` is rounded once from fp32, as without a
sink, and the LSE is ``L' = logaddexp(L, s)`` with ``L`` the row's
log-sum-exp over its keys. Rows that see no key give zeros and ``L' = s``.

The backward is the kernels' own on that ``out`` and ``L'``: with ``P' =
exp(x - L')``, exactly the sink-normalised weights, and ``Δ' = rowsum(dO ·
out)``, the softmax Jacobian's row term (the sink column has no value, so it
adds nothing to ``dP``). The sink's gradient is

    ds_h = -sum over rows of head h of exp(s_h - L') · rowsum(dO · out).

The backward's preprocess computes it beside Δ (``kernels/backward_pre``;
the backward ops return it). This module's ``sink_grad`` serves a backward
that trains the sinks alone: one Triton pass over ``dO`` and ``out``
(``kernels/sink.py``) on CUDA tensors outside tracing, torch's ops
otherwise. A row counts only where ``L' > s_h``:
rows that saw no key (``L' = s_h`` exactly; their ``out`` is 0 and their
``dO`` may hold anything, NaN included, as past ``seqused_q``) add nothing,
and so do rows whose keys' whole weight is below fp32's resolution next to
the sink's, whose term is that small.

(Until the thirty-second session the sink was applied after the kernels, a
pass that rescaled ``out`` and a preprocess that took the sink in the
backward: BENCHMARKS.md, thirty-first session.)
"""
from __future__ import annotations

import torch
import triton

from . import plan
from .kernels.sink import _sink_grad_kernel


def _row_layout(x: torch.Tensor, lse: torch.Tensor):
    """``(batch, rows, strides8)`` of ``x`` (an output or its gradient) in
    ``lse``'s layout, varlen THD as batch 1; ``strides8``: ``(b, s, h)`` in
    units of 8 elements (kernels/sink.py), None when one is not a multiple
    of 8."""
    batch, rows, strides = ((x.shape[0], x.shape[1], (x.stride(0), x.stride(1), x.stride(2))) if lse.dim() == 3
                            else (1, x.shape[0], (0, x.stride(0), x.stride(1))))
    if x.stride(-1) != 1 or any(st % 8 for st in strides):
        return batch, rows, None
    return batch, rows, tuple(st // 8 for st in strides)


def _lse_strides(lse: torch.Tensor) -> tuple[int, int]:
    assert lse.stride(-1) == 1
    return (lse.stride(0), lse.stride(1)) if lse.dim() == 3 else (0, lse.stride(0))


def _block(rows: int) -> int:
    """Rows per program of kernels/sink.py: 64, or fewer rows (the power of
    two at or above their number) for short ones, such as a decode step's
    one row per sequence."""
    return min(64, triton.next_power_of_2(max(rows, 1)))


def _fused(*tensors) -> bool:
    """Run kernels/sink.py: plain CUDA tensors, outside torch.compile and
    any dispatch mode (an AOT-traced backward runs this under one, with
    fake tensors that have no data: it gets torch's ops, which it fuses)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(type(t) is torch.Tensor and t.is_cuda for t in tensors)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``ds`` (``sink``'s shape and dtype) from a forward's sink-normalised
    ``out`` and ``lse`` (fixed length: ``out [B, Sq, H, D]``, ``lse [B, H,
    Sq]``; varlen: ``out [T, H, D]``, ``lse [H, T]``; module docstring)."""
    if _fused(dout, out, lse, sink):
        out = out if _row_layout(out, lse)[2] is not None else out.contiguous()
        dout = dout if _row_layout(dout, lse)[2] is not None else dout.contiguous()
        batch, rows, so = _row_layout(out, lse)
        block = _block(rows)
        blocks = plan.triton_cdiv(rows, block)
        part = torch.empty(out.shape[-2], batch * blocks, dtype=torch.float32, device=out.device)
        if out.numel():
            plan.launch_triton(_sink_grad_kernel, (blocks, out.shape[-2], batch),
                               (out, dout, lse, plan.sink_arg(sink), part, rows, *so, *_row_layout(dout, lse)[2],
                                *_lse_strides(lse)),
                               dict(BLOCK=block, HEAD_DIM=plan.kernel_head_dim(out.shape[-1]),
                                    OUT_DIM=plan.narrower_width(out.shape[-1])), num_warps=4)
        # (per-block partials summed in a fixed order: deterministic; each
        # head's contiguous, as plan_backward._sink_partials lays them out)
        return part.sum(dim=1).to(sink.dtype)
    delta = (dout.float() * out.float()).sum(-1)  # [B, Sq, H] or [T, H]
    delta = delta.transpose(1, 2) if lse.dim() == 3 else delta.t()
    s = sink.detach().to(lse.dtype)
    s = s.view(1, -1, 1) if lse.dim() == 3 else s.view(-1, 1)
    terms = torch.where(lse > s, torch.exp(s - lse) * delta, 0.0)
    ds = -(terms.sum(dim=(0, 2)) if lse.dim() == 3 else terms.sum(dim=1))
    return ds.to(sink.dtype)
