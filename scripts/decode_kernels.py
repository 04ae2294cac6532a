"""What each library's one-row decode call runs on the GPU: every kernel of
one call (name, grid, block, registers, shared memory, duration) and the
call's span from its first kernel's start to its last kernel's end, with the
gaps between kernels, from a ``torch.profiler`` trace.

The question it answers (issue 10's "at least 1.0x SDPA cuDNN" rows, where
the split kernel alone is ahead of cuDNN and the whole call is not): how
cuDNN's decode is built (how many kernels, how many CTAs of what size, a
merge kernel or none), and where our call's time goes between its kernels.

Each library's output is judged against the float64 reference first. Calls
are eager (not graph replays), issued after a sync so the GPU is idle at the
start of each; the spans are device time, the host's enqueue time is not in
them, but a gap between two kernels of one call can hold launch latency
that a graph replay would hide (``decode_splits.py --combine-cost`` times
replays).

``--append``: our calls append one new token per row first (``k``, ``v``
of one token at ``cache_seqlens = seqlen_k - 1``), as a serving loop's
decode step does, so the trace shows what the append adds to a call
(cuDNN's calls have no append).

    PYTHONPATH=. python -P scripts/decode_kernels.py [--calls 20] [--append]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from hopper_flash import flash_attn_with_kvcache, plan
from hopper_flash.reference import check_kvcache, random_qkv

# (batch, seqlen_k, query heads, KV heads): issue 10's one-row rows with a cuDNN column.
ROWS = [(8, 4096, 32, 8), (8, 16384, 32, 8), (1, 65536, 32, 8), (64, 2048, 32, 8)]
D = 128
SCALE = D ** -0.5


def kernels_per_call(fn, calls: int):
    """[(name, grid, block, regs, smem, start_us, dur_us)] for each of ``calls``
    calls, each call issued on an idle GPU (a sync before each)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(calls):
            with torch.profiler.record_function(f"call{i}"):
                fn()
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return group_by_call(events)


def group_by_call(events):
    """The trace's kernels grouped by call, each in start order."""
    # Each kernel belongs to the call whose host range (record_function
    # "callN") issued its launch: the runtime or driver API event of the
    # same correlation id (Triton and the C path launch through the driver).
    calls_at = sorted((e["ts"], e["ts"] + e["dur"], int(e["name"][4:])) for e in events
                      if e.get("cat") == "user_annotation" and e.get("name", "")[:4] == "call"
                      and e["name"][4:].isdigit())
    launched_at = {e["args"]["correlation"]: e["ts"] for e in events
                   if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = [[] for _ in calls_at]
    for e in sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"]):
        t = launched_at.get(e.get("args", {}).get("correlation"))
        call = next((n for lo, hi, n in calls_at if t is not None and lo <= t <= hi), None)
        if call is None:
            continue
        a = e.get("args", {})
        out[call].append((e["name"], tuple(a.get("grid", ())), tuple(a.get("block", ())),
                          a.get("registers per thread"), a.get("shared memory"), e["ts"], e["dur"]))
    return [c for c in out if c]


def report(label: str, calls) -> None:
    shapes = {}
    for c in calls:
        shapes.setdefault(tuple(k[0] for k in c), []).append(c)
    for names, cs in shapes.items():
        print(f"  {label}: {len(cs)} calls of {len(names)} kernels")
        spans = [c[-1][5] + c[-1][6] - c[0][5] for c in cs]
        print(f"    span first start -> last end: median {statistics.median(spans):.1f} us "
              f"(min {min(spans):.1f})")
        for j, name in enumerate(names):
            k = cs[0][j]
            durs = [c[j][6] for c in cs]
            gap = ""
            if j:
                gaps = [c[j][5] - (c[j - 1][5] + c[j - 1][6]) for c in cs]
                gap = f", gap before {statistics.median(gaps):.1f} us"
            print(f"    [{j}] {name[:110]}")
            print(f"        grid {k[1]} block {k[2]} regs {k[3]} smem {k[4]}: "
                  f"median {statistics.median(durs):.1f} us (min {min(durs):.1f}){gap}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--append", action="store_true", help="our calls append one token per row first")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, SMs {plan.sm_count()}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for B, S, H, HKV in ROWS:
        q, k, v = random_qkv(B, 1, S, H, HKV, D, seed=B * S + 1)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        print(f"B{B} Sk{S} H{H}/{HKV} D{D}, K/V {2 * k.numel() * k.element_size() / 1e6:.1f} MB"
              f"{', our calls append one token' if args.append else ''}")
        new = ()
        if args.append:  # each call writes the cache's last position (the same values every call)
            new = tuple(x[:, -1:].clone() for x in (k, v))
            lens = lens - 1

        def ours():
            return flash_attn_with_kvcache(q, k, v, *new, cache_seqlens=lens, softmax_scale=SCALE, causal=True)

        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=SCALE, enable_gqa=True)

        for label, fn, layout in (("ours", ours, "bshd"), ("cuDNN", cudnn, "bhsd")):
            o = fn()
            if layout == "bhsd":
                o = o.transpose(1, 2)
            bad = [x.message for x in check_kvcache(o, q, k, v, [S] * B, causal=True, softmax_scale=SCALE) if not x]
            print(f"  {label} judged: {'ok' if not bad else 'FAIL ' + bad[0]}")
            report(label, kernels_per_call(fn, args.calls))


if __name__ == "__main__":
    main()
