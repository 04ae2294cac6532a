"""What a kernel's steady-state loop does, read from its SASS on the CPU.

Compiles one specialisation for sm_90a (no GPU: ``compile_check``), finds the
loops that hold both wgmma (HGMMA) and exponentials (MUFU.EX2), and prints for
each its instruction count, the opcodes that matter for the step's critical
path, and the order of its synchronisation events: HGMMA groups, wgmma waits
(``WARPGROUP.DEPBAR.LE gsb0, N``), named barriers (``BAR.SYNC``), mbarrier
waits and arrives (``SYNCS``), runs of MUFU and F2FP, branches. The source
order is not the SASS order: the thirteenth session found ptxas hoisting each
wgmma wait to the top of its basic block, so the forward's softmax ran after
PV had completed (BENCHMARKS.md); ``exps in flight`` counts the exponentials
issued while a wgmma group is still pending (between ``LE 1`` and ``LE 0``).

    python scripts/sass_flow.py --headdim 128 [--causal] [--wide] [--backward] [--flow]
    PYTHONPATH=COPY python -P scripts/sass_flow.py ...   (a variant's copy)
"""
from __future__ import annotations

import argparse
import re
from collections import Counter

from hopper_flash.compile_check import exps_in_flight, instructions, steady_loops

KEY_OPS = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "F2FP", "SHFL", "BAR", "SYNCS", "LDS", "STS",
           "LDL", "STL")


def opcode(text: str) -> str:
    words = text.split()
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def flow(body: list[tuple[int, str]]) -> list[str]:
    """The body's events in SASS order, runs of one opcode collapsed."""
    events, last, run = [], None, 0
    for addr, text in body:
        op = opcode(text)
        if op in ("HGMMA", "MUFU", "F2FP"):
            key = op if op != "HGMMA" else "HGMMA " + ("(A from registers)" if re.search(r"HGMMA\S* R\d+, R\d+", text)
                                                      else "(A from shared)")
        elif op in ("BAR", "SYNCS", "BRA", "WARPGROUP", "DEPBAR"):
            key = text
        else:
            continue
        if key == last and op in ("HGMMA", "MUFU", "F2FP"):
            run += 1
            continue
        if run > 1:
            events[-1] += f"  x{run}"
        events.append(f"{addr:05x}  {key}")
        last, run = key, 1
    if run > 1:
        events[-1] += f"  x{run}"
    return events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--wide", action="store_true", help="the forward's three-consumer tiles (head dim 64)")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--flow", action="store_true", help="print every loop's event order")
    args = ap.parse_args()

    if args.backward:
        from hopper_flash import compile_check_backward as ccb
        from hopper_flash.plan_backward import BACKWARD_CONFIGS

        report = ccb.census(BACKWARD_CONFIGS[args.headdim], args.dtype, args.causal, False)
    else:
        from hopper_flash import compile_check, plan

        cfg = (plan.WIDE_CONFIGS if args.wide else plan.CONFIGS)[args.headdim]
        report = compile_check.census(cfg, args.dtype, args.causal, False, plan.PREFILL)
    import hopper_flash

    print(f"hopper_flash from {hopper_flash.__file__}; registers {report.registers}, stack {report.stack_bytes} B")
    for n, body in enumerate(steady_loops(instructions(report.sass))):
        counts = Counter(opcode(t) for _, t in body)
        print(f"loop {n}: {body[0][0]:05x}..{body[-1][0]:05x}, {len(body)} instructions, "
              f"exps in flight {exps_in_flight(body)} of {counts['MUFU']} MUFU")
        print("   " + ", ".join(f"{op} {counts[op]}" for op in KEY_OPS if counts[op]))
        if args.flow:
            for event in flow(body):
                print("     " + event)


if __name__ == "__main__":
    main()
