"""Decode steps and short query blocks at GQA groups that are not powers of
two (PackGQA from a packed view of q, ``plan.Mode.pack_view``) beside a
power-of-two group: one query per row (the view is q itself), then query
blocks of 4-4096 rows (a copy of q, or read by rows from q itself,
``plan.Mode.q_rows``; FA3 packs them too), contiguous
caches, ``do_bench`` medians and K/V TB/s, each output judged against the
float64 reference first (``reference.check_kvcache``). Run it for this tree
and for main's package in the same machine:

    PYTHONPATH=.:/tmp/fa3pkg python -P scripts/pack_view_bench.py
    PYTHONPATH=.wt/main:/tmp/fa3pkg python -P scripts/pack_view_bench.py   (git archive main hopper_flash | tar -x -C .wt/main)

FA3's ``flash_attn_with_kvcache`` (its own split and pack heuristics) is
timed beside on the same inputs when ``flash_attn_interface`` imports.

``--fused-q``: q a slice of a fused QKV projection's output, ``[B, Sq, H +
2 Hkv, D]`` (its tokens strided): read by rows since the seventy-second
session's branch ``q-rows-strided``, copied before."""
import argparse

import torch
import triton

import hopper_flash
from hopper_flash.reference import check_kvcache


def _fa3():
    try:
        from flash_attn_interface import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fused-q", action="store_true")
    args = ap.parse_args()
    fa3 = _fa3()
    print(hopper_flash.__file__, torch.cuda.get_device_name(),
          f"FA3 {'beside' if fa3 else 'absent'}", "q fused" if args.fused_q else "q contiguous", flush=True)
    rows = [(h, hkv, b, 1, s) for h, hkv in ((40, 8), (28, 4), (32, 8)) for b, s in ((8, 8192), (1, 65536), (64, 2048))]
    # Query blocks of several packed tiles (BENCHMARKS.md, sixty-second session: padded, branch pad-tiles,
    # they never won; FA3 packs them without padding, 2x at 48 queries of 40/8).
    rows += [(40, 8, 4, 48, 8192), (28, 4, 4, 130, 8192), (28, 4, 4, 96, 8192), (32, 8, 4, 48, 8192)]
    # Drafts of 4 queries and a 4096-query chunk over a cache (seventy-second session: past one query
    # per row the kernel reads a contiguous q's rows itself, plan.Mode.q_rows, instead of a copy).
    rows += [(h, hkv, 8, 4, 16384) for h, hkv in ((40, 8), (28, 4))]
    rows += [(h, hkv, 1, 4096, 8192) for h, hkv in ((40, 8), (28, 4), (32, 8))]
    rows += [(h, hkv, 1, 8192, 16384) for h, hkv in ((40, 8), (28, 4))]
    for h, hkv, b, sq, s in rows:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, sq, h, 128, device="cuda", generator=g).to(torch.bfloat16)
        if args.fused_q:
            fused = torch.randn(b, sq, h + 2 * hkv, 128, device="cuda", generator=g).to(torch.bfloat16)
            fused[:, :, :h] = q
            q = fused[:, :, :h]
        kc, vc = (torch.randn(b, s, hkv, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in "kv")
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        calls = {"ours": lambda: hopper_flash.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, causal=True)}
        if sq > 256:  # a chunk: the fill rule leaves it unpacked; packed (by rows past a power of two) beside it
            calls["packed"] = lambda: hopper_flash.flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=lens, causal=True, pack_gqa=True)
        if fa3 is not None:
            calls["fa3"] = lambda: fa3(q, kc, vc, cache_seqlens=lens, causal=True)
        bad = [v.message for name in calls if name != "fa3"
               for v in check_kvcache(calls[name](), q, kc, vc, [s] * b, causal=True) if not v]
        if bad:
            raise SystemExit(f"H{h}/{hkv} B{b} Sq{sq} S{s}: " + "; ".join(bad))
        row = []
        for name, call in calls.items():
            us = triton.testing.do_bench(call, warmup=30, rep=150) * 1e3
            row.append(f"{name} {us:.1f} us ({2 * b * s * hkv * 128 * 2 / us / 1e6:.2f} TB/s)")
        print(f"H{h}/{hkv} B{b} Sq{sq} S{s}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
