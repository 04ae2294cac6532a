"""Quick side-by-side timing for development runs on the GPU (the product
benchmark is `hopper-flash bench`). Prints one line per (S, causal)."""
import sys

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import dataclasses

import hopper_flash
from hopper_flash import plan

# --pingpong: time the kernel with the consumers' ping-pong schedule.
if "--pingpong" in sys.argv:
    plan.CONFIGS[128] = dataclasses.replace(plan.CONFIGS[128], pingpong=True)

B, H, D = 4, 32, 128
causal_modes = [True, False] if "--both" in sys.argv else [True]
print(f"{'S':>6} {'causal':>6} {'hf ms':>8} {'hf TF':>7} {'cudnn TF':>9} {'fa2 TF':>7} {'hf/cudnn':>8}")
for causal in causal_modes:
    for S in (1024, 2048, 4096, 8192, 16384):
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        flops = 4 * B * H * S * S * D / (2 if causal else 1)

        def sdpa(backend):
            def f():
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            return f

        res = {}
        for name, fn in (("hf", lambda: hopper_flash.flash_attn_func(q, k, v, causal=causal)),
                         ("cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("fa2", sdpa(SDPBackend.FLASH_ATTENTION))):
            ms = triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")
            res[name] = (ms, flops / ms / 1e9)
        print(f"{S:>6} {str(causal):>6} {res['hf'][0]:>8.3f} {res['hf'][1]:>7.1f} {res['cudnn'][1]:>9.1f} "
              f"{res['fa2'][1]:>7.1f} {res['hf'][1] / res['cudnn'][1]:>8.3f}", flush=True)
