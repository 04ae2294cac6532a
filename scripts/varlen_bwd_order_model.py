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
"""
import heapq
import math
import random

SMS, HKV, GROUP, BLOCK_N, BLOCK_M = 132, 8, 4, 128, 64
STEP, OVERHEAD, DEAD, CLOCK = 4060, 6600, 800, 1.7e9
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
    sms = [0] * SMS
    for item in items:
        heapq.heappush(sms, heapq.heappop(sms) + cost(lens, *item))
    return max(sms) / CLOCK * 1e3


def main():
    rng = random.Random(0)
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
