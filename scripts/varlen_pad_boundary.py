"""Where ``plan.choose_varlen_pad`` flips, for the ``--groups`` batches of
``scripts/varlen_pack_bench.py``: each batch's break-even
``PAD_FLOPS_PER_BYTE`` (the model pads where the constant exceeds it: the padding
rows' work over the K/V bytes the pack saves) and the current choice. CPU
only; set the timed speeds beside it (BENCHMARKS.md, sixty-second session).

    python scripts/varlen_pad_boundary.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hopper_flash import plan  # noqa: E402
from varlen_pack_bench import group_batches  # noqa: E402


def main():
    print(f"PAD_FLOPS_PER_BYTE = {plan.PAD_FLOPS_PER_BYTE}")
    for name, lq, lk, h, hkv, _ in group_batches():
        group, rows = h // hkv, plan.pad_rows(h // hkv)
        total_q, batch, max_q, max_k, total_k = sum(lq), len(lq), max(lq), max(lk), sum(lk)
        # choose_varlen_pad's model, with the constant left out.
        chunks = min(batch, max(0, total_q - batch) // max(1, max_q - 1))
        saved = (group - 1) * (batch - chunks) * total_k / batch
        added = (rows - group) * chunks * max_q * max(max_k - max_q / 2, max_q / 2)
        even = f"{added / saved:9.1f}" if saved else "      inf"
        pads = plan.choose_varlen_pad(total_q, batch, max_q, max_k, total_k, group, True)
        print(f"{name:58s} break-even {even}  {'padded' if pads else 'unpadded'}")


if __name__ == "__main__":
    main()
