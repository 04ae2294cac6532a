"""The GPU kernels one backward call runs, and their time (torch.profiler),
with attention sinks and without: what a sink adds to a training step's
backward beyond the attention kernels themselves.

    PYTHONPATH=. python -P scripts/bwd_kernels.py [--seqlen 2048] [--headdim 64]
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import hopper_flash


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    print(f"torch {torch.__version__}, hopper_flash from {hopper_flash.__file__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, args.headdim)
    q, k, v, do = (torch.randn(*shape, device="cuda", generator=gen).bfloat16() for _ in range(4))
    for sink in (None, torch.randn(args.heads, device="cuda")):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if sink is not None:
            leaves.append(sink.clone().requires_grad_())
        out = hopper_flash.flash_attn_func(*leaves[:3], causal=True, learnable_sink=leaves[3] if sink is not None
                                           else None)
        for _ in range(3):
            torch.autograd.grad(out, leaves, do, retain_graph=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.reps):
                torch.autograd.grad(out, leaves, do, retain_graph=True)
            torch.cuda.synchronize()
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:70]] += e.device_time / args.reps
        print(f"== {'with' if sink is not None else 'without'} a sink: {sum(per.values()):.1f} us of kernels per call")
        for name, us in sorted(per.items(), key=lambda x: -x[1]):
            print(f"  {us:9.1f} us  {name}")


if __name__ == "__main__":
    main()
