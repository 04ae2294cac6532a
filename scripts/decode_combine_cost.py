"""What the split-KV combine costs a one-row decode call, timed: each row of
issue 10's one-row table through ``flash_attn_with_kvcache`` (heuristic
splits), CUDA-graph replay, as

* ``full``: the call as shipped (split kernel, then ``combine_kernel``);
* ``split only``: the same with ``plan.launch_combine`` patched to do nothing
  (the output is then wrong: only the time means anything);
* ``combine only``: ``plan.launch_combine`` alone on the partials of one call;

beside SDPA cuDNN on the same inputs. ``full`` is judged against the float64
reference first. The question: whether merging the splits inside the split
kernel (the last split of a row combines) could close the one-row rows' 2-4%
to cuDNN, which is at most what ``full - split only`` is.

    PYTHONPATH=. python -P scripts/decode_combine_cost.py [--rep-ms 300]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from hopper_flash import flash_attn_with_kvcache, plan
from hopper_flash.bench.timing import cuda_graph_timer
from hopper_flash.reference import check_kvcache

# (batch, seqlen_k); 32 query heads on 8 KV heads, D=128, bf16.
ROWS = [(8, 4096), (8, 16384), (1, 65536), (64, 2048)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rep-ms", type=float, default=300)
    args = p.parse_args()
    timer = cuda_graph_timer(args.rep_ms)
    H, HKV, D = 32, 8, 128
    scale = D ** -0.5
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, SMs {plan.sm_count()}")
    print(f"{'row':>12} {'full':>8} {'split only':>11} {'combine only':>13} {'cuDNN':>8}  (us)  judged")
    shipped_combine = plan.launch_combine
    for B, S in ROWS:
        gen = torch.Generator(device="cuda").manual_seed(B * S)
        q = torch.randn(B, 1, H, D, device="cuda", generator=gen).to(torch.bfloat16)
        k = torch.randn(B, S, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
        v = torch.randn(B, S, HKV, D, device="cuda", generator=gen).to(torch.bfloat16)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")

        def call():
            return flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, softmax_scale=scale, causal=True)

        out = call()
        bad = [x.message for x in check_kvcache(out, q, k, v, [S] * B, causal=True, softmax_scale=scale) if not x]
        full = timer(call).median_ms * 1e3

        seen = []
        plan.launch_combine = lambda *a: seen.append(a)
        try:
            call()
            split_only = timer(call).median_ms * 1e3
        finally:
            plan.launch_combine = shipped_combine
        if seen:
            o_part, lse_part, o, lse = seen[0]
            combine_only = timer(lambda: shipped_combine(o_part, lse_part, o, lse)).median_ms * 1e3
        else:
            combine_only = float("nan")  # one split: no combine

        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            cudnn = timer(lambda: F.scaled_dot_product_attention(qt, kt, vt, scale=scale,
                                                                 enable_gqa=True)).median_ms * 1e3
        print(f"{f'B{B} Sk{S}':>12} {full:8.1f} {split_only:11.1f} {combine_only:13.1f} {cudnn:8.1f}  "
              f"{'ok' if not bad else bad[0]}")


if __name__ == "__main__":
    main()
