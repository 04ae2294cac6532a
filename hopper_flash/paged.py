"""Packed (varlen) queries over a paged KV cache: ``flash_attn_varlen_func``
with ``block_table`` (FA2's and vLLM's form), forward only.

q is THD ``[total_q, H, D]`` with ``cu_seqlens_q``; k and v are page pools
``[num_pages, page_size, Hkv, D]``; sequence ``b``'s keys are the first
``seqused_k[b]`` (or ``cu_seqlens_k[b+1] - cu_seqlens_k[b]``) keys of the
pages its row of ``block_table`` names, in order. It is the KV cache's call
with FA3's packed queries (``kvcache.kvcache_forward`` with
``cu_seqlens_q``; ``cache_layout.varlen_over_cache`` where ``seqused_q`` leaves
gaps), whose three routes are all decided on the host from shapes alone
(nothing read back from the device):

* every sequence has ``max_seqlen_q`` queries (``total_q == batch *
  max_seqlen_q``, no ``seqused_q``; a decode step, or speculative decoding's
  fixed draft length): q is a ``[batch, max_seqlen_q, H, D]`` view and the
  call is ``flash_attn_with_kvcache``'s decode path over the same pages,
  with its split-KV and PackGQA;
* otherwise (a mixed batch: prefill chunks beside decodes) the forward
  kernel's VARLEN mode reads the pages itself (``Mode.page_size``: TMA
  boxes per page, or rows gathered under 16 keys), as the KV cache does;
* pages that mode cannot read in place (``cache_layout.page_plan``: small pages
  at head dim 256 or in strided pools, or a v head dim of its own) are
  gathered into a contiguous cache first, read through ``seqused_k`` as
  one sequence axis (correct, not at memory speed).

The caller's contract is flash-attn's: prefix sums from 0, never
decreasing; every length within ``max_seqlen_*`` and within the pages its
row names; every page-table entry that covers a live key a valid page.
``check_contract=True`` (or ``HOPPER_FLASH_CHECK_VARLEN=1``) checks them at
the cost of one host sync.
"""
from __future__ import annotations

import torch

from . import cache_layout, checks, dispatch, kvcache, ops, plan


def check_paged_varlen_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                 seqused_k, block_table, softmax_scale, causal):
    """Every check that needs no device data; returns ``(softmax_scale,
    max_seqlen_q, max_seqlen_k)``. Safe on meta and fake tensors."""
    checks._check_thd("q", q)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [num_pages, page_size, nheads_kv, headdim] (a page "
                             f"pool, with block_table), got shape {tuple(t.shape)}")
    checks._check_same_device_and_dtype(q, k, v)
    checks._check_kv_shapes(k, v)
    checks._check_heads_and_head_dim(q, k, v, heads_axis=1, kv_heads_axis=2)
    page_size = k.shape[1]
    if page_size < 1 or page_size & (page_size - 1) or page_size > 1024:
        raise ValueError(f"page size (k.shape[1]) must be a power of two from 1 to 1024, got {page_size}")
    batch = checks.check_cu_seqlens_q(cu_seqlens_q, q.device)
    if cu_seqlens_k is None and seqused_k is None:
        raise ValueError("with block_table, the key lengths come from seqused_k or cu_seqlens_k: give one")
    if cu_seqlens_k is not None:
        checks._check_index_vector("cu_seqlens_k", cu_seqlens_k, batch + 1, q.device,
                                   checks.PREFIX_SUMS + ", as many as cu_seqlens_q")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            checks._check_index_vector(name, t, batch, q.device, "int32 live length of each sequence, [batch]")
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 torch.Tensor [batch, max_pages], got "
                        f"{type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise ValueError(f"block_table must have dtype int32, got {checks.dtype_name(block_table.dtype)}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must have shape [batch, max_pages] = ({batch}, max_pages >= 1), got "
                         f"{tuple(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table must be on q's device {q.device}, got {block_table.device}")
    max_seqlen_q = checks.check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = checks.check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if seqused_q is None and q.shape[0] > batch * max_seqlen_q:
        raise ValueError(f"q has {q.shape[0]} tokens, more than batch ({batch}) x max_seqlen_q ({max_seqlen_q}): "
                         f"max_seqlen_q must be at least the longest sequence in cu_seqlens_q")
    checks.check_causal(causal)
    softmax_scale = checks.check_softmax_scale(softmax_scale, q.shape[2])
    block_m = plan.CONFIGS[plan.kernel_head_dim(int(q.shape[2]), int(v.shape[3]))].block_m
    if plan.triton_cdiv(max_seqlen_q, block_m) * q.shape[1] * batch > plan.MAX_WORK_ITEMS:
        raise ValueError(f"batch ({batch}) x nheads ({q.shape[1]}) x query tiles of max_seqlen_q ({max_seqlen_q}) "
                         f"exceeds the limit of {plan.MAX_WORK_ITEMS} work items (the kernel numbers them in int32)")
    return softmax_scale, max_seqlen_q, max_seqlen_k


def validate_paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                          block_table, softmax_scale, causal) -> tuple:
    """``check_paged_varlen_arguments``, the device check and TMA's rules
    for q and the page pools; returns ``(softmax_scale, max_seqlen_q,
    max_seqlen_k)``. A signature that passed once (``checks._varlen_signature``
    with the block table's shape, dtype and device) passes again without
    them, as in ``checks.validate_varlen``: every layer of a continuous
    batching step meets one."""
    try:
        signature = checks._varlen_signature(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             seqused_q, seqused_k, softmax_scale, causal)
        key = None if signature is None else ("paged", signature, checks._index_signature(block_table))
    except AttributeError:  # block_table is no tensor: the checks name it
        key = None
    key, passed = checks._recall(key)
    if passed is not None:
        return passed
    passed = check_paged_varlen_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                          seqused_k, block_table, softmax_scale, causal)
    checks.check_device(q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel():
            checks.check_tma_addressable(name, t if t.dim() == 4 else t.unsqueeze(0))
    checks._remember(key, q.device, passed)
    return passed


def check_paged_varlen_contract(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                                block_table) -> None:
    """The opt-in check of the device values (one host sync): the queries'
    prefix sums and lengths as for any varlen batch; ``cu_seqlens_k`` from 0
    and never decreasing, ``seqused_k`` within its slots; every key length
    within ``max_seqlen_k`` and the pages of its row; every page covering a
    live key a valid page."""
    bad = checks.prefix_sum_problems("q", cu_seqlens_q, seqused_q, q.shape[0], max_seqlen_q)
    if cu_seqlens_k is not None:  # (k's rows are pages: no total to end within)
        bad += checks.prefix_sum_problems("k", cu_seqlens_k, seqused_k, None, max_seqlen_k)
    lens = _key_lengths(cu_seqlens_k, seqused_k).long()
    capacity = block_table.shape[1] * k.shape[1]
    if bool(((lens < 0) | (lens > min(capacity, max_seqlen_k))).any()):
        bad.append(f"key lengths must lie in [0, min(max_seqlen_k, block_table's {capacity} keys)] = "
                   f"[0, {min(capacity, max_seqlen_k)}], got {lens.tolist()}")
    if cache_layout.live_pages_invalid(block_table, k, lens):
        bad.append(f"block_table entries covering live keys must lie in [0, {k.shape[0]})")
    if bad:
        raise ValueError("flash_attn_varlen_func contract violated: " + "; ".join(bad))


def _key_lengths(cu_seqlens_k, seqused_k) -> torch.Tensor:
    """int32 ``[batch]``: ``seqused_k``, or the slots of ``cu_seqlens_k`` (on the device)."""
    if seqused_k is not None:
        return seqused_k.contiguous()
    return (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).contiguous()


def paged_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                         block_table, softmax_scale, causal, return_lse, check_contract=None, window=None,
                         softcap=0.0, sink=None, num_splits=0):
    """Checked forward; returns ``(out [total_q, H, Dv], lse [H, total_q] or None)``.
    ``window``, ``softcap``, ``sink``, ``num_splits``: as
    ``dispatch.forward_varlen``'s."""
    softmax_scale, max_seqlen_q, max_seqlen_k = validate_paged_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, block_table,
        softmax_scale, causal)
    if dispatch._check_contract_requested(check_contract):
        check_paged_varlen_contract(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                    seqused_k, block_table)
    lens = _key_lengths(cu_seqlens_k, seqused_k)
    if seqused_q is None:
        # flash_attn_with_kvcache's packed queries over the same pages: its
        # decode path where every sequence has max_seqlen_q queries, else
        # the varlen kernel reading the pages.
        return kvcache.kvcache_forward_validated(q, k, v, None, None, lens, None, block_table, softmax_scale,
                                                 bool(causal), num_splits, None, return_lse, check=False, window=window,
                                                 softcap=softcap, sink=sink, cu_seqlens_q=cu_seqlens_q,
                                                 max_seqlen_q=max_seqlen_q)
    return cache_layout.varlen_over_cache(q, cu_seqlens_q, max_seqlen_q, seqused_q, k, v, lens, None, None, block_table,
                                     softmax_scale, causal, return_lse, window, softcap, sink, max_seqlen_k,
                                     num_splits=num_splits)


@torch.library.custom_op("hopper_flash::varlen_fwd_paged", mutates_args=(), device_types="cuda")
def varlen_fwd_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor | None, seqused_q: torch.Tensor | None,
                     seqused_k: torch.Tensor | None, block_table: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float, causal: bool, window_left: int = -1, window_right: int = -1,
                     softcap: float = 0.0, sink: torch.Tensor | None = None,
                     num_splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_varlen_forward`` as an op (torch.compile); returns ``(out, lse)``.
    Forward only: it has no autograd formula (flash-attn's paged varlen has
    no backward either)."""
    checks.check_learnable_sink(sink, q.shape[1], q.device)
    out, lse = paged_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                    seqused_k, block_table, softmax_scale, causal, True,
                                    window=checks.op_window(window_left, window_right, causal),
                                    softcap=checks.check_softcap(softcap), sink=sink,
                                    num_splits=checks.check_num_splits(num_splits))
    return out, lse


@varlen_fwd_paged.register_fake
def _varlen_fwd_paged_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, block_table, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0,
                           sink=None, num_splits=0):
    check_paged_varlen_arguments(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                 seqused_k, block_table, softmax_scale, causal)
    checks.check_num_splits(num_splits)
    return ops.varlen_fake_outputs(q, v, causal, window_left, window_right, softcap, sink)


def refuse_gradients(q, k, v, sink=None) -> None:
    """Paged varlen attention has no backward (as in flash-attn): say so
    rather than return an output autograd cannot differentiate."""
    if ops.records_grad(q, k, v, sink):
        raise NotImplementedError("flash_attn_varlen_func with block_table is forward only (no backward through "
                                  "a paged KV cache, as in flash-attn): call it under torch.no_grad() or on "
                                  "tensors (q, k, v, learnable_sink) that do not require grad")
