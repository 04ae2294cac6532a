"""The float32 reference every timed result is checked against.

The reference is PyTorch's math SDPA on float32 copies of the very inputs the
backends got, with an explicit bottom-right causal mask. The math backend
materializes the score matrix, which at S=32768 would be 137 GB per batch
entry, so:

* queries up to FULL_CHECK_MAX_SEQLEN: every row is checked;
* longer: a stratified sample of rows, two random rows from every 64-row
  block plus the first and last row. Every query tile of every (batch, head)
  of a kernel with 64-row or larger tiles is thus exercised, which is where
  indexing bugs live, at a fraction of the cost.

Work is chunked over heads so the score matrix stays under ~1 GB.
Rows with no visible key (causal with seqlen_q > seqlen_k) are 0 in the
reference, flash-attn's convention.
"""

from __future__ import annotations

from dataclasses import dataclass

from .configs import Config

FULL_CHECK_MAX_SEQLEN = 4096
SAMPLE_BLOCK = 64
SAMPLES_PER_BLOCK = 2
MAX_SCORE_ELEMENTS = 1 << 28  # float32 scores per chunk (1 GB)

# Max-abs error tolerance against the float32 reference. Outputs of randn
# inputs are O(1); bf16 keeps 8 bits, so rounding the output alone costs up
# to ~1e-2 on large values.
TOLERANCE = {"bf16": 2e-2, "fp16": 2e-2}


@dataclass
class Reference:
    rows: "object"  # LongTensor of checked query rows
    out: "object"  # float32 [B, len(rows), H, D]

    @property
    def num_rows(self) -> int:
        return int(self.rows.numel())


def check_rows(seqlen_q: int, device, seed: int = 0):
    import torch

    if seqlen_q <= FULL_CHECK_MAX_SEQLEN:
        return torch.arange(seqlen_q, device=device)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.arange(0, seqlen_q, SAMPLE_BLOCK)
    sizes = (seqlen_q - starts).clamp(max=SAMPLE_BLOCK)
    picks = [
        starts + (torch.rand(len(starts), generator=gen) * sizes).long() for _ in range(SAMPLES_PER_BLOCK)
    ]
    rows = torch.cat([torch.tensor([0, seqlen_q - 1]), *picks]).unique()  # unique() also sorts
    return rows.to(device)


def compute_reference(cfg: Config, q, k, v, scale: float) -> Reference:
    """float32 attention of q[:, rows] against all of k, v (BSHD inputs)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sq, sk = cfg.seqlen_q, cfg.seqlen_kv
    rows = check_rows(sq, q.device)
    group = cfg.heads // cfg.nheads_kv
    mask = None
    if cfg.causal:
        kv_idx = torch.arange(sk, device=q.device)
        mask = kv_idx[None, :] <= rows[:, None] + (sk - sq)  # True = attend
    heads_per_chunk = max(1, MAX_SCORE_ELEMENTS // (len(rows) * sk))
    out = torch.empty(cfg.batch, len(rows), cfg.heads, cfg.headdim, dtype=torch.float32, device=q.device)

    # TF32 would make the "float32" reference only ~10 bits accurate.
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with sdpa_kernel(SDPBackend.MATH):
            for b in range(cfg.batch):
                for h0 in range(0, cfg.heads, heads_per_chunk):
                    h1 = min(cfg.heads, h0 + heads_per_chunk)
                    qc = q[b, rows, h0:h1].transpose(0, 1).float()  # [hc, rows, D]
                    # Query head h reads kv head h // group (GQA).
                    kv_heads = torch.arange(h0, h1, device=q.device) // group
                    kc = k[b][:, kv_heads].transpose(0, 1).float()
                    vc = v[b][:, kv_heads].transpose(0, 1).float()
                    o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale)
                    out[b, :, h0:h1] = o.transpose(0, 1)
    finally:
        torch.set_float32_matmul_precision(precision)
    if mask is not None:
        out[:, ~mask.any(dim=1)] = 0.0
    return Reference(rows, out)


def max_abs_error(out, ref: Reference) -> float:
    """Max |out - ref| over the checked rows, or NaN if the output has a
    non-finite value anywhere (checked on all rows: it is cheap)."""
    import torch

    if not bool(torch.isfinite(out).all()):
        return float("nan")
    return float((out[:, ref.rows].float() - ref.out).abs().max())
