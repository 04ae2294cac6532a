"""The forward as a PyTorch custom op, so torch.compile traces through it and
autograd knows it has no backward yet.

``hopper_flash::fwd`` always returns ``(out, lse)``: one schema, and the LSE
store costs the kernel next to nothing. Its fake implementation runs the same
argument checks as the eager path (``checks.check_arguments``) and gives the
output shapes for tracing; its real implementation is the validated eager
forward (``dispatch.forward``); its autograd formula refuses the backward
with a clear error, so gradients are never silently wrong.

Eager calls that need neither tracing nor autograd skip the dispatcher (see
``interface.flash_attn_func``): the op's dispatch costs more host time than a
short attention call takes on the GPU.
"""
from __future__ import annotations

import torch

from . import checks, dispatch


@torch.library.custom_op("hopper_flash::fwd", mutates_args=(), device_types="cuda")
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
        causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on BSHD tensors; returns ``(out, lse)``."""
    return dispatch.forward(q, k, v, softmax_scale, causal, True)


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal):
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


def _setup_context(ctx, inputs, output):
    pass


def _backward(ctx, grad_out, grad_lse):
    raise NotImplementedError(
        "hopper_flash implements the attention forward pass only: backward is not implemented yet. "
        "Use it under torch.no_grad()/torch.inference_mode(), or detach q, k and v.")


fwd.register_autograd(_backward, setup_context=_setup_context)
