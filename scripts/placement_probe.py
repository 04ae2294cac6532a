"""Whether a row's speed depends on where its inputs land in memory.

The thirty-sixth and thirty-seventh sessions timed B4 H32 S2048 D128 causal
at ~567 TFLOP/s in one bench process and 525-542 in every other, while
cuDNN and FA3 in the same processes did not move (BENCHMARKS.md,
thirty-seventh session). A process differs from the next in where its
tensors are allocated (and in nothing else the kernel sees), so this probe
times the same shape over fresh allocations, in one process: before each
trial it allocates a pad of a random size (so q, k, v and the kernel's
workspace move), fresh random q, k, v, and times our forward, SDPA cuDNN
and FA3 (when importable) on them with ``do_bench`` medians (L2 flushed
between reps), printing the addresses' offsets within 32 MB and 2 MB.

A fast mode that follows the addresses points at L2 placement; one that does
not, while the others stay flat, at something inside the process (the
dynamic order's counter, say).

    PYTHONPATH=/tmp/fa3pkg:. python -P scripts/placement_probe.py [--trials 12] [--seqlen 2048] [--graph]
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


def time_ms(fn, graph: bool) -> float:
    if not graph:
        return do_bench(fn, warmup=30, rep=100)
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=30, rep=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (launch gaps out)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    b, h, s, d = args.batch, args.heads, args.seqlen, args.headdim
    flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
    fns = backends(args)
    print(f"B{b} H{h} S{s} D{d} {'causal' if args.causal else 'non-causal'} bf16, {args.trials} trials, "
          f"{'graph replay' if args.graph else 'eager'}; TFLOP/s per trial")
    print(f"{'trial':>5} {'pad MB':>7} {'q % 32MB':>9} {'k % 32MB':>9} {'v % 32MB':>9} {'q % 2MB':>8} "
          + " ".join(f"{name:>12}" for name in fns))
    keep = []
    for trial in range(args.trials):
        pad_mb = rng.randrange(0, 64)
        keep.append(torch.empty(pad_mb * 2**20 + rng.randrange(0, 2**20, 512), dtype=torch.uint8, device="cuda"))
        qkv = [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        rates = [flops / time_ms(functools.partial(fn, *qkv), args.graph) / 1e9 for fn in fns.values()]
        q, k, v = qkv
        print(f"{trial:>5} {pad_mb:>7} {offset_mb(q, 25):>9.2f} {offset_mb(k, 25):>9.2f} {offset_mb(v, 25):>9.2f} "
              f"{offset_mb(q, 21):>8.3f} " + " ".join(f"{r:>12.1f}" for r in rates), flush=True)


if __name__ == "__main__":
    main()
