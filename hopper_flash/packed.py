"""flash-attn's packed layouts: ``flash_attn_qkvpacked_func``,
``flash_attn_kvpacked_func`` and their varlen forms.

Each unpacks its tensor into views (``unbind`` along the packing axis, no
copy: the views of a contiguous packed tensor meet the kernels' 16-byte
stride rules) and runs the unpacked call's checks (their errors name q, k or
v) and kernels. Under plain eager autograd, ``ops.EagerPackedAttention``
writes the backward's dQ, dK and dV straight into the packed gradient, as
flash-attn does; elsewhere (no gradient, torch.compile, dispatch modes,
tensor subclasses) the unpacked function runs on the views, and autograd
stacks the three gradients (one more pass over them).

As in ``flash_attn_func``, everything after the tensors and the varlen
metadata is keyword-only: flash-attn 2 puts ``dropout_p`` first and
FlashAttention-3 ``softmax_scale``, so a positional call would be read
one way or the other.
"""
from __future__ import annotations

import torch

from . import checks, dispatch, interface, ops


def _unpack(name: str, t, rank: int, axis: int, parts: int, layout: str) -> tuple[torch.Tensor, ...]:
    """The ``parts`` views of ``t`` along ``axis``; a clear error naming
    ``name`` and its expected layout otherwise."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != rank or t.shape[axis] != parts:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")
    return t.unbind(axis)


def _eager_autograd(q, packed, axis, views, varlen, softmax_scale, causal, deterministic, window_size,
                    check_contract=None, softcap=0.0):
    """``(out, lse)`` through ``ops.EagerPackedAttention`` where plain eager
    autograd records the call (checked as the unpacked call checks it), else
    None. ``varlen``: None or ``(cu_seqlens_q, cu_seqlens_k, seqused_q,
    seqused_k, max_seqlen_q, max_seqlen_k)``."""
    qv, k, v = views
    tensors = (qv, k, v) if varlen is None else (qv, k, v, *varlen[:4])
    if not interface._needs_op(qv, k, v) or not ops.plain_eager(*tensors):
        return None
    if varlen is None:
        softmax_scale = checks.validate(qv, k, v, softmax_scale, causal)
    else:
        cu_q, cu_k, used_q, used_k, max_q, max_k = varlen
        softmax_scale, max_q, max_k = dispatch.validate_varlen(qv, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k,
                                                               softmax_scale, causal, check_contract)
        varlen = (cu_q, cu_k, used_q, used_k, max_q, max_k)
    return ops.EagerPackedAttention.apply(q, packed, axis, varlen, softmax_scale, bool(causal), bool(deterministic),
                                          checks.window_bounds(window_size, causal), checks.check_softcap(softcap))


def _fixed(q, packed, views, softmax_scale, causal, return_lse, options):
    """A fixed-length packed call: ``ops.EagerPackedAttention`` under plain
    eager autograd, ``flash_attn_func`` on the views otherwise. ``options``:
    flash-attn's (dropout_p, window_size, softcap, alibi_slopes,
    deterministic, return_attn_probs)."""
    interface._check_options(*options)
    got = _eager_autograd(q, packed, 2, views, None, softmax_scale, causal, options[4], options[1],
                          softcap=options[2])
    if got is not None:
        return got if return_lse else got[0]
    dropout_p, window_size, softcap, alibi_slopes, deterministic, return_attn_probs = options
    return interface.flash_attn_func(*views, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse,
                                     dropout_p=dropout_p, window_size=window_size, softcap=softcap,
                                     alibi_slopes=alibi_slopes, deterministic=deterministic,
                                     return_attn_probs=return_attn_probs)


def _varlen(q, packed, views, varlen, softmax_scale, causal, return_lse, check_contract, options):
    """``_fixed`` for THD tensors; ``varlen``: (cu_seqlens_q, cu_seqlens_k,
    seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)."""
    interface._check_options(*options)
    got = _eager_autograd(q, packed, 1, views, varlen, softmax_scale, causal, options[4], options[1], check_contract,
                          options[2])
    if got is not None:
        return got if return_lse else got[0]
    cu_q, cu_k, used_q, used_k, max_q, max_k = varlen
    dropout_p, window_size, softcap, alibi_slopes, deterministic, return_attn_probs = options
    return interface.flash_attn_varlen_func(
        *views, cu_q, cu_k, max_q, max_k, seqused_q=used_q, seqused_k=used_k, softmax_scale=softmax_scale,
        causal=causal, deterministic=deterministic, return_lse=return_lse, check_contract=check_contract,
        dropout_p=dropout_p, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs)


def flash_attn_qkvpacked_func(qkv, *, softmax_scale=None, causal=False, return_lse=False, dropout_p=0.0,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                              return_attn_probs=False):
    """``flash_attn_func`` on ``qkv`` ``[batch, seqlen, 3, nheads, headdim]``
    (q, k, v stacked on axis 2, flash-attn's layout). Returns ``out``
    ``[batch, seqlen, nheads, headdim]``, or ``(out, lse)`` with
    ``return_lse``; the options are ``flash_attn_func``'s."""
    views = _unpack("qkv", qkv, 5, 2, 3, "[batch, seqlen, 3, nheads, headdim]")
    return _fixed(None, qkv, views, softmax_scale, causal, return_lse,
                  (dropout_p, window_size, softcap, alibi_slopes, deterministic, return_attn_probs))


def flash_attn_kvpacked_func(q, kv, *, softmax_scale=None, causal=False, return_lse=False, dropout_p=0.0,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                             return_attn_probs=False):
    """``flash_attn_func`` with k and v stacked: ``q`` ``[batch, seqlen_q,
    nheads, headdim]``, ``kv`` ``[batch, seqlen_k, 2, nheads_kv, headdim]``
    (GQA/MQA as in ``flash_attn_func``)."""
    k, v = _unpack("kv", kv, 5, 2, 2, "[batch, seqlen_k, 2, nheads_kv, headdim]")
    return _fixed(q, kv, (q, k, v), softmax_scale, causal, return_lse,
                  (dropout_p, window_size, softcap, alibi_slopes, deterministic, return_attn_probs))


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, *, seqused=None, softmax_scale=None, causal=False,
                                     deterministic=False, return_lse=False, check_contract=None, dropout_p=0.0,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     return_attn_probs=False):
    """``flash_attn_varlen_func`` on ``qkv`` ``[total, 3, nheads, headdim]``:
    one set of ``cu_seqlens`` (int32 ``[batch + 1]``), ``max_seqlen`` and
    optional ``seqused`` serves queries and keys. Returns ``out`` ``[total,
    nheads, headdim]``, or ``(out, lse)``; the contract on the device values
    is ``flash_attn_varlen_func``'s."""
    views = _unpack("qkv", qkv, 4, 1, 3, "[total, 3, nheads, headdim]")
    return _varlen(None, qkv, views, (cu_seqlens, cu_seqlens, seqused, seqused, max_seqlen, max_seqlen),
                   softmax_scale, causal, return_lse, check_contract,
                   (dropout_p, window_size, softcap, alibi_slopes, deterministic, return_attn_probs))


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_q=None,
                                    seqused_k=None, softmax_scale=None, causal=False, deterministic=False,
                                    return_lse=False, check_contract=None, dropout_p=0.0, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, return_attn_probs=False):
    """``flash_attn_varlen_func`` with k and v stacked: ``q`` ``[total_q,
    nheads, headdim]``, ``kv`` ``[total_k, 2, nheads_kv, headdim]``."""
    k, v = _unpack("kv", kv, 4, 1, 2, "[total_k, 2, nheads_kv, headdim]")
    return _varlen(q, kv, (q, k, v), (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k),
                   softmax_scale, causal, return_lse, check_contract,
                   (dropout_p, window_size, softcap, alibi_slopes, deterministic, return_attn_probs))
