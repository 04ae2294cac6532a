"""Paged KV caches against the contiguous cache, timed (issue 10: page sizes
of 64 and more at least 0.9x the contiguous cache's speed).

Each row of issue 10's decode table is run through ``flash_attn_with_kvcache``
on one contiguous cache ``[B, S, Hkv, D]`` and on the same keys and values
cut into pages of each size, the pages scattered over the pool in a random
order (as a serving engine's allocator leaves them) and found through the
page table. Every output is judged against the float64 reference on the
contiguous tensors first (``reference.check_kvcache``, the tests' judge);
then each is timed by CUDA-graph replay in the same process, and the table
gives the paged call's speed as a fraction of the contiguous one's.

Page sizes of 16 and more are read by TMA straight from the pages (a
128-key tile loads one box per page of 16, 32 or 64); smaller ones are
copied row by row by the kernel's producer warpgroup (head dims 64 and 128;
issue 10 asks only that they be correct), so ``--small`` adds 8 and 1 for
the record.

    PYTHONPATH=. python -P scripts/paged_speed.py [--rep-ms 200] [--small]
"""
from __future__ import annotations

import argparse

import torch

from hopper_flash import flash_attn_with_kvcache
from hopper_flash.bench.timing import cuda_graph_timer
from hopper_flash.reference import check_kvcache, paged_cache, random_qkv

# (batch, seqlen_q, seqlen_k) of issue 10's table; GQA 32/8, D=128, bf16, causal.
ROWS = [(8, 1, 4096), (8, 1, 16384), (1, 1, 65536), (64, 1, 2048), (8, 4, 8192), (4, 128, 8192)]
H, HKV, D = 32, 8, 128
SCALE = D ** -0.5


def row(timer, B: int, Sq: int, S: int, sizes) -> str:
    """One row: the contiguous call and each page size, judged, then timed."""
    q, k, v = random_qkv(B, Sq, S, H, HKV, D, seed=B * S + Sq)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    name = f"B{B} Sq{Sq} Sk{S}"

    def timed(kc, vc, table):
        def call():
            return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, softmax_scale=SCALE,
                                           causal=True)

        bad = [x.message for x in check_kvcache(call(), q, k, v, [S] * B, causal=True, softmax_scale=SCALE) if not x]
        if bad:
            raise SystemExit(f"{name}, {'contiguous' if table is None else f'page {kc.shape[1]}'}: {bad[0]}")
        return timer(call).median_ms * 1e3

    base = timed(k, v, None)
    cells = []
    for ps in sizes:
        t = timed(*paged_cache(k, v, ps, seed=ps))
        cells.append(f"{t:7.1f} ({base / t:.2f})")
    return f"{name:>18} {base:10.1f} " + " ".join(f"{c:>14}" for c in cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rep-ms", type=float, default=200)
    p.add_argument("--small", action="store_true", help="also page sizes 8 and 1 (gathered by the kernel)")
    p.add_argument("--sizes", type=int, nargs="+", help="these page sizes instead")
    args = p.parse_args()
    sizes = args.sizes or [16, 32, 64, 128, 256] + ([8, 1] if args.small else [])
    timer = cuda_graph_timer(args.rep_ms)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; GQA {H}/{HKV}, D {D}, bf16, causal, "
          f"CUDA-graph replay, us (contiguous / paged)")
    print(f"{'row':>18} {'contiguous':>10} " + " ".join(f"{'page ' + str(s):>14}" for s in sizes))
    for B, Sq, S in ROWS:
        print(row(timer, B, Sq, S, sizes), flush=True)
    print("All outputs matched the float64 reference.")


if __name__ == "__main__":
    main()
