"""attention_chunk timed (FA3's chunked attention; Llama 4's local layers,
40 query heads on 8 KV heads, D=128, chunks of 8192 in Scout and Maverick):
``flash_attn_func(attention_chunk=C, causal=True)`` forward beside FA3's
forward with the same chunk (``flash_attn_interface``, when it imports;
FA3 has no chunked backward) and beside our plain causal call on the same
rows (what the chunks save), then our backward; and a decode step through
``flash_attn_with_kvcache`` beside FA3's, and over pages of 64 and 256
keys (ours alone: FA3's build has no paged KV). ``do_bench`` medians;
TFLOP/s count each call's visible (query, key) pairs, 4·D FLOPs each
forward and 2.5x that backward. Every output is judged first against the float64
reference on sampled rows (``reference.judge``, the chunk mask of
``reference.chunk_visible``; baseline PyTorch's attention with the same
mask); a wrong result stops the run.

    PYTHONPATH=.:/tmp/fa3pkg python -P scripts/chunk_bench.py      (on the GPU)

FA3 runs beside only with ``HOPPER_FLASH_FA3_LOCAL=1``: its chunked mask is
compiled into its local (window) kernels, which ``shared/tools/fa3``'s
build leaves out (``FLASH_ATTENTION_DISABLE_LOCAL``), and its chunked call
then crashed the process (exit 139, sixtieth session). Build FA3 without
that flag first.
"""
import importlib
import os

import torch
import triton

import hopper_flash
from hopper_flash.reference import attention_baseline, attention_reference, judge, paged_cache

ROWS = [(1, 32768, 40, 8, 128, 8192), (2, 16384, 40, 8, 128, 8192), (4, 8192, 40, 8, 128, 2048)]
DECODE_ROWS = [(8, 32768, 40, 8, 128, 8192), (8, 30000, 40, 8, 128, 8192)]
PAGES = (64, 256)  # paged decode rows beside the contiguous cache (FA3's build here has no paged KV)


def visible_pairs(seqlen: int, chunk: int) -> int:
    """Causal pairs under the chunk mask, equal lengths: row a sees a % C + 1 keys."""
    full, rest = divmod(seqlen, chunk)
    return full * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2


def _fa3(name):
    """FA3's function ``name``, where asked for and importable (module docstring)."""
    if os.environ.get("HOPPER_FLASH_FA3_LOCAL", "0") in ("", "0"):
        return None
    try:
        return getattr(importlib.import_module("flash_attn_interface"), name)
    except Exception:
        return None


def main():
    fa3 = _fa3("flash_attn_func")
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, "
          f"FA3 {'beside' if fa3 else 'absent'}")
    for b, s, h, hkv, d, chunk in ROWS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, n, d, generator=gen, device="cuda").to(torch.bfloat16) for n in (h, hkv, hkv))
        calls = {"chunked": lambda: hopper_flash.flash_attn_func(q, k, v, causal=True, attention_chunk=chunk),
                 "plain causal": lambda: hopper_flash.flash_attn_func(q, k, v, causal=True)}
        if fa3 is not None:
            calls["fa3 chunked"] = lambda: (lambda o: o[0] if isinstance(o, tuple) else o)(
                fa3(q, k, v, causal=True, attention_chunk=chunk))
        rows = torch.randint(0, s, (256,), generator=gen, device="cuda")
        rows = torch.cat([rows, torch.tensor([0, chunk - 1, chunk, s - 1], device="cuda")]).clamp_(max=s - 1)
        ref, _ = attention_reference(q, k, v, causal=True, chunk=chunk, rows=rows)
        base = attention_baseline(q, k, v, causal=True, chunk=chunk, rows=rows)
        pairs = b * h * visible_pairs(s, chunk)
        line = []
        for name, fn in calls.items():
            if name != "plain causal":
                verdict = judge(name, fn()[:, rows], ref, base)
                assert verdict, verdict.message
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            n = b * h * s * (s + 1) // 2 if name == "plain causal" else pairs
            line.append(f"{name} {ms:.3f} ms ({4 * d * n / ms / 1e9:.0f} TFLOP/s)")
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        out = hopper_flash.flash_attn_func(qg, kg, vg, causal=True, attention_chunk=chunk)
        dout = torch.randn_like(out)
        ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True),
                                     warmup=20, rep=300)
        line.append(f"chunked backward {ms:.3f} ms ({2.5 * 4 * d * pairs / ms / 1e9:.0f} TFLOP/s)")
        print(f"B{b} S{s} H{h}/{hkv} D{d} chunk {chunk}: " + "; ".join(line), flush=True)
    for b, cap, h, hkv, d, chunk in DECODE_ROWS:
        decode_row(b, cap, h, hkv, d, chunk)


def decode_row(b, cap, h, hkv, d, chunk):
    """One decode step (a query per row) over caches of ``cap`` keys with
    the chunk: ours and FA3's ``flash_attn_with_kvcache``, judged on every
    row first; K/V TB/s of the keys each query sees (the last chunk's)."""
    fa3 = _fa3("flash_attn_with_kvcache")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, 1, h, d, generator=gen, device="cuda").to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, cap, hkv, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in "kv")
    lens = torch.full((b,), cap, dtype=torch.int32, device="cuda")
    calls = {"chunked": lambda: hopper_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                                       causal=True, attention_chunk=chunk)}
    for page in PAGES:  # the same cache as shuffled pages (read in place: the chunk is a multiple of the page)
        kp, vp, table = paged_cache(k_cache, v_cache, page, seed=page)  # (NaN past each row's keys)
        calls[f"chunked, pages of {page}"] = (lambda kp, vp, t: lambda: hopper_flash.flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=lens, page_table=t, causal=True, attention_chunk=chunk))(kp, vp, table)
    if fa3 is not None:
        calls["fa3 chunked"] = lambda: (lambda o: o[0] if isinstance(o, tuple) else o)(
            fa3(q, k_cache, v_cache, cache_seqlens=lens, causal=True, attention_chunk=chunk))
    ref, _ = attention_reference(q, k_cache, v_cache, causal=True, chunk=chunk)
    base = attention_baseline(q, k_cache, v_cache, causal=True, chunk=chunk)
    seen = (cap - 1) % chunk + 1  # keys in the last query's chunk
    line = []
    for name, fn in calls.items():
        verdict = judge(name, fn(), ref, base)
        assert verdict, verdict.message
        us = triton.testing.do_bench(fn, warmup=50, rep=300) * 1e3
        line.append(f"{name} {us:.1f} us ({2 * b * seen * hkv * d * 2 / us / 1e6:.2f} TB/s of the chunk's K/V)")
    print(f"decode B{b} cache {cap} H{h}/{hkv} D{d} chunk {chunk}: " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
