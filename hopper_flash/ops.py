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
``out`` is differentiable. Attention sinks (``sink``, flash-attn's
``learnable_sink``) are in the forward kernels' normaliser, so the saved
``out`` and ``lse`` are the sink-normalised ones and the backward kernels
run unchanged on them; the sink's own gradient comes with theirs (the
backward ops take the sinks and return it, from the backward's preprocess),
or from ``sinks.sink_grad`` when q, k and v need none.

Eager calls skip the dispatcher, whose cost in host time exceeds what a
short attention call takes on the GPU: without autograd ``interface`` calls
the implementation (``dispatch``) directly, and with autograd on plain CUDA
tensors it uses ``EagerAttention`` / ``EagerVarlenAttention`` below, plain
``torch.autograd.Function``s around the same implementations
(``EagerPackedAttention`` for flash-attn's packed layouts, ``packed.py``). The ops serve
torch.compile, dispatch modes and tensor subclasses. An op's autograd formula
itself calls the backward's implementation directly in a plain eager
backward (``_plain_eager_backward``): that is the path of a direct call of
``torch.ops.hopper_flash.fwd`` under autograd.
"""
from __future__ import annotations

import torch

from torch.autograd.function import once_differentiable

from . import checks, dispatch, plan, plan_backward, sinks


def records_grad(*tensors) -> bool:
    """Whether autograd would record a call on these tensors (``None``
    allowed): grad mode on and one of them requires grad."""
    if not torch.is_grad_enabled():  # inference: no per-tensor look (host time per call)
        return False
    return any(getattr(t, "requires_grad", False) for t in tensors)


def needs_op(*tensors) -> bool:
    """Tracing, or autograd would record the call: go through the registered
    op, which torch.compile can trace and autograd knows about."""
    return torch.compiler.is_compiling() or records_grad(*tensors)


@torch.library.custom_op("hopper_flash::fwd", mutates_args=(), device_types="cuda")
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
        causal: bool, deterministic: bool = False, window_left: int = -1,
        window_right: int = -1, softcap: float = 0.0,
        sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on BSHD tensors; returns ``(out, lse)``.
    ``deterministic`` only selects the backward's dQ summation order;
    ``window_left``/``window_right``: ``checks.window_bounds``'s sliding
    window, -1 -1 for none; ``softcap``: logit soft-capping (0.0: none);
    ``sink``: attention sinks, ``[H]`` (None: none)."""
    checks.check_learnable_sink(sink, q.shape[2], q.device)
    return dispatch.forward(q, k, v, softmax_scale, causal, True,
                            window=checks.op_window(window_left, window_right, causal),
                            softcap=checks.check_softcap(softcap), sink=sink)


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
              sink=None):
    # The same checks as the eager path, so a traced call fails at trace time
    # with the same message. Meta tensors ask for shapes only (no device to
    # check); the TMA rules need data pointers: the real implementation has them.
    checks.check_arguments(q, k, v, softmax_scale, causal)
    checks.op_window(window_left, window_right, causal)
    checks.check_softcap(softcap)
    checks.check_learnable_sink(sink, q.shape[2], q.device)
    if q.device.type != "meta":
        checks.check_device(q)
    batch, seqlen_q, nheads, _ = q.shape
    out = torch.empty(plan.out_shape(q, v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.custom_op("hopper_flash::bwd", mutates_args=(), device_types="cuda")
def bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, softmax_scale: float, causal: bool,
        deterministic: bool, window_left: int = -1,
        window_right: int = -1, softcap: float = 0.0,
        sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward: ``(dq, dk, dv, dsink)`` from the forward's saved
    tensors (with attention sinks, the sink-normalised ``out`` and ``lse``).
    ``sink``: the forward's sinks, whose gradient is ``dsink`` (without
    sinks ``dsink`` is empty)."""
    checks.check_learnable_sink(sink, q.shape[2], q.device)
    grads = plan_backward.backward(grad_out, q, k, v, out, lse, softmax_scale, causal, deterministic,
                                   window=checks.op_window(window_left, window_right, causal),
                                   softcap=checks.check_softcap(softcap), sink=sink)
    return _with_dsink(grads, q)


def _with_dsink(grads: tuple, q: torch.Tensor) -> tuple:
    """The backward ops' four results: ``grads``, and an empty ``dsink`` where it has none."""
    return grads if len(grads) == 4 else (*grads, q.new_empty(0))


def _backward_fake(grad_out, q, k, v, out, causal, window_left, window_right, softcap, sink):
    """Both backward ops' fake results, after the checks their real
    implementations make (BSHD or THD: heads on axis -2, head dim last)."""
    checks.op_window(window_left, window_right, causal)
    checks.check_softcap(softcap)
    checks.check_learnable_sink(sink, q.shape[-2], q.device)
    plan_backward.check_head_dim(q.shape[-1], v.shape[-1])
    plan_backward.check_grad_out_meta(grad_out, out)
    dsink = q.new_empty(0) if sink is None else torch.empty(sink.shape, dtype=sink.dtype, device=sink.device)
    return (*(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)), dsink)


@bwd.register_fake
def _bwd_fake(grad_out, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left=-1, window_right=-1,
              softcap=0.0, sink=None):
    return _backward_fake(grad_out, q, k, v, out, causal, window_left, window_right, softcap, sink)


def plain_eager(*tensors) -> bool:
    """Eager autograd may bypass the ops: not under torch.compile, no
    TorchDispatchMode active, and only plain CUDA tensors (``None`` allowed).
    Anything else (FakeTensor, FunctionalTensor, other subclasses, meta or CPU
    tensors) goes through the ops, whose fake implementations and error
    messages serve it."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(type(t) is torch.Tensor and t.is_cuda for t in tensors if t is not None)


def _plain_eager_backward(*tensors) -> bool:
    """A backward pass ``plain_eager`` would let through, with grad mode off
    (autograd's default in a backward; ``create_graph=True`` turns it on).
    Then the backward's implementation runs without the op's dispatch, which
    cost 0.2-0.7 ms of host time per call on the H200 machine's CPU (torch
    2.11; BENCHMARKS.md, eighth session): more than a B16 H16 S1024 backward
    takes on the GPU, so that row was host-bound."""
    return not torch.is_grad_enabled() and plain_eager(*tensors)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal = inputs[:5]
    deterministic = inputs[5] if len(inputs) > 5 else False
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic
    ctx.window = (inputs[6] if len(inputs) > 6 else -1, inputs[7] if len(inputs) > 7 else -1)
    ctx.softcap = inputs[8] if len(inputs) > 8 else 0.0
    ctx.sink = inputs[9] if len(inputs) > 9 else None


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors

    def run(sink):
        args = (grad_out, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic)
        if _plain_eager_backward(grad_out, q, k, v, out, lse):
            return plan_backward.backward(*args, window=checks.op_window(*ctx.window, ctx.causal),
                                          softcap=checks.check_softcap(ctx.softcap), sink=sink)
        return bwd(*args, *ctx.window, ctx.softcap, sink)

    dq, dk, dv, ds = _attention_grads(ctx, 9, grad_out, out, lse, run)
    return dq, dk, dv, None, None, None, None, None, None, ds


def _attention_grads(ctx, sink_index: int, grad_out, out, lse, run) -> tuple:
    """``(dq, dk, dv, ds)`` for an attention forward's autograd formula (the
    ops' and the eager Functions'; input ``sink_index`` is the sinks):
    ``run(sink)`` runs the backward, with the sinks where they need a
    gradient (else None), when q, k or v need one; when only the sinks are
    trained their gradient comes from ``sinks.sink_grad`` alone. A gradient
    nobody needs is None."""
    sink = ctx.sink if ctx.sink is not None and ctx.needs_input_grad[sink_index] else None
    if any(ctx.needs_input_grad[:3]):
        grads = run(sink)
        return (*grads[:3], grads[3] if sink is not None else None)
    return None, None, None, None if sink is None else sinks.sink_grad(grad_out, out, lse, sink)


fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- Variable-length (THD) batches: flash_attn_varlen_func. ----
# cu_seqlens/seqused are device tensors the kernels read; max_seqlen_* are
# host ints (tile counts), so nothing is read back from the device.


@torch.library.custom_op("hopper_flash::varlen_fwd", mutates_args=(), device_types="cuda")
def varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
               max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
               deterministic: bool = False, window_left: int = -1,
               window_right: int = -1, softcap: float = 0.0,
               sink: torch.Tensor | None = None, num_splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention forward on THD tensors; returns ``(out, lse)`` with
    ``lse`` ``[nheads, total_q]``. ``deterministic`` only selects the
    backward's dQ summation order."""
    checks.check_learnable_sink(sink, q.shape[1], q.device)
    out, lse = dispatch.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                       seqused_k, softmax_scale, causal, True,
                                       window=checks.op_window(window_left, window_right, causal),
                                       softcap=checks.check_softcap(softcap), sink=sink,
                                       num_splits=checks.check_num_splits(num_splits))
    return out, lse


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
                     sink=None, num_splits=0):
    checks.check_varlen_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                  seqused_k, softmax_scale, causal)
    checks.check_num_splits(num_splits)
    return varlen_fake_outputs(q, v, causal, window_left, window_right, softcap, sink)


def varlen_fake_outputs(q, v, causal, window_left, window_right, softcap, sink):
    """A varlen forward op's fake after its arguments' own checks: the
    options' checks, the device's (but on meta), and ``(out [total_q, H,
    Dv], lse [H, total_q])`` (paged or not)."""
    checks.op_window(window_left, window_right, causal)
    checks.check_softcap(softcap)
    checks.check_learnable_sink(sink, q.shape[1], q.device)
    if q.device.type != "meta":
        checks.check_device(q)
    total_q, nheads, _ = q.shape
    return (torch.empty((total_q, nheads, v.shape[-1]), dtype=q.dtype, device=q.device),
            torch.empty((nheads, total_q), dtype=torch.float32, device=q.device))


@torch.library.custom_op("hopper_flash::varlen_bwd", mutates_args=(), device_types="cuda")
def varlen_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
               seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool,
               deterministic: bool, window_left: int = -1,
               window_right: int = -1, softcap: float = 0.0,
               sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Varlen attention backward: ``(dq, dk, dv, dsink)``, zero outside the
    live rows; ``sink`` and ``dsink`` as ``bwd``'s."""
    checks.check_learnable_sink(sink, q.shape[1], q.device)
    grads = _varlen_bwd_impl(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                             max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic,
                             window=checks.op_window(window_left, window_right, causal),
                             softcap=checks.check_softcap(softcap), sink=sink)
    return _with_dsink(grads, q)


def _varlen_bwd_impl(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, deterministic, window=None, softcap=0.0, sink=None):
    """``varlen_bwd``'s work; ``window``: ``checks.window_bounds``'s pair,
    already checked (the op checks its ints, the eager path its forward's),
    ``softcap`` a checked float; with ``sink``, a fourth result (``plan_backward.backward``)."""
    varlen = plan_backward.VarlenBatch(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                       max_seqlen_k)
    return plan_backward.backward_varlen(grad_out, q, k, v, out, lse, varlen, softmax_scale, causal, deterministic,
                                         window=window, softcap=softcap, sink=sink)


@varlen_bwd.register_fake
def _varlen_bwd_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, deterministic, window_left=-1, window_right=-1,
                     softcap=0.0, sink=None):
    return _backward_fake(grad_out, q, k, v, out, causal, window_left, window_right, softcap, sink)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, softmax_scale, causal) = inputs[:11]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_q, used_k)
    ctx.max_seqlens = (max_q, max_k)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = inputs[11] if len(inputs) > 11 else False
    ctx.window = (inputs[12] if len(inputs) > 12 else -1, inputs[13] if len(inputs) > 13 else -1)
    ctx.softcap = inputs[14] if len(inputs) > 14 else 0.0
    ctx.sink = inputs[15] if len(inputs) > 15 else None


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k, used_q, used_k = ctx.saved_tensors

    def run(sink):
        args = (grad_out, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, *ctx.max_seqlens, ctx.softmax_scale,
                ctx.causal, ctx.deterministic)
        if _plain_eager_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, used_q, used_k):
            return _varlen_bwd_impl(*args, window=checks.op_window(*ctx.window, ctx.causal),
                                    softcap=checks.check_softcap(ctx.softcap), sink=sink)
        return varlen_bwd(*args, *ctx.window, ctx.softcap, sink)

    dq, dk, dv, ds = _attention_grads(ctx, 15, grad_out, out, lse, run)
    return dq, dk, dv, *(None,) * 12, ds, None


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ---- Eager autograd without the ops' dispatch. ----


class EagerAttention(torch.autograd.Function):
    """``hopper_flash::fwd`` with its autograd formula, without the dispatch:
    the same forward and backward (``plan_backward.backward``), applied to
    arguments that passed ``checks.validate`` (``softmax_scale`` resolved), so
    the forward is ``dispatch.forward_validated``. The LSE is returned, not
    differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale: float, causal: bool, deterministic: bool, window=None, softcap=0.0,
                sink=None):
        out, lse = dispatch.forward_validated(q, k, v, softmax_scale, causal, True, window=window, softcap=softcap,
                                              sink=sink)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (softmax_scale, causal, deterministic)
        ctx.window = window
        ctx.softcap = softcap
        ctx.sink = sink
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, ds = _attention_grads(
            ctx, 8, grad_out, out, lse, lambda sink: plan_backward.backward(
                grad_out, q, k, v, out, lse, *ctx.args, window=ctx.window, softcap=ctx.softcap, sink=sink))
        return dq, dk, dv, None, None, None, None, None, ds


class EagerVarlenAttention(torch.autograd.Function):
    """``hopper_flash::varlen_fwd`` with its autograd formula, without the
    dispatch (``dispatch.forward_varlen_validated`` on arguments that passed
    ``dispatch.validate_varlen``, and ``_varlen_bwd_impl``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q: int,
                max_seqlen_k: int, softmax_scale: float, causal: bool, deterministic: bool, window=None,
                softcap=0.0, sink=None, num_splits=0):
        out, lse = dispatch.forward_varlen_validated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                     seqused_q, seqused_k, softmax_scale, causal, True, window=window,
                                                     softcap=softcap, sink=sink, num_splits=num_splits)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.args = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic)
        ctx.window = window
        ctx.softcap = softcap
        ctx.sink = sink
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        saved = ctx.saved_tensors
        dq, dk, dv, ds = _attention_grads(
            ctx, 14, grad_out, saved[3], saved[4], lambda sink: _varlen_bwd_impl(
                grad_out, *saved, *ctx.args, window=ctx.window, softcap=ctx.softcap, sink=sink))
        return dq, dk, dv, *(None,) * 11, ds, None


class EagerPackedAttention(torch.autograd.Function):
    """flash-attn's packed layouts (``hopper_flash.packed``) under plain eager
    autograd. ``packed`` holds k and v (``q`` given) or q, k and v (``q``
    None), stacked on ``axis``; ``varlen`` is None or ``(cu_seqlens_q,
    cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)``. The
    forward is ``EagerAttention``'s / ``EagerVarlenAttention``'s on the
    unbound views; the backward writes dQ, dK and dV straight into the packed
    tensor's gradient (flash-attn's way), where autograd would otherwise
    stack three separate gradients: one pass over them less, and no second
    copy in memory. Applied, like ``EagerAttention``, to validated arguments
    (``packed._eager_autograd``)."""

    @staticmethod
    def forward(ctx, q, packed, axis: int, varlen, softmax_scale: float, causal: bool, deterministic: bool,
                window=None, softcap=0.0):
        qv, k, v = _unpacked(q, packed, axis)
        if varlen is None:
            out, lse = dispatch.forward_validated(qv, k, v, softmax_scale, causal, True, window=window,
                                                  softcap=softcap)
        else:
            out, lse = dispatch.forward_varlen_validated(qv, k, v, *varlen[:2], *varlen[4:], *varlen[2:4],
                                                         softmax_scale, causal, True, window=window, softcap=softcap)
        ctx.save_for_backward(q, packed, out, lse)
        ctx.args = (axis, varlen, softmax_scale, causal, deterministic, window, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, packed, out, lse = ctx.saved_tensors
        axis, varlen, softmax_scale, causal, deterministic, window, softcap = ctx.args
        # (Varlen: rows outside the live parts, which the kernels do not
        # write, are zeroed by plan_backward.backward_varlen.)
        d_packed = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        dq = None if q is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        grads = _unpacked(dq, d_packed, axis)
        qv, k, v = _unpacked(q, packed, axis)
        if varlen is None:
            plan_backward.backward(grad_out, qv, k, v, out, lse, softmax_scale, causal, deterministic, grads=grads,
                                   window=window, softcap=softcap)
        else:
            batch = plan_backward.VarlenBatch(*varlen)
            plan_backward.backward_varlen(grad_out, qv, k, v, out, lse, batch, softmax_scale, causal, deterministic,
                                          grads=grads, window=window, softcap=softcap)
        return dq, d_packed, None, None, None, None, None, None, None


def _unpacked(q, packed, axis):
    """(q, k, v) as views: q given and k, v stacked in ``packed``, or all three in it."""
    parts = packed.unbind(axis)
    return parts if q is None else (q, *parts)
