"""Two speeds of one row: per-rep times over fresh allocations, in one process.

The thirty-sixth and thirty-seventh sessions timed B4 H32 S2048 D128 causal
at ~567 TFLOP/s in one bench process and 525-542 in the others. The
thirty-seventh's JSON has each process's min and max as well: in *every*
process our reps span 0.238-0.241 ms (min) to 0.262-0.266 ms (max), and the
median lands near one end or the other; FA3's span 0.225-0.251 ms the same
way (its median near the slow end in all six), cuDNN's only 0.280-0.300. So
the reps themselves take one of two speeds, and a process's median says which
held the majority.

This probe times the row over fresh allocations (a pad of random size first,
so q, k, v and the kernels' workspaces move), ours beside SDPA cuDNN and FA3
(when importable), and prints per backend the 10th, 50th and 90th
percentile of the reps' times and the share of reps nearer the fast end,
with the inputs' offsets and the SM clock after the trial. If the share
follows the addresses, it is L2
placement; if it is the same in every trial, something per rep (the
dynamic order's draws: both FA3 and ours draw causal items from an atomic
counter; the L2 flush before each rep; the clock).

    PYTHONPATH=/tmp/fa3pkg:. python -P scripts/placement_probe.py [--trials 8] [--seqlen 2048] [--graph]
"""
from __future__ import annotations

import argparse
import functools
import random

import torch
from triton.testing import do_bench

import hopper_flash


def backends(args):
    fns = {"hopper_flash": lambda q, k, v: hopper_flash.flash_attn_func(q, k, v, causal=args.causal)}

    def cudnn(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=args.causal)

    fns["sdpa-cudnn"] = cudnn
    try:
        from flash_attn_interface import flash_attn_func as fa3
    except ImportError:
        pass
    else:
        fns["fa3"] = lambda q, k, v: fa3(q, k, v, causal=args.causal)
    return fns


def offset_mb(t: torch.Tensor, log2_bytes: int) -> float:
    """Where ``t`` starts within an aligned block of 2**log2_bytes bytes, in MB."""
    return (t.data_ptr() % (1 << log2_bytes)) / 2**20


def rep_times(fn, graph: bool, rep_ms: int) -> torch.Tensor:
    """Every rep's time in ms (``do_bench``'s, the L2 flushed before each)."""
    if graph:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    return torch.tensor(do_bench(fn, warmup=30, rep=rep_ms, return_mode="all"))


def clock_mhz() -> str:
    """The SM clock now (NVML through torch; "-" where it cannot say): the
    H200 runs these rows at its power cap, where the clock moves."""
    try:
        return f"{torch.cuda.clock_rate():.0f}"
    except Exception:  # noqa: BLE001 (no pynvml, or NVML's own error types): only the column is lost
        return "-"


def summary(times: torch.Tensor) -> str:
    p10, p50, p90 = (times.quantile(q).item() for q in (0.1, 0.5, 0.9))
    fast = (times < (times.min() + times.max()) / 2).float().mean().item()
    return f"{p10:.4f} {p50:.4f} {p90:.4f} {fast:4.0%}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (launch gaps out)")
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    b, h, s, d = args.batch, args.heads, args.seqlen, args.headdim
    fns = backends(args)
    print(f"B{b} H{h} S{s} D{d} {'causal' if args.causal else 'non-causal'} bf16, {args.trials} trials, "
          f"{'graph replay' if args.graph else 'eager'}; per backend: p10 p50 p90 ms, share of reps nearer the min")
    print(f"{'trial':>5} {'pad MB':>7} {'q%32MB':>7} {'k%32MB':>7} {'v%32MB':>7} {'q%2MB':>6}  "
          + "  ".join(f"{name:<27}" for name in fns))
    keep = []
    for trial in range(args.trials):
        pad_mb = rng.randrange(0, 64)
        keep.append(torch.empty(pad_mb * 2**20 + rng.randrange(0, 2**20, 512), dtype=torch.uint8, device="cuda"))
        qkv = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        cells = [summary(rep_times(functools.partial(fn, *qkv), args.graph, args.rep_ms)) for fn in fns.values()]
        q, k, v = qkv
        print(f"{trial:>5} {pad_mb:>7} {offset_mb(q, 25):>7.2f} {offset_mb(k, 25):>7.2f} {offset_mb(v, 25):>7.2f} "
              f"{offset_mb(q, 21):>6.3f}  " + "  ".join(f"{c:<27}" for c in cells) + f"  {clock_mhz()} MHz",
              flush=True)


if __name__ == "__main__":
    main()
