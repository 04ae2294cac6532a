"""Host-time helpers shared by the host-overhead probes (``host_overhead.py``,
``decode_host.py``): run on the GPU machine, with the GPU work per call far
shorter than the host's."""
import cProfile
import io
import pstats
import time

import torch


def host_us(fn, n=2000):
    """Wall time per call of ``n`` back-to-back calls (best of three, after a
    warm-up): the host's time whenever it exceeds the GPU's."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def enqueue_us(fn, n=200):
    """CPU time per call of ``n`` calls issued without waiting for the GPU
    (``n`` stays under CUDA's launch-queue depth, so no call blocks on it)."""
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return best


def profile_calls(fn, n=1000, sort="tottime", limit=25) -> str:
    """A cProfile of ``n`` calls of ``fn`` (the GPU synchronised inside the
    profile), as text sorted by ``sort``, ``limit`` functions."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(limit)
    return out.getvalue()
