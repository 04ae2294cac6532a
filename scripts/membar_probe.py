"""Where triton's Gluon puts a partition-wide ``bar.sync`` around mbarrier
operations (CPU only: compiles small kernels for sm_90a and prints the PTX's
barrier and mbarrier lines per case).

Under triton 3.6 (thirteenth session): two *different* mbarrier operations in
a row (an arrive after an arrive, or after a wait) get a ``bar.sync`` between
them, also when they touch different barriers or different slots of one; one
arrive repeated by a loop (even on a slot chosen at run time) gets none. This
is where the three 128-thread ``BAR.SYNC`` of each forward consumer step come
from (``scripts/sass_flow.py --flow``: before the step's K/V waits, before
the K release and before the V release). CUTLASS's pipelines have none.

    python scripts/membar_probe.py
"""
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
        ops = [line.split()[0] if not line.strip().startswith("@") else line.split()[1]
               for line in ptx.splitlines() if "bar.sync" in line or "mbarrier." in line]
        print(f"{what:45s} {' -> '.join(op.strip().rstrip(';') for op in ops)}")


if __name__ == "__main__":
    main()
