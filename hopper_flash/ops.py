"""Forward and backward as PyTorch custom ops, so torch.compile traces
training steps through them.

``hopper_flash::fwd`` always returns ``(out, lse)``: one schema, and the LSE
store costs the kernel next to nothing. Its fake implementation runs the same
argument checks as the eager path (``checks.check_arguments``) and gives the
output shapes for tracing; its real implementation is the validated eager
forward (``dispatch.forward``). Its autograd formula saves q, k, v, out and
lse and calls ``hopper_flash::bwd``, a custom op of its own with its own fake
implementation, so a compiled backward graph contains it as one opaque node.
The gradient of ``lse`` itself is not propagated (as in flash-attn): only
``out`` is differentiable.

Eager calls that need neither tracing nor autograd skip the dispatcher (see
``interface.flash_attn_func``): the op's dispatch costs more host time than a
short attention call takes on the GPU.
"""
from __future__ import annotations

import torch

from . import checks, dispatch, plan_backward


@torch.library.custom_op("hopper_flash::fwd", mutates_args=(), device_types="cuda")
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
        causal: bool, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on BSHD tensors; returns ``(out, lse)``.
    ``deterministic`` only selects the backward's dQ summation order."""
    return dispatch.forward(q, k, v, softmax_scale, causal, True)


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False):
    # The same checks as the eager path, so a traced call fails at trace time
    # with the same message. Meta tensors ask for shapes only (no device to
    # check); the TMA rules need data pointers: the real implementation has them.
    checks.check_arguments(q, k, v, softmax_scale, causal)
    if q.device.type != "meta":
        checks.check_device(q)
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.custom_op("hopper_flash::bwd", mutates_args=(), device_types="cuda")
def bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, softmax_scale: float, causal: bool,
        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: ``(dq, dk, dv)`` from the forward's saved tensors."""
    return plan_backward.backward(grad_out, q, k, v, out, lse, softmax_scale, causal, deterministic)


@bwd.register_fake
def _bwd_fake(grad_out, q, k, v, out, lse, softmax_scale, causal, deterministic):
    plan_backward.check_head_dim(q.shape[3])
    plan_backward.check_grad_out_meta(grad_out, out)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal = inputs[:5]
    deterministic = inputs[5] if len(inputs) > 5 else False
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd(grad_out, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic)
    return dq, dk, dv, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)
