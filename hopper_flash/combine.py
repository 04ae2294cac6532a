"""``flash_attn_combine``: FlashAttention-3's merge of partial attention
outputs by their log-sum-exps.

Attention over keys split into parts (split-KV, or the shards of context
parallelism and ring attention) gives, per part ``s``, an output ``O_s``
normalised over that part's keys and its natural-log normaliser ``lse_s``
(``return_lse=True`` / ``return_softmax_lse=True`` of the attention
functions). The attention over all the keys is

    lse = log(sum_s exp(lse_s)),    O = sum_s exp(lse_s - lse) * O_s.

A part that saw no key has ``lse_s = -inf`` and weight 0: its ``O_s`` is
never read (0 * NaN would be NaN), as FA3's kernel skips it; a row whose
parts all saw no key gets ``O = 0`` and ``lse = -inf``. A part that saw
a NaN (a NaN LSE, or NaN in its output) makes its row NaN, as attention
over all the keys would be.

On a CUDA device, with no gradient to record and outside torch.compile's
tracing, one Triton kernel merges the partials in a single pass
(``kernels/combine.py``'s ``combine_strided_kernel``: rows in tiles, any
strides with a contiguous head dim). Everywhere else a handful of torch ops
compute the same (any device, traced by ``torch.compile``, differentiable
by autograd); they also take partials whose head dim is strided. Neither
syncs the host, so both are captured by CUDA graphs. hopper_flash's own
split-KV launches merge in ``kernels/combine.py``'s ``combine_kernel``
(their own partials' layout, launched dependent on the split grid) and do
not come here.
"""
from __future__ import annotations

import torch

__all__ = ["flash_attn_combine"]

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(out_partial, lse_partial, out, out_dtype) -> torch.dtype:
    """The checks, each naming its argument; returns the output's dtype."""
    for name, t, rank, what in (("out_partial", out_partial, 5, "[num_splits, batch, seqlen, nheads, headdim]"),
                                ("lse_partial", lse_partial, 4, "[num_splits, batch, seqlen, nheads]")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (the split-KV partials' dtype), got {t.dtype}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {what}, got shape {tuple(t.shape)}")
    if lse_partial.shape != out_partial.shape[:4]:
        raise ValueError(f"lse_partial must have shape {tuple(out_partial.shape[:4])} (out_partial's "
                         f"[num_splits, batch, seqlen, nheads]), got {tuple(lse_partial.shape)}")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"lse_partial must be on out_partial's device ({out_partial.device}), "
                         f"got {lse_partial.device}")
    if out_partial.shape[0] == 0:
        raise ValueError("out_partial must have at least one split (its first dimension is 0)")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got {out_dtype!r}")
    if out is None:
        return out_dtype if out_dtype is not None else torch.float32
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != out_partial.shape[1:]:
        raise ValueError(f"out must have shape {tuple(out_partial.shape[1:])} ([batch, seqlen, nheads, headdim]), "
                         f"got {tuple(out.shape)}")
    if out.device != out_partial.device:
        raise ValueError(f"out must be on out_partial's device ({out_partial.device}), got {out.device}")
    if out_dtype is not None and out.dtype != out_dtype:
        raise TypeError(f"out's dtype ({out.dtype}) must be out_dtype ({out_dtype})")
    if out.dtype not in _OUT_DTYPES:
        raise TypeError(f"out must be float32, bfloat16 or float16, got {out.dtype}")
    return out.dtype


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention outputs computed over parts of the keys (FA3's
    ``flash_attn_combine``, the same arguments and results).

    Args:
        out_partial: float32 ``[num_splits, batch, seqlen, nheads, headdim]``,
            part ``s``'s output normalised over its own keys (any strides).
        lse_partial: float32 ``[num_splits, batch, seqlen, nheads]``, part
            ``s``'s natural-log normaliser; ``-inf`` for a part that saw no key
            (its ``out_partial`` rows are then never read). An attention call's
            LSE ``[batch, nheads, seqlen]`` stacked and transposed:
            ``torch.stack(lses).transpose(-1, -2)``.
        out: ``[batch, seqlen, nheads, headdim]`` to write the result into, or
            None for a new tensor.
        out_dtype: the result's dtype (float32, bfloat16 or float16); default
            ``out``'s, else float32.

    Returns:
        ``(out, lse)``: the merged output ``[batch, seqlen, nheads, headdim]``
        and its float32 log-sum-exp ``[batch, seqlen, nheads]`` (laid out as a
        transposed ``[batch, nheads, seqlen]``, as FA3 returns it). A row whose
        parts all saw no key gets 0 and ``-inf``.
    """
    dtype = _check(out_partial, lse_partial, out, out_dtype)
    if _kernel_route(out_partial, lse_partial, out):
        return _combine_on_the_gpu(out_partial, lse_partial, out, dtype)
    lse_max = lse_partial.amax(dim=0)
    # Rows whose parts all saw no key: every weight exp(-inf - 0) = 0.
    shift = torch.where(lse_max == float("-inf"), torch.zeros_like(lse_max), lse_max)
    weights = torch.exp(lse_partial - shift)  # [splits, batch, seqlen, nheads]
    total = weights.sum(dim=0)
    lse = torch.log(total) + shift  # log(0) = -inf: a row without keys
    scale = weights / torch.where(total == 0, torch.ones_like(total), total)
    # A part of weight 0 is not read: its output may be anything, NaN included.
    read = torch.where((scale > 0).unsqueeze(-1), out_partial, torch.zeros((), dtype=out_partial.dtype,
                                                                          device=out_partial.device))
    merged = torch.einsum("sblh,sblhd->blhd", scale, read)
    lse = lse.transpose(1, 2).contiguous().transpose(1, 2)  # FA3's layout: [batch, nheads, seqlen] transposed
    if out is None:
        return merged.to(dtype), lse
    out.copy_(merged)
    return out, lse


def _kernel_route(out_partial, lse_partial, out) -> bool:
    """Whether the Triton kernel merges: CUDA tensors, nothing for autograd
    to record, not while torch.compile traces (its graph takes the torch
    ops), head dims contiguous, row counts within int32."""
    if not out_partial.is_cuda or torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() and (out_partial.requires_grad or lse_partial.requires_grad):
        return False
    if out_partial.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        return False
    return out_partial[0].numel() < 2**31


def _combine_on_the_gpu(out_partial, lse_partial, out, dtype):
    import triton

    from . import plan
    from .kernels.combine import combine_strided_kernel

    splits, batch, seqlen, nheads, head_dim = out_partial.shape
    if out is None:
        out = torch.empty((batch, seqlen, nheads, head_dim), dtype=dtype, device=out_partial.device)
    lse = torch.empty((batch, nheads, seqlen), dtype=torch.float32, device=out_partial.device).transpose(1, 2)
    rows = batch * seqlen * nheads
    if rows == 0:
        return out, lse
    d_pow2 = max(16, triton.next_power_of_2(head_dim))
    # Rows in tiles of up to 2048 elements, smaller where that leaves SMs
    # idle (a decode step's few rows wait on one split's loads after another).
    block_m = max(1, min(64, 2048 // d_pow2))
    while block_m > 1 and (rows + block_m - 1) // block_m < 2 * plan.sm_count(out_partial.device.index):
        block_m //= 2
    vec = 4 if all(st % 4 == 0 for st in out_partial.stride()[:4]) else 1  # 16 bytes of fp32
    out_vec = 16 // out.element_size()
    out_vec = out_vec if all(st % out_vec == 0 for st in out.stride()[:3]) else 1
    args = (out_partial, lse_partial, out, lse, splits, rows, seqlen, nheads, *out_partial.stride()[:4],
            *lse_partial.stride(), *out.stride()[:3], *lse.stride())
    plan.launch_triton(combine_strided_kernel, ((rows + block_m - 1) // block_m, 1, 1), args,
                       {"HEAD_DIM": head_dim, "D_POW2": d_pow2, "BLOCK_M": block_m, "VEC": vec,
                        "OUT_VEC": out_vec}, num_warps=max(1, min(4, block_m * d_pow2 // 512)))
    return out, lse
