"""Is a failing accuracy check luck or a bug? Re-run one varlen backward
check (tests/test_varlen_gpu.py's length mix) over many seeds and print, per
seed, each gradient's worst-row error against the judge's limit, and the
error on the worst row next to the baseline's (SDPA's) error on *that* row.
Run it for two packages (the shipped one and a variant's copy) and compare
the distributions: a kernel whose ratios sit systematically above the
other's has a real accuracy difference; matching spreads mean the check
caught rounding luck on an ill-conditioned row.

    PYTHONPATH=. python -P scripts/judge_sweep.py --d 256 --causal --seeds 20
    PYTHONPATH=/tmp/variant-NAME python -P scripts/judge_sweep.py ...
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import test_varlen_gpu as tv  # noqa: E402

import hopper_flash  # noqa: E402
from hopper_flash.reference import judge  # noqa: E402


def sweep(d, causal, h, hkv, seeds):
    worst = {"dq": 0.0, "dk": 0.0, "dv": 0.0}
    fails = 0
    for seed in range(seeds):
        grads, ref, base, tol = tv.backward_case(tv.MIX["lq"], tv.MIX["lk"], h, hkv, d, causal, seed=seed)
        line = []
        for name, g, r, bl in zip(("dq", "dk", "dv"), grads, ref, base):
            vd = judge(name, g, r, bl, abs_tol=tol)
            ratio = vd.row_rel / vd.row_rel_limit if vd.row_rel_limit == vd.row_rel_limit else 0.0
            worst[name] = max(worst[name], ratio)
            # The value's worst row, and the baseline's error on that same row.
            diff = (g.double() - r.double()).reshape(-1, g.shape[-1])
            bdiff = (bl.double() - r.double()).reshape(-1, g.shape[-1])
            rn = r.double().reshape(-1, g.shape[-1]).norm(dim=-1)
            rel = torch.where(rn > 0, diff.norm(dim=-1) / rn, torch.zeros_like(rn))
            i = int(rel.argmax())
            brel = float(bdiff[i].norm() / rn[i]) if rn[i] > 0 else 0.0
            line.append(f"{name} {ratio:4.2f}{'' if vd.ok else ' FAIL'} (row {i}: {float(rel[i]):.1e} vs base "
                        f"{brel:.1e})")
            fails += not vd.ok
        print(f"seed {seed:3d}: " + "  ".join(line), flush=True)
    print(f"d{d} {'causal' if causal else 'full'} h{h}/{hkv}: worst row_rel/limit "
          + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()) + f"; {fails} failing checks", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[256])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--heads", type=int, nargs=2, default=[4, 4])
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    print("hopper_flash from", hopper_flash.__file__)
    for d in args.d:
        sweep(d, args.causal, *args.heads, args.seeds)


if __name__ == "__main__":
    main()
