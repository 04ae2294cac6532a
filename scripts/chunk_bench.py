"""attention_chunk timed (FA3's chunked attention; Llama 4's local layers,
40 query heads on 8 KV heads, D=128, chunks of 8192 in Scout and Maverick):
``flash_attn_func(attention_chunk=C, causal=True)`` forward beside FA3's
forward with the same chunk (``flash_attn_interface``, when it imports;
FA3 has no chunked backward) and beside our plain causal call on the same
rows (what the chunks save), then our backward. ``do_bench`` medians;
TFLOP/s count each call's visible (query, key) pairs, 4·D FLOPs each
forward and 2.5x that backward. Every output is judged first against the float64
reference on sampled rows (``reference.judge``, the chunk mask of
``reference.chunk_visible``; baseline PyTorch's attention with the same
mask); a wrong result stops the run.

    PYTHONPATH=.:/tmp/fa3pkg python -P scripts/chunk_bench.py      (on the GPU)
"""
import importlib

import torch
import triton

import hopper_flash
from hopper_flash.reference import attention_baseline, attention_reference, judge

ROWS = [(1, 32768, 40, 8, 128, 8192), (2, 16384, 40, 8, 128, 8192), (4, 8192, 40, 8, 128, 2048)]


def visible_pairs(seqlen: int, chunk: int) -> int:
    """Causal pairs under the chunk mask, equal lengths: row a sees a % C + 1 keys."""
    full, rest = divmod(seqlen, chunk)
    return full * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2


def main():
    try:
        fa3 = importlib.import_module("flash_attn_interface").flash_attn_func
    except Exception:
        fa3 = None
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


if __name__ == "__main__":
    main()
