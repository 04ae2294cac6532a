"""The decode of variant ``varlen-compact-order`` (``scheduler.varlen_coords``
in its patch), ported line for line to Python and checked on random varlen
batches: every live (query tile, head, sequence) is exactly one item, the
items past the last live one decode to batch ``B`` (the end), and nothing
divides by zero there. A check of the algorithm, not of the kernel (the
GPU tests are that); rerun it after editing the patch's decode.

    python scripts/varlen_order_check.py [--trials 300]
"""
from __future__ import annotations

import argparse
import itertools
import random


def varlen_coords(item: int, lens: list[int], heads_total: int, section: int, block_m: int = 128):
    """(bm, h, b) as the patch's ``varlen_coords`` computes them."""
    batch = len(lens)
    j0 = before = tiles_b = first_b = 0
    b = batch
    while j0 < batch and b == batch:
        js = [j0 + k for k in range(32)]
        tiles = [-(-lens[j] // block_m) if j < batch else 0 for j in js]
        n_items = [t * heads_total for t in tiles]
        upto = [u + before for u in itertools.accumulate(n_items)]
        n_past = sum(1 for k, j in enumerate(js) if j < batch and upto[k] > item)
        if n_past > 0:
            b = j0 + min(batch - j0, 32) - n_past
            tiles_b, first_b = tiles[b - j0], upto[b - j0] - n_items[b - j0]
        before += sum(n_items)
        j0 += 32
    heads = min(section, heads_total)
    r = item - first_b if b < batch else 0
    per_section = max(heads * tiles_b, 1)
    sec = r // per_section
    in_section = min(heads, heads_total - sec * heads)
    rr = r - sec * per_section
    return tiles_b - 1 - rr // in_section, sec * heads + rr % in_section, b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=300)
    args = p.parse_args()
    rng = random.Random(0)
    for _ in range(args.trials):
        batch = rng.choice([1, 2, 3, 16, 31, 32, 33, 70])
        heads = rng.choice([1, 4, 8, 12, 32])
        section = rng.choice([1, 2, 3, 4, 8, 16, 32, 64])
        lens = [rng.choice([0, 1, 127, 128, 129, 1000, 3001, rng.randint(0, 9000)]) for _ in range(batch)]
        live = {(bm, h, b) for b in range(batch) for h in range(heads) for bm in range(-(-lens[b] // 128))}
        bound = max([-(-n // 128) for n in lens] + [0]) * heads * batch  # the host's item bound
        seen = []
        for item in range(bound + 1):
            bm, h, b = varlen_coords(item, lens, heads, section)
            if b == batch:
                assert item == len(live), (item, len(live))
                break
            seen.append((bm, h, b))
        assert len(seen) == len(set(seen)) and set(seen) == live, (batch, heads, section, lens)
    print(f"{args.trials} batches: every live item decoded exactly once, the rest past the end")


if __name__ == "__main__":
    main()
