"""Where the varlen forward and backward spend their GPU time, kernel by
kernel, next to FA3's varlen on the same batch (issue 12's mixed batch:
``hopper-flash bench --varlen 512:8192 --batch 16``'s lengths and inputs).

Each backend's forward, then its backward (``torch.autograd.grad`` with
dO = ones, as the bench times it), runs ``--iters`` times under
``torch.profiler``; the table lists every kernel's device time per
iteration. The backward's total over its kernels against the bench's
median says how much of a call is launch gaps; the split between the main
kernel and the pre/postprocess says where a gap to FA3 sits.

    PYTHONPATH=/tmp/fa3pkg:. python -P scripts/varlen_profile.py [--iters 10] [--lo 512 --hi 8192]

FA3's column needs its build on the path (``flash_attn_interface``); without
it only ours runs.

``--max-scale 2`` passes twice the longest length as ``max_seqlen_*`` (the
results are the same): the grids then cover twice the query and KV tiles
per sequence, and the extra ones are dead items (the forward's dynamic
order draws and skips them; the backward launches CTAs that store
nothing). What that adds is what the dead items of the tight bound cost.
"""
from __future__ import annotations

import argparse
import collections
import importlib

import torch
from torch.profiler import ProfilerActivity, profile

import hopper_flash
from hopper_flash.bench.varlen import VarlenConfig


def kernels(fn, iters: int) -> dict[str, float]:
    """Device microseconds per iteration of ``fn`` by kernel name."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time / iters  # device_time: us
    return dict(per)


def show(title: str, per: dict[str, float]) -> None:
    total = sum(per.values())
    print(f"\n{title}: {total:.0f} us of kernels per iteration")
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
        if us >= 0.5:
            print(f"  {us:9.1f} us  {100 * us / total:5.1f}%  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--lo", type=int, default=512)
    p.add_argument("--hi", type=int, default=8192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-scale", type=float, default=1.0, help="max_seqlen_* passed as this times the longest")
    args = p.parse_args()
    cfg = VarlenConfig(args.lo, args.hi, batch=args.batch)
    lengths = cfg.lengths()
    total, mx = sum(lengths), int(max(lengths) * args.max_scale)
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    q = torch.randn(total, cfg.heads, cfg.headdim, generator=gen, device="cuda").bfloat16()
    k = torch.randn(total, cfg.kv_heads, cfg.headdim, generator=gen, device="cuda").bfloat16()
    v = torch.randn(total, cfg.kv_heads, cfg.headdim, generator=gen, device="cuda").bfloat16()
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    print(f"{cfg.label}; lengths {lengths} (total {total}); max_seqlen passed {mx}")

    funcs = {"hopper_flash": hopper_flash.flash_attn_varlen_func}
    try:
        funcs["fa3"] = importlib.import_module("flash_attn_interface").flash_attn_varlen_func
    except ImportError:
        print("(no flash_attn_interface on the path: FA3 not profiled)")
    for name, func in funcs.items():
        def fwd(qq=q, kk=k, vv=v, func=func):
            out = func(qq, kk, vv, cu, cu, mx, mx, causal=cfg.causal)
            return out[0] if isinstance(out, tuple) else out

        show(f"{name} forward", kernels(fwd, args.iters))
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = fwd(qg, kg, vg)
        dout = torch.ones_like(out)
        show(f"{name} backward", kernels(
            lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True), args.iters))


if __name__ == "__main__":
    main()
