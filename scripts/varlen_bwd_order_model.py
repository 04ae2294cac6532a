"""Usage: python scripts/varlen_bwd_order_model.py [--persistent | --forward]

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
longest-first order of every CTA (a bound), and for variant
``bwd-varlen-lpt``'s order (KV head outermost, then the (sequence, KV
tile) pairs longest first), for the bench's
``--varlen 512:8192 --batch 16`` lengths and six other seeded mixes.
That variant, 0.4% faster here, timed 3% slower on the device (forty-third
session). The model has no L2; one untested reading is that the pair order
spreads a sequence's Q and dO reads over more concurrent tiles. Read the
model's gains as bounds of what an order can give, not predictions.

``--persistent``: the figures of the persistent grid the D = 128 fast mode
runs on since the forty-first session, from the forty-second session's
timelines (B4 H32 S2048 causal, ``scripts/bwd_timeline.py``): a step 3898
cycles (3728 one CTA per tile), an item's K/V wait, start, epilogue and
hand-off 6300 (8780 one CTA per tile), a dead item a decode (~200).

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


def pair_order(lens):
    """Variant ``bwd-varlen-lpt``'s order: KV head outermost, then every
    (sequence, KV tile) pair by cost, most first, ties by index."""
    tiles = math.ceil(max(lens) / BLOCK_N)
    pairs = sorted(((b, n) for b in range(len(lens)) for n in range(tiles)),
                   key=lambda it: (-cost(lens, *it), it[0] * tiles + it[1]))
    return [p for _ in range(HKV) for p in pairs]


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
    global STEP, OVERHEAD, DEAD
    rng = random.Random(0)
    if "--persistent" in sys.argv[1:]:
        STEP, OVERHEAD, DEAD = 3898, 6300, 200
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
    print("batch    ideal ms  caller's order  sorted  global LPT  sorted gains  pairs (bwd-varlen-lpt)")
    for name, lens in mixes:
        items = grid_order(lens, range(len(lens)))
        ideal = sum(cost(lens, *it) for it in items) / SMS / CLOCK * 1e3
        caller = run(lens, items)
        srt = run(lens, grid_order(lens, sorted(range(len(lens)), key=lambda b: -lens[b])))
        lpt = run(lens, sorted(items, key=lambda it: -cost(lens, *it)))
        print(f"{name:8} {ideal:9.2f} {caller:15.2f} {srt:7.2f} {lpt:11.2f} {caller / srt - 1:12.1%}"
              f"  {run(lens, pair_order(lens)):8.2f}")


if __name__ == "__main__":
    main()
