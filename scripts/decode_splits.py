"""Split counts for one-row decode, timed: each row of issue 10's one-row
table through ``flash_attn_with_kvcache`` at several explicit ``num_splits``
(the heuristic's own count marked), beside SDPA cuDNN, CUDA-graph replay, on
the same inputs in one process. Every count's output is judged against the
float64 reference first (``reference.check_kvcache``, the tests' judge).

The question it answers: whether the one-row rows, which read K/V at
3.5-4.3 TB/s, lose to cuDNN for want of SMs (the heuristic takes the
smallest count within 0.85 of the best wave efficiency: 15 splits of one
batch's 8 KV heads run on 120 of 132 SMs) rather than per-SM speed.

``--combine-cost`` asks instead what the split-KV combine costs each row at
the heuristic's count: the call as shipped, the same with
``plan.launch_combine`` patched out (the split kernel alone, launched the
tensor-passing way; its output is
then wrong, only the time means anything) and the combine alone on one
call's partials (BENCHMARKS.md, twenty-first session).

``--no-pack-gqa`` times the same counts with PackGQA off: one item per
query head, each re-reading its KV head's keys (from L2 where the heads of
a group run together), as cuDNN's decode does.

``--append``: each call appends one new token per row first (``k``,
``v`` of one token at ``cache_seqlens = seqlen_k - 1``), as a decode step of
a serving loop does: the append kernel, then the attention (cuDNN's row has
no append). Each replay appends at the same place. With ``--fa3-append``
FA3's ``flash_attn_with_kvcache`` with the same append (its kernel writes
the new keys itself) is judged and timed beside: a build with its append
kernels (``scripts/fa3_extra_build.sh append``, ``PYTHONPATH=/tmp/fa3append``;
the stock build has none and crashes the process on an append).

``--blocks``: query blocks of 48-130 rows (drafts, short chunks; B4 over
8192 keys) instead, whose packed items are whole 128-row tiles: the split
rule gave H28/4 at 96 queries 4 splits, 134.5 us against 105.6 unsplit on
an H100 (BENCHMARKS.md, sixty-third session), dealt in pairs. Each count
is timed as shipped (``plan.deal_split``: one CTA per split item) and
again dealt as before (``pairs``: ``plan.deal``, pairs past one wave of
items). With ``--no-pack-gqa`` the unpacked plan's counts.

    PYTHONPATH=. python -P scripts/decode_splits.py [--rep-ms 300] [--combine-cost] [--no-pack-gqa]
                                                    [--append [--fa3-append]] [--fill | --blocks]
"""
from __future__ import annotations

import argparse
import contextlib

import torch

from hopper_flash import flash_attn_with_kvcache, plan
from hopper_flash.bench.timing import cuda_graph_timer
from hopper_flash.reference import check_kvcache, random_qkv

# (batch, seqlen_k, query heads, KV heads, split counts to time); D=128, bf16.
ROWS = [
    (8, 4096, 32, 8, [1, 2, 3, 4, 8]),
    (8, 16384, 32, 8, [2, 3, 4, 8]),
    (1, 65536, 32, 8, [8, 15, 16, 22, 33, 64]),
    (64, 2048, 32, 8, [1, 2, 4]),
]
# --fill: rows whose items fit one partial wave, at FA3's count and at the
# fullest single wave (plan.choose_num_splits, twenty-third session): 8, 4,
# 2 and 1 packed items (GQA groups of 4 and 8).
FILL_ROWS = [
    (1, 65536, 32, 8, [15, 16]),
    (1, 65536, 16, 4, [29, 33]),
    (1, 65536, 16, 2, [57, 66]),
    (1, 65536, 8, 1, [109, 128]),
    (1, 16384, 32, 8, [15, 16]),
]
# --blocks: (batch, seqlen_k, query heads, KV heads, split counts, queries).
BLOCK_ROWS = [
    (4, 8192, 28, 4, [1, 2, 3, 4, 6], 96),
    (4, 8192, 32, 8, [1, 2, 3, 4, 6], 96),
    (4, 8192, 40, 8, [1, 2, 4], 48),
    (4, 8192, 32, 8, [1, 2, 4], 48),
    (4, 8192, 28, 4, [1, 2, 4], 130),
    (8, 8192, 32, 8, [1, 2], 64),
]
D = 128
SCALE = D ** -0.5


def split_counts(timer, name, call, judge, kv_bytes, splits, deals=("",)) -> None:
    """Each count (0: the heuristic's) judged, then timed, under each deal
    ("": as shipped; "pairs": ``plan.deal`` for split runs too)."""
    for s in [0] + splits:
        for deal in deals:
            with dealt(deal):
                out = call(s)
                bad = [x.message for x in judge(out) if not x]
                t = timer(lambda: call(s)).median_ms * 1e-3
            label = ("heur." if s == 0 else str(s)) + (f" {deal}" if deal else "")
            print(f"{name:>16} {label:>7} {t * 1e6:8.1f} {kv_bytes / t / 1e12:9.2f}  "
                  f"{'ok' if not bad else 'FAIL ' + bad[0]}", flush=True)


@contextlib.contextmanager
def dealt(deal: str):
    """Split runs dealt as shipped ("") or in pairs past one wave ("pairs",
    the deal before ``plan.deal_split``); plans and prepared calls rebuilt."""
    shipped = plan.deal_split
    if deal == "pairs":
        plan.deal_split = plan.deal
    plan._plan_launch.cache_clear()
    plan._PREPARED.clear()
    try:
        yield
    finally:
        plan.deal_split = shipped
        plan._plan_launch.cache_clear()
        plan._PREPARED.clear()


def combine_cost(timer, name, call, judge) -> None:
    """The heuristic's count: the whole call, the split kernel alone, the combine alone (us)."""
    bad = [x.message for x in judge(call(0)) if not x]
    full = timer(lambda: call(0)).median_ms * 1e3
    shipped_combine, fast_launch, seen = plan.launch_combine, plan.FAST_LAUNCH, []
    # The tensor-passing launch path (host time does not count under graph
    # replay): the direct one launches a combine it has seen without
    # launch_combine.
    plan.launch_combine, plan.FAST_LAUNCH = (lambda *a: seen.append(a)), False
    try:
        call(0)
        split_only = timer(lambda: call(0)).median_ms * 1e3
    finally:
        plan.launch_combine, plan.FAST_LAUNCH = shipped_combine, fast_launch
    combine_only = timer(lambda: shipped_combine(*seen[0])).median_ms * 1e3 if seen else float("nan")
    print(f"{name:>16} {full:8.1f} {split_only:11.1f} {combine_only:13.1f}  {'ok' if not bad else 'FAIL ' + bad[0]}",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rep-ms", type=float, default=300)
    p.add_argument("--combine-cost", action="store_true")
    p.add_argument("--fill", action="store_true", help="the single-wave rows (FILL_ROWS) instead")
    p.add_argument("--blocks", action="store_true", help="query blocks of 48-130 rows (BLOCK_ROWS) instead")
    p.add_argument("--no-pack-gqa", action="store_true", help="PackGQA off (pack_gqa=False)")
    p.add_argument("--append", action="store_true", help="each call appends one token per row first")
    p.add_argument("--fa3-append", action="store_true",
                   help="with --append: FA3's call with the same append beside (a build with APPENDKV)")
    args = p.parse_args()
    timer = cuda_graph_timer(args.rep_ms)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, SMs {plan.sm_count()}"
          f"{', PackGQA off' if args.no_pack_gqa else ''}{', one-token append' if args.append else ''}")
    if args.combine_cost:
        print(f"{'row':>16} {'full':>8} {'split only':>11} {'combine only':>13}  judged (us; cuDNN below)")
    else:
        print(f"{'row':>16} {'splits':>7} {'us':>8} {'K/V TB/s':>9}  judged")
    rows = BLOCK_ROWS if args.blocks else [(*r, 1) for r in (FILL_ROWS if args.fill else ROWS)]
    for B, S, H, HKV, splits, SQ in rows:
        q, k, v = random_qkv(B, SQ, S, H, HKV, D, seed=B * S + SQ + (HKV if args.fill or args.blocks else 0))
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        kv_bytes = 2 * k.numel() * k.element_size()
        name = f"B{B} Sk{S}" + (f" {H}/{HKV}" if args.fill or args.blocks else "") + (f" Sq{SQ}" if SQ > 1 else "")

        new = ()
        if args.append:  # the last cache position is written by each call
            new = tuple(torch.randn_like(k[:, :1]) for _ in "kv")
            lens = lens - 1

        def call(s):
            return flash_attn_with_kvcache(q, k, v, *new, cache_seqlens=lens, softmax_scale=SCALE, causal=True,
                                           num_splits=s, pack_gqa=False if args.no_pack_gqa else None)

        def judge(out):
            return check_kvcache(out, q, k, v, [S] * B, causal=True, softmax_scale=SCALE)

        if args.combine_cost:
            combine_cost(timer, name, call, judge)
        else:
            split_counts(timer, name, call, judge, kv_bytes, splits, ("", "pairs") if args.blocks else ("",))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=SCALE, enable_gqa=True)

        cudnn()
        t = timer(cudnn).median_ms * 1e-3
        print(f"{name:>16} {'cuDNN':>7} {t * 1e6:8.1f} {kv_bytes / t / 1e12:9.2f}", flush=True)
        if args.append and args.fa3_append:
            fa3_with_append(timer, name, q, k, v, new, lens, judge, kv_bytes)


def fa3_with_append(timer, name, q, k, v, new, lens, judge, kv_bytes) -> None:
    """FA3's ``flash_attn_with_kvcache`` with the same one-token append (its
    own heuristics), judged, then timed."""
    from flash_attn_interface import flash_attn_with_kvcache as fa3_kvcache

    def fa3():
        out = fa3_kvcache(q, k, v, *new, cache_seqlens=lens, softmax_scale=SCALE, causal=True)
        return out[0] if isinstance(out, tuple) else out

    bad = [x.message for x in judge(fa3()) if not x]
    t = timer(fa3).median_ms * 1e-3
    print(f"{name:>16} {'FA3':>7} {t * 1e6:8.1f} {kv_bytes / t / 1e12:9.2f}  {'ok' if not bad else 'FAIL ' + bad[0]}",
          flush=True)


if __name__ == "__main__":
    main()
