"""Why a short backward's median moves between processes (the B16 H16 S1024
causal row of the bwd block read 0.51 ms in some processes and 0.60-0.71 in
others, with single calls up to 3.9 ms; nineteenth session).

One process, our backward alone on the bench's shape, timed per call with
CUDA events in three loops: back to back (host ahead of the GPU), with an L2
flush before each call (as `do_bench` does), and with a synchronise before
each call (the GPU idles while the host enqueues: the call's host time shows).
Per loop: median / p90 / max ms, and the caching allocator's device
allocations and frees during the loop (a cudaMalloc or cudaFree inside a
timed loop is a synchronous stall).

    PYTHONPATH=. python -P scripts/bwd_short_timing.py [--batch 16 --heads 16 --seqlen 1024]
"""
import argparse
import statistics

import torch

import hopper_flash


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    torch.manual_seed(0)
    shape = (a.batch, a.seqlen, a.heads, a.headdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = hopper_flash.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")

    def call():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    for mode in ("back-to-back", "l2-flush", "sync-each"):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(a.calls)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(a.calls)]
        before = torch.cuda.memory_stats()
        for i in range(a.calls):
            if mode == "l2-flush":
                flush.zero_()
            elif mode == "sync-each":
                torch.cuda.synchronize()
            starts[i].record()
            call()
            ends[i].record()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        allocs = after["num_device_alloc"] - before["num_device_alloc"]
        frees = after["num_device_free"] - before["num_device_free"]
        print(f"{mode:13s} median {statistics.median(ms):.3f}  p90 {ms[int(0.9 * len(ms))]:.3f}  "
              f"max {ms[-1]:.3f} ms; device allocs {allocs}, frees {frees}, "
              f"alloc retries {after['num_alloc_retries'] - before['num_alloc_retries']}")


if __name__ == "__main__":
    main()
