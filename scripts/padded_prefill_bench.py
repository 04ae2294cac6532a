"""One padded prefill's attention through the transformers backend
(``hopper_flash_attention_forward`` with the 2-D padding mask), k and v in
the BHSD layout a KV cache holds them in (``DynamicCache`` after its first
update, a static cache's buffer), q in the BSHD layout its projection
makes, as a model hands them over. Every output is judged against the
float64 reference over each row's run (NaN outside the runs, in the
padding).

    PYTHONPATH=. python -P scripts/padded_prefill_bench.py [--shape B,H,HK,S ...]
    PYTHONPATH=OTHER_TREE python -P scripts/padded_prefill_bench.py   (another package, e.g. main's)

Row ``b`` is left-padded by ``b * S // (2 * B)`` tokens; causal, D128,
bf16, no gradient; ``do_bench`` medians (us) of plain calls and of CUDA-graph
replay, and TFLOP/s over the live runs (causal: half of 4·H·L²·D per row)."""
from __future__ import annotations

import argparse
import math

import torch
import triton

import hopper_flash
from hopper_flash.integrations import transformers as hft
from hopper_flash.reference import check_kvcache


class _Module(torch.nn.Module):
    is_causal = True


def row(b, h, hk, s, d=128):
    torch.manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # BSHD, as projected
    k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")  # BHSD, as cached
    starts = [i * s // (2 * b) for i in range(b)]
    mask = torch.ones(b, s, dtype=torch.long, device="cuda")
    for i, lo in enumerate(starts):
        mask[i, :lo] = 0
        k[i, :, :lo] = v[i, :, :lo] = math.nan
    scale = d ** -0.5
    flops = sum(2 * h * (s - lo) ** 2 * d for lo in starts)  # causal: half of 4·H·L²·D
    f = lambda: hft.hopper_flash_attention_forward(_Module(), q, k, v, mask, scaling=scale)[0]  # noqa: E731
    with torch.no_grad():
        out = f()
        # Each row's live queries are its run's tokens: judged as a KV cache call over its run, on the
        # first KV head's group of query heads (the float64 reference's memory).
        g = h // hk
        ok = all(all(check_kvcache(out[i:i + 1, lo:, :g], q[i:i + 1, :g, lo:].transpose(1, 2),
                                   k[i:i + 1, :1].transpose(1, 2), v[i:i + 1, :1].transpose(1, 2), [s],
                                   starts=[lo], causal=True, softmax_scale=scale)) for i, lo in enumerate(starts))
        ok = ok and all(bool((out[i, :lo] == 0).all()) for i, lo in enumerate(starts))  # padded queries: 0
        plain = triton.testing.do_bench(f, warmup=10, rep=200) * 1e3
        graph = triton.testing.do_bench_cudagraph(f, rep=200) * 1e3
    print(f"B{b} H{h}/{hk} S{s} D{d} left-padded by {s // (2 * b)}·b ({hopper_flash.__file__}): "
          f"{'ok  ' if ok else 'FAIL'} plain {plain:8.1f} us  graph {graph:8.1f} us  "
          f"{flops / (graph * 1e-6) / 1e12:6.1f} TFLOP/s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", nargs="*", default=["4,32,8,4096", "8,32,8,2048", "2,32,8,16384"])
    args = p.parse_args()
    for shape in args.shape:
        row(*(int(x) for x in shape.split(",")))


if __name__ == "__main__":
    main()
