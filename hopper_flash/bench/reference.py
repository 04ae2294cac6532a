"""How the bench checks every timed output and gradient: the package's float64 reference
and judge (``hopper_flash.reference``) on the checked query rows.

* queries up to FULL_CHECK_MAX_SEQLEN: every row is checked;
* longer: a stratified sample of rows, two random rows from every 64-row
  block plus the first and last row. Every query tile of every (batch, head)
  of a kernel with 64-row or larger tiles is thus exercised, which is where
  indexing bugs live, at a fraction of the cost.

An output passes when it is finite everywhere (checked on all rows: it is
cheap) and, on the checked rows, within the judge's bounds: at most twice
the error of PyTorch SDPA's cuDNN backend (or its efficient/math backends
where cuDNN cannot express the config) on the same inputs, in relative
Frobenius norm and in max-abs error, plus a small floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .configs import Config

FULL_CHECK_MAX_SEQLEN = 4096
SAMPLE_BLOCK = 64
SAMPLES_PER_BLOCK = 2


@dataclass
class Reference:
    rows: "object"  # LongTensor of checked query rows
    out: "object"  # float64 reference [B, len(rows), H, D]
    baseline: "object"  # SDPA's output on the same rows, input dtype

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
    """The float64 reference and SDPA's baseline on the checked rows (BSHD inputs)."""
    from hopper_flash.reference import attention_baseline, attention_reference

    rows = check_rows(cfg.seqlen_q, q.device)
    window = cfg.window_bounds
    out, _ = attention_reference(q, k, v, causal=cfg.causal, softmax_scale=scale, rows=rows, window=window)
    baseline = attention_baseline(q, k, v, causal=cfg.causal, softmax_scale=scale, rows=rows, window=window)
    return Reference(rows, out, baseline)


def judge_output(out, ref: Reference):
    """The judge's ``Verdict`` for a backend's output (all rows: BSHD)."""
    import torch

    from hopper_flash.reference import Verdict, judge

    if not bool(torch.isfinite(out).all()):
        return Verdict("output", False, "non-finite values in output", max_abs=math.nan, rel_fro=math.nan)
    return judge("output", out[:, ref.rows], ref.out, ref.baseline)


@dataclass
class GradReference:
    """The float64 reference gradients and SDPA's on the checked query rows
    (dq) and keys (dk, dv); ``rows`` / ``key_rows`` are None where every row
    is checked."""

    rows: "object"
    key_rows: "object"
    grads: tuple  # float64 (dq, dk, dv) on the checked rows / keys
    baseline: tuple  # SDPA's backward, input dtype, same rows / keys
    abs_tol: float
    shapes: tuple  # q's, k's and v's shapes (what a backend's grads must have)

    @property
    def num_rows(self) -> int:
        return int(self.grads[0].shape[1])


def make_grad_out(cfg: Config, device: str, seed: int = 1):
    """The fixed output gradient every backend's backward gets: standard
    normal, the output's shape (q's, with v's head dim) and q's dtype, from
    its own seeded generator."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    return torch.randn(cfg.batch, cfg.seqlen_q, cfg.heads, cfg.head_dim_v, generator=gen, device=device).to(dtype)


def compute_grad_reference(cfg: Config, q, k, v, dout, scale: float) -> GradReference:
    """Reference and baseline gradients (``hopper_flash.reference``) on the
    checked rows: all of them up to FULL_CHECK_MAX_SEQLEN, else the same
    stratified sample as the outputs', for query rows (dq) and for keys
    (dk, dv; every key's gradient still sums over every query row)."""
    from hopper_flash.reference import attention_baseline_grads, attention_reference_grads, grads_abs_tol

    def sample(n: int, seed: int):
        return None if n <= FULL_CHECK_MAX_SEQLEN else check_rows(n, q.device, seed)

    rows, key_rows = sample(cfg.seqlen_q, 0), sample(cfg.seqlen_kv, 1)
    kw = dict(causal=cfg.causal, softmax_scale=scale, rows=rows, key_rows=key_rows, window=cfg.window_bounds)
    grads = attention_reference_grads(q, k, v, dout, **kw)
    baseline = attention_baseline_grads(q, k, v, dout, **kw)
    return GradReference(rows, key_rows, grads, baseline, grads_abs_tol(grads, q.dtype),
                         (tuple(q.shape), tuple(k.shape), tuple(v.shape)))


def judge_grads(grads, ref: GradReference):
    """The judge's verdicts on a backend's ``(dq, dk, dv)`` (full BSHD)."""
    from hopper_flash.reference import judge_grads as judge_all

    return judge_all(grads, ref.grads, ref.baseline, shapes=ref.shapes, rows=ref.rows, key_rows=ref.key_rows,
                     abs_tol=ref.abs_tol)
