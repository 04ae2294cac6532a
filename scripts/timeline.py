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
# The step-timeline variants write their extra trace at this many CTAs' item
# traces from the start (a fixed offset past any grid: kernels/forward.py's
# ``_trace_step`` in those patches).
STEP_BASE_CTAS = 1024
ITEM_WORDS = 3 * 64 * 8  # per CTA: three consumer slots, 64 items, 8 events


def trace(batch, seqlen, heads, head_dim, causal, step_words=0):
    """The item trace [SMs, 3, 64, 8] (int64 clocks; CTAs past the grid
    zero) and the wall time in us; ``step_words``: int32 words per CTA of
    extra trace (the ``fwd-step-timeline`` variants, scripts/step_timeline.py),
    returned as a third item [SMs, step_words]."""
    if not hasattr(plan, "TRACE"):
        raise SystemExit("run with PYTHONPATH pointing at the timeline variant (see the docstring), with python -P")
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    hopper_flash.flash_attn_func(q, k, v, causal=causal)  # compile and warm up (traces land in the output)
    # The JIT, not the cached fast launch: the buffer is fp32 where the warm-up's was the bf16 output, and
    # only the JIT specialises the kernel on a pointer's dtype.
    plan.FAST_LAUNCH = False
    sms = plan.sm_count()
    size = STEP_BASE_CTAS * ITEM_WORDS + sms * step_words if step_words else sms * ITEM_WORDS
    plan.TRACE = torch.zeros(size, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    hopper_flash.flash_attn_func(q, k, v, causal=causal)
    end.record()
    torch.cuda.synchronize()
    words = plan.TRACE.view(torch.int32).cpu().to(torch.int64)
    plan.TRACE = None
    t = words[:sms * ITEM_WORDS].view(sms, 3, 64, 8)
    wall_us = start.elapsed_time(end) * 1000.0
    if step_words:
        base = STEP_BASE_CTAS * ITEM_WORDS
        return t, wall_us, words[base:base + sms * step_words].view(sms, step_words)
    return t, wall_us


def report(t, label, wall_us=None):
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
    print_ctas(t, wall_us)


def print_ctas(t, wall_us):
    """Per CTA (first 64 items of each consumer): its span from the first
    item's start to the last item's end, the items' own cycles (busy), and
    the item count. A static deal that spreads the work unevenly shows as
    spans far apart; slow items as spans near the kernel's wall time with
    busy close to span. Spans are in the SM's clock; the wall time (CUDA
    events around the traced launch, trace stores included) is in us."""
    wrap = 1 << 32
    spans, busy, items = [], [], []
    for cta in range(t.shape[0]):
        ev = t[cta]
        counts = [int((ev[wg, :, 7] > 0).sum()) for wg in range(ev.shape[0])]
        live = [wg for wg in range(ev.shape[0]) if counts[wg]]
        if not live:
            continue
        t0 = int(ev[live[0], 0, 0])

        def since_t0(clock):  # signed cycles from t0, across a wrap of the 32-bit clock
            return (int(clock) - t0 + wrap // 2) % wrap - wrap // 2
        first = min(since_t0(ev[wg, 0, 0]) for wg in live)
        last = max(since_t0(ev[wg, counts[wg] - 1, 6]) for wg in live)
        spans.append(last - first)
        busy.append(max(sum(int((ev[wg, i, 6] - ev[wg, i, 0]) % wrap) for i in range(counts[wg])) for wg in live))
        items.append(counts[live[0]])
    if not spans:
        return
    xs = torch.tensor(spans, dtype=torch.float64)
    print(f"CTAs {len(spans)}: span min {xs.min().item():.0f} median {xs.median().item():.0f} "
          f"max {xs.max().item():.0f} cycles; busy/span {sum(busy) / sum(spans):.0%}; items per CTA "
          f"{min(items)}-{max(items)}" + (f"; wall {wall_us:.1f} us" if wall_us is not None else ""))


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
            t, wall_us = trace(args.batch, s, args.heads, args.headdim, causal)
            report(t, label, wall_us)


if __name__ == "__main__":
    main()
