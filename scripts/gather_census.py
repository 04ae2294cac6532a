"""Compile-only census of the gathered-page kernels (``Mode.GATHER``: pages
of fewer than ``plan.GATHER_PAGE`` keys, copied row by row by a four-warp
producer) over the switches that change their register pressure: head dim,
dtype, causal, LSE, split-KV, PackGQA, cache_batch_idx and a sliding window.
The producer runs on few registers (``plan.register_split``), so a change to
its code can spill where tests/test_compile_decode.py's few cases do not.

    python scripts/gather_census.py [--head-dims 64 128] [--jobs 2]

Prints one line per specialisation (registers, stack bytes) and exits 1 if
any spills. No GPU needed (Triton compiles for sm_90a on the CPU).
"""
import argparse
import itertools
import sys
from concurrent.futures import ProcessPoolExecutor

from hopper_flash import compile_check, plan


def cases(head_dims):
    for d, dtype, causal, lse, split, pack_g, page in itertools.product(
            head_dims, ("bfloat16", "float16"), (True, False), (False, True), (False, True), (1, 8), (1, 8)):
        yield d, dtype, causal, lse, plan.Mode(pack_g=pack_g, split=split, seqused=True, page_size=page)
    for d in head_dims:  # cache_batch_idx and a window, on the heaviest of the rest
        yield d, "float16", True, True, plan.Mode(pack_g=8, split=True, seqused=True, kv_batch=True, page_size=1)
        yield d, "bfloat16", True, True, plan.Mode(pack_g=4, split=True, seqused=True, page_size=8,
                                                  window_left=300, window_right=0)


def one(case):
    d, dtype, causal, lse, mode = case
    rep = compile_check.census(plan.CONFIGS[d], dtype, causal, lse, mode)
    return case, rep.registers, rep.stack_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[d for d in plan.CONFIGS if plan.gathers(1, d)])
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    spilled = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        for (d, dtype, causal, lse, m), regs, stack in pool.map(one, cases(args.head_dims)):
            spilled += stack > 0
            print(f"d{d} {dtype} causal={causal} lse={lse} split={m.split} g{m.pack_g} page{m.page_size}"
                  f"{' kv_batch' if m.kv_batch else ''}{' window' if m.window_left >= 0 else ''}: "
                  f"{regs} registers, stack {stack}{'  SPILL' if stack else ''}", flush=True)
    print(f"{spilled} spilled" if spilled else "no spills")
    sys.exit(1 if spilled else 0)


if __name__ == "__main__":
    main()
