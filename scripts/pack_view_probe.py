"""The packed view (``plan.Mode.pack_view``) on query blocks of 48-130 rows,
as the sixty-third session timed it: each row through
``flash_attn_with_kvcache`` (B4 over 8192 keys, D128, causal, bf16) with
the default plan and with PackGQA and the split count forced (``pack_gqa``
/ ``num_splits``: True/1, True/2, False/0), ``do_bench`` medians of plain
calls and of CUDA-graph replay (the GPU's time alone). On main's tree
``pack_gqa=True`` is whatever that tree packs (the padded pack before the
view). Outputs are judged against the float64 reference first.

    PYTHONPATH=. python -P scripts/pack_view_probe.py
    PYTHONPATH=.wt/main python -P scripts/pack_view_probe.py   (git archive main hopper_flash | tar -x -C .wt/main)

``--profile``: one query per row instead (H40/8, H28/4, H32/8 over 8192
and 65536 keys), with the forward and combine kernels' device times from
``torch.profiler`` beside the plain and replayed call (the check that the
view's one-query launches match main's kernel for kernel).
"""
import argparse

import torch
import triton
from torch.profiler import ProfilerActivity, profile

import hopper_flash
from hopper_flash.reference import check_kvcache


def graph_of(call):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def inputs(b, sq, h, hkv, s):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, sq, h, 128, device="cuda", generator=gen).to(torch.bfloat16)
    kc, vc = (torch.randn(b, s, hkv, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in "kv")
    return q, kc, vc, torch.full((b,), s, dtype=torch.int32, device="cuda")


def blocks():
    for h, hkv, sq in ((40, 8, 48), (28, 4, 96), (28, 4, 130)):
        q, kc, vc, lens = inputs(4, sq, h, hkv, 8192)
        row = []
        for pack, splits in ((None, 0), (True, 1), (True, 2), (False, 0)):
            def call(pack=pack, splits=splits):
                return hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                                            pack_gqa=pack, num_splits=splits)
            bad = [v.message for v in check_kvcache(call(), q, kc, vc, [8192] * 4, causal=True) if not v]
            if bad:
                raise SystemExit(f"H{h}/{hkv} Sq{sq} {pack}/{splits}: {bad[0]}")
            plain = triton.testing.do_bench(call, warmup=30, rep=100) * 1e3
            replay = triton.testing.do_bench(graph_of(call).replay, warmup=30, rep=100) * 1e3
            row.append(f"{pack}/{splits} plain {plain:.1f} graph {replay:.1f}")
        print(f"H{h}/{hkv} Sq{sq}: " + "; ".join(row), flush=True)


def one_query_profile():
    for h, hkv, b, s in ((40, 8, 8, 8192), (40, 8, 1, 65536), (28, 4, 8, 8192), (28, 4, 1, 65536), (32, 8, 8, 8192)):
        q, kc, vc, lens = inputs(b, 1, h, hkv, s)

        def call():
            return hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
        bad = [v.message for v in check_kvcache(call(), q, kc, vc, [s] * b, causal=True) if not v]
        if bad:
            raise SystemExit(f"H{h}/{hkv} B{b} S{s}: {bad[0]}")
        plain = triton.testing.do_bench(call, warmup=30, rep=100) * 1e3
        replay = triton.testing.do_bench(graph_of(call).replay, warmup=30, rep=100) * 1e3
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                kernels.setdefault(e.name[:40], []).append(e.device_time)
        times = "; ".join(f"{n} x{len(t)} {sum(t) / len(t):.1f}" for n, t in kernels.items())
        print(f"H{h}/{hkv} B{b} S{s}: plain {plain:.1f} us, graph {replay:.1f} us | {times}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    print(hopper_flash.__file__, torch.cuda.get_device_name(), flush=True)
    one_query_profile() if args.profile else blocks()
