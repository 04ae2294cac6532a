"""Where the backward's time goes, per step of the split-keys consumers
(D=64 and D=128), on the GPU.

Runs the ``bwd-timeline`` kernel variant (scripts/variants/bwd-timeline.patch),
whose consumers write the SM's ``%clock`` at nine points of each of a CTA's
first 63 steps, and at its start, K/V arrival and end, into a buffer
(written by the consumers' first thread: warpgroup 0's view; the two
warpgroups meet at two barriers per step). Prints per phase the median and
mean cycles and the share of the traced steps' time:

    python scripts/kernel_variant.py bwd-timeline .wt/btl
    PYTHONPATH=.wt/btl python -P scripts/bwd_timeline.py [--seqlen 8192] [--headdim 128]

``bwd-persistent-timeline`` is the same on the persistent grid at D=128
(every fixed-length fast call), traced per item (KV tile) rather than per CTA,
steps counted from each item's first. Both record each item's CTA and SM,
so the report also gives the gap between consecutive items on one SM (the
previous item's end to the next one's start: a CTA's exit and the next
one's launch on the one-CTA-per-tile grid, the hand-off on the persistent
one) and the items per SM.

Phases of a step (``_bwd_consumer_split_keys``, ``_p_and_ds``):
``wait_q`` the wait for Q (and its L2), ``st`` the wait for Sᵀ (issued with
dPᵀ behind it), ``p_ds`` P, the wait for dPᵀ and dS, ``dv_ds`` dV's issue,
dSᵀ to shared memory and the wait for the previous dQ reduce to have read
its staging tile, ``bar1`` the first barrier (both warpgroups' dSᵀ),
``dq_dk`` the dQ and dK issue and the wait for dV and dQ, ``dq_stage`` dQ
to its staging tile and the second barrier, ``dq_add`` the reduce's issue
and the wait for dK; ``between`` from one step's end to the next one's
start. The variant's kernel is not the shipped one (the clock reads and
stores add a little): read shares, not absolute speed.
"""
import argparse
import os
import sys

import torch

import hopper_flash
from hopper_flash import plan_backward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the script's folder out
from timeline import print_phases, print_row  # noqa: E402

STEP_PHASES = ("wait_q", "st", "p_ds", "dv_ds", "bar1", "dq_dk", "dq_stage", "dq_add")
STEPS, EVENTS = 64, 10


def trace(batch, seqlen, heads, head_dim, causal):
    if not hasattr(plan_backward, "TRACE"):
        raise SystemExit("run with PYTHONPATH pointing at the bwd-timeline variant (see the docstring), with python -P")
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = hopper_flash.flash_attn_func(q, k, v, causal=causal)
    grad = torch.randn_like(out)
    out.backward(grad, retain_graph=True)  # compile and warm up
    cfg = plan_backward.BACKWARD_CONFIGS[head_dim]
    ctas = plan_backward.grid(batch, heads, seqlen, cfg)[0]
    plan_backward.TRACE = torch.zeros(ctas * STEPS * EVENTS, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    out.backward(grad)
    torch.cuda.synchronize()
    t = plan_backward.TRACE.view(torch.int32).view(ctas, STEPS, EVENTS).cpu().to(torch.int64)
    plan_backward.TRACE = None
    return t


def report(t, label):
    wrap = 1 << 32
    phases = {p: [] for p in STEP_PHASES + ("between", "step")}
    cta = {"kv_wait": [], "to_first_step": [], "epilogue": []}
    spans = {}  # SM -> [(start, end)] of its items
    totals = {p: 0 for p in STEP_PHASES + ("between",)}
    traced = 0
    for c in range(t.shape[0]):
        ev = t[c]
        n = int((ev[:STEPS - 1, 8] != 0).sum())
        for i in range(n):
            d = [int((ev[i, j + 1] - ev[i, j]) % wrap) for j in range(8)]
            for p, x in zip(STEP_PHASES, d):
                phases[p].append(x)
                totals[p] += x
            phases["step"].append(int((ev[i, 8] - ev[i, 0]) % wrap))
            if i + 1 < n:
                g = int((ev[i + 1, 0] - ev[i, 8]) % wrap)
                phases["between"].append(g)
                totals["between"] += g
        if n:
            traced += int((ev[n - 1, 8] - ev[0, 0]) % wrap)
            s = ev[STEPS - 1]
            cta["kv_wait"].append(int((s[1] - s[0]) % wrap))
            cta["to_first_step"].append(int((ev[0, 0] - s[1]) % wrap))
            if n < STEPS - 1:  # every step traced: the epilogue follows the last one
                cta["epilogue"].append(int((s[2] - ev[n - 1, 8]) % wrap))
        s = ev[STEPS - 1]
        spans.setdefault(int(s[5]), []).append((int(s[0]) % wrap, int(s[2]) % wrap))  # unsigned clocks
    print(f"## {label}: {len(phases['step'])} steps traced in {t.shape[0]} items (CTAs or tiles), cycles")
    print_phases(STEP_PHASES + ("between",), phases, totals, traced)
    print_row("step", phases["step"])
    for p, xs in cta.items():
        print_row("cta " + p, xs, width=18)
    if len(spans) > 1:  # SM ids recorded (a variant before the forty-first session wrote none)
        gaps = []
        for items in spans.values():
            starts = [a for a, _ in items]
            if max(starts) - min(starts) > wrap // 2:  # the 32-bit clock wrapped during the run
                items = [((a + wrap if a < wrap // 2 else a), (b + wrap if b < wrap // 2 else b)) for a, b in items]
            items.sort()
            gaps += [(nxt[0] - prev[1]) % wrap for prev, nxt in zip(items, items[1:])]
        print_row("gap between items on an SM", gaps, width=28)
        print_row("items per SM", [len(v) for v in spans.values()], width=28)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[8192])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--headdim", type=int, nargs="+", default=[128])
    args = ap.parse_args()
    print("hopper_flash from", hopper_flash.__file__)
    for d in args.headdim:
        if plan_backward.BACKWARD_CONFIGS[d].split_d:
            raise SystemExit(f"head dim {d}: the timeline traces the split-keys consumers (D <= 128) only")
        for s in args.seqlen:
            for causal in (True, False):
                label = f"B{args.batch} H{args.heads} S{s} D{d} {'causal' if causal else 'full'}"
                report(trace(args.batch, s, args.heads, d, causal), label)


if __name__ == "__main__":
    main()
