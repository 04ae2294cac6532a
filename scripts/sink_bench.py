"""What attention sinks (``learnable_sink``) cost: the same calls with a
sink and without, same inputs, do_bench medians (triton's L2 flush between
calls). Prefill: the forward, and the backward (the sink's gradient
included), causal, TFLOP/s by the usual count (half of 4·B·H·S²·D; the
backward 2.5x). Decode: ``flash_attn_with_kvcache`` with one query row,
replayed from a CUDA graph (a serving loop's way: small launches, which
eager calls would hide behind host time),
with the K/V read rate. FA3 as built here (``shared/tools/fa3``) and SDPA
have no sinks, so the comparison is with our own kernel.

    PYTHONPATH=. python -P scripts/sink_bench.py [--passes fwd bwd decode]
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import hopper_flash


def rnd(*shape, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=gen).bfloat16()


def prefill(args) -> None:
    print(f"prefill: causal bf16 B{args.batch}, H{args.heads} (D=256: half), sink per head")
    print(f"{'D':>4} {'S':>6} {'pass':5} {'plain ms':>9} {'sink ms':>8} {'plain TF/s':>10} {'sink TF/s':>9} "
          f"{'sink/plain':>10}")
    for d in args.headdim:
        heads = args.heads if d <= 128 else args.heads // 2
        sink = torch.randn(heads, device="cuda")
        for s in args.seqlen:
            q, k, v, do = (rnd(args.batch, s, heads, d, seed=i) for i in range(4))
            flops = 4 * args.batch * heads * s * s * d / 2
            for which in [x for x in ("fwd", "bwd") if x in args.passes]:
                times = []
                for with_sink in (None, sink):
                    if which == "fwd":
                        def fn(with_sink=with_sink):
                            return hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=with_sink)
                    else:
                        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                        if with_sink is not None:
                            leaves.append(with_sink.clone().requires_grad_())
                        out = hopper_flash.flash_attn_func(*leaves[:3], causal=True,
                                                           learnable_sink=leaves[3] if len(leaves) > 3 else None)

                        def fn(out=out, leaves=leaves):
                            return torch.autograd.grad(out, leaves, do, retain_graph=True)
                    times.append(do_bench(fn, warmup=50, rep=args.rep_ms, return_mode="median"))
                f = flops * (2.5 if which == "bwd" else 1.0)
                print(f"{d:>4} {s:>6} {which:5} {times[0]:9.3f} {times[1]:8.3f} {f / times[0] / 1e9:10.1f} "
                      f"{f / times[1] / 1e9:9.1f} {times[0] / times[1]:10.3f}", flush=True)


def decode(args) -> None:
    print("decode: flash_attn_with_kvcache, one query row, H32/8 D128 causal bf16, CUDA-graph replay")
    print(f"{'B':>3} {'cache':>6} {'plain us':>9} {'sink us':>8} {'plain TB/s':>10} {'sink TB/s':>9} {'sink/plain':>10}")
    for batch, cache in ((8, 4096), (8, 16384), (1, 65536), (64, 2048)):
        q = rnd(batch, 1, 32, 128, seed=1)
        k_cache, v_cache = rnd(batch, cache, 8, 128, seed=2), rnd(batch, cache, 8, 128, seed=3)
        lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
        sink = torch.randn(32, device="cuda")
        times = []
        for with_sink in (None, sink):
            def step(with_sink=with_sink):
                return hopper_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                                            learnable_sink=with_sink)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            times.append(do_bench(graph.replay, warmup=50, rep=args.rep_ms, return_mode="median") * 1e3)
        kv_bytes = 2 * batch * cache * 8 * 128 * 2
        print(f"{batch:>3} {cache:>6} {times[0]:9.1f} {times[1]:8.1f} {kv_bytes / times[0] / 1e6:10.2f} "
              f"{kv_bytes / times[1] / 1e6:9.2f} {times[0] / times[1]:10.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--passes", nargs="+", choices=("fwd", "bwd", "decode"), default=["fwd", "bwd", "decode"])
    args = p.parse_args()
    print(f"torch {torch.__version__}, hopper_flash from {hopper_flash.__file__}")
    if {"fwd", "bwd"} & set(args.passes):
        prefill(args)
    if "decode" in args.passes:
        decode(args)


if __name__ == "__main__":
    main()
