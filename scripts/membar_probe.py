"""Where triton's Gluon puts a partition-wide ``bar.sync`` around mbarrier
operations (CPU only: compiles small kernels for sm_90a and prints the PTX's
barrier and mbarrier lines per case).

Under triton 3.6 (thirteenth session) every mbarrier arrive is preceded by a
``bar.sync`` over the partition's warps, inside the loop: also when the
operation before it is the same arrive of the loop's previous trip, and
whether the barriers are distinct allocations, slots of one array or a slot
chosen at run time; a wait is preceded by one too. This is where the three
128-thread ``BAR.SYNC`` of each forward consumer step come from
(``scripts/sass_flow.py --flow``: before the step's K/V waits, before the K
release and before the V release). CUTLASS's pipelines have none. (A first
reading of this probe that ignored the loop's labels concluded that repeats
of one arrive get none: wrong, the listing below shows the loop.)

    python scripts/membar_probe.py
"""
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

CASES = ["arrive in a loop", "wait, then arrive on another barrier", "arrive, then arrive on another barrier",
         "arrive on two slots of one barrier array", "wait, then arrive on another slot",
         "one arrive on a slot chosen at run time", "wait, then arrive on the same barrier"]


@gluon.jit
def _probe(n, CASE: gl.constexpr):
    a = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    b = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(a.index(0), count=1)
    mbarrier.init(b.index(0), count=1)
    for i in range(n):
        if CASE == 0:
            mbarrier.arrive(b.index(0), count=1)
        elif CASE == 1:
            mbarrier.wait(a.index(0), i & 1)
            mbarrier.arrive(b.index(0), count=1)
        elif CASE == 2:
            mbarrier.arrive(b.index(0), count=1)
            mbarrier.arrive(a.index(0), count=1)
        elif CASE == 3:
            mbarrier.arrive(a.index(0), count=1)
            mbarrier.arrive(a.index(1), count=1)
        elif CASE == 4:
            mbarrier.wait(a.index(0), i & 1)
            mbarrier.arrive(a.index(1), count=1)
        elif CASE == 5:
            mbarrier.arrive(a.index(i % 2), count=1)
        else:
            mbarrier.wait(a.index(0), i & 1)
            mbarrier.arrive(a.index(0), count=1)


def main() -> None:
    print(f"triton {triton.__version__}")
    for case, what in enumerate(CASES):
        src = GluonASTSource(_probe, {"n": "i32", "CASE": "constexpr"}, constexprs={"CASE": case})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        events = []
        for line in ptx.splitlines():
            line = line.strip()
            if line.startswith("$L__BB"):
                events.append(line.split(":")[0].replace("$L__BB0_", "L"))  # a label: loop heads are targets
            elif "bar.sync" in line or "mbarrier." in line or re.search(r"\bbra\b", line):
                op = (line.split()[1] if line.startswith("@") else line.split()[0]).rstrip(";")
                if op == "bra":
                    op += " " + line.split()[-1].rstrip(";").replace("$L__BB0_", "L")
                events.append(op.replace(".shared::cta.b64", ""))
        print(f"{what:42s} {' | '.join(events)}")


if __name__ == "__main__":
    main()
