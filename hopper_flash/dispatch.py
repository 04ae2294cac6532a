"""Validated eager entry points: check the arguments, allocate the outputs,
launch the planned kernel.

The public API (``interface``) calls these directly when neither autograd nor
torch.compile is involved, and the custom ops (``ops``) call them as their
real implementations. Both sit above this module; it imports only
``checks`` and ``plan``, so there is no import cycle.
"""
from __future__ import annotations

import math
import os

import torch

from . import checks, plan


def forward(q, k, v, softmax_scale, causal, return_lse, out=None, window=None, softcap=0.0, sink=None):
    """Validated forward; ``out`` lets tests hand in a poisoned buffer;
    ``window``: ``checks.window_bounds``'s ``(left, right)`` or None;
    ``softcap``: ``checks.check_softcap``'s cap (0.0: none); ``sink``:
    attention sinks (``checks.check_learnable_sink``'s ``[H]``) or None.

    Returns ``(out, lse)`` when ``return_lse`` else ``out``.

    A call whose argument signature (``checks._signature``, the flags and
    the window) was validated and launched directly before, with as many KV
    tiles, takes the call prepared then (``plan.PreparedForward``): the
    checks and the plan are what they were, so only the outputs are
    allocated and the kernels launched. The signature leaves the key length
    free, so a decode step's growing cache keeps its prepared call. This is
    most of a decode step's host time. With attention sinks the signature
    holds their address, dtype and size (``_sink_key``): the prepared launch
    reads them where they are, whatever they hold by then."""
    key = signature = None
    if out is None:
        result, key = prepared_forward(q, k, v, softmax_scale, causal, return_lse, window, softcap, sink)
        if result is not None:
            return result
        signature = key[0] if key is not None else None  # validate's key: computed once
    softmax_scale = checks.validate(q, k, v, softmax_scale, causal, signature)
    return forward_validated(q, k, v, softmax_scale, causal, return_lse, out, window, prepare_key=key,
                             softcap=softcap, sink=sink)


def _sink_key(sink):
    """The part of a prepared call's key that attention sinks make: None
    for none, their address, device, dtype and size where the kernels read
    them in place (``plan.sink_in_place``), else False (such a call is not
    prepared: its sinks are copied per call)."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or not plan.sink_in_place(sink):
        return False
    return sink.data_ptr(), sink.get_device(), sink.dtype, sink.numel()


def prepared_forward(q, k, v, softmax_scale, causal, return_lse, window=None, softcap=0.0, sink=None):
    """``forward``'s prepared call alone: ``(result, key)``, the result None
    where these arguments' signature has no prepared call for their KV tile
    count (the key, None where there is no signature, is what the full path
    prepares under). For a caller that has already done ``flash_attn_func``'s
    part (the transformers backend's decode step)."""
    key = checks._signature(q, k, v, softmax_scale, causal)
    sink_key = _sink_key(sink)
    if key is None or sink_key is False:
        return None, None
    key = (key, bool(return_lse), window, softcap, sink_key)
    call = plan.prepared(key)
    return (call(q, k, v) if call is not None else None), key


def forward_validated(q, k, v, softmax_scale: float, causal, return_lse, out=None, window=None, prepare_key=None,
                      softcap=0.0, sink=None):
    """``forward`` on arguments that passed ``checks.validate`` (which
    resolved ``softmax_scale``): the eager autograd Functions (``ops``) are
    applied to arguments checked once, before ``apply``. ``prepare_key``:
    where the launch is direct, remember it as a prepared call under this
    key (``forward`` only, whose outputs this function allocates)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    causal = bool(causal)
    out_shape = plan.out_shape(q, v)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    elif out.shape != out_shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must have shape {tuple(out_shape)} (q's, with v's head dim), q's dtype and device, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    else:
        checks.check_tma_addressable("out", out)
    lse = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device) if return_lse else None
    if out.numel() == 0:
        pass  # nothing to compute: no launch
    elif seqlen_k == 0:
        out.zero_()  # no key at all: zero output, -inf LSE (the sink's where given), no launch
        if lse is not None:
            fill_empty_lse(lse, sink)
    else:
        # num_splits=0, pack_gqa=None: the decode heuristics (split-KV,
        # PackGQA) take over when seqlen_q is small next to seqlen_k; large
        # problems get the plain prefill kernel.
        with plan.on_device(q):
            direct = plan.launch_forward(q, k, v, out, lse, softmax_scale, causal, num_splits=0, pack_gqa=None,
                                         window=window, softcap=softcap, sink=plan.sink_arg(sink))
        if direct is not None and prepare_key is not None and q.device.type == checks._PASSED_DEVICE_TYPE:
            plan.remember_prepared(prepare_key, direct, q, k, out, lse, softmax_scale, softcap, sink)
    return (out, lse) if return_lse else out


def fill_empty_lse(lse, sink) -> None:
    """The LSE of rows that saw no key: -inf, or with sinks their head's
    logit (``lse`` ``[B, H, Sq]`` or ``[H, T]``)."""
    if sink is None:
        lse.fill_(-math.inf)
    else:
        lse.copy_(sink.detach().float().view(-1, 1).expand(lse.shape[-2:]).expand(lse.shape))


def _check_contract_requested(check_contract) -> bool:
    """Whether to run a varlen contract check (``check_contract``, None:
    ``HOPPER_FLASH_CHECK_VARLEN``): never while a CUDA graph is being
    captured, where its host sync is not allowed (the eager warm-up calls
    before a capture are checked)."""
    if check_contract is None:
        check_contract = os.environ.get("HOPPER_FLASH_CHECK_VARLEN", "0") not in ("", "0")
    return bool(check_contract) and not checks.capturing()


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                    softmax_scale, causal, check_contract=None):
    """Every check of a varlen forward, and the contract check where
    ``check_contract`` (None: ``HOPPER_FLASH_CHECK_VARLEN``) asks for it;
    returns ``(softmax_scale, max_seqlen_q, max_seqlen_k)``."""
    softmax_scale, max_seqlen_q, max_seqlen_k = checks.validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale,
        causal)
    if _check_contract_requested(check_contract):
        checks.check_varlen_contract(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                     seqused_k)
    return softmax_scale, max_seqlen_q, max_seqlen_k


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                   softmax_scale, causal, return_lse, check_contract=None, out=None, window=None, softcap=0.0,
                   sink=None, pack_gqa=None, num_splits=1):
    """Validated varlen forward on THD tensors; returns ``(out, lse)`` with
    ``lse`` ``[nheads, total_q]`` (None unless ``return_lse``).

    Rows of q outside every sequence's live part (past ``seqused_q``) get a
    zero output and an LSE of -inf (with sinks, ``sink``, their head's
    logit). ``out`` lets tests hand in a poisoned buffer (then those rows
    are left as they are). ``pack_gqa``: PackGQA (None:
    ``plan.choose_varlen_pack_gqa``); ``num_splits``: KV splits (0: the
    heuristic, ``plan._plan_varlen``)."""
    softmax_scale, max_seqlen_q, max_seqlen_k = validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale,
        causal, check_contract)
    return forward_varlen_validated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                    seqused_k, softmax_scale, causal, return_lse, out, window, softcap, sink,
                                    pack_gqa=pack_gqa, num_splits=num_splits)


def forward_varlen_validated(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                             softmax_scale: float, causal, return_lse, out=None, window=None, softcap=0.0,
                             sink=None, page_table=None, pack_gqa=None, num_splits=1):
    """``forward_varlen`` on arguments that passed ``validate_varlen`` (or,
    with ``page_table``, ``paged.check_paged_varlen_arguments``: k and v
    page pools, ``seqused_k`` given)."""
    total_q, nheads, _ = q.shape
    # Gaps (rows past seqused_q) are never written by the kernel: zero them up
    # front. Without seqused_q the sequences tile q (the caller's contract).
    gaps = seqused_q is not None
    out_shape = plan.out_shape(q, v)
    if out is None:
        out = (torch.zeros if gaps else torch.empty)(out_shape, dtype=q.dtype, device=q.device)
    elif out.shape != out_shape or out.dtype != q.dtype or out.device != q.device or not out.is_contiguous():
        raise ValueError(f"out must be contiguous with shape {tuple(out_shape)} (q's, with v's head dim), q's dtype "
                         f"and device, got {tuple(out.shape)} {out.dtype} on {out.device}")
    if return_lse:
        lse = torch.empty((nheads, total_q), dtype=torch.float32, device=q.device)
        if gaps:
            fill_empty_lse(lse, sink)
    else:
        lse = None
    if out.numel() == 0:
        return out, lse
    if k.shape[0] == 0:
        out.zero_()  # no key in any sequence
        if lse is not None:
            fill_empty_lse(lse, sink)
        return out, lse
    with plan.on_device(q):
        plan.launch_forward_varlen(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                   max_seqlen_q, max_seqlen_k, softmax_scale, bool(causal), window=window,
                                   softcap=softcap, sink=plan.sink_arg(sink), page_table=page_table,
                                   pack_gqa=pack_gqa, num_splits=num_splits)
    return out, lse
