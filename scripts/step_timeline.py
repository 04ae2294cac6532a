"""Where a forward *step* goes, per consumer warpgroup, on the GPU.

Runs the ``fwd-step-timeline`` kernel variant (scripts/variants/: the
``timeline`` variant plus clocks inside the steady loop): each consumer's
first item records, for steps 1..48, the SM's ``%clock`` at five points,
and this prints the median cycles of each phase and how the two (or three)
consumers of a CTA sit against each other in time:

    python scripts/kernel_variant.py fwd-step-timeline .wt/stl
    PYTHONPATH=.wt/stl python -P scripts/step_timeline.py [--seqlen 8192] [--headdim 128]

Points: ``top`` the loop's head, ``issue`` K and V landed (QK and PV are
issued next), ``qk`` QK complete, ``sm`` PV complete, ``end`` O rescaled
and P converted. Phases: ``kv_wait`` (top to issue), ``qk`` (issue to qk:
the QK's latency, including any queueing behind the other warpgroups'
GEMMs), ``softmax`` (qk to sm), ``rescale`` (sm to end), ``loop`` (end to
the next top). What lies between ``qk`` and ``sm`` depends on the head
dim's schedule (kernels/forward.py's docstring; the variant keeps the
shipped SASS order): at head dim 128 (``MAX_BEFORE_PV``) the row maximum
and the wait for PV, the exponentials falling in ``rescale``; elsewhere,
where ptxas hoists the PV wait above the softmax, the wait for PV and the
whole softmax (``PV_AFTER_SOFTMAX``: the softmax, then the wait).

``offset``: per CTA and step, consumer 1's issue time minus consumer 0's,
as a fraction of consumer 0's step: near 0 the two issue together (their
softmaxes coincide, the tensor cores idle while both run them), near 0.5
they alternate. The variant's clock reads add a little to each step: read
shares and offsets, not absolute speed.
"""
import argparse
import os
import sys

import torch

import hopper_flash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python -P leaves the script's folder off the path
from timeline import print_row, trace  # noqa: E402

STEPS, EVENTS = 48, 8
SLOTS = (0, 1, 2, 4, 5)  # the points top, issue, qk, sm, end
PHASES = ("kv_wait", "qk", "softmax", "rescale", "loop")


def report(steps, label, n_consumers):
    wrap = 1 << 32
    samples = {p: [] for p in PHASES + ("step",)}
    offsets = []
    for cta in range(steps.shape[0]):
        ev = steps[cta].view(3, STEPS, EVENTS)
        for wg in range(n_consumers):
            for j in range(STEPS):
                e = [int(ev[wg, j, s]) for s in SLOTS]
                if not all(e):
                    break
                d = [(e[i + 1] - e[i]) % wrap for i in range(4)]
                for p, x in zip(PHASES[:4], d):
                    samples[p].append(x)
                if j + 1 < STEPS and int(ev[wg, j + 1, 0]):
                    samples["loop"].append((int(ev[wg, j + 1, 0]) - e[4]) % wrap)
                    samples["step"].append((int(ev[wg, j + 1, 1]) - e[1]) % wrap)
        for j in range(STEPS - 1):
            a0, a1, b0 = int(ev[0, j, 1]), int(ev[0, j + 1, 1]), int(ev[1, j, 1])
            if a0 and a1 and b0:
                step = (a1 - a0) % wrap
                if step:
                    offsets.append(((b0 - a0 + wrap // 2) % wrap - wrap // 2) / step)
    print(f"## {label}: {len(samples['qk'])} steps traced, cycles")
    print(f"{'phase':10} {'median':>8} {'mean':>8}")
    for p in PHASES + ("step",):
        print_row(p, samples[p])
    if offsets:
        xs = torch.tensor(offsets, dtype=torch.float64)
        q = torch.quantile(xs, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64))
        print("offset (consumer 1 - consumer 0, fraction of a step): p10 {:.2f} p25 {:.2f} median {:.2f} "
              "p75 {:.2f} p90 {:.2f}".format(*q.tolist()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[8192])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--headdim", type=int, default=128)
    args = ap.parse_args()
    print("hopper_flash from", hopper_flash.__file__)
    n_consumers = 2
    for s in args.seqlen:
        for causal in (True, False):
            label = f"B{args.batch} H{args.heads} S{s} D{args.headdim} {'causal' if causal else 'full'}"
            _, wall_us, steps = trace(args.batch, s, args.heads, args.headdim, causal,
                                      step_words=3 * STEPS * EVENTS)
            report(steps, label + f" (wall {wall_us:.0f} us)", n_consumers)


if __name__ == "__main__":
    main()
