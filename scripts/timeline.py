"""Where a forward work item's time goes, per consumer warpgroup, on the GPU.

Runs the ``timeline`` kernel variant (scripts/variants/timeline.patch), whose
consumers write the SM's ``%clock`` at seven points of every work item (the
first 64 per CTA) into a buffer, and prints per phase the median cycles per
item and the share of the traced time:

    python scripts/kernel_variant.py timeline .wt/tl
    PYTHONPATH=.wt/tl python -P scripts/timeline.py [--seqlen 2048 8192] [--headdim 128]

Phases of ``_consumer_tile`` (kernels/forward.py): ``q`` waiting for the
item's Q, ``k0`` for its first K tile, ``prologue`` the first QK and its
softmax, ``steady`` the QK/PV steps (also per step), ``last_pv`` the final PV
and the normalisation, ``epilogue`` the O store, and ``between`` the time
from one item's end to the next one's start (the scheduler's handoff, the
next item's coordinates). The variant's kernel is not the shipped one (its
stores add a little): read shares, not absolute speed.
"""
import argparse

import torch

import hopper_flash
from hopper_flash import plan

PHASES = ("q", "k0", "prologue", "steady", "last_pv", "epilogue")


def trace(batch, seqlen, heads, head_dim, causal):
    if not hasattr(plan, "TRACE"):
        raise SystemExit("run with PYTHONPATH pointing at the timeline variant (see the docstring), with python -P")
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    hopper_flash.flash_attn_func(q, k, v, causal=causal)  # compile and warm up (traces land in the output)
    # The JIT, not the cached fast launch: the buffer is fp32 where the warm-up's was the bf16 output, and
    # only the JIT specialises the kernel on a pointer's dtype.
    plan.FAST_LAUNCH = False
    sms = plan.sm_count()
    plan.TRACE = torch.zeros(sms * 3 * 64 * 8, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    hopper_flash.flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
    t = plan.TRACE.view(torch.int32).view(sms, 3, 64, 8).cpu().to(torch.int64)
    plan.TRACE = None
    return t


def report(t, label):
    wrap = 1 << 32
    per_phase = {p: [] for p in PHASES + ("between", "step")}
    totals = {p: 0 for p in PHASES + ("between",)}
    traced = 0
    for cta in range(t.shape[0]):
        for wg in range(3):  # consumer warpgroups: two, or three on wide tiles (plan.WIDE_CONFIGS)
            ev = t[cta, wg]
            n = int((ev[:, 7] > 0).sum())
            for i in range(n):
                e = ev[i]
                d = [int((e[j + 1] - e[j]) % wrap) for j in range(6)]
                for p, x in zip(PHASES, d):
                    per_phase[p].append(x)
                    totals[p] += x
                if e[7] > 1:
                    per_phase["step"].append(d[3] / int(e[7] - 1))
                if i + 1 < n:
                    g = int((ev[i + 1][0] - e[6]) % wrap)
                    per_phase["between"].append(g)
                    totals["between"] += g
            if n:
                traced += int((ev[n - 1][6] - ev[0][0]) % wrap)
    print(f"## {label}: {len(per_phase['q'])} items traced, cycles")
    print_phases(PHASES + ("between",), per_phase, totals, traced)
    print_row("per step", per_phase["step"])


def print_phases(names, samples, totals, traced):
    """The phase table (shared with scripts/bwd_timeline.py): per phase the
    median and mean cycles of its samples and its share of the traced time."""
    print(f"{'phase':10} {'median':>8} {'mean':>8} {'share':>7}")
    for p in names:
        if samples[p]:
            xs = torch.tensor(samples[p], dtype=torch.float64)
            print(f"{p:10} {xs.median().item():8.0f} {xs.mean().item():8.0f} {totals[p] / traced:7.1%}")


def print_row(name, samples, width=10):
    """A row of median and mean cycles, without a share; none for no samples."""
    if samples:
        xs = torch.tensor(samples, dtype=torch.float64)
        print(f"{name:{width}} {xs.median().item():8.0f} {xs.mean().item():8.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--wide", action="store_true",
                    help="run the wide tiles (plan.WIDE_CONFIGS) at every length, not only where plan.choose_wide picks them")
    args = ap.parse_args()
    if args.wide:
        plan.WIDE_MIN_KEYS_FULL = plan.WIDE_MIN_KEYS_CAUSAL = plan.WIDE_MIN_ROWS = 0
    print("hopper_flash from", hopper_flash.__file__)
    for s in args.seqlen:
        for causal in (True, False):
            label = f"B{args.batch} H{args.heads} S{s} D{args.headdim} {'causal' if causal else 'full'}"
            report(trace(args.batch, s, args.heads, args.headdim, causal), label)


if __name__ == "__main__":
    main()
