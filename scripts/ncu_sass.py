"""Read the per-SASS csv that ``scripts/ncu_forward.sh`` writes
(``ncu-NAME-sass.csv.gz``: Nsight Compute's source page) on the CPU.

    python scripts/ncu_sass.py mix FILE...              executed instructions by opcode, stall reasons
    python scripts/ncu_sass.py top FILE [N]             the N instructions with most warp-state samples
    python scripts/ncu_sass.py step FILE EXEC COLUMNS   the instructions executed EXEC times (one steady
                                                        step's body: pick EXEC from `top`), per key column
    python scripts/ncu_sass.py regions FILE EXEC        that step's body cut at each wait, barrier and
                                                        wgmma group: samples and stall reasons per stretch

The fourteenth session's comparison with FA3 (BENCHMARKS.md) used these:
``step ours.csv.gz 2064384 256`` (two consumer copies of a 128-key step) and
``step fa3.csv.gz 3014656 176``."""
import collections
import csv
import gzip
import re
import sys


def load(path):
    rows = list(csv.reader(gzip.open(path, "rt")))
    header = rows[1]
    return header, [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


def opcode(source):
    return re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split(" ")[0].split(".")[0]


def num(d, key):
    return int(d[key] or 0)


SAMPLES, EXECUTED = "Warp Stall Sampling (All Samples)", "Instructions Executed"


def mix(paths):
    for path in paths:
        header, data = load(path)
        stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        executed, samples, reasons = collections.Counter(), collections.Counter(), collections.Counter()
        for d in data:
            op = opcode(d["Source"])
            executed[op] += num(d, EXECUTED)
            samples[op] += num(d, SAMPLES)
            for k in stalls:
                reasons[k] += num(d, k)
        n, s = sum(executed.values()), sum(samples.values())
        print(f"== {path}: executed warp instructions {n:,}, samples {s:,}")
        for op, c in executed.most_common(28):
            print(f"  {op:12s} {c:14,} {c / n * 100:5.1f}%  samples {samples[op] / s * 100:5.1f}%")
        print("  stalls:", ", ".join(f"{k[6:]} {v / s * 100:.1f}%" for k, v in reasons.most_common(10)))


def top(path, n=40):
    header, data = load(path)
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(num(d, SAMPLES) for d in data)
    for i in sorted(sorted(range(len(data)), key=lambda i: -num(data[i], SAMPLES))[:n]):
        d = data[i]
        why = sorted(((num(d, k), k[6:]) for k in stalls), reverse=True)[:3]
        print(f"{i:5d} {num(d, SAMPLES) / total * 100:5.2f}% ex={num(d, EXECUTED):>11,} {d['Source'].strip()[:60]:60s} "
              + " ".join(f"{k}:{v / total * 100:.2f}" for v, k in why if v))


def step(path, executed, columns):
    _, data = load(path)
    ops = collections.Counter(opcode(d["Source"]) for d in data if num(d, EXECUTED) == executed)
    n = sum(ops.values())
    print(f"{path}: {n} instructions executed {executed:,} times, {n / columns:.2f} per key column")
    print(sorted(ops.items(), key=lambda x: -x[1]))


def regions(path, executed):
    """The steady step (the instructions executed ``executed`` times), in
    SASS order, cut before every wgmma wait, named barrier, mbarrier
    operation and first HGMMA of a group: each stretch's share of all
    warp-state samples, its three main stall reasons, and its opcodes. The
    thirty-sixth session read where our consumers and FA3's wait with it
    (ours: ``2064384 / 2`` per consumer copy, FA3's shared code ``2064384``
    at B4 H32 S8192 D128 causal)."""
    header, data = load(path)
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(num(d, SAMPLES) for d in data)
    steady = [i for i, d in enumerate(data) if num(d, EXECUTED) == executed]
    print(f"{path}: {len(steady)} instructions executed {executed:,} times, "
          f"{sum(num(data[i], SAMPLES) for i in steady) / total * 100:.1f}% of the samples")
    cuts = ("DEPBAR", "SYNCS", "BAR.SYNC", "BAR.ARV")
    stretches, cur = [], []
    for i in steady:
        text = data[i]["Source"]
        first_hgmma = "HGMMA" in text and not (cur and "HGMMA" in data[cur[-1]]["Source"])
        if cur and (first_hgmma or any(c in text for c in cuts)):
            stretches.append(cur)
            cur = []
        cur.append(i)
    stretches.append(cur)
    for idx in stretches:
        smp = sum(num(data[i], SAMPLES) for i in idx)
        why = collections.Counter({k[6:]: sum(num(data[i], k) for i in idx) for k in stalls})
        ops = collections.Counter(opcode(data[i]["Source"]) for i in idx)
        print(f"{idx[0]:5d} {len(idx):4d} instr {smp / total * 100:5.2f}%  {data[idx[0]]['Source'].strip()[:48]:48s} | "
              + " ".join(f"{k}:{v / total * 100:.2f}" for k, v in why.most_common(3)) + " | "
              + " ".join(f"{k}{v}" for k, v in ops.most_common(6)))


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "mix":
        mix(rest)
    elif cmd == "top":
        top(rest[0], int(rest[1]) if len(rest) > 1 else 40)
    elif cmd == "step":
        step(rest[0], int(rest[1]), int(rest[2]))
    elif cmd == "regions":
        regions(rest[0], int(rest[1]))
    else:
        sys.exit(__doc__)
