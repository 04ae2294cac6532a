"""CPU-side references for the attention kernels (pure PyTorch, no triton).

Two references with different jobs:

* :func:`attention_reference` is the ground truth: exact softmax attention in
  float64 (or float32), computed directly, no online softmax.
* :func:`emulate_forward` replays the kernel's own tiled algorithm (tile
  order, masking rule, base-2 online softmax, P rounded to the input dtype)
  in PyTorch. When the GPU kernel disagrees with the ground truth, comparing it
  with the emulator tells an algorithm bug (emulator also wrong) from a code
  bug (emulator right, kernel wrong).

Conventions shared by both, and by the kernel:

* Layout BSHD as in flash-attn: q ``[batch, seqlen_q, nheads, headdim]``,
  k and v ``[batch, seqlen_k, nheads_kv, headdim]``; ``nheads`` is a multiple
  of ``nheads_kv`` and q head ``h`` reads kv head ``h // (nheads // nheads_kv)``.
* Causal masking is aligned to the bottom-right (flash-attn >= 2.1): query row
  ``i`` sees key ``j`` iff ``j <= i + (seqlen_k - seqlen_q)``.
* A row that sees no key has output 0 and LSE -inf (never NaN).
* LSE is float32 ``[batch, nheads, seqlen_q]``, natural log.
* ``softmax_scale`` defaults to ``1 / sqrt(headdim)``.

All functions are device-agnostic: they run on whatever device the inputs live
on, so GPU tests can call them on CUDA tensors.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "attention_reference",
    "emulate_forward",
    "max_abs_err",
    "rel_fro_err",
]

LOG2E = math.log2(math.e)

# Upper bound on the elements of one score chunk in attention_reference. 2**24
# float64 scores are 128 MiB: S=8k fits in 2k-row chunks on CPU or GPU.
_SCORE_CHUNK_ELEMS = 1 << 24


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate BSHD shapes; return (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D BSHD, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, seqlen_q, nheads, headdim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != batch or k.shape[3] != headdim:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch or headdim")
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    return batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim


def _default_scale(softmax_scale: float | None, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention: ``softmax(scale * q k^T + mask) v`` and its LSE.

    Inputs (any float dtype, e.g. bf16) are upcast to ``dtype`` (float64 by
    default, float32 allowed) and every step is done in that precision.

    Returns ``(out, lse)``: ``out`` has q's shape and dtype ``dtype``; ``lse``
    is float32 ``[batch, nheads, seqlen_q]`` (natural log). Rows with no
    visible key give 0 output and -inf LSE.

    Memory: works one (batch, head) pair at a time, and within it on row
    chunks of at most ``_SCORE_CHUNK_ELEMS`` scores, so seqlen ~8k is fine on
    CPU; the causal mask is built per chunk from two aranges, never dense over
    the whole problem.
    """
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"dtype must be float64 or float32, got {dtype}")
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    scale = _default_scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    offset = seqlen_k - seqlen_q
    device = q.device

    out = torch.zeros(batch, seqlen_q, nheads, headdim, dtype=dtype, device=device)
    lse = torch.empty(batch, nheads, seqlen_q, dtype=torch.float32, device=device)
    rows_per_chunk = max(1, _SCORE_CHUNK_ELEMS // max(seqlen_k, 1))
    cols = torch.arange(seqlen_k, device=device)

    for b in range(batch):
        for h in range(nheads):
            hk = h // group
            kt = k[b, :, hk, :].to(dtype)  # [Sk, D]
            vt = v[b, :, hk, :].to(dtype)
            for r0 in range(0, seqlen_q, rows_per_chunk):
                r1 = min(r0 + rows_per_chunk, seqlen_q)
                s = (q[b, r0:r1, h, :].to(dtype) @ kt.T) * scale  # [rows, Sk]
                if causal:
                    rows = torch.arange(r0, r1, device=device)
                    s.masked_fill_(cols[None, :] > rows[:, None] + offset, -math.inf)
                row_lse = torch.logsumexp(s, dim=-1)  # -inf for rows with no visible key
                # exp(-inf - 0) = 0 keeps empty rows at 0 instead of exp(-inf + inf) = NaN.
                safe_lse = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)
                p = torch.exp(s - safe_lse[:, None])
                out[b, r0:r1, h, :] = p @ vt
                lse[b, h, r0:r1] = row_lse.float()
    return out, lse


def emulate_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_m: int = 128,
    block_n: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel's forward algorithm tile by tile in PyTorch.

    This mirrors the GPU kernel step for step (same tiles, visiting order,
    masking rule, base-2 online softmax with the scale folded in, P rounded to
    the input dtype before the PV product, float32 everywhere else), so its
    output should match the kernel's to within float32 reassociation noise.
    Keep it in sync with the kernel: if the kernel's algorithm changes, change
    this first.

    Per query tile ``bm`` (rows ``[bm*block_m, (bm+1)*block_m)``, zero-padded
    past ``seqlen_q`` like a TMA load), with ``offset = seqlen_k - seqlen_q``:

    * KV tiles ``0 .. n_kv-1`` are read, ``n_kv = max(1, cdiv(min(seqlen_k,
      (bm+1)*block_m + offset), block_n))`` if causal, else
      ``cdiv(seqlen_k, block_n)``; visited from ``n_kv-1`` (the diagonal) down
      to 0. A tile whose rows see no key still runs one fully-masked tile.
    * ``s = q_tile @ k_tile^T`` in float32. Column ``c`` is hidden (-inf) if
      ``c >= seqlen_k`` or, causal, ``c > r + offset``. The mask is applied
      only to the first visited tile and, causal, to tiles with
      ``n*block_n + block_n - 1 > bm*block_m + offset``; the emulator checks
      that every other tile really had nothing to hide.
    * ``qk_scale = softmax_scale * log2(e)`` (float32). ``m_new = max(m,
      rowmax(s))``; ``m_scaled = m_new * qk_scale`` (0 where ``m_new`` is
      -inf); ``alpha = exp2(m * qk_scale - m_scaled)``; ``p = exp2(s *
      qk_scale - m_scaled)``; ``l = l * alpha + rowsum(p)``; ``acc = acc *
      alpha + p.to(q.dtype) @ v_tile``.
    * ``out = acc / l`` (0 where ``l == 0``) rounded to q's dtype; ``lse =
      (m * qk_scale + log2(l)) / log2(e)`` (-inf where ``l == 0``), float32
      ``[batch, nheads, seqlen_q]``.

    Assumes ``softmax_scale > 0``, as the kernel does (the running max of the
    unscaled scores is only the max of the scaled ones for a positive scale).
    Vectorised over batch and heads; only tiles are looped over.
    """
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    scale = _default_scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    offset = seqlen_k - seqlen_q
    device = q.device
    in_dtype = q.dtype
    # The kernel receives qk_scale as an fp32 argument: round it once, here.
    qk_scale = float(torch.tensor(scale * LOG2E, dtype=torch.float32))
    neg_inf = -math.inf

    n_m_tiles = -(-seqlen_q // block_m)
    # At least one KV tile exists even when seqlen_k == 0 (causal runs a
    # fully-masked tile); its padding is zeros, as TMA fills out-of-bounds.
    n_n_tiles = max(1, -(-seqlen_k // block_n))

    # [B, H, S, D] float32, padded to whole tiles; GQA heads expanded so the
    # per-tile work is one batched matmul over (batch, head).
    qf = torch.zeros(batch, nheads, n_m_tiles * block_m, headdim, dtype=torch.float32, device=device)
    qf[:, :, :seqlen_q] = q.transpose(1, 2).float()
    kf = torch.zeros(batch, nheads, n_n_tiles * block_n, headdim, dtype=torch.float32, device=device)
    vf = torch.zeros_like(kf)
    kf[:, :, :seqlen_k] = k.transpose(1, 2).float().repeat_interleave(group, dim=1)
    vf[:, :, :seqlen_k] = v.transpose(1, 2).float().repeat_interleave(group, dim=1)

    out = torch.empty(batch, nheads, n_m_tiles * block_m, headdim, dtype=in_dtype, device=device)
    lse = torch.empty(batch, nheads, n_m_tiles * block_m, dtype=torch.float32, device=device)
    col_in_tile = torch.arange(block_n, device=device)
    row_in_tile = torch.arange(block_m, device=device)

    for bm in range(n_m_tiles):
        row0 = bm * block_m
        q_tile = qf[:, :, row0:row0 + block_m]  # [B, H, BM, D]
        rows = row0 + row_in_tile
        if causal:
            last_key = min(seqlen_k, (bm + 1) * block_m + offset)
            n_kv = max(1, -(-last_key // block_n))
        else:
            n_kv = -(-seqlen_k // block_n)

        m = torch.full((batch, nheads, block_m), neg_inf, dtype=torch.float32, device=device)
        l = torch.zeros((batch, nheads, block_m), dtype=torch.float32, device=device)
        acc = torch.zeros((batch, nheads, block_m, headdim), dtype=torch.float32, device=device)

        for step, n in enumerate(range(n_kv - 1, -1, -1)):
            col0 = n * block_n
            k_tile = kf[:, :, col0:col0 + block_n]
            v_tile = vf[:, :, col0:col0 + block_n]
            s = q_tile @ k_tile.transpose(-1, -2)  # [B, H, BM, BN] float32

            cols = col0 + col_in_tile
            hidden = (cols >= seqlen_k)[None, :].expand(block_m, block_n)
            if causal:
                hidden = hidden | (cols[None, :] > rows[:, None] + offset)
            masked = step == 0 or (causal and col0 + block_n - 1 > row0 + offset)
            if masked:
                s = s.masked_fill(hidden, neg_inf)
            elif bool(hidden.any()):
                # The kernel would read hidden scores unmasked here: a bug in
                # the tile-skipping rule, not a numerical issue.
                raise AssertionError(
                    f"unmasked KV tile n={n} of query tile bm={bm} hides some columns "
                    f"(seqlen_q={seqlen_q}, seqlen_k={seqlen_k}, causal={causal})"
                )

            m_new = torch.maximum(m, s.amax(dim=-1))
            # Rows that have seen only -inf use 0 so exp2(-inf - 0) = 0, not NaN.
            m_scaled = torch.where(m_new == neg_inf, torch.zeros_like(m_new), m_new * qk_scale)
            alpha = torch.exp2(m * qk_scale - m_scaled)
            p = torch.exp2(s * qk_scale - m_scaled[..., None])
            # FA3 order: rescale the carried sum, then add this tile's partial sum.
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p.to(in_dtype).float() @ v_tile
            m = m_new

        empty = l == 0
        safe_l = torch.where(empty, torch.ones_like(l), l)
        out_tile = torch.where(empty[..., None], torch.zeros_like(acc), acc / safe_l[..., None])
        out[:, :, row0:row0 + block_m] = out_tile.to(in_dtype)
        lse_tile = (m * qk_scale + torch.log2(safe_l)) / LOG2E
        lse[:, :, row0:row0 + block_m] = torch.where(empty, torch.full_like(lse_tile, neg_inf), lse_tile)

    return out[:, :, :seqlen_q].transpose(1, 2).contiguous(), lse[:, :, :seqlen_q].contiguous()


def _as_f64_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.as_tensor(a)
    b = torch.as_tensor(b)
    if a.shape != b.shape:
        # No broadcasting: a shape slip in a test must not turn into a pass.
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    return a.detach().to(torch.float64).cpu(), b.detach().to(torch.float64).cpu()


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b|`` as a python float, computed in float64.

    Equal entries (including matching infinities, e.g. -inf LSE of empty rows)
    count as 0. Any NaN in ``a`` or ``b`` gives ``inf``, so ``err <= tol``
    fails and ``err > tol`` holds: a NaN can never pass a check.
    """
    a, b = _as_f64_pair(a, b)
    if torch.isnan(a).any() or torch.isnan(b).any():
        return math.inf
    if a.numel() == 0:
        return 0.0
    diff = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
    return float(diff.max())


def rel_fro_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ``||a - b||_F / ||b||_F`` as a python float (float64 math).

    ``b`` is the reference. Any NaN or infinity in ``a`` or ``b`` gives ``inf``
    (this metric is for outputs, which are always finite). If ``b`` is all
    zeros the result is 0 when ``a`` is too and ``inf`` otherwise.
    """
    a, b = _as_f64_pair(a, b)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    num = float(torch.linalg.vector_norm(a - b))
    den = float(torch.linalg.vector_norm(b))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den
