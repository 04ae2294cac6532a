"""``flash_attn_combine`` timed: the CUDA route's Triton kernel, the torch-op
route the same call takes under autograd (forced here), and FA3's
``flash_attn_combine`` when its build is on the path (``PYTHONPATH=/tmp/fa3pkg``),
on FA3's layout (``out_partial`` [splits, B, L, H, D] contiguous fp32,
``lse_partial`` the transposed [splits, B, H, L]), bf16 output.
``do_bench`` medians (us) and the partials' read rate (GB/s over
``out_partial``'s and ``lse_partial``'s bytes). Every output is first checked
against a float64 merge on the GPU (the bound of an fp32 sum, then bf16's
rounding); a miss stops the run.

    PYTHONPATH=.:/tmp/fa3pkg python -P scripts/combine_bench.py
"""
import math
import sys

import torch
import triton

import hopper_flash
from hopper_flash import combine

try:
    from flash_attn_interface import flash_attn_combine as fa3_combine
except ImportError:  # no FA3 build on the path
    fa3_combine = None

SHAPES = [  # (splits, batch, seqlen, heads, head dim): what merges them
    (2, 1, 32768, 32, 128),   # ring attention over two shards, one long sequence
    (8, 4, 4096, 32, 128),    # context parallel over eight ranks
    (4, 2, 8192, 16, 64),
    (16, 8, 1, 32, 128),      # a decode step's splits: latency
    (3, 1, 4096, 8, 256),
]


def _inputs(splits, b, l, h, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    o = torch.randn(splits, b, l, h, d, generator=g, device="cuda")
    lse = (torch.randn(splits, b, h, l, generator=g, device="cuda") * 3).transpose(-1, -2)
    lse[-1, :, : max(1, l // 7)] = -math.inf  # a part that saw no key: its O is never read
    o[-1, :, : max(1, l // 7)] = math.nan
    return o, lse


def _check(name, out, o, lse):
    l64 = lse.double()
    top = l64.amax(0).nan_to_num(0.0, neginf=0.0)
    w = torch.exp(l64 - top)
    total = w.sum(0)
    want = torch.einsum("sblh,sblhd->blhd", w / total.clamp_min(1e-300), o.double().nan_to_num(0.0))
    size = torch.einsum("sblh,sblhd->blhd", w / total.clamp_min(1e-300), o.double().nan_to_num(0.0).abs())
    bound = want.abs() * 2.0 ** -8 + size * (o.shape[0] + 8) * 2.0 ** -24 + 1e-7
    ok = bool(((out.double() - want).abs() <= bound).all())
    print(f"  {name}: {'ok' if ok else 'WRONG'}", flush=True)
    if not ok:
        sys.exit(f"{name}: the merge is off the float64 reference")


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"FA3 {'yes' if fa3_combine else 'no'}")
    for i, (splits, b, l, h, d) in enumerate(SHAPES):
        o, lse = _inputs(splits, b, l, h, d, seed=i)
        gb = (o.numel() + lse.numel()) * 4 / 1e9
        calls = {"ours (kernel)": lambda: hopper_flash.flash_attn_combine(o, lse, out_dtype=torch.bfloat16)}

        def torch_route():
            saved = combine._kernel_route
            combine._kernel_route = lambda *a: False
            try:
                return hopper_flash.flash_attn_combine(o, lse, out_dtype=torch.bfloat16)
            finally:
                combine._kernel_route = saved
        calls["ours (torch ops)"] = torch_route
        if fa3_combine is not None:
            calls["FA3"] = lambda: fa3_combine(o, lse, out_dtype=torch.bfloat16)
        print(f"splits {splits}, B{b} L{l} H{h} D{d} ({gb:.3f} GB of partials)")
        for name, fn in calls.items():
            try:
                out, _ = fn()
            except RuntimeError as e:  # FA3's limits (e.g. its head dims or split counts)
                print(f"  {name}: not run ({str(e).splitlines()[0]})")
                continue
            _check(name, out, o, lse)
            del out
            torch.cuda.empty_cache()
            us = triton.testing.do_bench(fn, warmup=20, rep=200) * 1e3
            print(f"  {name:18s} {us:9.1f} us  {gb / us * 1e6:7.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
