"""Runs every (config, pass, backend) cell: same random inputs (and output
gradient) for all backends of a config, a correctness check of each output
and each gradient against the float64 reference (judged relative to SDPA's
error, see ``reference.py``), then timing.

The backends and the timer are parameters so that tests can drive the whole
loop on the CPU with fakes.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from .backends import CUDNN, Backend, Unsupported
from .configs import Config, attention_flops, kv_bytes
from .reference import compute_grad_reference, compute_reference, judge_grads, judge_output, make_grad_out
from .results import ERROR, FAIL, OK, UNAVAILABLE, UNSUPPORTED, Result
from .timing import Timer, Timing, time_in_rounds

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}

# Called before each cell with (config, backend name), e.g. to move a progress bar.
StepHook = Callable[[Config, str], None]


def make_inputs(cfg: Config, device: str, seed: int = 0):
    """Fresh standard-normal q, k, v in BSHD (``hopper_flash.reference.random_qkv``)."""
    import torch

    from hopper_flash.reference import random_qkv

    dtype = getattr(torch, TORCH_DTYPES[cfg.dtype])
    q, k, v = random_qkv(cfg.batch, cfg.seqlen_q, cfg.seqlen_kv, cfg.heads, cfg.nheads_kv, cfg.headdim,
                         dtype=dtype, seed=seed, device=device)
    if cfg.head_dim_v != cfg.headdim:  # v of its own head dim, from a generator of its own
        v = random_qkv(cfg.batch, 0, cfg.seqlen_kv, cfg.heads, cfg.nheads_kv, cfg.head_dim_v, dtype=dtype,
                       seed=seed + 7919, device=device)[2]
    return q, k, v


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


# What a cell times. "fwd": the attention output. "bwd": the gradients
# (dq, dk, dv) of a fixed grad_out through autograd, the forward run once
# outside the timed region (retain_graph keeps its saved tensors). "fwd+bwd":
# both, as a training step does.
PASSES = ("fwd", "bwd", "fwd+bwd")

# Called around one call of a cell's timed callable; returns the peak bytes
# allocated during it beyond what was allocated before (None: not measured).
MemoryProbe = Callable[[Callable[[], object]], "int | None"]


def pass_flops(cfg: Config, bench_pass: str) -> int:
    """FLOPs credited to one call: the forward's (``attention_flops``), the
    backward counted as 2.5x the forward (its five matmuls against the
    forward's two; causal halved as in the forward), fwd+bwd as 3.5x."""
    fwd = attention_flops(cfg)  # even: 2 or 4 times an integer
    return {"fwd": fwd, "bwd": 5 * fwd // 2, "fwd+bwd": 7 * fwd // 2}[bench_pass]


def _prepare(backend: Backend, cfg: Config, q, k, v, dout, scale: float, bench_pass: str):
    """(timed callable, output to check or None, grads to check or None) of
    one cell; the callable has been called once (compilation, probes)."""
    import torch

    expected = (cfg.batch, cfg.seqlen_q, cfg.heads, cfg.head_dim_v)

    def shape_ok(out):
        if tuple(out.shape) != expected:
            raise _BadShape(f"output shape {tuple(out.shape)}, expected {expected}")
        return out

    if bench_pass == "fwd":
        fn = backend.build(cfg, q, k, v, scale)
        return fn, shape_ok(fn()), None
    if not backend.grad:
        raise Unsupported(f"{backend.name}: the backward is not benchmarked for this backend")
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    forward = backend.build(cfg, *leaves, scale)
    if bench_pass == "bwd":
        with torch.enable_grad():
            out = shape_ok(forward())

        def fn():
            return torch.autograd.grad(out, leaves, dout, retain_graph=True, allow_unused=True)

        return fn, None, _materialized(_first_backward(fn), leaves)

    def fn():
        with torch.enable_grad():
            o = forward()
            return o, torch.autograd.grad(o, leaves, dout, allow_unused=True)

    with torch.enable_grad():
        shape_ok(forward())  # the shape check before autograd meets a mismatched grad_out
    out, grads = _first_backward(fn)
    return fn, out, _materialized(grads, leaves)


class _BadShape(Exception):
    """A backend's output has the wrong shape: a FAIL, not an error."""


def _first_backward(fn):
    """The first call of a callable with a backward in it: a backend whose
    backward declines the config (NotImplementedError, e.g. an unsupported
    head dim) is unsupported, not broken."""
    try:
        return fn()
    except NotImplementedError as e:
        raise Unsupported(str(e)) from e


def _materialized(grads, leaves):
    """An input the output does not depend on has gradient 0 (autograd says
    None): judged as such, so a backend that drops one is wrong, not broken."""
    import torch

    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves))


def _worst(verdicts):
    """The verdict closest to (or furthest past) its max-abs limit."""
    def ratio(v):
        if math.isnan(v.max_abs) or not v.max_abs_limit:
            return math.inf if (math.isnan(v.max_abs) or v.max_abs) else 0.0
        return v.max_abs / v.max_abs_limit

    return max(verdicts, key=ratio)


def run_config(
    cfg: Config,
    backends: Sequence[Backend],
    timer: Timer,
    *,
    device: str = "cuda",
    matmul_tflops: float | None = None,
    unavailable: dict[str, str] | None = None,
    on_step: StepHook | None = None,
    bench_pass: str = "fwd",
    memory: MemoryProbe | None = None,
    rounds: int = 1,
) -> list[Result]:
    """One config's cells for one pass. ``rounds`` > 1 times the backends
    that passed their set-up in that many rounds, each backend once per
    round in a rotating order, and summarizes each backend's calls over all
    rounds (``timer`` gets each round's share of the budget: the caller's
    job). A power-capped GPU moves its clock by up to 18% over a few
    seconds (BENCHMARKS.md, sixty-fourth session); interleaved, the drift
    falls on every backend alike instead of on whichever ran during it.
    Every backend's callable (and its memory) is then held until the last
    round."""
    import torch

    if bench_pass not in PASSES:
        raise ValueError(f"bench_pass must be one of {PASSES}, got {bench_pass!r}")
    scale = 1.0 / math.sqrt(cfg.headdim)
    flops = pass_flops(cfg, bench_pass)
    q, k, v = make_inputs(cfg, device)
    dout = make_grad_out(cfg, device) if bench_pass != "fwd" else None
    reference = grad_reference = None  # computed on first need, shared by all backends
    results = []
    waiting = []  # (result, callable) judged and waiting for the rounds (rounds > 1)
    for backend in backends:
        if on_step:
            on_step(cfg, backend.name)
        r = Result(**cfg.to_record(), label=cfg.label, backend=backend.name, status=OK, flops=flops,
                   matmul_tflops=matmul_tflops, bench_pass=bench_pass)
        results.append(r)
        reason = (unavailable or {}).get(backend.name)
        if reason is not None:
            r.status, r.message = UNAVAILABLE, reason
            continue
        fn = out = grads = None
        try:
            try:
                fn, out, grads = _prepare(backend, cfg, q, k, v, dout, scale, bench_pass)
            except _BadShape as e:
                r.status, r.message = FAIL, str(e)
                continue
            verdicts = []
            if out is not None:
                if reference is None:
                    reference = compute_reference(cfg, q, k, v, scale)
                r.rows_checked = reference.num_rows
                verdicts.append(judge_output(out, reference))
            if grads is not None:
                if grad_reference is None:
                    grad_reference = compute_grad_reference(cfg, q, k, v, dout, scale)
                r.rows_checked = grad_reference.num_rows
                verdicts += judge_grads(grads, grad_reference)
            out = grads = None
            worst = _worst(verdicts)
            r.max_abs_err, r.tolerance = worst.max_abs, worst.max_abs_limit
            r.rel_fro_err, r.rel_fro_limit = worst.rel_fro, worst.rel_fro_limit
            if not all(verdicts):
                r.status, r.message = FAIL, "; ".join(v.message for v in verdicts if not v)
            # A FAIL is still timed (useful while debugging) but never plotted
            # or counted as a pass.
            if rounds > 1:
                waiting.append((r, fn))
                continue
            t = timer(fn)
            if memory is not None:
                _record_memory(r, memory, fn)
        except Unsupported as e:
            r.status, r.message = UNSUPPORTED, str(e)
            continue
        except Exception as e:  # e.g. compile failure, out of memory
            r.status, r.message = ERROR, _short(e)
            continue
        finally:
            fn = out = grads = None  # free this backend's memory (and its autograd graph) before the next one
        _record_timing(r, t, flops, cfg, bench_pass, matmul_tflops)
    for r, t in _time_in_rounds(waiting, timer, rounds, memory):
        _record_timing(r, t, flops, cfg, bench_pass, matmul_tflops)
    waiting = None  # the callables' memory, before empty_cache below
    _add_cudnn_ratio(results)
    del q, k, v, dout, reference, grad_reference
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def _record_memory(r: Result, memory: MemoryProbe, fn) -> None:
    peak = memory(fn)
    r.peak_mib = None if peak is None else peak / 2**20


def _time_in_rounds(waiting: list, timer: Timer, rounds: int, memory: MemoryProbe | None):
    """``(result, Timing)`` of each waiting ``(result, callable)``, timed by
    ``timing.time_in_rounds``; a backend that raises drops out with an ERROR
    (and no timing)."""
    for (r, fn), t in zip(waiting, time_in_rounds([fn for _, fn in waiting], timer, rounds)):
        if isinstance(t, Exception):
            r.status, r.message = ERROR, _short(t)
            continue
        if memory is not None:
            try:
                _record_memory(r, memory, fn)
            except Exception as e:
                r.status, r.message = ERROR, _short(e)
                continue
        yield r, t


def _record_timing(r: Result, t: Timing, flops: int, cfg: Config, bench_pass: str,
                   matmul_tflops: float | None) -> None:
    r.median_ms, r.min_ms, r.max_ms, r.reps = t.median_ms, t.min_ms, t.max_ms, t.reps
    r.tflops = flops / (t.median_ms * 1e-3) / 1e12
    if bench_pass == "fwd":  # the K/V read rate of a forward (decode's measure)
        r.kv_tbs = kv_bytes(cfg) / (t.median_ms * 1e-3) / 1e12
    if matmul_tflops:
        r.pct_matmul = 100.0 * r.tflops / matmul_tflops


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
    passes: Sequence[str] = ("fwd",),
    memory: MemoryProbe | None = None,
    on_config: Callable[[list[Result]], None] | None = None,
    rounds: int = 1,
) -> list[Result]:
    """All cells: configs in order, each config's passes in the given order.
    Availability is checked once per backend. ``on_config`` gets the results
    so far after each config (the CLI writes them, so a process that dies
    later, a backend's segfault say, leaves the rows it finished);
    ``rounds``: ``run_config``'s."""
    unavailable = {b.name: reason for b in backends if (reason := b.unavailable_reason()) is not None}
    results = []
    for cfg in configs:
        for bench_pass in passes:
            results += run_config(cfg, backends, timer, device=device, matmul_tflops=matmul_tflops,
                                  unavailable=unavailable, on_step=on_step, bench_pass=bench_pass, memory=memory,
                                  rounds=rounds)
        if on_config is not None:
            on_config(results)
    return results


def cuda_peak_memory(fn: Callable[[], object]) -> int:
    """Peak bytes allocated by PyTorch's caching allocator during one call of
    ``fn`` beyond what was allocated before it (inputs, and for "bwd" the
    forward's saved tensors, are not counted; outputs, gradients and
    workspaces are). Synchronizes around the call."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak
