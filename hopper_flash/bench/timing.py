"""GPU timing: triton's do_bench (with the L2 flush it does) and the dense
bf16 matmul rate that every result is compared against.

What ``triton.testing.do_bench`` does in triton 3.6 (checked in its source):
it calls ``fn`` once, estimates the time per call from 5 calls, then runs
``warmup_ms / estimate`` untimed calls and ``rep_ms / estimate`` timed calls.
Before each timed call it zeroes a 256 MB buffer
(``driver.get_empty_cache_for_benchmark`` / ``clear_cache``), which evicts
the inputs from L2 (50 MB on H100/H200), and times each call with its own pair
of CUDA events. The flush runs before the start event, so it is not timed,
and the GPU is still busy with it while Python launches ``fn``: small
kernels are therefore not measured with launch overhead in them.
``return_mode="all"`` gives every per-call time; we summarize them ourselves.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

MATMUL_N = 8192


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int  # timed calls behind the numbers
    samples: tuple[float, ...] = ()  # the per-call times, where the timer has them (merge_timings)


Timer = Callable[[Callable[[], object]], Timing]


def summarize(times_ms: list[float]) -> Timing:
    return Timing(statistics.median(times_ms), min(times_ms), max(times_ms), len(times_ms), tuple(times_ms))


def merge_timings(timings: list[Timing]) -> Timing:
    """One Timing over several rounds' calls: the median of all their calls
    where every round kept them, else the median of the rounds' medians."""
    if all(t.samples for t in timings):
        return summarize([x for t in timings for x in t.samples])
    return Timing(statistics.median(t.median_ms for t in timings), min(t.min_ms for t in timings),
                  max(t.max_ms for t in timings), sum(t.reps for t in timings))


def time_in_rounds(fns: list[Callable[[], object]], timer: Timer, rounds: int) -> list:
    """Each of ``fns`` timed once per round for ``rounds`` rounds, the order
    rotated by one each round (none always first or last); per callable its
    calls merged over the rounds (``merge_timings``), or the exception that
    dropped it out of the later rounds. For ``--rounds``: a power-capped
    GPU's clock drift then falls on every callable alike."""
    times: list = [[] for _ in fns]
    for n in range(rounds):
        live = [i for i, ts in enumerate(times) if isinstance(ts, list)]
        if not live:
            break
        first = n % len(live)
        for i in live[first:] + live[:first]:
            try:
                times[i].append(timer(fns[i]))
            except Exception as e:
                times[i] = e
    return [merge_timings(ts) if isinstance(ts, list) else ts for ts in times]


def do_bench_timer(warmup_ms: float = 100, rep_ms: float = 500, min_calls: int = 1) -> Timer:
    """A Timer built on triton.testing.do_bench; warmup/rep are time budgets
    in milliseconds, as do_bench takes them. ``min_calls``: where a call is
    so long that the budget timed fewer, time the rest in a second do_bench
    sized for them (``--rounds`` splits the budget: at 100 ms over four
    rounds a 13 ms call was timed once a round)."""

    def timer(fn: Callable[[], object]) -> Timing:
        from triton.testing import do_bench

        times = list(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all"))
        missing = min_calls - len(times)
        if missing > 0:
            # do_bench times rep / (its estimate of one call) calls, at least one.
            times += do_bench(fn, warmup=0, rep=missing * statistics.median(times) * 1.05, return_mode="all")
        return summarize(times)

    return timer


ROUND_MIN_CALLS = 3  # timed calls per round at least, under --rounds (do_bench_timer's min_calls)


def round_timer(warmup_ms: float, rep_ms: float, rounds: int) -> Timer:
    """``do_bench_timer`` for one of ``rounds`` rounds (``time_in_rounds``):
    the budgets' share, and at least ``ROUND_MIN_CALLS`` calls where there
    is more than one round."""
    return do_bench_timer(warmup_ms / rounds, rep_ms / rounds, ROUND_MIN_CALLS if rounds > 1 else 1)


def cuda_graph_timer(rep_ms: float = 500) -> Timer:
    """A Timer that replays ``fn`` from a CUDA graph (triton's
    ``do_bench_cudagraph``): the calls are captured back to back into one
    graph, so host and launch overhead drop out, as in a serving loop that
    replays graphs. There is no L2 flush between replayed calls: use it for
    problems whose inputs exceed the L2 (50 MB), or read the numbers as
    L2-warm. Each returned time is one replay divided by the calls in it."""

    def timer(fn: Callable[[], object]) -> Timing:
        from triton.testing import do_bench_cudagraph

        return summarize(do_bench_cudagraph(fn, rep=rep_ms, return_mode="all"))

    return timer


def matmul_tflops(timer: Timer, device: str = "cuda") -> float:
    """Rate of a dense N^3 bf16 torch.matmul (cuBLAS), timed with the same
    timer: the practical ceiling the attention numbers are expressed against."""
    import torch

    n = MATMUL_N
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    timing = timer(lambda: torch.matmul(a, b))
    return 2 * n**3 / (timing.median_ms * 1e-3) / 1e12


COPY_BYTES = 1 << 30


def hbm_copy_tbs(timer: Timer, device: str = "cuda") -> float:
    """HBM rate of a device-to-device copy of ``COPY_BYTES`` (each byte read
    and written: 2 x the bytes over the median time) under ``timer``: the
    ceiling a decode's K/V read rate is read against (4.3 TB/s on the H200).
    The bench times it with ``do_bench`` even in a ``--cuda-graph`` run: a
    graph's replay of the copy measured 19% slower on an H100."""
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = timer(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (timing.median_ms * 1e-3) / 1e12
