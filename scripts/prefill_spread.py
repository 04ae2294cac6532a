"""Per-call time distribution of the causal prefill forward, ours beside FA3:
eight interleaved rounds of 25 calls per kernel, CUDA events around each
call (no L2 flush: the rows are compute-bound), percentiles and each
round's median, with the SM clock and power draw read after each row (the
H100's 700 W cap moved both kernels' medians by up to 18% together,
BENCHMARKS.md, sixty-fourth session). ``--static``: the static deal forced
(``plan.choose_dynamic`` patched), to see what the dynamic order is worth.

    PYTHONPATH=.:/tmp/fa3pkg python -P scripts/prefill_spread.py [--static]

Each kernel's output is judged against the float64 reference first
(``reference.check_attention``, the tests' judge)."""
import statistics
import sys

import torch

import hopper_flash
from hopper_flash import plan
from hopper_flash.reference import check_attention
try:
    from flash_attn_interface import flash_attn_func as fa3
except ImportError:
    fa3 = None

ROWS = [(8, 32, 8192, 64), (2, 16, 12345, 128), (4, 16, 8192, 256), (4, 32, 8192, 128)]


def times(fn, n):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def pct(xs):
    xs = sorted(xs); n = len(xs)
    return " ".join(f"{xs[int(p * (n - 1))]:.3f}" for p in (0, .1, .5, .9, 1))


def clock():
    try:
        return f"sm {torch.cuda.clock_rate()} MHz, {torch.cuda.power_draw() / 1000:.0f} W"
    except Exception:  # no pynvml
        return "clock n/a"


static = "--static" in sys.argv
if static:
    plan.choose_dynamic = lambda *a: False
    plan._plan_launch.cache_clear()
for B, H, S, D in ROWS:
    g = torch.Generator(device="cuda").manual_seed(S + D)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", generator=g).to(torch.bfloat16) for _ in "qkv")
    calls = {"ours": lambda: hopper_flash.flash_attn_func(q, k, v, causal=True)}
    if fa3:
        calls["fa3"] = lambda: fa3(q, k, v, causal=True)
    for n, f in calls.items():
        bad = [x.message for x in check_attention(f(), q, k, v, causal=True) if not x]
        if bad:
            raise SystemExit(f"{n} B{B} H{H} S{S} D{D}: " + "; ".join(bad))
    res = {n: [] for n in calls}
    for n, f in calls.items():
        times(f, 20)
    for r in range(8):
        for n, f in calls.items():
            res[n] += times(f, 25)
    print(f"B{B} H{H} S{S} D{D} causal{' static' if static else ''} (outputs judged) {clock()}")
    for n in calls:
        print(f"   {n:5s} min/p10/p50/p90/max ms: {pct(res[n])}")
    # the rounds' medians in order, to see drift/throttling
    for n in calls:
        meds = [statistics.median(res[n][i * 25:(i + 1) * 25]) for i in range(8)]
        print(f"   {n:5s} round medians: " + " ".join(f"{m:.3f}" for m in meds))
