"""Decode with ``cache_leftpad`` (the varlen route: no split-KV or PackGQA)
next to the same call without it (the decode route) on the same keys (pads
of 0), ``do_bench`` medians, the K/V read rate and the two outputs' largest
difference.

    PYTHONPATH=. python scripts/leftpad_bench.py   (on the GPU)
"""
import torch, triton
import hopper_flash
torch.manual_seed(0)
for B, S, H, Hkv in [(8, 4096, 32, 8), (8, 16384, 32, 8), (64, 2048, 32, 8)]:
    kc = torch.randn(B, S, Hkv, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, 1, H, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    pads = torch.zeros(B, dtype=torch.int32, device="cuda")
    a = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    b = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=pads, causal=True)
    err = (a.float() - b.float()).abs().max().item()
    t0 = triton.testing.do_bench(lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True))
    t1 = triton.testing.do_bench(lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=pads, causal=True))
    kv = 2 * B * S * Hkv * 128 * 2
    print(f"B{B} S{S} H{H}/{Hkv}: decode {t0*1e3:.1f} us ({kv/t0/1e9:.2f} TB/s), leftpad route {t1*1e3:.1f} us ({kv/t1/1e9:.2f} TB/s), max diff {err:.2e}")
