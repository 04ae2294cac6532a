"""Host time of a decode call with attention sinks (gpt-oss's decode step:
one query row, a model's bf16 sinks), against the same call without: the
enqueue time per call over many calls in one process (the GPU work queues
behind; a sync at the end), medians of rounds. The transformers backend's
decode steps are host-bound, so this is what a sink costs a generated
token per layer.

    PYTHONPATH=. python -P scripts/sink_host.py
"""
from __future__ import annotations

import statistics
import time

import torch

import hopper_flash


def per_call_us(fn, calls: int = 300, rounds: int = 7) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    print(f"torch {torch.__version__}, hopper_flash from {hopper_flash.__file__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    # gpt-oss-20b's attention: 64 query heads on 8 KV heads, head dim 64, bf16.
    for batch, cache in ((1, 4096), (8, 4096), (1, 32768)):
        q = torch.randn(batch, 1, 64, 64, device="cuda", generator=gen).bfloat16()
        k = torch.randn(batch, cache, 8, 64, device="cuda", generator=gen).bfloat16()
        v = torch.randn_like(k)
        s = torch.randn(64, device="cuda", generator=gen).bfloat16()
        with torch.no_grad():
            plain = per_call_us(lambda: hopper_flash.flash_attn_func(q, k, v, causal=True))
            sink = per_call_us(lambda: hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=s))
        print(f"B{batch} cache {cache}: plain {plain:6.1f} us/call, bf16 sinks {sink:6.1f} us/call "
              f"({sink - plain:+.1f})")


if __name__ == "__main__":
    main()
