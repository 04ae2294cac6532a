"""Quick side-by-side timing for kernel work on the GPU (the product benchmark
is `hopper-flash bench`): hopper_flash with and without config variants next
to SDPA's cuDNN backend, one line per (head dim, causal, S)."""
import argparse
import dataclasses

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import hopper_flash
from hopper_flash import plan

parser = argparse.ArgumentParser()
parser.add_argument("--headdim", type=int, nargs="+", default=[128])
parser.add_argument("--seqlen", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
parser.add_argument("--causal", choices=["yes", "no", "both"], default="yes")
parser.add_argument("--pingpong", action="store_true", help="also time the ping-pong variant")
parser.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                    help="also time plan.ForwardConfig with these fields replaced, e.g. k_stages=3,v_stages=3")
args = parser.parse_args()

B, H = 4, 32
causal_modes = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
variants = ["default"] + (["pingpong"] if args.pingpong else []) + args.variant
for i, v in enumerate(variants):
    print(f"variant {i}: {v}")
print(f"{'D':>4} {'causal':>6} {'S':>6} " + " ".join(f"{'v%d TF' % i:>8}" for i in range(len(variants)))
      + f" {'cudnn TF':>9} " + " ".join(f"{'v%d/cudnn' % i:>9}" for i in range(len(variants))))
for d in args.headdim:
    base = plan.CONFIGS[d]
    for causal in causal_modes:
        for S in args.seqlen:
            q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            flops = 4 * B * H * S * S * d / (2 if causal else 1)
            tf = {}
            for name in variants:
                if name == "default":
                    plan.CONFIGS[d] = base
                elif name == "pingpong":
                    plan.CONFIGS[d] = dataclasses.replace(base, pingpong=True)
                else:
                    plan.CONFIGS[d] = dataclasses.replace(base, **plan.config_variant(name))
                ms = triton.testing.do_bench(lambda: hopper_flash.flash_attn_func(q, k, v, causal=causal),
                                             warmup=100, rep=400, return_mode="median")
                tf[name] = flops / ms / 1e9
            plan.CONFIGS[d] = base

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

            ref = flops / triton.testing.do_bench(cudnn, warmup=100, rep=400, return_mode="median") / 1e9
            print(f"{d:>4} {str(causal):>6} {S:>6} " + " ".join(f"{tf[v]:>8.1f}" for v in variants)
                  + f" {ref:>9.1f} " + " ".join(f"{tf[v] / ref:>9.3f}" for v in variants), flush=True)
