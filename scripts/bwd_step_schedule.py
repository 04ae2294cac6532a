"""How ptxas scheduled the D=128 backward's step, persistent against one CTA
per tile, on the CPU (no GPU: ``compile_check_backward``).

The forty-third session found the persistent kernel's step ~4% slower than
the one-CTA kernel's in cycles, on either grid (BENCHMARKS.md), while the
two step loops are the same PTX: ptxas schedules them differently. This
prints, for the causal fast-mode kernel of each kind, the unmasked step
path (the loop with the diagonal's mask block left out) as

* its instruction count,
* where the first exponential (``MUFU.EX2``) issues, counted from the Sᵀ
  wait (``WARPGROUP.DEPBAR.LE gsb0, 0x1``),
* how many of the 32 exponentials issue before the dPᵀ wait (``... 0x0``),
* local memory accesses in the loop,

and how much of the persistent kernel's unmasked path matches the one-CTA
kernel's, registers renamed (1.0: the same schedule).

    python -P scripts/bwd_step_schedule.py
    PYTHONPATH=COPY python -P scripts/bwd_step_schedule.py   (an edited copy)

These marks describe the schedule; they do not predict its speed: the
forty-fourth session gave the varlen persistent kernel the one-CTA
kernel's marks (variant ``bwd-dq-buf-and``, text at 6690b0c) and its
backward timed level (BENCHMARKS.md).

``TRITON_ALWAYS_COMPILE=1`` is set: triton's cache would otherwise hand back
the last build of an edited copy's kernel.
"""
from __future__ import annotations

import difflib
import os
import re

os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")

import hopper_flash  # noqa: E402
from hopper_flash import compile_check_backward as ccb  # noqa: E402
from hopper_flash.compile_check import exps_in_flight, instructions, steady_loops  # noqa: E402
from hopper_flash.plan_backward import BACKWARD_CONFIGS  # noqa: E402


def unmasked_step(short_rows: bool):
    """(unmasked path of the step loop, the whole loop, stack bytes)."""
    report = ccb.census(BACKWARD_CONFIGS[128], "bfloat16", True, False, short_rows=short_rows)
    loop = steady_loops(instructions(report.sass))[0]
    for k, (_, text) in enumerate(loop):
        m = re.search(r"BRA P\d, (0x[0-9a-f]+)", text)  # the mask branch: jumps over the mask block
        if m:
            target = int(m.group(1), 16)
            path = [t for _, t in loop[:k + 1]] + [t for a, t in loop if a >= target]
            return path, loop, report.stack_bytes
    raise SystemExit("no mask branch in the step loop: the kernel's structure changed")


def normalise(text: str) -> str:
    text = re.sub(r"0x[0-9a-f]+", "X", text)
    text = re.sub(r"\bU?R\d+\b", "R", text)
    text = re.sub(r"\bU?P\d\b", "P", text)
    return text.replace(".reuse", "").strip()


def describe(name: str, path, loop, stack) -> None:
    st_wait = next(i for i, t in enumerate(path) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t)
    exps = [i for i, t in enumerate(path) if "MUFU.EX2" in t]
    local = sum(("LDL" in t or "STL" in t) for _, t in loop)
    # exps_in_flight: those between the Sᵀ wait and the dPᵀ wait.
    print(f"{name:10s} {len(path):5d} instructions, first EX2 +{exps[0] - st_wait}, "
          f"{exps_in_flight([(0, t) for t in path])} of {len(exps)} EX2 before the dP wait, "
          f"{local} local accesses in the loop, stack {stack} B")


def main() -> None:
    print(f"hopper_flash from {hopper_flash.__file__}")
    one = unmasked_step(False)
    persistent = unmasked_step(True)
    describe("one CTA", *one)
    describe("persistent", *persistent)
    match = difflib.SequenceMatcher(a=[normalise(t) for t in one[0]], b=[normalise(t) for t in persistent[0]],
                                    autojunk=False)
    print(f"persistent against one CTA, registers renamed: {match.ratio():.4f} alike")


if __name__ == "__main__":
    main()
