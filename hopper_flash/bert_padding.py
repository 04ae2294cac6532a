"""flash-attn's padding helpers (``flash_attn.bert_padding``), so code that
unpads a batch for ``flash_attn_varlen_func`` moves over by changing the import:

    from hopper_flash.bert_padding import unpad_input, pad_input

    x_thd, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, attention_mask)
    out = flash_attn_varlen_func(q_thd, k_thd, v_thd, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out, indices, batch, seqlen)         # zeros at the padded positions

Same names, arguments and results as flash-attn's (2.7 on: ``unpad_input``
returns ``seqused`` as a fifth value). The gathers and scatters are plain
torch indexing, so autograd, ``torch.compile`` and any device work as for
any torch op; the backward of a gather writes each index once, so it is
deterministic.

Host synchronisation: ``unpad_input`` reads the mask's nonzero positions
and the longest length back to the host (two syncs, as in flash-attn;
``max_seqlen_in_batch`` is a Python int because ``flash_attn_varlen_func``
needs one); ``unpad_input_for_concatenated_sequences`` also reads which
length slots are used (three, as in flash-attn). Unpad once per batch,
before the model's layers, not per layer; ``index_first_axis`` and
``pad_input`` on already known indices do not sync.

Masks are read as booleans (nonzero = selected); flash-attn sums them, which
agrees on 0/1 masks. With ``unused_mask`` (FA3's ``seqused``: slots whose
last tokens are allocated but not live), each row's live tokens must come
before its unused ones, since ``seqused[b]`` counts the first tokens of slot
``b``; that layout is the caller's contract, as in flash-attn.
"""
from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
           "unpad_input_for_concatenated_sequences"]


def _check_tensor(name: str, t, min_dim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimensions {layout}, got shape {tuple(t.shape)}")


def _check_indices(indices, rows: int | None, device: torch.device) -> None:
    what = "(positions along the first axis, as unpad_input returns them)"
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor {what}, got {type(indices).__name__}")
    if indices.dtype not in (torch.int64, torch.int32):
        dtype = str(indices.dtype).removeprefix("torch.")
        raise ValueError(f"indices must have dtype int64 or int32 {what}, got {dtype}")
    if indices.dim() != 1:
        raise ValueError(f"indices must be 1-D {what}, got shape {tuple(indices.shape)}")
    if rows is not None and indices.shape[0] != rows:
        raise ValueError(f"indices must have one entry per row of hidden_states ({rows}), got {indices.shape[0]}")
    if indices.device != device:
        raise ValueError(f"indices must be on hidden_states' device {device}, got {indices.device}")


def _check_mask(name: str, mask, hidden_states: torch.Tensor) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [batch, seqlen], got {type(mask).__name__}")
    if mask.dim() != 2 or tuple(mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(f"{name} must be [batch, seqlen], hidden_states' first two dimensions "
                         f"{tuple(hidden_states.shape[:2])}, got shape {tuple(mask.shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise ValueError(f"{name} must be bool or an integer dtype (nonzero = selected), "
                         f"got {str(mask.dtype).removeprefix('torch.')}")
    if mask.device != hidden_states.device:
        raise ValueError(f"{name} must be on hidden_states' device {hidden_states.device}, got {mask.device}")


def _check_size(name: str, value) -> None:
    if isinstance(value, torch.SymInt):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]``: the rows ``indices`` of ``input`` ([N, ...]) along its
    first axis, as ``[len(indices), ...]``. Its gradient scatters back into
    zeros of ``input``'s shape."""
    _check_tensor("input", input, 2, "[rows, ...]")
    _check_indices(indices, None, input.device)
    return input[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros of shape ``[first_axis_dim, *values.shape[1:]]`` with row
    ``indices[i]`` set to ``values[i]``. ``indices`` must not repeat (as
    ``unpad_input`` gives them): which of two writes wins is undefined."""
    _check_tensor("values", values, 2, "[rows, ...]")
    _check_indices(indices, values.shape[0], values.device)
    _check_size("first_axis_dim", first_axis_dim)
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """Drop a padded batch's padding.

    Arguments:
        hidden_states: ``[batch, seqlen, ...]``.
        attention_mask: ``[batch, seqlen]``, bool or integer; nonzero marks a
            live token (left or right padding, or any pattern).
        unused_mask: optional ``[batch, seqlen]``; nonzero marks tokens kept
            in the result but not live (after each row's live ones).

    Returns ``(hidden_states [total, ...], indices [total] int64, cu_seqlens
    [batch + 1] int32, max_seqlen_in_batch: int, seqused [batch] int32)``:
    the selected tokens in row order, their positions in the flattened
    ``[batch * seqlen]`` input, the prefix sums of each row's selected count,
    the longest row and each row's live count. Two host syncs."""
    _check_tensor("hidden_states", hidden_states, 2, "[batch, seqlen, ...]")
    _check_mask("attention_mask", attention_mask, hidden_states)
    live = attention_mask.bool()
    kept = live
    if unused_mask is not None:
        _check_mask("unused_mask", unused_mask, hidden_states)
        kept = live | unused_mask.bool()
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = live.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, seqused


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor, attention_mask_in_length: torch.Tensor):
    """Unpad rows that each hold several sequences one after the other.

    ``attention_mask_in_length`` ``[batch, seqlen]`` (integer) lists each
    row's sequence lengths from its first column, zeros after: ``[[2, 3, 0,
    0, 0, 0], [6, 0, 0, 0, 0, 0]]`` holds sequences of 2 and 3 tokens in row
    0 (its last slot padding) and one of 6 in row 1. Each sequence attends
    only within itself once given to ``flash_attn_varlen_func``.

    Returns ``(hidden_states [total, ...], indices [total] int64, cu_seqlens
    [num_sequences + 1] int32, max_seqlen_in_batch: int)``. Three host syncs."""
    _check_tensor("hidden_states", hidden_states, 2, "[batch, seqlen, ...]")
    _check_mask("attention_mask_in_length", attention_mask_in_length, hidden_states)
    if attention_mask_in_length.dtype == torch.bool:
        raise ValueError("attention_mask_in_length must hold lengths (an integer dtype), got bool")
    lengths = attention_mask_in_length.to(torch.int64)
    seqlen = lengths.shape[-1]
    used = lengths.sum(dim=-1)
    kept = torch.arange(seqlen, device=lengths.device).expand(lengths.shape[0], seqlen) < used.unsqueeze(1)
    flat_lengths = lengths.flatten()
    seqlens = flat_lengths[torch.nonzero(flat_lengths, as_tuple=False).flatten()].to(torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Put unpadded rows back: ``hidden_states`` ``[total, ...]`` at the flat
    positions ``indices`` of a ``[batch, seqlen, ...]`` result, zeros
    elsewhere. No host sync."""
    _check_tensor("hidden_states", hidden_states, 1, "[total_tokens, ...]")
    _check_size("batch", batch)
    _check_size("seqlen", seqlen)
    flat = hidden_states if hidden_states.dim() >= 2 else hidden_states.unsqueeze(-1)
    out = index_put_first_axis(flat, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
