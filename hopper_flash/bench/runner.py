"""Runs every (config, backend) cell: same random inputs for all backends of
a config, a correctness check of each output against the float64 reference
(judged relative to SDPA's error, see ``reference.py``), then timing.

The backends and the timer are parameters so that tests can drive the whole
loop on the CPU with fakes.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .backends import CUDNN, Backend, Unsupported
from .configs import Config, attention_flops, kv_bytes
from .reference import compute_reference, judge_output
from .results import ERROR, FAIL, OK, UNAVAILABLE, UNSUPPORTED, Result
from .timing import Timer

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

# Called before each cell with (config, backend name), e.g. to move a progress bar.
StepHook = Callable[[Config, str], None]


def make_inputs(cfg: Config, device: str, seed: int = 0):
    """Fresh standard-normal q, k, v in BSHD (``hopper_flash.reference.random_qkv``)."""
    import torch

    from hopper_flash.reference import random_qkv

    return random_qkv(cfg.batch, cfg.seqlen_q, cfg.seqlen_kv, cfg.heads, cfg.nheads_kv, cfg.headdim,
                      dtype=getattr(torch, TORCH_DTYPES[cfg.dtype]), seed=seed, device=device)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


def run_config(
    cfg: Config,
    backends: Sequence[Backend],
    timer: Timer,
    *,
    device: str = "cuda",
    matmul_tflops: float | None = None,
    unavailable: dict[str, str] | None = None,
    on_step: StepHook | None = None,
) -> list[Result]:
    import torch

    scale = 1.0 / math.sqrt(cfg.headdim)
    flops = attention_flops(cfg)
    q, k, v = make_inputs(cfg, device)
    reference = None  # computed on first need, shared by all backends
    results = []
    for backend in backends:
        if on_step:
            on_step(cfg, backend.name)
        r = Result(**cfg.to_record(), label=cfg.label, backend=backend.name, status=OK, flops=flops,
                   matmul_tflops=matmul_tflops)
        results.append(r)
        reason = (unavailable or {}).get(backend.name)
        if reason is not None:
            r.status, r.message = UNAVAILABLE, reason
            continue
        try:
            fn = backend.build(cfg, q, k, v, scale)
            out = fn()
            expected = (cfg.batch, cfg.seqlen_q, cfg.heads, cfg.headdim)
            if tuple(out.shape) != expected:
                r.status, r.message = FAIL, f"output shape {tuple(out.shape)}, expected {expected}"
                continue
            if reference is None:
                reference = compute_reference(cfg, q, k, v, scale)
            r.rows_checked = reference.num_rows
            verdict = judge_output(out, reference)
            del out
            r.max_abs_err, r.tolerance = verdict.max_abs, verdict.max_abs_limit
            r.rel_fro_err, r.rel_fro_limit = verdict.rel_fro, verdict.rel_fro_limit
            if not verdict:
                r.status, r.message = FAIL, verdict.message
            # A FAIL is still timed (useful while debugging) but never plotted
            # or counted as a pass.
            t = timer(fn)
        except Unsupported as e:
            r.status, r.message = UNSUPPORTED, str(e)
            continue
        except Exception as e:  # e.g. compile failure, out of memory
            r.status, r.message = ERROR, _short(e)
            continue
        finally:
            fn = out = None  # free this backend's memory before the next one
        r.median_ms, r.min_ms, r.max_ms, r.reps = t.median_ms, t.min_ms, t.max_ms, t.reps
        r.tflops = flops / (t.median_ms * 1e-3) / 1e12
        r.kv_tbs = kv_bytes(cfg) / (t.median_ms * 1e-3) / 1e12
        if matmul_tflops:
            r.pct_matmul = 100.0 * r.tflops / matmul_tflops
    _add_cudnn_ratio(results)
    del q, k, v, reference
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def _add_cudnn_ratio(results: list[Result]) -> None:
    base = next((r for r in results if r.backend == CUDNN and r.status == OK), None)
    if base is None:
        return
    for r in results:
        if r.median_ms:
            r.speedup_vs_cudnn = base.median_ms / r.median_ms


def run(
    configs: Sequence[Config],
    backends: Sequence[Backend],
    timer: Timer,
    *,
    device: str = "cuda",
    matmul_tflops: float | None = None,
    on_step: StepHook | None = None,
) -> list[Result]:
    """All cells, configs in order. Availability is checked once per backend."""
    unavailable = {b.name: reason for b in backends if (reason := b.unavailable_reason()) is not None}
    results = []
    for cfg in configs:
        results += run_config(cfg, backends, timer, device=device, matmul_tflops=matmul_tflops,
                              unavailable=unavailable, on_step=on_step)
    return results
