"""Soft-capped and sink launches on the one-item kernels or not: chunked
prefill's shape (B4, 32 query heads on 8 KV heads, 128 queries on 8192
keys, bottom-right causal, bf16, D=128), each feature timed with the
shipped plan (every CTA one item: ``plan.Mode.one_item``, V_AT_ISSUE) and
with one-item launches turned off (``plan.ONE_ITEM_MAX_KV_TILES = 0``), in
one process, alternating, do_bench medians (L2 flushed between calls), and
TFLOP/s of the medians by the bench's count (4·B·H·D·visible pairs, bottom-right
causal; soft-capping's tanh not counted).
Outputs of the two forms are compared with each other (the GPU tests judge
them against the float64 reference).

    PYTHONPATH=. python -P scripts/one_item_features.py [--rounds 3] [--seqlen-k 8192]
"""
from __future__ import annotations

import argparse
import functools

import torch
from triton.testing import do_bench

import hopper_flash
from hopper_flash import plan
from hopper_flash.bench.configs import causal_pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seqlen-k", type=int, default=8192)
    p.add_argument("--rep-ms", type=int, default=200)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 128, 32, 128, device="cuda", generator=gen).bfloat16()
    k, v = (torch.randn(4, args.seqlen_k, 8, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    sink = torch.randn(32, device="cuda", generator=gen)
    features = {"plain": {}, "softcap 30": {"softcap": 30.0}, "sinks": {"learnable_sink": sink},
                "softcap + sinks": {"softcap": 30.0, "learnable_sink": sink}}
    flops = 4 * 4 * 32 * 128 * causal_pairs(128, args.seqlen_k)
    cap = plan.ONE_ITEM_MAX_KV_TILES
    real = plan._plan_launch
    planned = []

    def spy(*a, **kw):
        lp = real(*a, **kw)
        planned.append(lp.mode.one_item)
        return lp
    plan._plan_launch = spy
    print(f"torch {torch.__version__}, B4 H32/8 128 x {args.seqlen_k} causal bf16 D128, us (one item / off)")
    for name, kw in features.items():
        call = functools.partial(hopper_flash.flash_attn_func, q, k, v, causal=True, **kw)
        times = {True: [], False: []}
        outs = {}
        for _ in range(args.rounds):
            for one in (True, False):
                plan.ONE_ITEM_MAX_KV_TILES = cap if one else 0
                real.cache_clear()
                plan._PREPARED.clear()  # prepared launches replay their first plan
                planned.clear()
                outs[one] = call()
                assert planned == [one], planned
                times[one].append(do_bench(call, warmup=30, rep=args.rep_ms) * 1e3)
        plan.ONE_ITEM_MAX_KV_TILES = cap
        real.cache_clear()
        plan._PREPARED.clear()
        diff = (outs[True].float() - outs[False].float()).abs().max().item()
        on, off = (", ".join(f"{t:.1f}" for t in times[x]) for x in (True, False))
        med = {x: sorted(times[x])[len(times[x]) // 2] for x in times}
        gain = med[False] / med[True] - 1
        tflops = " / ".join(f"{flops / (med[x] * 1e-6) / 1e12:.0f}" for x in (True, False))
        print(f"{name:16} one item {on:24} off {off:24} gain {gain * 100:+.1f}%  TFLOP/s {tflops}  "
              f"max |diff| {diff:.1e}")


if __name__ == "__main__":
    main()
