"""What logit soft-capping costs: the forward and the backward at a cap and
without, same inputs, do_bench medians (triton's L2 flush between calls),
TFLOP/s by the usual count (causal: half of 4·B·H·Sq·Sk·D; the backward
2.5x the forward). FA3 has a softcap build switch that
``shared/tools/fa3/build.sh`` turns off (FLASH_ATTENTION_DISABLE_SOFTCAP),
so no FA3 column here; SDPA cannot express the cap.

    PYTHONPATH=. python -P scripts/softcap_bench.py [--cap 50] [--seqlen 8192] [--headdim 128 ...]
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import hopper_flash


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", type=float, default=50.0)
    p.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--headdim", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--rep-ms", type=int, default=200)
    args = p.parse_args()
    print(f"torch {torch.__version__}, cap {args.cap}, causal, bf16, B{args.batch} H{args.heads}")
    print(f"{'D':>4} {'S':>6} {'pass':5} {'plain ms':>9} {'capped ms':>10} {'plain TF/s':>10} {'capped TF/s':>11} "
          f"{'capped/plain':>12}")
    for d in args.headdim:
        heads = args.heads if d <= 128 else args.heads // 2
        for s in args.seqlen:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(args.batch, s, heads, d, device="cuda", generator=gen).bfloat16() * 3
                           for _ in range(4))
            flops = 4 * args.batch * heads * s * s * d / 2
            for which in ("fwd", "bwd"):
                times = []
                for cap in (0.0, args.cap):
                    if which == "fwd":
                        def fn(cap=cap):
                            return hopper_flash.flash_attn_func(q, k, v, causal=True, softcap=cap)
                    else:
                        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
                        out = hopper_flash.flash_attn_func(qg, kg, vg, causal=True, softcap=cap)

                        def fn(out=out, qg=qg, kg=kg, vg=vg):
                            return torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
                    times.append(do_bench(fn, warmup=50, rep=args.rep_ms, return_mode="median"))
                f = flops * (2.5 if which == "bwd" else 1.0)
                print(f"{d:>4} {s:>6} {which:5} {times[0]:9.3f} {times[1]:10.3f} {f / times[0] / 1e9:10.1f} "
                      f"{f / times[1] / 1e9:11.1f} {times[0] / times[1]:12.3f}", flush=True)


if __name__ == "__main__":
    main()
