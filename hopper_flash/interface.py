"""The public calls: argument checks, then the eager entry point or the
custom op.

``flash_attn_func`` follows flash-attn's signature and layout: q is
``[batch, seqlen_q, nheads, headdim]``, k and v ``[batch, seqlen_k, nheads_kv,
headdim]``. Every unsupported input is answered with a ``ValueError`` (or
``TypeError``) that names the argument and says what is expected, before
anything touches the GPU, on every path: eager, through the custom op
(autograd) and under torch.compile. flash-attn options this library does not
implement are accepted at their no-op values and refused with a
``NotImplementedError`` otherwise.

Modules: ``checks`` (argument checks) <- ``dispatch`` (validated eager
calls) <- ``ops`` (custom ops), ``kvcache`` (the KV cache) and ``paged``
(packed queries over a paged cache), both over ``cache_layout`` (how the
kernels read a cache) <- ``interface``; nothing imports upwards.
"""
from __future__ import annotations

import numbers
from typing import Literal, overload

import torch

from . import cache_layout, checks, chunked, dispatch, ops, paged


_needs_op = ops.needs_op


def _is_zero(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == 0


def check_flash_attn_options(*, dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False) -> None:
    """flash-attn 2's options: their no-op values pass, anything else is refused
    by name, rather than silently computing something else."""
    if not _is_zero(dropout_p):
        raise NotImplementedError(f"dropout_p must be 0.0 (hopper_flash has no dropout), got {dropout_p!r}")
    checks.window_bounds(window_size, False)  # a pair of ints >= -1 (what it means is the caller's business)
    checks.check_softcap(softcap)
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes must be None (ALiBi is not supported)")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    # deterministic=True needs nothing from the forward (no atomics: the same bits every run); it reaches
    # the backward through the op (ops.fwd's last argument), which then sums dq in a fixed order.
    if return_attn_probs is not False:
        raise NotImplementedError(f"return_attn_probs must be False (attention probabilities are not returned); "
                                  f"use return_lse=True for the log-sum-exp, got {return_attn_probs!r}")


# The common call passes none of them: one tuple comparison instead of the checks (host time per call).
_FLASH_ATTN_DEFAULTS = (0.0, None, False, False)


def _check_options(dropout_p, window_size, softcap, alibi_slopes, deterministic, return_attn_probs) -> None:
    """``check_flash_attn_options`` but for ``window_size`` and ``softcap``,
    after one tuple comparison that passes the common call. Every caller
    resolves ``window_size`` with ``checks.window_bounds`` and ``softcap``
    with ``checks.check_softcap`` (which check them), so a sliding-window or
    soft-capped model's every call does not check them twice."""
    if (dropout_p, alibi_slopes, deterministic, return_attn_probs) != _FLASH_ATTN_DEFAULTS:
        check_flash_attn_options(dropout_p=dropout_p, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, return_attn_probs=return_attn_probs)


@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = ...,
                    causal: bool = ..., return_lse: Literal[False] = ..., dropout_p: float = ...,
                    window_size: tuple[int, int] = ..., softcap: float = ..., alibi_slopes: None = ...,
                    deterministic: bool = ..., return_attn_probs: Literal[False] = ...,
                    learnable_sink: torch.Tensor | None = ..., qv: None = ..., q_descale: None = ...,
                    k_descale: None = ..., v_descale: None = ..., attention_chunk: int = ...,
                    num_splits: int = ..., pack_gqa: bool | None = ..., sm_margin: int = ...) -> torch.Tensor: ...


@overload
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = ...,
                    causal: bool = ..., return_lse: Literal[True], dropout_p: float = ...,
                    window_size: tuple[int, int] = ..., softcap: float = ..., alibi_slopes: None = ...,
                    deterministic: bool = ..., return_attn_probs: Literal[False] = ...,
                    learnable_sink: torch.Tensor | None = ..., qv: None = ..., q_descale: None = ...,
                    k_descale: None = ..., v_descale: None = ..., attention_chunk: int = ...,
                    num_splits: int = ..., pack_gqa: bool | None = ...,
                    sm_margin: int = ...) -> tuple[torch.Tensor, torch.Tensor]: ...


def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, return_lse=False, dropout_p=0.0,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, learnable_sink=None, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, attention_chunk=0, num_splits=1, pack_gqa=None, sm_margin=0):
    """Exact attention forward on Hopper, flash-attn compatible.

    Args:
        q: ``[batch, seqlen_q, nheads, headdim]``. Head dims 64, 128 and 256
            have kernels of their own; other multiples of 8 below 256 run on
            the next of those, at its cost, forward and backward, read as
            they are (``plan.kernel_head_dim``: no copy).
        k, v: ``[batch, seqlen_k, nheads_kv, headdim]``; ``nheads`` must be a
            multiple of ``nheads_kv`` (GQA/MQA, read without a copy). v's
            head dim may differ from q's and k's (FA3's ``hdim_v``, e.g.
            192 and 128): both run on the kernels of the wider, and ``out``
            has v's head dim.
        softmax_scale: scale of ``q @ k^T`` before the softmax; default
            ``1 / sqrt(headdim)``.
        causal: mask aligned to the bottom-right corner, as flash-attn >= 2.1:
            query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
            Rows that see no key return zeros.
        return_lse: also return the log-sum-exp of the scaled scores,
            ``[batch, nheads, seqlen_q]`` float32, natural log (-inf for rows
            that see no key).
        window_size: ``(left, right)`` sliding window, flash-attn's: query
            ``i`` sees keys ``i + off - left .. i + off + right`` (``off =
            seqlen_k - seqlen_q``; -1 = no bound on that side; ``causal``
            makes ``right`` 0). Differentiable, and traced by torch.compile,
            as without a window. Each distinct window compiles a
            specialisation (forward and backward) on first use.
        softcap: logit soft-capping, flash-attn's (Gemma 2): each scaled
            score ``x`` becomes ``softcap * tanh(x / softcap)`` before the
            mask and the softmax; 0.0 (default) for none. The LSE is that of
            the capped scores. Differentiable; forward, backward and every
            mode compile a soft-capped specialisation on first use.
        learnable_sink: attention sinks, flash-attn's (gpt-oss): a floating
            tensor ``[nheads]``, one logit per query head that joins every
            row's softmax as a key with no value (not scaled by
            ``softmax_scale``); the LSE then includes it, and rows that see
            no key return zeros with an LSE equal to the sink. Differentiable
            in the sink too. Taken in the kernels' normaliser (``sinks.py``);
            each mode compiles a specialisation with sinks on first use.
        dropout_p, alibi_slopes, deterministic,
            return_attn_probs: flash-attn 2's options, accepted at their
            no-op values (0.0, None, any bool, False); other values
            raise ``NotImplementedError``.
        attention_chunk: FlashAttention-3's chunked attention (Llama 4's
            local layers): with ``C > 0`` query ``i``, at key position ``a =
            i + seqlen_k - seqlen_q``, sees only keys ``floor(a / C) * C ..
            floor(a / C) * C + C - 1``, with ``causal`` and ``window_size``
            applied as well (rows with ``a < 0`` see none). Runs on the
            varlen kernels over the chunks as sequences (``chunked.py``: no
            copy), forward and backward (FA3's own backward has none);
            where one chunk holds every key it is the plain call. 0
            (default): none.
        qv, q_descale, k_descale, v_descale, sm_margin:
            FlashAttention-3's options, accepted at their no-op values
            (None, 0); other values raise ``NotImplementedError``.
        num_splits, pack_gqa: FlashAttention-3's scheduling hints, checked
            (an int >= 0; None or a bool) but not honoured: the launch plans
            its own split-KV and PackGQA from the shapes, the same attention.

    Everything after ``v`` is keyword-only: flash-attn 2's positional order
    (``dropout_p`` before ``softmax_scale``) would otherwise be misread.

    Returns:
        ``out`` shaped like q with v's head dim (contiguous), or ``(out, lse)``.

    Views work without a copy as long as the head dim is contiguous and the
    other strides are multiples of 16 bytes (for example q, k, v sliced out of
    one packed ``[batch, seqlen, 3, nheads, headdim]`` tensor). Differentiable
    in q, k and v through the ``hopper_flash::fwd`` / ``hopper_flash::bwd``
    custom ops; ``deterministic=True`` makes the backward's gradients bitwise
    reproducible (dQ summed in a fixed order; a slower backward). The returned
    LSE carries no gradient.
    """
    _check_options(dropout_p, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    chunk = 0
    if ((qv, q_descale, k_descale, v_descale, attention_chunk, sm_margin) != checks.FA3_DEFAULTS
            or num_splits != 1 or pack_gqa is not None):
        chunk = chunked.check_attention_chunk(attention_chunk)
        checks.check_fa3_options(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                 sm_margin=sm_margin, num_splits=num_splits, pack_gqa=pack_gqa)
    if chunk:
        return _chunked_func(q, k, v, chunk, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse,
                             window_size=window_size, softcap=softcap, deterministic=deterministic,
                             learnable_sink=learnable_sink)
    window = checks.window_bounds(window_size, causal)
    softcap = checks.check_softcap(softcap)
    sink = learnable_sink
    if sink is not None and isinstance(q, torch.Tensor) and q.dim() == 4:  # (q's own errors: the checks below)
        checks.check_learnable_sink(sink, q.shape[2], q.device)
    if _needs_op(q, k, v, sink):
        if ops.plain_eager(q, k, v, sink):
            # The op's autograd without its dispatch (host time per call),
            # on arguments validated once, here.
            softmax_scale = checks.validate(q, k, v, softmax_scale, causal)
            out, lse = ops.EagerAttention.apply(q, k, v, softmax_scale, bool(causal), bool(deterministic), window,
                                                softcap, sink)
            return (out, lse) if return_lse else out
        # The op's schema takes a float and a bool: check the Python values
        # here, as the eager path does, before they are converted.
        softmax_scale = checks.check_arguments(q, k, v, softmax_scale, causal)
        checks.check_op_device(q)
        out, lse = ops.fwd(q, k, v, softmax_scale, bool(causal), bool(deterministic), *(window or (-1, -1)),
                           softcap, sink)
        return (out, lse) if return_lse else out
    return dispatch.forward(q, k, v, softmax_scale, causal, return_lse, window=window, softcap=softcap, sink=sink)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` on Hopper, for
    ``[batch, heads, seqlen, headdim]`` inputs.

    The inputs are read through BSHD views (no copy when the head dim is
    contiguous) and the result is a ``[batch, heads, seqlen_q, headdim]`` view
    of a BSHD buffer. As in SDPA, ``is_causal`` is aligned to the top-left
    corner, so with unequal lengths it differs from ``flash_attn_func``'s
    bottom-right mask: that case, an explicit ``attn_mask`` and
    ``dropout_p > 0`` raise ``NotImplementedError``. Query heads different from
    key/value heads need ``enable_gqa=True``, as in SDPA.
    """
    if attn_mask is not None:
        raise NotImplementedError("hopper_flash.scaled_dot_product_attention: attn_mask is not supported; "
                                  "use is_causal=True for causal masking")
    if dropout_p != 0.0:
        raise NotImplementedError(f"hopper_flash.scaled_dot_product_attention: dropout_p must be 0.0 "
                                  f"(dropout is not supported), got {dropout_p}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, seqlen, headdim], got {shape}")
    if is_causal and query.shape[2] != key.shape[2]:
        raise NotImplementedError(
            f"hopper_flash.scaled_dot_product_attention: is_causal with seqlen_q ({query.shape[2]}) != "
            f"seqlen_k ({key.shape[2]}) means SDPA's top-left mask, which is not supported; "
            f"flash_attn_func(causal=True) gives the bottom-right mask")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True "
                         f"for grouped-query attention, as with torch's SDPA")
    out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                          softmax_scale=scale, causal=bool(is_causal))
    return out.transpose(1, 2)



def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, block_table,
                  softmax_scale, causal, return_lse, check_contract, window, softcap, sink, num_splits):
    """``flash_attn_varlen_func`` with ``block_table`` (``hopper_flash.paged``):
    checked before anything runs on every path; the custom op under
    torch.compile, the eager function otherwise."""
    paged.refuse_gradients(q, k, v, sink)
    if not torch.compiler.is_compiling():
        return paged.paged_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                          seqused_k, block_table, softmax_scale, causal, return_lse, check_contract,
                                          window, softcap, sink, num_splits)
    softmax_scale, max_seqlen_q, max_seqlen_k = paged.check_paged_varlen_arguments(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, block_table,
        softmax_scale, causal)
    checks.check_op_device(q)
    return paged.varlen_fwd_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table,
                                  max_seqlen_q, max_seqlen_k, softmax_scale, bool(causal), *(window or (-1, -1)),
                                  softcap, sink, num_splits)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, deterministic=False, return_lse=False,
                           check_contract=None, dropout_p=0.0, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, return_attn_probs=False, block_table=None, learnable_sink=None,
                           num_splits=0, qv=None, q_descale=None, k_descale=None, v_descale=None, attention_chunk=0,
                           pack_gqa=None, sm_margin=0, scheduler_metadata=None):
    """Exact attention over a packed batch of sequences of different lengths,
    flash-attn compatible (``flash_attn_varlen_func``).

    Args:
        q: ``[total_q, nheads, headdim]``: the batch's query sequences one
            after the other (THD); head dims as in ``flash_attn_func``.
        k, v: ``[total_k, nheads_kv, headdim]`` (v's head dim may differ, as
            in ``flash_attn_func``); ``nheads`` a multiple of
            ``nheads_kv`` (GQA/MQA).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` device tensors of
            prefix sums: sequence ``b`` occupies rows ``cu[b] .. cu[b+1] - 1``.
        max_seqlen_q, max_seqlen_k: positive Python ints, at least every
            sequence's (live) length: host-side bounds that size the grid,
            never read back from the device (a padded length is fine).
        seqused_q, seqused_k: optional int32 ``[batch]``: only the first
            ``seqused[b]`` rows of each slot are live (the rest is never
            read: it may hold anything, NaN included). Rows of q past
            ``seqused_q`` get a zero output and an LSE of -inf.
        softmax_scale: default ``1 / sqrt(headdim)`` (q's).
        causal: bottom-right aligned per sequence: query ``i`` of sequence
            ``b`` sees key ``j`` iff ``j <= i + len_k(b) - len_q(b)``. Rows and
            sequences that see no key give zeros and an LSE of -inf.
        deterministic: bitwise reproducible backward (dQ summed in order).
        return_lse: also return the LSE, float32 ``[nheads, total_q]``
            (flash-attn's varlen layout), natural log.
        check_contract: validate the device values below at the cost of one
            host sync (default: the ``HOPPER_FLASH_CHECK_VARLEN`` environment
            variable, off).
        window_size: a sliding window as in ``flash_attn_func`` (per
            sequence).
        softcap: logit soft-capping as in ``flash_attn_func``.
        learnable_sink: attention sinks as in ``flash_attn_func``; rows past
            ``seqused_q`` then get an LSE equal to their head's sink.
        block_table: int32 ``[batch, max_pages]``: k and v are then a paged
            KV cache, page pools ``[num_pages, page_size, nheads_kv,
            headdim]`` (page_size a power of two up to 1024), and sequence
            ``b``'s keys the first ``seqused_k[b]`` (or ``cu_seqlens_k[b+1]
            - cu_seqlens_k[b]``; ``cu_seqlens_k`` may then be None) keys of
            the pages its row names (FA2's and vLLM's form; forward only).
            See ``hopper_flash.paged`` for how each batch is run.
        num_splits: split the keys of each (query tile, head) item over this
            many CTAs, merged by a combine kernel (FA3's name): 0 (default)
            splits where the batch would leave SMs idle, judged from host
            values only (FA3's rule on ``max_seqlen_q``, ``max_seqlen_k`` and
            q's row count: a few long decodes beside a short prefill chunk
            split, a batch whose rows can fill the SMs never does; and,
            for unpaged k, a skewed batch whose longest sequence has over
            twice the mean per-SM share of KV tiles that k's rows bound,
            e.g. many short decodes beside one long one,
            ``plan.varlen_skew_splits``); 1 never splits.
        dropout_p, alibi_slopes, return_attn_probs: flash-attn's options,
            accepted at their no-op values only.
        attention_chunk: chunked attention as in ``flash_attn_func``, per
            sequence (``chunked.varlen_segments``: the segments built on the
            device, no sync); with ``block_table`` the segments read the
            pages in place where the chunk is a multiple of the page size
            (``chunked.paged_segments``), else each sequence's pages are
            copied into packed rows first (correct, not at memory speed).
            Packed self attention
            (the same ``cu_seqlens`` tensor for q and k, no ``seqused``)
            plans the tightest grid.
        qv, q_descale, k_descale, v_descale, sm_margin:
            FlashAttention-3's options, accepted at their no-op values
            (None, 0) only. ``pack_gqa``: FA3's hint, checked (None or a
            bool) but not honoured: the varlen mode packs a GQA group's
            queries by FA3's own rule (every power-of-two group).
            ``scheduler_metadata``: FA3's precomputed schedule
            (``get_scheduler_metadata``), None or an int32 tensor, accepted
            and not read (each call is planned here; the schedule never
            changes the result).

    **Caller's contract** (as in flash-attn, unchecked by default since only
    the device knows the values): ``cu_seqlens_*`` start at 0, never
    decrease and end at most at the tensors' first dimension (without
    ``seqused_q`` they end exactly at ``total_q``); every live length is at
    most ``max_seqlen_*``; ``seqused[b] <= cu[b+1] - cu[b]``. What can be
    checked without a sync is checked (dtype int32, rank, length, device,
    ``total > batch * max_seqlen``, ``max_seqlen`` a positive int).

    No host synchronisation: CUDA-graph capturable (replays may change the
    values of ``cu_seqlens``/``seqused`` but not ``batch``) and traceable by
    torch.compile. Differentiable in q, k and v (but with ``block_table``).

    Returns:
        ``out`` ``[total_q, nheads, headdim_v]``, or ``(out, lse)``.
    """
    _check_options(dropout_p, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    chunk = 0
    if ((qv, q_descale, k_descale, v_descale, attention_chunk, sm_margin) != checks.FA3_DEFAULTS
            or pack_gqa is not None):
        chunk = chunked.check_attention_chunk(attention_chunk)
        checks.check_fa3_options(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                 sm_margin=sm_margin, pack_gqa=pack_gqa)
    if scheduler_metadata is not None:
        checks.check_scheduler_metadata(scheduler_metadata)  # (accepted, not read: each call is planned here)
    if chunk:
        return _chunked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, chunk,
                               seqused_q=seqused_q, seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
                               deterministic=deterministic, return_lse=return_lse, check_contract=check_contract,
                               window_size=window_size, softcap=softcap, block_table=block_table,
                               learnable_sink=learnable_sink, num_splits=num_splits)
    window = checks.window_bounds(window_size, causal)
    softcap = checks.check_softcap(softcap)
    num_splits = checks.check_num_splits(num_splits)
    sink = learnable_sink
    if sink is not None and isinstance(q, torch.Tensor) and q.dim() == 3:  # (q's own errors: the checks below)
        checks.check_learnable_sink(sink, q.shape[1], q.device)
    if block_table is not None:
        out, lse = _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                 seqused_k, block_table, softmax_scale, causal, return_lse, check_contract, window,
                                 softcap, sink, num_splits)
        return (out, lse) if return_lse else out
    if _needs_op(q, k, v, sink):
        if ops.plain_eager(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sink):
            # The op's autograd without its dispatch (host time per call), on
            # arguments validated once, here (the contract check included).
            softmax_scale, max_seqlen_q, max_seqlen_k = dispatch.validate_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale,
                causal, check_contract)
            out, lse = ops.EagerVarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                                      max_seqlen_q, max_seqlen_k, softmax_scale, bool(causal),
                                                      bool(deterministic), window, softcap, sink, num_splits)
            return (out, lse) if return_lse else out
        softmax_scale, max_seqlen_q, max_seqlen_k = checks.check_varlen_arguments(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale,
            causal)
        checks.check_op_device(q)
        if check_contract and not torch.compiler.is_compiling():
            # (The op's real implementation honours HOPPER_FLASH_CHECK_VARLEN itself.)
                checks.check_varlen_contract(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             seqused_q, seqused_k)
        out, lse = ops.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, bool(causal), bool(deterministic),
                                  *(window or (-1, -1)), softcap, sink, num_splits)
        return (out, lse) if return_lse else out
    out, lse = dispatch.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                       seqused_k, softmax_scale, causal, return_lse, check_contract, window=window,
                                       softcap=softcap, sink=sink, num_splits=num_splits)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------
# attention_chunk (FA3's; Llama 4): the varlen kernels over chunk segments
# --------------------------------------------------------------------------
def _chunked_func(q, k, v, chunk: int, *, softmax_scale, causal, return_lse, window_size, softcap, deterministic,
                  learnable_sink):
    """``flash_attn_func`` with ``attention_chunk``: the rows as a varlen
    batch of chunk segments (``chunked.fixed_segments``; views, no copy),
    or the plain call where every query lies in one chunk (over that
    chunk's keys, a view)."""
    checks.check_arguments(q, k, v, softmax_scale, causal)  # errors named as flash_attn_func's
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    plain = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                 deterministic=deterministic, learnable_sink=learnable_sink)
    first = seqlen_k - seqlen_q  # the first query's key position
    if seqlen_q == 0 or seqlen_k == 0:
        return flash_attn_func(q, k, v, return_lse=return_lse, **plain)
    if first >= 0 and first // chunk == (seqlen_k - 1) // chunk:
        # Every query in the last chunk (one chunk holding every key, a
        # decode step, a short query block): the plain call over that
        # chunk's keys, a view of k and v.
        start = first // chunk * chunk
        if start:
            k, v = k[:, start:], v[:, start:]
        return flash_attn_func(q, k, v, return_lse=return_lse, **plain)
    seg = chunked.fixed_segments(batch, seqlen_q, seqlen_k, chunk, q.device)
    res = flash_attn_varlen_func(q.reshape(batch * seqlen_q, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                 v.reshape(-1, *v.shape[2:]), seg.cu_seqlens_q, seg.cu_seqlens_k, seg.max_seqlen_q,
                                 seg.max_seqlen_k, return_lse=return_lse, **plain)
    out, lse = chunked.as_batch(*(res if return_lse else (res, None)), batch, seqlen_q)
    return (out, lse) if return_lse else out


def _chunked_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, chunk: int, *, seqused_q,
                    seqused_k, softmax_scale, causal, deterministic, return_lse, check_contract, window_size, softcap,
                    block_table, learnable_sink, num_splits):
    """``flash_attn_varlen_func`` with ``attention_chunk``: the sequences'
    chunk segments as the varlen batch (``chunked.varlen_segments``, built
    on the device). The call's own arguments are checked first, and its
    contract where asked; the segments then keep it."""
    if block_table is not None:
        return _chunked_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, chunk,
                                     seqused_q=seqused_q, seqused_k=seqused_k, softmax_scale=softmax_scale,
                                     causal=causal, return_lse=return_lse, check_contract=check_contract,
                                     window_size=window_size, softcap=softcap, block_table=block_table,
                                     learnable_sink=learnable_sink, num_splits=num_splits)
    softmax_scale, max_seqlen_q, max_seqlen_k = checks.check_varlen_arguments(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale, causal)
    if dispatch._check_contract_requested(check_contract) and not torch.compiler.is_compiling():
        checks.check_varlen_contract(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                     seqused_k)
    seg = chunked.varlen_segments(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                                  chunk)
    return flash_attn_varlen_func(q, k, v, seg.cu_seqlens_q, seg.cu_seqlens_k, seg.max_seqlen_q, seg.max_seqlen_k,
                                  seqused_q=seg.seqused_q, seqused_k=seg.seqused_k, softmax_scale=softmax_scale,
                                  causal=causal, deterministic=deterministic, return_lse=return_lse,
                                  check_contract=False, window_size=window_size, softcap=softcap,
                                  learnable_sink=learnable_sink, num_splits=num_splits)


def _chunked_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, chunk: int, *,
                          seqused_q, seqused_k, softmax_scale, causal, return_lse, check_contract, window_size,
                          softcap, block_table, learnable_sink, num_splits):
    """``flash_attn_varlen_func`` with ``attention_chunk`` and ``block_table``:
    where the chunk is a multiple of the page size every chunk starts at a
    page, and the segments are a paged batch of their own
    (``chunked.paged_segments``: their page-table rows gathered on the
    device); otherwise each sequence's pages are copied into packed rows
    first (correct, not at memory speed) and chunked as unpaged keys."""
    paged.refuse_gradients(q, k, v, learnable_sink)
    softmax_scale, max_seqlen_q, max_seqlen_k = paged.check_paged_varlen_arguments(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, block_table,
        softmax_scale, causal)
    if dispatch._check_contract_requested(check_contract) and not torch.compiler.is_compiling():
        paged.check_paged_varlen_contract(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                          seqused_k, block_table)
    lens = paged._key_lengths(cu_seqlens_k, seqused_k)
    common = dict(softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, check_contract=False,
                  window_size=window_size, softcap=softcap, learnable_sink=learnable_sink, num_splits=num_splits)
    page_size = k.shape[1]
    if chunk % page_size == 0:
        seg, table = chunked.paged_segments(cu_seqlens_q.contiguous(), seqused_q, max_seqlen_q, lens, max_seqlen_k,
                                            chunk, block_table.contiguous(), page_size)
        return flash_attn_varlen_func(q, k, v, seg.cu_seqlens_q, None, seg.max_seqlen_q, seg.max_seqlen_k,
                                      seqused_q=seg.seqused_q, seqused_k=seg.seqused_k, block_table=table, **common)
    k_rows, v_rows = (t.flatten(0, 1) for t in cache_layout.pages_copied(k, v, block_table))
    rows = block_table.shape[1] * page_size
    cu_k = torch.arange(block_table.shape[0] + 1, dtype=torch.int32, device=q.device) * rows
    return _chunked_varlen(q, k_rows, v_rows, cu_seqlens_q, cu_k, max_seqlen_q, min(max_seqlen_k, rows), chunk,
                           seqused_q=seqused_q, seqused_k=lens, deterministic=False, block_table=None, **common)


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens: torch.Tensor, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0) -> torch.Tensor:
    """FlashAttention-3's ``get_scheduler_metadata``, the same arguments:
    FA3 precomputes a call's schedule (its split counts) once per step and
    passes it to every layer's ``flash_attn_with_kvcache`` /
    ``flash_attn_varlen_func`` as ``scheduler_metadata``. hopper_flash plans
    each call itself, from host values and without a sync, so there is
    nothing to precompute: this returns an empty int32 tensor on
    ``cache_seqlens``' device, which both functions accept and do not read
    (code written for FA3, vLLM's and SGLang's, runs unchanged; a copy into
    a persistent buffer of any length works)."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be a torch.Tensor (int32 [batch]), got {type(cache_seqlens).__name__}")
    return torch.empty(0, dtype=torch.int32, device=cache_seqlens.device)
