"""The one reference and the one judge of every correctness check (tests,
sanitizer cases and bench), for outputs, log-sum-exps, gradients and decode
outputs alike.

* :func:`attention_reference`: exact softmax attention computed directly in
  float64 (no online softmax), on the inputs' device.
* :func:`attention_baseline`: what a good bf16/fp16 attention kernel gets on
  the same inputs: PyTorch SDPA's cuDNN backend where it can express the
  problem, else SDPA's efficient/math backends with an explicit mask.
* :func:`attention_reference_grads` / :func:`attention_baseline_grads`: the
  same two for a backward's ``(dq, dk, dv)``; :func:`check_attention_grads`
  judges all three (tests, scripts, sanitizer cases and the bench).
* :func:`judge`: a value against the reference, relative to the error the
  baseline makes on the same inputs. Fixed tolerances are either loose where
  errors are small (an absolute 2e-2 passes a 3% error on S=4096 outputs of
  magnitude ~0.1) or flaky where they are large; the baseline scales with the
  problem. :func:`judge_lse` holds the log-sum-exp, an fp32 quantity, to a
  tight fixed relative bound.

Conventions (shared with the kernels):

* BSHD layout as in flash-attn: q ``[batch, seqlen_q, nheads, headdim]``,
  k and v ``[batch, seqlen_k, nheads_kv, headdim]`` (v's head dim may
  differ, as in FA3, and the output has it); q head ``h`` reads kv
  head ``h // (nheads // nheads_kv)``.
* Causal masks are aligned to the bottom-right (flash-attn >= 2.1): query row
  ``i`` sees key ``j`` iff ``j <= i + (seqlen_k - seqlen_q)``.
* A row that sees no key has output 0 and LSE -inf (never NaN).
* LSE is ``[batch, nheads, seqlen_q]``, natural log.
* ``softmax_scale`` defaults to ``1 / sqrt(headdim)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "LSE_REL_TOL",
    "JUDGE_FACTOR",
    "Problem",
    "Verdict",
    "assert_judged",
    "attention_baseline",
    "attention_baseline_grads",
    "attention_reference",
    "attention_reference_grads",
    "check_attention",
    "check_attention_grads",
    "grads_abs_tol",
    "judge_grads",
    "judge",
    "judge_lse",
    "max_abs_err",
    "paged_cache",
    "random_qkv",
    "rel_fro_err",
    "score_scale",
]

# A value may be this many times as far from the reference as the baseline
# (in relative Frobenius norm and in max-abs error), plus a floor.
JUDGE_FACTOR = 2.0
# LSE: |lse - ref| <= LSE_REL_TOL * max(1, |ref|, score_scale). The LSE is
# computed in fp32 from the same rounded inputs as the reference, so its error
# is a few fp32 ulps per step: of the dot products behind the scores (bounded
# by score_scale), and of the running sum: ~1e-7 relative for short rows,
# ~3e-6 for a row of 2**18 keys (2048 tiles summed one after the other).
LSE_REL_TOL = 2e-5

# Upper bound on the elements of one chunk of scores (or of one chunk of
# float64 keys). 2**24 float64 elements are 128 MiB.
_CHUNK_ELEMS = 1 << 24


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """Validate BSHD shapes; return (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D BSHD, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, seqlen_q, nheads, headdim = q.shape
    if k.shape[:3] != v.shape[:3]:  # (v's head dim may differ: FA3's hdim_v)
        raise ValueError(f"k and v shapes differ but for the head dim: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != batch or k.shape[3] != headdim:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} in batch or headdim")
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    return batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim


def _scale(softmax_scale: float | None, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _row_index(rows, seqlen_q: int, device) -> torch.Tensor:
    if rows is None:
        return torch.arange(seqlen_q, device=device)
    rows = torch.as_tensor(rows, dtype=torch.long).to(device)
    if rows.dim() != 1:
        raise ValueError(f"rows must be 1-D query row indices, got shape {tuple(rows.shape)}")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= seqlen_q):
        raise ValueError(f"rows must lie in [0, {seqlen_q}), got [{int(rows.min())}, {int(rows.max())}]")
    return rows


def _chunking(pairs: int, n_rows: int, seqlen_k: int, headdim: int) -> tuple[int, int]:
    """(batch, head) pairs per chunk and query rows per chunk: at most
    ``_CHUNK_ELEMS`` scores per chunk and float64 keys per pair chunk."""
    keys = max(seqlen_k, 1)
    pairs_per_chunk = max(1, min(_CHUNK_ELEMS // max(n_rows * keys, 1), _CHUNK_ELEMS // (keys * max(headdim, 1))))
    rows_per_chunk = max(1, _CHUNK_ELEMS // (keys * min(pairs_per_chunk, max(pairs, 1))))
    return pairs_per_chunk, rows_per_chunk


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    rows=None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention ``softmax(scale * q k^T + mask) v`` and its LSE.

    ``softcap`` (> 0): logit soft-capping, each scaled score ``x`` replaced
    by ``softcap * tanh(x / softcap)`` before the mask (flash-attn's).

    ``sink`` (``[nheads]``): attention sinks (flash-attn's
    ``learnable_sink``, gpt-oss's): head ``h``'s logit joins every row's
    softmax as one more column with no value, unscaled; the LSE includes it
    and rows with no visible key give 0 and an LSE of ``sink[h]``.
    Differentiable in ``sink`` (and in q, k, v) when it requires grad.

    ``window``: a sliding window ``(left, right)`` (flash-attn's
    ``window_size``, -1 = no bound on that side): row ``r`` sees keys
    ``r + off - left .. r + off + right``, ``off = seqlen_k - seqlen_q``; with
    ``causal`` as well both masks apply. ``chunk`` (> 0): FA3's
    ``attention_chunk`` as well (``chunk_visible``).

    The inputs (any float dtype: pass the kernel's bf16 inputs themselves) are
    upcast to ``dtype`` (float64; float32 only for a quick look) and every
    step runs in that precision. ``rows`` (1-D query row indices) restricts
    the computation to those rows of q, masked by their true positions: how
    long problems are checked on a sample.

    Returns ``(out, lse)``: ``out`` ``[batch, len(rows), nheads, headdim]`` in
    ``dtype``; ``lse`` ``[batch, nheads, len(rows)]`` in ``dtype``. Rows with
    no visible key give 0 and -inf. NaN and inf inputs propagate as the
    formula says (NaN where a visible score is NaN, ``0 * inf = NaN`` where a
    zero weight meets an infinite value).

    Works on chunks of (batch, head) pairs and of rows, each at most
    ``_CHUNK_ELEMS`` scores, so many small problems run batched and long
    ones (S = 2**18 and more) in bounded memory.
    """
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"dtype must be float64 or float32, got {dtype}")
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    scale = _scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    device = q.device
    row_idx = _row_index(rows, seqlen_q, device)
    n_rows = row_idx.numel()

    out = torch.zeros(batch, nheads, n_rows, v.shape[3], dtype=dtype, device=device)
    lse = torch.full((batch, nheads, n_rows), -math.inf, dtype=dtype, device=device)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # BHSD views
    cols = torch.arange(seqlen_k, device=device)
    pairs = batch * nheads
    pairs_per_chunk, rows_per_chunk = _chunking(pairs, n_rows, seqlen_k, headdim)

    for p0 in range(0, pairs, pairs_per_chunk):
        pair = torch.arange(p0, min(p0 + pairs_per_chunk, pairs), device=device)
        b, h = pair // nheads, pair % nheads
        kc = kh[b, h // group].to(dtype)  # [pairs, Sk, D]
        vc = vh[b, h // group].to(dtype)
        for r0 in range(0, n_rows, rows_per_chunk):
            r = row_idx[r0:r0 + rows_per_chunk]
            s = (qh[b[:, None], h[:, None], r[None, :]].to(dtype) @ kc.transpose(-1, -2)) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            _mask_scores(s, r, cols, seqlen_q, seqlen_k, causal, window, chunk)
            if sink is not None:
                column = sink.to(dtype)[h][:, None, None].expand(-1, s.shape[1], 1)
                row_lse = torch.logsumexp(torch.cat([s, column], dim=-1), dim=-1)  # finite
            else:
                row_lse = torch.logsumexp(s, dim=-1)  # -inf for rows with no visible key
            # exp(-inf - 0) = 0 keeps empty rows at 0 instead of exp(-inf + inf) = NaN.
            p = torch.exp(s - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
            out[b, h, r0:r0 + len(r)] = p @ vc
            lse[b, h, r0:r0 + len(r)] = row_lse
    return out.transpose(1, 2), lse


def attention_baseline(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    rows=None,
    cudnn: bool = True,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    chunk: int = 0,
) -> torch.Tensor:
    """The same attention from PyTorch, in q's dtype: the error a judged value
    is allowed (a multiple of) is this one's (``chunk``: FA3's
    ``attention_chunk``, an explicit mask).

    With ``softcap`` (which SDPA does not express): :func:`softcap_eager`,
    the bf16/fp16 PyTorch path of transformers' eager Gemma 2 attention.

    SDPA's cuDNN backend where it expresses the problem (CUDA, one kv head per
    q head, causal only with equal lengths); else SDPA restricted to the
    efficient and math backends with an explicit bottom-right mask, with GQA
    heads repeated. Rows that see no key are 0 (SDPA gives NaN there).
    ``rows`` as in :func:`attention_reference`; returns
    ``[batch, len(rows), nheads, headdim]``. ``cudnn=False`` skips cuDNN.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if softcap:
        out = softcap_eager(q, k, v, causal=causal, softmax_scale=softmax_scale, softcap=softcap, window=window)
        return out if rows is None else out[:, _row_index(rows, q.shape[1], q.device)]
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    scale = _scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    row_idx = _row_index(rows, seqlen_q, q.device)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if (cudnn and window is None and not chunk and q.is_cuda and group == 1 and (seqlen_q == seqlen_k or not causal)
            and min(seqlen_q, seqlen_k) > 0):
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = sdpa(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)
            return out if rows is None else out[:, row_idx]
        except RuntimeError:
            pass  # cuDNN declined (shape, size, version): the fallback below
    if group > 1:
        kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    qt = qt[:, :, row_idx]
    mask = None
    if causal:
        mask = torch.arange(seqlen_k, device=q.device)[None, :] <= row_idx[:, None] + (seqlen_k - seqlen_q)
    if window is not None:
        visible = window_visible(row_idx, torch.arange(seqlen_k, device=q.device), seqlen_q, seqlen_k, window)
        mask = visible if mask is None else mask & visible
    if chunk:
        visible = chunk_visible(row_idx, torch.arange(seqlen_k, device=q.device), seqlen_q, seqlen_k, chunk)
        mask = visible if mask is None else mask & visible
    if qt.numel() == 0 or seqlen_k == 0:
        return torch.zeros(batch, row_idx.numel(), nheads, v.shape[3], dtype=q.dtype, device=q.device)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            out = sdpa(qt, kt, vt, attn_mask=mask, scale=scale)
    except RuntimeError:  # the efficient kernel accepted the problem but could not launch it (e.g. its grid)
        with sdpa_kernel(SDPBackend.MATH):
            out = sdpa(qt, kt, vt, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2)
    if mask is not None:
        out = torch.where(mask.any(dim=1)[None, :, None, None], out, 0.0)
    return out


def _visible(seqlen_q: int, seqlen_k: int, causal: bool, window, device) -> torch.Tensor:
    """``[seqlen_q, seqlen_k]`` booleans: which keys each query row sees
    (bottom-right causal, and a sliding window: ``window_visible``); the
    eager baselines' mask."""
    rows, cols = torch.arange(seqlen_q, device=device), torch.arange(seqlen_k, device=device)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if causal:
        visible &= cols[None, :] <= rows[:, None] + (seqlen_k - seqlen_q)
    if window is not None:
        visible &= window_visible(rows, cols, seqlen_q, seqlen_k, window)
    return visible


def softcap_eager(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, softcap: float,
                  window: tuple[int, int] | None = None) -> torch.Tensor:
    """Soft-capped attention as transformers' eager Gemma 2 layer computes it,
    in q's dtype (differentiable): the scores ``q k^T * scale`` rounded to
    that dtype, capped there (``softcap * tanh(s / softcap)``), masked, a
    float32 softmax rounded back, then ``p v``. Rows that see no key give
    0. The baseline whose error a soft-capped kernel is judged against."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    scale = _scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap)
    visible = _visible(seqlen_q, seqlen_k, causal, window, q.device)
    s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
    return (p @ vt).transpose(1, 2)


def sink_eager(q, k, v, sink: torch.Tensor, *, causal: bool = False, softmax_scale: float | None = None,
               window: tuple[int, int] | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Attention with sinks as transformers' eager gpt-oss layer computes it,
    in q's dtype (differentiable, the sink included): the scores ``q k^T *
    scale`` in that dtype, masked, the sink appended as a column (in that
    dtype), the row maximum subtracted, the softmax, the sink's column
    dropped, then ``p v``. The baseline whose error a kernel with sinks is
    judged against. ``softcap``: the scores capped first, as
    :func:`softcap_eager` does."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    scale = _scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = _visible(seqlen_q, seqlen_k, causal, window, q.device)
    s = s.masked_fill(~visible, -math.inf)
    column = sink.to(q.dtype).view(1, -1, 1, 1).expand(batch, -1, seqlen_q, 1)
    logits = torch.cat([s, column], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    p = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(q.dtype)
    return (p @ vt).transpose(1, 2)


def softcap_eager_grads(q, k, v, dout, *, causal: bool = False, softmax_scale: float | None = None,
                        softcap: float, window: tuple[int, int] | None = None):
    """``(dq, dk, dv)`` of :func:`softcap_eager` computed as a flash-style
    backward does it in q's dtype (the baseline for soft-capped gradients):
    products of 16-bit operands, P and dS in float32, ``Δ = rowsum(dO ⊙ O)``
    from the rounded output O, dS rounded before its products. Autograd
    through ``softcap_eager`` would take Δ from P and dP instead and so
    escape the cancellation every flash backward (and cuDNN's) has in rows
    whose weight sits on one key: a baseline that no such kernel can match
    there."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    scale = _scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    dt = q.dtype
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, dout))
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    s = (qt @ kt.transpose(-1, -2)) * scale
    t = torch.tanh(s / softcap)
    visible = _visible(seqlen_q, seqlen_k, causal, window, q.device)
    z = (softcap * t).float().masked_fill(~visible, -math.inf)
    p = torch.softmax(z, dim=-1).nan_to_num(0.0)
    o = p.to(dt) @ vt
    dp = (dot @ vt.transpose(-1, -2)).float()
    delta = (dot.float() * o.float()).sum(-1, keepdim=True)
    ds = (p * (dp - delta) * (1 - t.float() ** 2)).to(dt)
    dq = (ds @ kt).float() * scale
    dk = ((ds.transpose(-1, -2) @ qt).float() * scale).unflatten(1, (nheads_kv, group)).sum(2)
    dv = (p.to(dt).transpose(-1, -2) @ dot).float().unflatten(1, (nheads_kv, group)).sum(2)
    return tuple(x.transpose(1, 2).to(dt) for x in (dq, dk, dv))


def sink_eager_grads(q, k, v, sink: torch.Tensor, dout, *, causal: bool = False,
                     softmax_scale: float | None = None, window: tuple[int, int] | None = None):
    """``(dq, dk, dv, dsink)`` of :func:`sink_eager` computed as a flash-style
    backward does it in q's dtype (the baseline for gradients with sinks; see
    :func:`softcap_eager_grads` for why not autograd): P with the sink's
    column in float32, ``Δ = rowsum(dO ⊙ O)`` from the rounded output O, dS
    rounded before its products, ``dsink = -sum over rows of p_sink · Δ``.
    With a sink even a one-key row has a nonzero dS, ``p (1 - p) dO·v``,
    which that cancellation resolves only to O's rounding."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    scale = _scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    dt = q.dtype
    qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, dout))
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    s = (qt @ kt.transpose(-1, -2)).float() * scale
    visible = _visible(seqlen_q, seqlen_k, causal, window, q.device)
    s = s.masked_fill(~visible, -math.inf)
    column = sink.float().view(1, -1, 1, 1).expand(batch, -1, seqlen_q, 1)
    p_all = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)
    p, p_sink = p_all[..., :-1], p_all[..., -1]
    o = p.to(dt) @ vt
    dp = (dot @ vt.transpose(-1, -2)).float()
    delta = (dot.float() * o.float()).sum(-1, keepdim=True)
    ds = (p * (dp - delta)).to(dt)
    dq = (ds @ kt).float() * scale
    dk = ((ds.transpose(-1, -2) @ qt).float() * scale).unflatten(1, (nheads_kv, group)).sum(2)
    dv = (p.to(dt).transpose(-1, -2) @ dot).float().unflatten(1, (nheads_kv, group)).sum(2)
    dsink = -(p_sink * delta[..., 0]).sum(dim=(0, 2))
    return (*(x.transpose(1, 2).to(dt) for x in (dq, dk, dv)), dsink.to(sink.dtype))


def _mask_scores(s: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int,
                 causal: bool, window: tuple[int, int] | None, chunk: int = 0) -> None:
    """Set to -inf, in place, the scores ``s`` ``[..., len(rows), len(cols)]``
    of keys a query row does not see: bottom-right causal, a sliding
    window (``window_visible``) and chunks (``chunk_visible``)."""
    if causal:
        s.masked_fill_(cols[None, None, :] > rows[None, :, None] + (seqlen_k - seqlen_q), -math.inf)
    if window is not None:
        s.masked_fill_(~window_visible(rows, cols, seqlen_q, seqlen_k, window)[None], -math.inf)
    if chunk:
        s.masked_fill_(~chunk_visible(rows, cols, seqlen_q, seqlen_k, chunk)[None], -math.inf)


def chunk_visible(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int,
                  chunk: int) -> torch.Tensor:
    """``[len(rows), len(cols)]`` boolean: FA3's ``attention_chunk``, query
    row ``r`` (key position ``a = r + seqlen_k - seqlen_q``) sees only the
    keys of its own chunk, ``floor(a / chunk) == floor(col / chunk)``."""
    pos = rows[:, None] + (seqlen_k - seqlen_q)
    return (torch.div(pos, chunk, rounding_mode="floor")
            == torch.div(cols[None, :], chunk, rounding_mode="floor"))


def window_visible(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int,
                   window: tuple[int, int]) -> torch.Tensor:
    """``[len(rows), len(cols)]`` boolean: query row sees key column under the
    sliding window ``(left, right)`` (-1 = no bound), bottom-right aligned."""
    left, right = window
    diag = rows[:, None] + (seqlen_k - seqlen_q)
    visible = torch.ones(rows.numel(), cols.numel(), dtype=torch.bool, device=cols.device)
    if left >= 0:
        visible &= cols[None, :] >= diag - left
    if right >= 0:
        visible &= cols[None, :] <= diag + right
    return visible


def _grads(fn, q, k, v, dout):
    """``(dq, dk, dv)`` of ``sum(fn(q, k, v) * dout)`` by autograd, on copies
    of the inputs; in the inputs' dtype."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        out = fn(*leaves)
        if not out.requires_grad:  # nothing to differentiate (e.g. no key at all: zeros)
            return tuple(torch.zeros_like(x) for x in leaves)
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves))


def attention_reference_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    rows=None,
    key_rows=None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact float64 ``(dq, dk, dv)`` (BSHD, shaped like q, k, v) of
    :func:`attention_reference`'s output for the output gradient ``dout``
    (``window``: a sliding window, as there).

    The textbook backward from the reference's own LSE:
    ``P = exp(S - lse)``, ``dV = P^T dO``, ``dP = dO V^T``,
    ``dS = P * (dP - rowsum(dO * O))`` (with ``rowsum(dO * O)`` as
    ``rowsum(P * dP)``, see ``_ds``), ``dQ = scale * dS K``,
    ``dK = scale * dS^T Q``; with GQA, dK and dV sum over the query heads
    that share a kv head. Rows that see no key contribute nothing. Chunked
    like the forward, so memory stays bounded (no autograd graph is kept).

    ``rows`` (query rows) and ``key_rows`` (key positions), 1-D indices,
    restrict dq to those query rows (``[batch, len(rows), nheads, headdim]``)
    and dk, dv to those keys (``[batch, len(key_rows), nheads_kv, headdim]``):
    how long problems are checked on a sample. Every key's gradient needs the
    LSE and ``rowsum(dO * O)`` of every query row, so the full forward still
    runs; the backward's products shrink to the sampled rows and keys.
    """
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    if dout.shape != q.shape[:3] + v.shape[3:]:
        raise ValueError(f"dout must have the output's shape {tuple(q.shape[:3] + v.shape[3:])} (q's, with v's head "
                         f"dim), got {tuple(dout.shape)}")
    if rows is not None or key_rows is not None:
        if softcap or chunk:
            raise NotImplementedError("sampled reference gradients with softcap or chunk")
        return _sampled_reference_grads(q, k, v, dout, causal, softmax_scale, rows, key_rows, window)
    f64 = torch.float64
    scale = _scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    device = q.device
    _, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                 softcap=softcap, chunk=chunk)
    qh, kh, vh, doh = (x.transpose(1, 2) for x in (q, k, v, dout))
    dq = torch.zeros(batch, nheads, seqlen_q, headdim, dtype=f64, device=device)
    dk = torch.zeros(batch, nheads_kv, seqlen_k, headdim, dtype=f64, device=device)
    dv = torch.zeros(batch, nheads_kv, seqlen_k, v.shape[3], dtype=f64, device=device)
    cols = torch.arange(seqlen_k, device=device)
    pairs = batch * nheads
    pairs_per_chunk, rows_per_chunk = _chunking(pairs, seqlen_q, seqlen_k, headdim)

    for p0 in range(0, pairs, pairs_per_chunk):
        pair = torch.arange(p0, min(p0 + pairs_per_chunk, pairs), device=device)
        b, h = pair // nheads, pair % nheads
        kc, vc = kh[b, h // group].to(f64), vh[b, h // group].to(f64)  # [pairs, Sk, D]
        dkc, dvc = torch.zeros_like(kc), torch.zeros_like(vc)
        for r0 in range(0, seqlen_q, rows_per_chunk):
            r = torch.arange(r0, min(r0 + rows_per_chunk, seqlen_q), device=device)
            idx = (b[:, None], h[:, None], r[None, :])
            qc, doc, row_lse = qh[idx].to(f64), doh[idx].to(f64), lse[idx]
            s = (qc @ kc.transpose(-1, -2)) * scale
            if softcap:
                t = torch.tanh(s / softcap)
                s = softcap * t
            _mask_scores(s, r, cols, seqlen_q, seqlen_k, causal, window, chunk)
            p = torch.exp(s - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
            dvc += p.transpose(-1, -2) @ doc
            ds = _ds(p, doc @ vc.transpose(-1, -2))
            if softcap:
                ds = ds * (1 - t * t)  # d(cap tanh(x / cap))/dx
            dq[idx] = (ds @ kc) * scale
            dkc += (ds.transpose(-1, -2) @ qc) * scale
        dk.index_put_((b, h // group), dkc, accumulate=True)
        dv.index_put_((b, h // group), dvc, accumulate=True)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _ds(p: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
    """``dS = P * (dP - delta)`` for whole rows of scores, with
    ``delta = rowsum(dO * O) = sum_j P_ij dP_ij`` (``O = P V``) taken from the
    row's own P and dP: a row that sees a single key (P = 1 there) gets
    dS = 0 exactly, as in exact arithmetic, instead of the last-bit
    difference of two differently ordered float64 sums. That zero matters
    to the judge: a reference row of 1e-16 would turn a kernel's 1e-6
    rounding there into a huge relative row error."""
    return p * (dp - (p * dp).sum(-1, keepdim=True))


def _sampled_reference_grads(q, k, v, dout, causal, softmax_scale, rows, key_rows, window=None):
    """:func:`attention_reference_grads` on sampled query rows (dq) and keys
    (dk, dv): one pass over the sampled rows against every key for dq, one
    pass over every row against the sampled keys for dk and dv."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = _check_inputs(q, k, v)
    f64 = torch.float64
    scale = _scale(softmax_scale, headdim)
    group = nheads // nheads_kv
    device = q.device
    row_idx = _row_index(rows, seqlen_q, device)
    key_idx = _row_index(key_rows, seqlen_k, device)
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window)
    qh, kh, vh, doh = (x.transpose(1, 2) for x in (q, k, v, dout))
    delta = (doh.to(f64) * out.transpose(1, 2)).sum(-1)  # [B, H, Sq]
    dq = torch.zeros(batch, nheads, row_idx.numel(), headdim, dtype=f64, device=device)
    dk = torch.zeros(batch, nheads_kv, key_idx.numel(), headdim, dtype=f64, device=device)
    dv = torch.zeros(batch, nheads_kv, key_idx.numel(), v.shape[3], dtype=f64, device=device)
    pairs = batch * nheads

    def probabilities(b, h, r, keys, kc):
        """P and the inputs of dS for query rows ``r`` against keys ``keys``."""
        idx = (b[:, None], h[:, None], r[None, :])
        qc, doc, row_lse = qh[idx].to(f64), doh[idx].to(f64), lse[idx]
        s = (qc @ kc.transpose(-1, -2)) * scale
        _mask_scores(s, r, keys, seqlen_q, seqlen_k, causal, window)
        p = torch.exp(s - torch.where(torch.isinf(row_lse), 0.0, row_lse)[..., None])
        return qc, doc, p, delta[idx][..., None]

    all_keys = torch.arange(seqlen_k, device=device)
    # dq on the sampled rows, against every key.
    pairs_per_chunk, rows_per_chunk = _chunking(pairs, row_idx.numel(), seqlen_k, headdim)
    for p0 in range(0, pairs, pairs_per_chunk):
        pair = torch.arange(p0, min(p0 + pairs_per_chunk, pairs), device=device)
        b, h = pair // nheads, pair % nheads
        kc, vc = kh[b, h // group].to(f64), vh[b, h // group].to(f64)
        for r0 in range(0, row_idx.numel(), rows_per_chunk):
            r = row_idx[r0:r0 + rows_per_chunk]
            _, doc, p, _ = probabilities(b, h, r, all_keys, kc)
            ds = _ds(p, doc @ vc.transpose(-1, -2))
            dq[b[:, None], h[:, None], torch.arange(r0, r0 + r.numel(), device=device)[None, :]] = (ds @ kc) * scale
    # dk, dv on the sampled keys, against every query row.
    pairs_per_chunk, rows_per_chunk = _chunking(pairs, seqlen_q, max(key_idx.numel(), 1), headdim)
    for p0 in range(0, pairs, pairs_per_chunk):
        pair = torch.arange(p0, min(p0 + pairs_per_chunk, pairs), device=device)
        b, h = pair // nheads, pair % nheads
        kc = kh[b[:, None], (h // group)[:, None], key_idx[None, :]].to(f64)  # [pairs, keys, D]
        vc = vh[b[:, None], (h // group)[:, None], key_idx[None, :]].to(f64)
        dkc, dvc = torch.zeros_like(kc), torch.zeros_like(vc)
        for r0 in range(0, seqlen_q, rows_per_chunk):
            r = torch.arange(r0, min(r0 + rows_per_chunk, seqlen_q), device=device)
            qc, doc, p, dlt = probabilities(b, h, r, key_idx, kc)
            dvc += p.transpose(-1, -2) @ doc
            ds = p * (doc @ vc.transpose(-1, -2) - dlt)
            dkc += (ds.transpose(-1, -2) @ qc) * scale
        dk.index_put_((b, h // group), dkc, accumulate=True)
        dv.index_put_((b, h // group), dvc, accumulate=True)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def attention_baseline_grads(q, k, v, dout, *, causal: bool = False, softmax_scale: float | None = None,
                             rows=None, key_rows=None, window: tuple[int, int] | None = None,
                             softcap: float = 0.0):
    """``(dq, dk, dv)`` of :func:`attention_baseline` (SDPA's backward on the
    same bf16/fp16 inputs), in the inputs' dtype: the baseline for judging a
    backward kernel's gradients. ``rows`` / ``key_rows`` select dq rows and
    dk/dv keys as in :func:`attention_reference_grads` (SDPA's backward
    itself always runs in full).

    Causal with ``seqlen_q > seqlen_k``: the first ``seqlen_q - seqlen_k``
    rows see no key (dq = 0, no contribution to dk/dv); SDPA runs on the
    other rows only, which with bottom-right alignment are the equal-length
    causal problem (cuDNN can take it, and no fully masked row can put a NaN
    into dk/dv through SDPA's backward). Where cuDNN's backward raises or its
    gradients are not finite the efficient/math backends are used instead.
    A sliding window bounded on the right (``window``) blinds the first
    ``seqlen_q - seqlen_k - right`` rows the same way; no other row of a
    window is blind (a row's leftmost key is never past the last key).
    """
    _, seqlen_q, seqlen_k, _, _, _ = _check_inputs(q, k, v)
    if dout.shape != q.shape[:3] + v.shape[3:]:
        raise ValueError(f"dout must have the output's shape {tuple(q.shape[:3] + v.shape[3:])} (q's, with v's head "
                         f"dim), got {tuple(dout.shape)}")
    if softcap:
        dq, dk, dv = softcap_eager_grads(q, k, v, dout, causal=causal, softmax_scale=softmax_scale, softcap=softcap,
                                         window=window)
        if rows is not None:
            dq = dq[:, _row_index(rows, seqlen_q, q.device)]
        if key_rows is not None:
            key_idx = _row_index(key_rows, seqlen_k, q.device)
            dk, dv = dk[:, key_idx], dv[:, key_idx]
        return dq, dk, dv
    blind = seqlen_q - seqlen_k if causal and seqlen_q > seqlen_k else 0
    if window is not None and window[1] >= 0:
        blind = max(blind, seqlen_q - seqlen_k - window[1])
    if blind >= seqlen_q:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def fn(use_cudnn):
        return lambda q, k, v: attention_baseline(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                                  cudnn=use_cudnn, window=window, softcap=softcap)

    try:
        grads = _grads(fn(True), q[:, blind:], k, v, dout[:, blind:])
    except RuntimeError:  # cuDNN ran the forward but declined the backward (head dim, version)
        grads = None
    if grads is None or not all(bool(torch.isfinite(g).all()) for g in grads):
        grads = _grads(fn(False), q[:, blind:], k, v, dout[:, blind:])
    dq, dk, dv = grads
    if blind:
        dq = torch.cat([torch.zeros_like(q[:, :blind]), dq], dim=1)
    if rows is not None:
        dq = dq[:, _row_index(rows, seqlen_q, q.device)]
    if key_rows is not None:
        key_idx = _row_index(key_rows, seqlen_k, q.device)
        dk, dv = dk[:, key_idx], dv[:, key_idx]
    return dq, dk, dv


# --------------------------------------------------------------------------
# The judge
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """One judged value. ``bool(verdict)`` is ``verdict.ok``; ``message`` is
    one line naming the value, its errors, the limits and the baseline's
    errors (and on failure where the worst element is). A verdict on
    non-finite positions leaves the numbers NaN. For :func:`judge_lse`,
    ``rel_fro``/``rel_fro_limit`` hold the worst relative LSE error and its
    bound, ``max_abs`` the worst absolute one."""

    name: str
    ok: bool
    message: str
    rel_fro: float = math.nan
    max_abs: float = math.nan
    row_rel: float = math.nan
    rel_fro_limit: float = math.nan
    max_abs_limit: float = math.nan
    row_rel_limit: float = math.nan
    baseline_rel_fro: float = math.nan
    baseline_max_abs: float = math.nan
    baseline_row_rel: float = math.nan

    def __bool__(self) -> bool:
        return self.ok


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def _nonfinite_mismatch(name: str, value: torch.Tensor, reference: torch.Tensor) -> str | None:
    """A message if value's NaN/+inf/-inf positions differ from the reference's."""
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        got, want = test(value), test(reference)
        if not torch.equal(got, want):
            wrong = (got != want).nonzero()
            return (f"{name}: FAIL: {what} at {int((got & ~want).sum())} positions where the reference has none "
                    f"and missing at {int((want & ~got).sum())} where it has; first at index "
                    f"{tuple(wrong[0].tolist())}")
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a matrix of its vectors along the last dimension."""
    return x.reshape(-1, x.shape[-1]) if x.dim() and x.numel() else x.reshape(-1, 1)


def _errors(x: torch.Tensor, ref: torch.Tensor, ref_norm: float, ref_row_norm: torch.Tensor,
            row_abs_tol: float | None = None):
    """(rel_fro, max_abs, row_rel) of float64 ``x`` against ``ref`` (same
    shape). Rows whose largest error is at most ``row_abs_tol`` do not count
    in row_rel."""
    if x.numel() == 0:
        return 0.0, 0.0, 0.0
    diff = x - ref
    err_norm = float(torch.linalg.vector_norm(diff))
    rel = err_norm / ref_norm if ref_norm else (0.0 if err_norm == 0 else math.inf)
    rows = ref_row_norm > 0
    if row_abs_tol is not None:
        rows &= _rows(diff).abs().amax(dim=-1) > row_abs_tol
    row_err = torch.linalg.vector_norm(_rows(diff), dim=-1)
    row_rel = float((row_err[rows] / ref_row_norm[rows]).max()) if rows.any() else 0.0
    return rel, float(diff.abs().max()), row_rel


def judge(
    name: str,
    value: torch.Tensor,
    reference: torch.Tensor,
    baseline: torch.Tensor,
    *,
    factor: float = JUDGE_FACTOR,
    rel_floor: float | None = None,
    abs_floor: float | None = None,
    abs_tol: float | None = None,
) -> Verdict:
    """Judge ``value`` against ``reference`` relative to ``baseline``'s error.

    All three have the same shape (no broadcasting: a ``ValueError``
    otherwise); pass the raw outputs (the floors follow their dtypes).
    Passes iff

    * ``value`` has NaN, +inf and -inf exactly where ``reference`` has them
      (so an unwritten NaN-poisoned element always fails); the rest is
      judged where the reference is finite, where ``baseline`` must be finite
      too (``ValueError`` otherwise: a broken baseline would pass anything);
    * ``rel_fro(value) <= factor * rel_fro(baseline) + rel_floor``, with
      ``rel_fro(x) = ||x - ref||_F / ||ref||_F``;
    * ``max_abs(value) <= factor * max_abs(baseline) + abs_floor``, with
      ``max_abs(x) = max |x - ref|``;
    * ``row_rel(value) <= factor * row_rel(baseline) + rel_floor``, with
      ``row_rel(x)`` the largest ``||x_r - ref_r|| / ||ref_r||`` over the
      vectors ``r`` along the last dimension (an output row of one head; rows
      where the reference is 0 count in max_abs only). Outputs of long causal
      rows are small (~1/sqrt(keys)), so a wrong row there hides in the two
      global measures but not in this one.

    The floors only matter where the baseline is (nearly) exact, e.g. rows
    that see a single key: ``rel_floor`` defaults to a quarter of the unit
    roundoff of the coarser of value's and baseline's dtypes (bf16: 9.8e-4,
    fp16: 1.2e-4), ``abs_floor`` to ``rel_floor * max |reference|``.
    Errors are computed in float64 on the value's device.

    ``abs_tol`` (off by default): a value with the reference's non-finite
    pattern whose ``max_abs`` is at most ``abs_tol`` passes whatever its
    relative errors. For values whose exact result is (nearly) 0 while the
    terms behind it are not, e.g. dQ and dK of a row that sees a single key
    (``dS = P * (dP - rowsum(dO * O)) = 0`` exactly, computed as a difference
    of two rounded dot products): relative errors mean nothing there. The
    same holds row by row: a row whose every error is at most ``abs_tol``
    does not count in row_rel (of the value, or of the baseline). E.g. dK of
    the last key of a long causal row: one query sees it, with P ~ 1e-4, and
    ``dP - rowsum(dO * O)`` cancels, so its exact norm is ~1e-6 against ~1
    for other keys, and the bf16 rounding of O (which every flash backward
    reads to form ``rowsum(dO * O)``) moves it by several percent: an error
    of ~1e-7 that is noise at the gradient's scale.
    """
    if not (value.shape == reference.shape == baseline.shape):
        raise ValueError(f"{name}: shapes differ: value {tuple(value.shape)}, reference {tuple(reference.shape)}, "
                         f"baseline {tuple(baseline.shape)}")
    device = value.device
    value = value.detach()
    reference, baseline = reference.detach().to(device), baseline.detach().to(device)
    mismatch = _nonfinite_mismatch(name, value, reference)
    if mismatch:
        return Verdict(name, False, mismatch)
    finite = torch.isfinite(reference)
    # Non-finite reference positions (matched above) are set to 0 in all three: no error there.
    ref, val, base = (torch.where(finite, x.detach().double(), 0.0) for x in (reference, value, baseline))
    if not torch.isfinite(base).all():
        raise ValueError(f"{name}: the baseline is not finite where the reference is "
                         f"({int((~torch.isfinite(base)).sum())} elements): it cannot set a tolerance")
    if rel_floor is None:
        rel_floor = max(_unit_roundoff(value.dtype), _unit_roundoff(baseline.dtype)) / 4
    ref_max = float(ref.abs().max()) if ref.numel() else 0.0
    if abs_floor is None:
        abs_floor = rel_floor * ref_max
    ref_norm = float(torch.linalg.vector_norm(ref))
    ref_row_norm = torch.linalg.vector_norm(_rows(ref), dim=-1)

    rel, mab, row = _errors(val, ref, ref_norm, ref_row_norm, abs_tol)
    base_rel, base_mab, base_row = _errors(base, ref, ref_norm, ref_row_norm, abs_tol)
    rel_limit = factor * base_rel + rel_floor
    abs_limit = factor * base_mab + abs_floor
    row_limit = factor * base_row + rel_floor
    ok = rel <= rel_limit and mab <= abs_limit and row <= row_limit
    within_abs_tol = not ok and abs_tol is not None and mab <= abs_tol
    ok = ok or within_abs_tol
    message = (f"{name}: {'ok' if ok else 'FAIL'}: rel_fro {rel:.3e} (limit {rel_limit:.3e} = {factor:g} x baseline "
               f"{base_rel:.3e} + {rel_floor:.1e}), max_abs {mab:.3e} (limit {abs_limit:.3e} = {factor:g} x "
               f"baseline {base_mab:.3e} + {abs_floor:.1e}), row_rel {row:.3e} (limit {row_limit:.3e} = "
               f"{factor:g} x baseline {base_row:.3e} + {rel_floor:.1e})")
    if within_abs_tol:
        message += f"; passes on max_abs <= abs_tol {abs_tol:.1e}"
    if not ok:
        where = torch.unravel_index((val - ref).abs().argmax(), ref.shape) if ref.dim() else ()
        where = tuple(int(i) for i in where)
        message += (f"; largest error at index {where}: {float(value[where]):.6g} vs "
                    f"reference {float(reference[where]):.6g}")
        if row > row_limit:
            row_err = torch.linalg.vector_norm(_rows(val - ref), dim=-1)
            counted = ref_row_norm > 0
            if abs_tol is not None:
                counted &= _rows(val - ref).abs().amax(dim=-1) > abs_tol
            worst = int(torch.where(counted, row_err / ref_row_norm.clamp_min(1e-300), 0.0).argmax())
            worst_row = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ref.shape[:-1]))
            message += f"; worst row (index without the last dim) {worst_row}"
    if within_abs_tol:
        abs_limit = abs_tol  # the limit that let it pass
    return Verdict(name, ok, message, rel, mab, row, rel_limit, abs_limit, row_limit, base_rel, base_mab, base_row)


def score_scale(q: torch.Tensor, k: torch.Tensor, *, softmax_scale: float | None = None, rows=None) -> torch.Tensor:
    """``softmax_scale * ||q_i|| * max_j ||k_j||`` per (batch, head, query row),
    ``[batch, nheads, len(rows)]`` float64: a bound (Cauchy-Schwarz) on the
    sum of ``|q_i[d] k_j[d]|`` behind any score of row ``i``. A score that
    cancels to ~0 still carries fp32 rounding of that size, so it is the
    scale of the LSE's absolute error where ``|lse|`` itself is small."""
    batch, seqlen_q, _, nheads, nheads_kv, headdim = _check_inputs(q, k, k)
    row_idx = _row_index(rows, seqlen_q, q.device)
    q_norm = torch.linalg.vector_norm(q[:, row_idx].double(), dim=-1).transpose(1, 2)  # [B, H, rows]
    k_norm = torch.linalg.vector_norm(k.double(), dim=-1).amax(dim=1) if k.shape[1] else k.new_zeros(
        batch, nheads_kv, dtype=torch.float64)  # [B, Hkv]
    k_norm = k_norm.repeat_interleave(nheads // nheads_kv, dim=1)
    return _scale(softmax_scale, headdim) * q_norm * k_norm[:, :, None]


def judge_lse(name: str, lse: torch.Tensor, reference: torch.Tensor, *, score_scale: torch.Tensor | None = None,
              rel_tol: float = LSE_REL_TOL) -> Verdict:
    """The log-sum-exp against the reference's: the same NaN/±inf positions,
    and ``|lse - ref| <= rel_tol * max(1, |ref|, score_scale)`` everywhere
    else. Pass ``score_scale`` (:func:`score_scale` of the inputs, same
    shape as ``lse``) whenever scores can cancel to near 0 while their terms
    are large (a row that sees one key, large inputs): without it a small
    ``|lse|`` gets a bound below fp32 rounding of the dot product."""
    if lse.shape != reference.shape or (score_scale is not None and score_scale.shape != lse.shape):
        raise ValueError(f"{name}: shapes differ: {tuple(lse.shape)} vs reference {tuple(reference.shape)}"
                         + ("" if score_scale is None else f" and score_scale {tuple(score_scale.shape)}"))
    reference = reference.detach().to(lse.device)
    mismatch = _nonfinite_mismatch(name, lse, reference)
    if mismatch:
        return Verdict(name, False, mismatch)
    finite = torch.isfinite(reference)
    err = (lse.detach()[finite].double() - reference[finite].double()).abs()
    bound = reference[finite].double().abs().clamp_min(1.0)
    if score_scale is not None:
        bound = torch.maximum(bound, score_scale.detach().to(lse.device)[finite].double())
    worst = float((err / bound).max()) if err.numel() else 0.0
    ok = worst <= rel_tol
    message = (f"{name}: {'ok' if ok else 'FAIL'}: max |lse - ref| / max(1, |ref|"
               f"{'' if score_scale is None else ', score_scale'}) = {worst:.3e} (limit {rel_tol:.1e})")
    if not ok:
        where = torch.nonzero(finite)[int((err / bound).argmax())]
        message += (f"; worst at index {tuple(where.tolist())}: {float(lse[tuple(where)]):.8g} vs "
                    f"reference {float(reference[tuple(where)]):.8g}")
    return Verdict(name, ok, message, rel_fro=worst, max_abs=float(err.max()) if err.numel() else 0.0,
                   rel_fro_limit=rel_tol)


def assert_judged(name: str, value: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor | None = None,
                  **kwargs) -> Verdict:
    """:func:`judge` (or :func:`judge_lse` when ``baseline`` is None) that
    raises ``AssertionError(verdict.message)`` on failure."""
    verdict = judge_lse(name, value, reference, **kwargs) if baseline is None else judge(
        name, value, reference, baseline, **kwargs)
    if not verdict:
        raise AssertionError(verdict.message)
    return verdict


def check_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    softmax_scale: float | None = None, lse: torch.Tensor | None = None,
                    name: str = "out", window: tuple[int, int] | None = None,
                    softcap: float = 0.0) -> list[Verdict]:
    """Verdicts on a forward's ``out`` (and ``lse``, when given) for the
    problem ``(q, k, v, causal, softmax_scale)``: :func:`judge` against the
    float64 reference and :func:`attention_baseline`, :func:`judge_lse` with
    :func:`score_scale`. ``all(verdicts)`` is the pass."""
    ref, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                       softcap=softcap)
    baseline = attention_baseline(q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
                                  softcap=softcap)
    verdicts = [judge(name, out, ref, baseline)]
    if lse is not None:
        if lse.dtype != torch.float32 or lse.shape != ref_lse.shape:
            verdicts.append(Verdict(f"{name} lse", False, f"{name} lse: FAIL: {lse.dtype} {tuple(lse.shape)}, "
                                    f"expected float32 {tuple(ref_lse.shape)}"))
        else:
            verdicts.append(judge_lse(f"{name} lse", lse, ref_lse,
                                      score_scale=score_scale(q, k, softmax_scale=softmax_scale)))
    return verdicts


def check_kvcache(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens, *,
                  causal: bool, rows=None, softmax_scale: float | None = None,
                  lse: torch.Tensor | None = None, window: tuple[int, int] | None = None,
                  softcap: float = 0.0, starts=None) -> list[Verdict]:
    """Verdicts on a KV-cache attention's ``out`` ``[B, Sq, H, D]`` (and its
    ``lse``): batch row ``b`` attends to the first ``lens[b]`` keys of cache
    row ``rows[b]`` (default ``b``) of a contiguous ``[B_cache, S_cache, Hkv,
    D]`` cache, bottom-right causal against that length. With ``starts``
    (flash-attn's ``cache_leftpad``) its keys are ``starts[b] .. lens[b] -
    1`` instead, the mask counted against ``lens[b] - starts[b]``. Each row is
    judged by :func:`check_attention` over its live keys alone, so whatever
    lies outside them (NaN in the tests) has no part in the reference. A row
    with no live key must be exactly 0 with an LSE of -inf."""
    verdicts = []
    for b, end in enumerate(int(x) for x in lens):
        start = 0 if starts is None else int(starts[b])
        length = end - start
        r = b if rows is None else int(rows[b])
        row_lse = None if lse is None else lse[b:b + 1]
        name = f"row {b} (len {length})"
        if length == 0:
            ok = bool((out[b] == 0).all()) and (row_lse is None or bool((row_lse == -math.inf).all()))
            verdicts.append(Verdict(name, ok, f"{name}: {'ok' if ok else 'FAIL: not 0 / -inf'} (no live key)"))
            continue
        verdicts += check_attention(out[b:b + 1], q[b:b + 1], k_cache[r:r + 1, start:end],
                                    v_cache[r:r + 1, start:end], causal=causal, softmax_scale=softmax_scale, lse=row_lse, name=name,
                                    window=window, softcap=softcap)
    return verdicts


GRAD_NAMES = ("dq", "dk", "dv")


def grads_abs_tol(reference_grads, dtype: torch.dtype) -> float:
    """The absolute tolerance for gradients (``judge``'s ``abs_tol``): a
    quarter of ``dtype``'s unit roundoff times the largest exact gradient
    element of dq, dk and dv together (bf16: ~1e-3 x that). dq and dk of a
    single-key row are exactly 0, so their own size cannot set the scale."""
    biggest = max((float(g.detach().abs().max()) for g in reference_grads if g.numel()), default=0.0)
    return _unit_roundoff(dtype) / 4 * biggest


def check_attention_grads(grads, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                          causal: bool, softmax_scale: float | None = None, rows=None, key_rows=None,
                          names: tuple[str, str, str] = GRAD_NAMES,
                          window: tuple[int, int] | None = None, softcap: float = 0.0) -> list[Verdict]:
    """Verdicts on a backward's ``grads = (dq, dk, dv)`` (full BSHD tensors,
    shaped like q, k, v) for the problem and the output gradient ``dout``:
    each :func:`judge`'d against :func:`attention_reference_grads` relative
    to :func:`attention_baseline_grads` (SDPA's backward: cuDNN where it
    expresses the problem) at the default factor 2, with
    :func:`grads_abs_tol` as the absolute floor. ``rows`` / ``key_rows``
    restrict the check of dq / of dk and dv to sampled query rows / keys; a
    non-finite element anywhere (sampled or not) fails. ``all(verdicts)``
    is the pass."""
    ref = attention_reference_grads(q, k, v, dout, causal=causal, softmax_scale=softmax_scale, rows=rows,
                                    key_rows=key_rows, window=window, softcap=softcap)
    base = attention_baseline_grads(q, k, v, dout, causal=causal, softmax_scale=softmax_scale, rows=rows,
                                    key_rows=key_rows, window=window, softcap=softcap)
    return judge_grads(grads, ref, base, shapes=(q.shape, k.shape, v.shape), rows=rows, key_rows=key_rows,
                       abs_tol=grads_abs_tol(ref, q.dtype), names=names)


def judge_grads(grads, reference_grads, baseline_grads, *, shapes, rows=None, key_rows=None,
                abs_tol: float | None = None, names: tuple[str, str, str] = GRAD_NAMES) -> list[Verdict]:
    """The judging half of :func:`check_attention_grads`, for callers that
    judge many backends against one reference (the bench): ``grads`` full
    (shaped ``shapes``: q's, k's, v's), ``reference_grads`` and
    ``baseline_grads`` on the sampled ``rows`` (dq) / ``key_rows`` (dk, dv)
    when those are given."""
    verdicts = []
    for i, (name, g, r, b, shape) in enumerate(zip(names, grads, reference_grads, baseline_grads, shapes)):
        idx = rows if i == 0 else key_rows
        if tuple(g.shape) != tuple(shape):
            verdicts.append(Verdict(name, False, f"{name}: FAIL: shape {tuple(g.shape)}, expected {tuple(shape)}"))
            continue
        if not bool(torch.isfinite(g).all()):
            bad = int((~torch.isfinite(g)).sum())
            verdicts.append(Verdict(name, False, f"{name}: FAIL: {bad} non-finite elements (gradients are "
                                    f"finite everywhere)"))
            continue
        if idx is not None:
            g = g[:, _row_index(idx, shape[1], g.device)]
        verdicts.append(judge(name, g, r, b, abs_tol=abs_tol))
    return verdicts


def random_qkv(batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_kv: int, head_dim: int, *,
               dtype: torch.dtype = torch.bfloat16, seed: int = 0, device="cuda", magnitude: float = 1.0):
    """Fresh standard-normal q, k, v (BSHD, times ``magnitude``) from a seeded
    generator on ``device``: never zeros or ones, on which a kernel that
    ignores the mask or the softmax can still match."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(seqlen, heads):
        return (torch.randn(batch, seqlen, heads, head_dim, generator=gen, device=device) * magnitude).to(dtype)

    return rnd(seqlen_q, nheads), rnd(seqlen_k, nheads_kv), rnd(seqlen_k, nheads_kv)


def paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, *, seed: int = 0,
                fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous caches ``[B, cap, Hkv, D]`` as page pools ``[B * pages,
    page_size, Hkv, D]`` in a seeded random order, and the int32 page table
    ``[B, pages]`` that reads each row back: ``(k_pages, v_pages, table)``,
    for a paged call on the same keys as a contiguous one. Keys past ``cap``
    in a row's last page hold ``fill`` (NaN: a kernel that reads past a
    row's length poisons its output)."""
    batch, cap = k_cache.shape[:2]
    pages = -(-cap // page_size)
    gen = torch.Generator(device=k_cache.device).manual_seed(seed)
    perm = torch.randperm(batch * pages, generator=gen, device=k_cache.device)
    pools = []
    for cache in (k_cache, v_cache):
        rows = torch.full((batch, pages * page_size, *cache.shape[2:]), fill, dtype=cache.dtype,
                          device=cache.device)
        rows[:, :cap] = cache
        pool = torch.empty((batch * pages, page_size, *cache.shape[2:]), dtype=cache.dtype, device=cache.device)
        pool[perm] = rows.view(batch * pages, page_size, *cache.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], perm.view(batch, pages).to(torch.int32)


@dataclass(frozen=True)
class Problem:
    """One attention problem: what a test, a fuzz example or a sanitizer case
    draws inputs for and checks."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    head_dim: int
    causal: bool = False
    dtype: torch.dtype = torch.bfloat16
    softmax_scale: float | None = None

    def inputs(self, seed: int = 0, device="cuda", magnitude: float = 1.0):
        """Fresh random q, k, v (:func:`random_qkv`)."""
        return random_qkv(self.batch, self.seqlen_q, self.seqlen_k, self.nheads, self.nheads_kv, self.head_dim,
                          dtype=self.dtype, seed=seed, device=device, magnitude=magnitude)

    def check(self, out, q, k, v, lse=None, name: str = "out") -> list[Verdict]:
        """:func:`check_attention` of this problem's output."""
        return check_attention(out, q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, lse=lse,
                               name=name)

    def check_grads(self, grads, q, k, v, dout) -> list[Verdict]:
        """:func:`check_attention_grads` of this problem's ``(dq, dk, dv)``."""
        return check_attention_grads(grads, q, k, v, dout, causal=self.causal, softmax_scale=self.softmax_scale)


# --------------------------------------------------------------------------
# Plain error measures
# --------------------------------------------------------------------------

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


# --------------------------------------------------------------------------
# Variable-length (THD) batches: the same references, sequence by sequence
# --------------------------------------------------------------------------

def varlen_spans(cu_seqlens: torch.Tensor, seqused: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """``(start, live length)`` of every sequence, read on the host (tests only)."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    used = None if seqused is None else [int(x) for x in seqused.tolist()]
    return [(cu[b], used[b] if used is not None else cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]


def varlen_apply(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_q=None, seqused_k=None, out_dtype=None,
                 with_lse=False):
    """Run ``fn(q_b, k_b, v_b)`` (BSHD, batch 1) -> ``out_b`` or
    ``(out_b, lse_b)`` on each sequence's live rows of the THD tensors and
    assemble ``[total_q, H, Dv]`` (zeros outside live rows) and, with
    ``with_lse``, ``[H, total_q]`` (-inf outside)."""
    total_q, nheads, _ = q.shape
    out = torch.zeros(total_q, nheads, v.shape[-1], dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.full((nheads, total_q), -math.inf, dtype=torch.float64, device=q.device) if with_lse else None
    for (qs, lq), (ks, lk) in zip(varlen_spans(cu_seqlens_q, seqused_q), varlen_spans(cu_seqlens_k, seqused_k)):
        if lq == 0:
            continue
        res = fn(q[qs:qs + lq][None], k[ks:ks + lk][None], v[ks:ks + lk][None])
        o, lb = res if with_lse else (res, None)
        out[qs:qs + lq] = o[0].to(out.dtype)
        if with_lse:
            lse[:, qs:qs + lq] = lb[0].to(lse.dtype)
    return (out, lse) if with_lse else out


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_q=None, seqused_k=None, causal=False,
                     softmax_scale=None, window=None, softcap=0.0, chunk=0):
    """float64 ``(out [total_q, H, D], lse [H, total_q])`` of a varlen batch:
    :func:`attention_reference` per sequence (bottom-right causal per
    sequence), zeros and -inf outside the live rows."""
    return varlen_apply(lambda a, b, c: attention_reference(a, b, c, causal=causal, softmax_scale=softmax_scale,
                                                            window=window, softcap=softcap, chunk=chunk),
                        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
                        out_dtype=torch.float64, with_lse=True)


def varlen_baseline(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_q=None, seqused_k=None, causal=False,
                    softmax_scale=None, window=None, softcap=0.0, chunk=0):
    """:func:`attention_baseline` per sequence (q's dtype), zeros outside."""
    return varlen_apply(lambda a, b, c: attention_baseline(a, b, c, causal=causal, softmax_scale=softmax_scale,
                                                           window=window, softcap=softcap, chunk=chunk),
                        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k)


def varlen_grads(grads_fn, q, k, v, dout, cu_seqlens_q, cu_seqlens_k, *, seqused_q=None, seqused_k=None,
                 out_dtype=None):
    """``(dq, dk, dv)`` THD from ``grads_fn(q_b, k_b, v_b, dout_b)`` per
    sequence; zero outside the live rows."""
    dq = torch.zeros(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=out_dtype or k.dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=out_dtype or v.dtype, device=v.device)
    for (qs, lq), (ks, lk) in zip(varlen_spans(cu_seqlens_q, seqused_q), varlen_spans(cu_seqlens_k, seqused_k)):
        if lq == 0 or lk == 0:
            continue
        g = grads_fn(q[qs:qs + lq][None], k[ks:ks + lk][None], v[ks:ks + lk][None], dout[qs:qs + lq][None])
        dq[qs:qs + lq] = g[0][0].to(dq.dtype)
        dk[ks:ks + lk] = g[1][0].to(dk.dtype)
        dv[ks:ks + lk] = g[2][0].to(dv.dtype)
    return dq, dk, dv
