"""Where a short backward's host time goes inside a ``do_bench``-like loop,
in one process (run it in several: the B16 H16 S1024 row of the bwd block
read host-bound in some processes and not in others).

Per iteration, as ``triton.testing.do_bench`` does it: the L2 flush, the
start event, the call (``torch.autograd.grad``), the end event. Host
timestamps split the call into: the autograd engine reaching our backward
(``wake``: main thread to the engine's device thread), our backward up to
its first launch (``pre-launch``), the three launches (``launch``), the
rest of our backward and the way back to the main thread (``return``).
Medians and p90 in µs, the GPU's time per call (events) and the whole
iteration's host time; then SDPA cuDNN's backward in the same loop.

    PYTHONPATH=. python -P scripts/bwd_host_phases.py [--batch 16 --heads 16 --seqlen 1024]
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import hopper_flash
from hopper_flash import plan_backward

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=16)
p.add_argument("--heads", type=int, default=16)
p.add_argument("--seqlen", type=int, default=1024)
p.add_argument("--iters", type=int, default=300)
a = p.parse_args()

marks = {}
_backward, _launch = plan_backward.backward, plan_backward.launch_backward


def backward(*args, **kwargs):
    marks["enter"] = time.perf_counter()
    r = _backward(*args, **kwargs)
    marks["exit"] = time.perf_counter()
    return r


def launch_backward(*args, **kwargs):
    marks["launch0"] = time.perf_counter()
    _launch(*args, **kwargs)
    marks["launch1"] = time.perf_counter()


plan_backward.backward, plan_backward.launch_backward = backward, launch_backward

torch.manual_seed(0)
shape = (a.batch, a.seqlen, a.heads, 128)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = hopper_flash.flash_attn_func(q, k, v, causal=True)
dout = torch.randn_like(out)
qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    oc = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
calls = {"hopper_flash": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
         "cudnn": lambda: torch.autograd.grad(oc, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)}
flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
print(f"pid {os.getpid()}, cpus {len(os.sched_getaffinity(0))}, torch {torch.__version__}")


def q50_90(xs):
    xs = sorted(xs)
    return f"{statistics.median(xs):7.1f} / {xs[int(0.9 * len(xs))]:7.1f}"


for name, fn in calls.items():
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    rec = []
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters)]
    for i in range(a.iters):
        t0 = time.perf_counter()
        flush.zero_()
        starts[i].record()
        t1 = time.perf_counter()
        marks.clear()
        fn()
        t2 = time.perf_counter()
        ends[i].record()
        rec.append((t0, t1, t2, dict(marks)))
    torch.cuda.synchronize()
    gpu = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    it = [rec[i + 1][0] - rec[i][0] for i in range(len(rec) - 1)]
    print(f"== {name}: GPU per call (median / p90 us) {q50_90(gpu)}, min {min(gpu):.1f}; "
          f"host per iteration {q50_90([1e6 * x for x in it])}; call {q50_90([1e6 * (r[2] - r[1]) for r in rec])}")
    if name == "hopper_flash":
        for label, f in (("wake", lambda r: r[3]["enter"] - r[1]),
                         ("pre-launch", lambda r: r[3]["launch0"] - r[3]["enter"]),
                         ("launch", lambda r: r[3]["launch1"] - r[3]["launch0"]),
                         ("return", lambda r: r[2] - r[3]["launch1"])):
            print(f"   {label:10s} {q50_90([1e6 * f(r) for r in rec])}")
