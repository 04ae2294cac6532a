"""Learnable attention sinks (flash-attn's ``learnable_sink``; gpt-oss's
``sinks``, transformers' ``s_aux``): one logit ``s_h`` per query head that
joins every row's softmax as a key with no value. A row's weights become

    p_ij = exp(x_ij) / (sum_j exp(x_ij) + exp(s_h))

(``x`` the scaled, soft-capped, masked scores), so the output shrinks by the
share the sink takes, and nothing else changes. The sink logit is not
scaled by ``softmax_scale`` (as in gpt-oss).

Applied after the kernels, from their output and LSE: with ``L`` a row's
log-sum-exp without the sink and ``L' = logaddexp(L, s)``,

    out' = out * exp(L - L'),    LSE' = L'.

The backward is the kernels' own, with ``P' = exp(x - L')``, exactly the
sink-normalised weights, and ``Δ' = rowsum(dO · out')``, the softmax
Jacobian's row term (the sink column has no value, so it adds nothing to
``dP``). Both come from the backward's preprocess (``kernels/backward_pre``),
which gets the kernels' own ``out`` and ``L`` and the sink: it takes ``L'``
there and ``Δ' = exp(L - L') · rowsum(dO · out)``, so Δ' carries only the
kernel's rounding of ``out``, not the second rounding of ``out'`` (in rows
that see one key, where ``out`` is a value row exactly, Δ' is then exact;
from ``out'`` it failed the gradient tests' row check, thirty-first
session). The sink's gradient is ``ds_h = -sum over rows of head h of
exp(s_h - L') · Δ'``. Rows that see no key (``L = -inf``) give zeros and
``LSE' = s``, and add nothing to ``ds``.

Cost: the renormalisation reads the output and writes it once more, and
the sink's gradient reads ``dO`` and ``out`` once more: one Triton kernel
each (``kernels/sink.py``) on CUDA tensors outside tracing; torch's
elementwise ops (below) on the CPU and under torch.compile, which fuses
them. That is small next to long prefill and training, but a launch next to
a decode step's few microseconds and a pass over O next to a short
prefill's (BENCHMARKS.md, thirty-first session); folding the sink into the
forward kernel's epilogue (and the split-KV combine) is the way to remove
it.
"""
from __future__ import annotations

import math

import torch
import triton

from . import checks, dispatch, ops, plan
from .kernels.sink import _sink_grad_kernel, _sink_renorm_kernel

# ---------------------------------------------------------------------------
# The renormalisation and the sink's gradient, for both LSE layouts:
# fixed length: out [B, Sq, H, D], lse [B, H, Sq]; varlen: out [T, H, D], lse [H, T].
# ---------------------------------------------------------------------------


def _sink_shaped(sink: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The sink logits in fp32, shaped to broadcast against ``lse``."""
    s = sink.float()
    return s.view(1, -1, 1) if lse.dim() == 3 else s.view(-1, 1)


def _rows_of_out(x: torch.Tensor) -> torch.Tensor:
    """A per-row ``[.., H, rows]`` tensor in the output's row order, with a trailing unit axis."""
    return (x.transpose(1, 2) if x.dim() == 3 else x.t()).unsqueeze(-1)


def _block(rows: int) -> int:
    """Rows per program of kernels/sink.py: 64, or fewer rows (the power of
    two at or above their number) for short ones, such as a decode step's
    one row per sequence."""
    return min(64, triton.next_power_of_2(max(rows, 1)))


def _fused(t: torch.Tensor) -> bool:
    """Run kernels/sink.py (CUDA, not tracing) rather than torch's ops."""
    return t.is_cuda and not torch.compiler.is_compiling()


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


def renormalise(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out', LSE')`` with the sink in every row's normaliser (module
    docstring). ``out`` and ``lse`` as a forward returned them (head dim
    contiguous; the LSE's rows contiguous)."""
    if _fused(out):
        out = out if _row_layout(out, lse)[2] is not None else out.contiguous()
        batch, rows, so = _row_layout(out, lse)
        out_sink, lse_sink = torch.empty_like(out), torch.empty_like(lse)
        if out.numel():
            block = _block(rows)
            plan.launch_triton(_sink_renorm_kernel, (plan.triton_cdiv(rows, block), out.shape[-2], batch),
                               (out, lse, sink.detach().float().contiguous(), out_sink, lse_sink, rows, *so,
                                0, 0, 0, *_lse_strides(lse)), dict(BLOCK=block, HEAD_DIM=out.shape[-1]),
                               num_warps=4)
        return out_sink, lse_sink
    lse_sink = torch.logaddexp(lse, _sink_shaped(sink, lse))
    factor = torch.exp(lse - lse_sink)  # 0 where lse is -inf
    return (out.float() * _rows_of_out(factor)).to(out.dtype), lse_sink


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, lse_sink: torch.Tensor,
              sink: torch.Tensor) -> torch.Tensor:
    """``ds`` (``sink``'s shape and dtype) from the kernels' own ``out`` and
    ``lse`` and the renormalised ``lse_sink`` (module docstring); rows that
    saw no key add nothing (their ``dO`` may hold anything)."""
    if _fused(out):
        out = out if _row_layout(out, lse)[2] is not None else out.contiguous()
        dout = dout if _row_layout(dout, lse)[2] is not None else dout.contiguous()
        batch, rows, so = _row_layout(out, lse)
        block = _block(rows)
        blocks = plan.triton_cdiv(rows, block)
        part = torch.empty(batch, blocks, out.shape[-2], dtype=torch.float32, device=out.device)
        if out.numel():
            plan.launch_triton(_sink_grad_kernel, (blocks, out.shape[-2], batch),
                               (out, dout, lse, sink.detach().float().contiguous(), part, rows, *so,
                                *_row_layout(dout, lse)[2], *_lse_strides(lse)),
                               dict(BLOCK=block, HEAD_DIM=out.shape[-1]), num_warps=4)
        return (-part.sum(dim=(0, 1))).to(sink.dtype)
    delta = (dout.float() * out.float()).sum(-1)  # [B, Sq, H] or [T, H]
    delta = delta.transpose(1, 2) if lse.dim() == 3 else delta.t()
    delta = delta * torch.exp(lse - lse_sink)  # Δ' of the renormalised output
    p_sink = torch.exp(_sink_shaped(sink, lse) - lse_sink)
    terms = torch.where(lse == -math.inf, 0.0, p_sink * delta)
    ds = -(terms.sum(dim=(0, 2)) if lse.dim() == 3 else terms.sum(dim=1))
    return ds.to(sink.dtype)


# ---------------------------------------------------------------------------
# Autograd: the forward op, the renormalisation, and the backward op on the
# renormalised output and LSE (module docstring). The ops are the custom ops
# (``ops.fwd``/``ops.bwd`` and the varlen pair), so torch.compile traces it.
# ---------------------------------------------------------------------------


class SinkAttention(torch.autograd.Function):
    """Fixed-length attention with a sink; ``window`` is ``(left, right)``
    as the ops take it (-1 -1 for none)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, softmax_scale: float, causal: bool, deterministic: bool, window_left: int,
                window_right: int, softcap: float):
        out, lse = ops.fwd(q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap)
        out_sink, lse_sink = renormalise(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, lse_sink, sink)
        ctx.args = (softmax_scale, causal, deterministic, window_left, window_right, softcap)
        ctx.mark_non_differentiable(lse_sink)
        return out_sink, lse_sink

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, lse_sink, sink = ctx.saved_tensors
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):  # (not when only the sink is trained)
            dq, dk, dv = ops.bwd(dout, q, k, v, out, lse, *ctx.args, sink)
        ds = sink_grad(dout, out, lse, lse_sink, sink) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, ds, None, None, None, None, None, None


class SinkVarlenAttention(torch.autograd.Function):
    """``SinkAttention`` for THD batches (``ops.varlen_fwd``/``varlen_bwd``)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q: int,
                max_seqlen_k: int, softmax_scale: float, causal: bool, deterministic: bool, window_left: int,
                window_right: int, softcap: float):
        out, lse = ops.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, deterministic, window_left, window_right,
                                  softcap)
        out_sink, lse_sink = renormalise(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, lse_sink, sink, cu_seqlens_q, cu_seqlens_k, seqused_q,
                              seqused_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic, window_left, window_right,
                    softcap)
        ctx.mark_non_differentiable(lse_sink)
        return out_sink, lse_sink

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, lse_sink, sink, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = ops.varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, *ctx.args, sink)
        ds = sink_grad(dout, out, lse, lse_sink, sink) if ctx.needs_input_grad[3] else None
        return (dq, dk, dv, ds) + (None,) * 12


# ---------------------------------------------------------------------------
# Entry points (``interface`` calls these when ``learnable_sink`` is given)
# ---------------------------------------------------------------------------


def _window(window) -> tuple[int, int]:
    return window if window is not None else (-1, -1)


def attention(q, k, v, sink, softmax_scale, causal, deterministic, window, softcap: float):
    """``flash_attn_func`` with ``learnable_sink=sink``; returns ``(out, lse)``.
    ``window``/``softcap`` already resolved (``checks.window_bounds``,
    ``checks.check_softcap``)."""
    if ops.needs_op(q, k, v, sink):
        softmax_scale = checks.check_arguments(q, k, v, softmax_scale, causal)
        checks.check_learnable_sink(sink, q.shape[2], q.device)
        checks.check_op_device(q)
        return SinkAttention.apply(q, k, v, sink, softmax_scale, bool(causal), bool(deterministic),
                                   *_window(window), softcap)
    # Inference: dispatch.forward validates q, k, v (or takes a prepared call:
    # a decode step's host time); the sink is checked before it launches.
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        checks.check_learnable_sink(sink, q.shape[2], q.device)
    out, lse = dispatch.forward(q, k, v, softmax_scale, causal, True, window=window, softcap=softcap)
    return renormalise(out, lse, sink)


def varlen_attention(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                     softmax_scale, causal, deterministic, check_contract, window, softcap: float):
    """``flash_attn_varlen_func`` with ``learnable_sink=sink``; returns ``(out, lse)``."""
    if ops.needs_op(q, k, v, sink):
        softmax_scale, max_seqlen_q, max_seqlen_k = checks.check_varlen_arguments(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale,
            causal)
        checks.check_learnable_sink(sink, q.shape[1], q.device)
        checks.check_op_device(q)
        if check_contract and not torch.compiler.is_compiling():
            checks.check_varlen_contract(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                         seqused_k)
        return SinkVarlenAttention.apply(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                         max_seqlen_q, max_seqlen_k, softmax_scale, bool(causal),
                                         bool(deterministic), *_window(window), softcap)
    if isinstance(q, torch.Tensor) and q.dim() == 3:  # (q's own errors: dispatch.forward_varlen's)
        checks.check_learnable_sink(sink, q.shape[1], q.device)
    out, lse = dispatch.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                       seqused_k, softmax_scale, causal, True, check_contract, window=window,
                                       softcap=softcap)
    return renormalise(out, lse, sink)
