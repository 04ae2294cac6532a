"""A chunked decode step (``flash_attn_with_kvcache(attention_chunk=C)``,
one query per row) over contiguous and paged caches: ``do_bench`` medians
of plain calls, CUDA-graph replay (the GPU's time alone) and the host's
time per call (200 calls queued without a sync), beside the plain paged
decode over each row's last chunk with the page table shifted by hand
(what the chunked step reduces to). B8, H40/8, D128, chunks of 8192, caches
of 32768 and 30000 keys; every output compared with the contiguous call's.
Run it for this tree and another's package (``git archive main
hopper_flash | tar -x -C .wt/main``), alternating:

    PYTHONPATH=. python -P scripts/chunk_decode_probe.py
    PYTHONPATH=.wt/main python -P scripts/chunk_decode_probe.py
"""
import time

import torch
import triton

import hopper_flash
from hopper_flash import chunked
from hopper_flash.reference import paged_cache


def main():
    b, h, hkv, d, chunk = 8, 40, 8, 128, 8192
    for cap in (32768, 30000):
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(b, 1, h, d, generator=gen, device="cuda").to(torch.bfloat16)
        kc, vc = (torch.randn(b, cap, hkv, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in "kv")
        lens = torch.full((b,), cap, dtype=torch.int32, device="cuda")
        calls = {"contig": lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, attention_chunk=chunk)}
        for page in (64, 256):
            *pools, table = paged_cache(kc, vc, page, seed=page)
            calls[f"paged{page}"] = (lambda kp, vp, t: lambda: hopper_flash.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lens, page_table=t, causal=True, attention_chunk=chunk))(*pools, table)
            start = chunked.last_chunk_start(lens, chunk)
            w = min(table.shape[1], chunk // page)
            t2 = chunked.shifted_pages(table, start, page, w); l2 = lens - start
            calls[f"paged{page} pre-shifted (no chunk)"] = (lambda kp, vp, t, l: lambda: hopper_flash.flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=l, page_table=t, causal=True))(*pools, t2, l2)
        ref = calls["contig"]()
        for name, fn in calls.items():
            err = (fn().float() - ref.float()).abs().max().item()
            us = triton.testing.do_bench(fn, warmup=50, rep=300) * 1e3
            g = triton.testing.do_bench_cudagraph(fn, rep=300) * 1e3
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(200): fn()
            host = (time.perf_counter() - t0) / 200 * 1e6; torch.cuda.synchronize()
            print(f"cap {cap} {name:32s} plain {us:7.1f} us  graph {g:7.1f} us  host/call {host:6.1f} us  maxdiff {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
