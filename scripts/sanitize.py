"""Small forward cases for compute-sanitizer (memcheck, racecheck).

Shapes cover tail tiles on both sides: a query length of 1, 65 (the second
consumer warpgroup has one row), 129 (the last tile has one row), 200 and 400;
key lengths that end mid-tile, wrap the two-slot K/V rings (400 keys are 4
tiles of 128 or 7 of 64), and, causal with seqlen_q > seqlen_k, query tiles
whose rows see no key at all. Every head dim, both causal modes, bf16, GQA,
with LSE. Each case writes into a NaN-filled output of exactly its size (no
guard region to hide an out-of-bounds write from memcheck) and is judged
like every GPU check: against the float64 reference, relative to SDPA's
error on the same inputs (``hopper_flash.reference.check_attention``).

    PYTHONPATH=. python scripts/sanitize.py            # 24 cases (memcheck)
    PYTHONPATH=. python scripts/sanitize.py --quick    # 6 cases (racecheck)
    PYTHONPATH=. python scripts/sanitize.py --backward          # 20 backward cases (memcheck)
    PYTHONPATH=. python scripts/sanitize.py --backward --quick  # 7 backward cases (racecheck)

Backward cases (``--backward``): the forward gives out and LSE, then
``plan_backward.launch_backward`` writes NaN-filled dq, dk, dv of exactly
their sizes; every head dim, causal and not, GQA 4/2 and MQA 8/1, query and
key tails (65, 129, 200 rows: a one-row last tile, causal query rows that see
no key), the deterministic mode (its semaphores); judged by
``hopper_flash.reference.check_attention_grads`` (float64 reference, 2x
SDPA's backward error).

First, one tiny launch per specialisation compiles (or loads from Triton's
cache) every kernel the cases use. Prints one line per case and a final
``sanitize.py: ... OK`` line; exits 1 if any case is wrong.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from dataclasses import dataclass

from hopper_flash import dispatch, plan, plan_backward
from hopper_flash.reference import Problem, check_attention_grads, random_qkv

# (seqlen_q, seqlen_k) for the full (memcheck) set.
FULL_PAIRS = ((1, 200), (65, 129), (129, 65), (200, 400))


class Case(Problem):
    def __str__(self):
        return (f"d={self.head_dim:<3} {'causal' if self.causal else 'full  '} b={self.batch} "
                f"sq={self.seqlen_q:<3} sk={self.seqlen_k:<3} h={self.nheads}/{self.nheads_kv}")


@dataclass(frozen=True)
class BackwardCase(Case):
    deterministic: bool = False
    window: tuple[int, int] | None = None  # checks.window_bounds form; None: no window

    def __str__(self):
        return (f"bwd {super().__str__()}{' deterministic' if self.deterministic else ''}"
                f"{f' window={self.window}' if self.window else ''}")


# (seqlen_q, seqlen_k) of the backward's full (memcheck) set: a query tail of
# one row past a 64-row tile and keys past one 128-key tile; and causal rows
# that see no key (200 > 129) with a one-row key tail.
BACKWARD_PAIRS = ((65, 129), (200, 129))


def backward_cases(quick: bool) -> list[BackwardCase]:
    dims = plan_backward.BACKWARD_HEAD_DIMS
    if quick:
        return ([BackwardCase(1, *((200, 129) if causal else (65, 129)), 4, 2, d, causal)
                 for d in dims for causal in (False, True)]
                + [BackwardCase(1, 129, 200, 4, 2, 128, True, deterministic=True)])
    return ([BackwardCase(2, sq, sk, 4, 2, d, causal) for d in dims for causal in (False, True)
             for sq, sk in BACKWARD_PAIRS]
            + [BackwardCase(2, 129, 200, 4, 2, d, True, deterministic=True) for d in dims]
            + [BackwardCase(2, 200, 129, 8, 1, 128, False, deterministic=True)]
            # Sliding windows: KV tiles that walk a middle range of query
            # tiles, masked at both edges; deterministic turns counted from
            # each query tile's first KV tile.
            + [BackwardCase(2, 300, 300, 4, 2, d, True, window=(100, 0)) for d in dims]
            + [BackwardCase(2, 300, 250, 4, 2, 128, False, deterministic=True, window=(40, 70))])


def run_backward_case(case: BackwardCase, seed: int) -> tuple[bool, str]:
    q, k, v = case.inputs(seed)
    dout = random_qkv(case.batch, case.seqlen_q, case.seqlen_q, case.nheads, case.nheads, case.head_dim,
                      dtype=case.dtype, seed=seed + 1)[0]
    scale = case.head_dim ** -0.5 if case.softmax_scale is None else case.softmax_scale
    out, lse = dispatch.forward(q, k, v, scale, case.causal, True, window=case.window)
    dq = torch.full(q.shape, math.nan, dtype=q.dtype, device="cuda")
    dk = torch.full(k.shape, math.nan, dtype=k.dtype, device="cuda")
    dv = torch.full(v.shape, math.nan, dtype=v.dtype, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    plan_backward.launch_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, case.causal, case.deterministic,
                                  window=case.window)
    torch.cuda.synchronize()  # errors are attributed to this case
    ms = (time.perf_counter() - t0) * 1e3
    verdicts = check_attention_grads((dq, dk, dv), q, k, v, dout, causal=case.causal, softmax_scale=scale,
                                     window=case.window)
    ok = all(verdicts)
    if case.causal and case.seqlen_q > case.seqlen_k and not bool((dq[:, :case.seqlen_q - case.seqlen_k] == 0).all()):
        ok = False
        verdicts.append(type(verdicts[0])("dq", False, "dq: FAIL: rows that see no key must get exactly 0"))
    numbers = " ".join(f"{v_.name}_rel={v_.rel_fro:.2e}" for v_ in verdicts[:3])
    status = "ok" if ok else "FAIL: " + "; ".join(v_.message for v_ in verdicts if not v_)
    return ok, f"case {case}  {numbers}  {ms:8.1f} ms  {status}"


def warm_up_backward(selected: list[BackwardCase]) -> None:
    """Compile (or load) each backward specialisation with a one-row launch."""
    t0 = time.perf_counter()
    specs = {(c.head_dim, c.causal, c.deterministic, c.window) for c in selected}
    for head_dim, causal, deterministic, window in specs:
        q, k, v = Case(1, 1, 1, 1, 1, head_dim, causal).inputs(seed=0)
        out, lse = dispatch.forward(q, k, v, head_dim ** -0.5, causal, True, window=window)
        plan_backward.backward(out, q, k, v, out, lse, head_dim ** -0.5, causal, deterministic, window=window)
    torch.cuda.synchronize()
    print(f"warm-up: {len(specs)} backward specialisations ready in {time.perf_counter() - t0:.1f} s", flush=True)


def cases(quick: bool) -> list[Case]:
    dims = plan.SUPPORTED_HEAD_DIMS
    if quick:
        # One per (head dim, causal), few CTAs: causal (400, 257) has query
        # tiles that see no key, tails in q and kv and 3-5 KV tiles; full
        # (129, 400) has a one-row last query tile and 4-7 KV tiles.
        return [Case(1, *((400, 257) if causal else (129, 400)), 2, 1, d, causal)
                for d in dims for causal in (False, True)]
    return [Case(2, sq, sk, 4, 2, d, causal) for d in dims for causal in (False, True) for sq, sk in FULL_PAIRS]


def run_case(case: Case, seed: int) -> tuple[bool, str]:
    q, k, v = case.inputs(seed)
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, lse = dispatch.forward(q, k, v, case.softmax_scale, case.causal, True, out=out)
    torch.cuda.synchronize()  # errors are attributed to this case
    ms = (time.perf_counter() - t0) * 1e3
    verdicts = case.check(out, q, k, v, lse)
    ok = all(verdicts)
    numbers = f"rel={verdicts[0].rel_fro:.2e} max_abs={verdicts[0].max_abs:.2e} lse_rel={verdicts[1].rel_fro:.2e}"
    status = "ok" if ok else "FAIL: " + "; ".join(v.message for v in verdicts if not v)
    return ok, f"case {case}  {numbers}  {ms:8.1f} ms  {status}"


def warm_up(selected: list[Case]) -> None:
    """Compile (or load) each specialisation with a one-row, one-key launch."""
    t0 = time.perf_counter()
    specs = sorted({(c.head_dim, c.causal) for c in selected})
    for head_dim, causal in specs:
        q, k, v = Case(1, 1, 1, 1, 1, head_dim, causal).inputs(seed=0)
        dispatch.forward(q, k, v, None, causal, True)
    torch.cuda.synchronize()
    print(f"warm-up: {len(specs)} specialisations ready in {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 6-case subset (for racecheck)")
    parser.add_argument("--backward", action="store_true",
                        help="the backward's cases (forward, then plan_backward.launch_backward) instead")
    parser.add_argument("--no-warmup", action="store_true", help="skip the compile launches")
    parser.add_argument("--variant", default="", metavar="FIELD=VALUE[,FIELD=VALUE]",
                        help="run with plan.ForwardConfig fields replaced for every head dim, "
                             "e.g. persistent=False")
    args = parser.parse_args(argv)
    if args.variant:
        print(f"sanitize.py: variant {plan.use_variant(args.variant)}", flush=True)
    if not torch.cuda.is_available():
        print("sanitize.py: no CUDA device", flush=True)
        return 2
    selected = backward_cases(args.quick) if args.backward else cases(args.quick)
    print(f"sanitize.py: {len(selected)} {'backward ' if args.backward else ''}cases on "
          f"{torch.cuda.get_device_name()} (torch {torch.__version__})", flush=True)
    if not args.no_warmup:
        (warm_up_backward if args.backward else warm_up)(selected)
    failed = 0
    for i, case in enumerate(selected):
        ok, line = (run_backward_case if args.backward else run_case)(case, seed=1000 + i)
        failed += not ok
        print(line, flush=True)
    if failed:
        print(f"sanitize.py: {failed} of {len(selected)} cases FAILED", flush=True)
        return 1
    print(f"sanitize.py: all {len(selected)} cases OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
