"""Host time of one varlen backward call (``plan_backward.backward_varlen``),
its launches queued without a sync: the per-call cost of the Python path
(planning lookups, allocations, launches), which bounds short backwards.

Each iteration issues one call; the loop's wall time over ``--iters`` calls
is divided by their number (the GPU runs behind: the shapes are small, so
its queue never fills). A fixed-length backward of the same tokens is timed
the same way beside it, as a control. Run it once per package to compare
(``PYTHONPATH=PKG python -P scripts/varlen_bwd_host.py``); the header says
which package ran.

    PYTHONPATH=. python -P scripts/varlen_bwd_host.py [--lengths 100 37 250 1] [--iters 2000]
"""
import argparse
import statistics
import time

import torch

import hopper_flash
from hopper_flash import dispatch, plan_backward
from hopper_flash.plan_backward import VarlenBatch

p = argparse.ArgumentParser()
p.add_argument("--lengths", type=int, nargs="+", default=[100, 37, 250, 1])
p.add_argument("--heads", type=int, default=8)
p.add_argument("--head-dim", type=int, default=128)
p.add_argument("--iters", type=int, default=2000)
p.add_argument("--rounds", type=int, default=5)
a = p.parse_args()
print("hopper_flash from", hopper_flash.__file__)

dev = "cuda"
lens = a.lengths
total = sum(lens)
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
q, k, v = (torch.randn(total, a.heads, a.head_dim, device=dev, dtype=torch.bfloat16) for _ in range(3))
dout = torch.randn_like(q)
varlen = VarlenBatch(cu, cu, None, None, max(lens), max(lens))
scale = a.head_dim ** -0.5
out, lse = dispatch.forward_varlen(q, k, v, cu, cu, max(lens), max(lens), None, None, scale, True, True)
qf, kf, vf = (t.unsqueeze(0) for t in (q, k, v))
outf, lsef = dispatch.forward(qf, kf, vf, scale, True, True)
doutf = dout.unsqueeze(0)


def varlen_call():
    plan_backward.backward_varlen(dout, q, k, v, out, lse, varlen, scale, True)


def fixed_call():
    plan_backward.backward(doutf, qf, kf, vf, outf, lsef, scale, True)


for name, fn in (("varlen", varlen_call), ("fixed", fixed_call)):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        for _ in range(a.iters):
            fn()
        per_call.append((time.perf_counter() - t0) / a.iters * 1e6)
        torch.cuda.synchronize()
    print(f"{name:7s} host us/call: median {statistics.median(per_call):.1f}  rounds "
          + " ".join(f"{x:.1f}" for x in per_call))
