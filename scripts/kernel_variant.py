"""Build a measurement-only variant of the kernels as a patched copy of the
package, so the shipped source carries no experiment switches.

    python scripts/kernel_variant.py NAME OUTDIR      # copies hopper_flash/, applies scripts/variants/NAME.patch
    PYTHONPATH=OUTDIR python -P -m hopper_flash.bench --config benchmarks/prefill.json --backends hopper_flash sdpa-cudnn

``-P`` (Python >= 3.11) matters: ``python -m`` otherwise puts the working
directory first on sys.path, and from the checkout's top the shipped package
there shadows the copy on PYTHONPATH (a whole screening in the fourth session
timed the shipped kernel under four names that way). The bench header's
"imported from" line says which package ran.

Time the variant in its own process next to SDPA cuDNN, and the shipped
package the same way right before or after it on the same machine; compare
the ratios to cuDNN. Variants (``scripts/variants/``):

* ``k-ahead-of-v``: the producer issues K[it + 1] before V[it] (FA3's order,
  shared/notes/fa3-forward.md section 7) instead of K[it], V[it].
* ``fa3-pingpong``: FA3's ping-pong (section 4 there): the two consumers take
  turns to issue their steady-state QK + PV pair (two mbarriers pass the
  turn; the first QK and the last PV of an item stay outside it), in the
  plain prefill modes.
* ``timeline``: the consumers write the SM's clock at seven points of each
  work item into a buffer (plan.TRACE); ``scripts/timeline.py`` runs it and
  prints where an item's time goes (waiting for Q or the first K, the
  prologue, the steady steps, the last PV, the epilogue, between items).
* ``bwd-d256-st-ahead`` (the backward, ``kernels/backward.py``): the D=256
  consumers issue the next step's Sᵀ while dQ goes out (one flat step loop)
  and wait for it at the step's end. The version measured in the sixth
  session (733e575: +2% causal, +1.5% non-causal on the H200 under triton
  3.6) carried that Sᵀ in flight over the loop's back-edge instead, and
  ptxas serialised all its wgmmas (64 WARPGROUP.DEPBAR for 64 HGMMA; see
  ``bwd-st-ahead``); this one is not serialised (6 DEPBAR) and not yet
  timed. Under triton 3.6 it spills as the shipped kernel does (32-40
  stack bytes); under 3.9 ptxas spills 270-310 bytes (the descriptors'
  addresses hoisted out of the loop, spilled and reloaded per wgmma).
* ``bwd-st-ahead`` (the backward, split-keys consumers, D = 64 and 128):
  one flat step loop; once dQ is in its staging tile, each step issues the
  next step's Sᵀ, so that it runs while dK finishes and dQ goes out (the
  bwd-timeline's ``dq_stage`` is 19% of a D = 128 step with only dK on the
  tensor cores), waits for it at the step's end, and frees its Q and dO
  slots at its own end (the slot the next Sᵀ needs was freed a step
  earlier). Not yet timed. A first version kept that Sᵀ in flight over the
  loop's back-edge: ptxas then serialised every wgmma (its C7514 info,
  "non wgmma instructions reading accumulator registers of a wgmma between
  start and end of the pipeline stage"; 40 WARPGROUP.DEPBAR for 40 HGMMA;
  ``bwd-d256-st-ahead`` is serialised the same way, 64 for 64, and still
  measured +2%). This one is not serialised (5 DEPBAR), but spills: D = 128
  40-56 stack bytes under triton 3.6, 80 under 3.9; D = 64 16-32 (3.6), 0-32
  (3.9); deterministic and varlen more.
* ``no-softmax``: an ablation with wrong results: the steady state's mask,
  softmax and O rescale are dropped (P = S), the GEMM issue order is kept.
  It tells how much of a step the softmax costs where it is not overlapped.

The bench checks every output against the reference, so an ablation's rows
read "wrong" there; only their times mean anything.

A patch that no longer applies after an edit of the kernel it changes fails
here with ``patch``'s message; regenerate it from an edited copy with
``diff -u a/hopper_flash/kernels/forward.py b/hopper_flash/kernels/forward.py``
(or ``backward.py``).
"""
import argparse
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = ROOT / "scripts" / "variants"


def main() -> int:
    names = sorted(p.stem for p in VARIANTS.glob("*.patch"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=names)
    ap.add_argument("outdir", type=pathlib.Path)
    args = ap.parse_args()
    dest = args.outdir / "hopper_flash"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ROOT / "hopper_flash", dest, ignore=shutil.ignore_patterns("__pycache__"))
    patch = VARIANTS / f"{args.name}.patch"
    r = subprocess.run(["patch", "-p1", "--forward", "-d", str(args.outdir), "-i", str(patch)])
    if r.returncode:
        print(f"{patch.name} did not apply to hopper_flash/ as it is now", file=sys.stderr)
        return r.returncode
    print(f"PYTHONPATH={args.outdir} python -P -m hopper_flash.bench ... runs the {args.name} variant")
    return 0


if __name__ == "__main__":
    sys.exit(main())
