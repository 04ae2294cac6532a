"""Usage: python scripts/varlen_bwd_order_model.py

A greedy-dispatch model of the varlen backward's grid (no GPU): one CTA per
(KV tile, KV head, sequence), each SM takes the next CTA in grid order when
its last one ends (one CTA per SM: the backward's shared memory). A CTA
costs its steps (every query tile that sees the KV tile, times the GQA
group: the CTA runs the whole group) at STEP cycles, plus OVERHEAD cycles
(K/V wait, start, dK/dV epilogue), or DEAD cycles past its sequence's keys;
STEP and OVERHEAD are the seventh session's timeline figures at D = 128
(BENCHMARKS.md, "Where a backward step's time goes"). Prints the modelled
time in the caller's order, with the sequences sorted longest first (what
the kernel does since the fortieth session, fast mode) and for a global
longest-first order of every CTA (a bound), for the bench's
``--varlen 512:8192 --batch 16`` lengths and six other seeded mixes.

``--forward``: the same for the forward's varlen items (a 128-row query
tile of one of 32 query heads, causal, (tile + 1) KV steps of FWD_STEP
cycles plus two steps an item; the dynamic order's sections hold all
heads of one sequence at these lengths, the tiles from the last down):
whether sorting the sequences would matter there too.
"""
import heapq
import math
import random
import sys

SMS, HKV, GROUP, BLOCK_N, BLOCK_M = 132, 8, 4, 128, 64
STEP, OVERHEAD, DEAD, CLOCK = 4060, 6600, 800, 1.7e9
FWD_HEADS, FWD_STEP = 32, 2600
BENCH = [6638, 4932, 6735, 1706, 6830, 4356, 1178, 6860, 1195, 5839, 1610, 7005, 5464, 6260, 5740, 1016]


def cost(lens, b, n):
    if n * BLOCK_N >= lens[b]:
        return DEAD
    return GROUP * (math.ceil(lens[b] / BLOCK_M) - n * BLOCK_N // BLOCK_M) * STEP + OVERHEAD  # causal, lq == lk


def grid_order(lens, seqs):
    """The kernel's order with sections of one (sequence, KV head) pair (its
    section size at these lengths): KV tiles from 0 (longest) up."""
    tiles = math.ceil(max(lens) / BLOCK_N)
    return [(b, n) for b in seqs for _ in range(HKV) for n in range(tiles)]


def run(lens, items):
    return run_costs([cost(lens, *item) for item in items])


def forward_costs(lens, seqs):
    """The forward's items in the dynamic order, as costs (dead tiles drawn and skipped: none here)."""
    tiles = math.ceil(max(lens) / 128)
    return [(t + 3) * FWD_STEP for b in seqs for t in reversed(range(tiles)) for _ in range(FWD_HEADS)
            if t * 128 < lens[b]]


def run_costs(costs):
    sms = [0] * SMS
    for c in costs:
        heapq.heappush(sms, heapq.heappop(sms) + c)
    return max(sms) / CLOCK * 1e3


def main():
    rng = random.Random(0)
    if "--forward" in sys.argv[1:]:
        print("batch    ideal ms  caller's order  sorted  sorted gains (forward)")
        for name, lens in [("bench", BENCH)] + [(f"mix {i}", [rng.randint(512, 8192) for _ in range(16)])
                                                for i in range(1, 7)]:
            caller = forward_costs(lens, range(len(lens)))
            srt = run_costs(forward_costs(lens, sorted(range(len(lens)), key=lambda b: -lens[b])))
            print(f"{name:8} {sum(caller) / SMS / CLOCK * 1e3:9.2f} {run_costs(caller):15.2f} {srt:7.2f} "
                  f"{run_costs(caller) / srt - 1:12.2%}")
        return
    mixes = [("bench", BENCH)] + [(f"mix {i}", [rng.randint(512, 8192) for _ in range(16)]) for i in range(1, 7)]
    print("batch    ideal ms  caller's order  sorted  global LPT  sorted gains")
    for name, lens in mixes:
        items = grid_order(lens, range(len(lens)))
        ideal = sum(cost(lens, *it) for it in items) / SMS / CLOCK * 1e3
        caller = run(lens, items)
        srt = run(lens, grid_order(lens, sorted(range(len(lens)), key=lambda b: -lens[b])))
        lpt = run(lens, sorted(items, key=lambda it: -cost(lens, *it)))
        print(f"{name:8} {ideal:9.2f} {caller:15.2f} {srt:7.2f} {lpt:11.2f} {caller / srt - 1:12.1%}")


if __name__ == "__main__":
    main()
