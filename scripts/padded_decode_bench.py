"""One decode step's attention in a left-padded batch, through the
transformers backend (``hopper_flash_attention_forward`` with the 2-D
padding mask ``generate`` passes), beside the same step without padding,
SDPA (cuDNN where it takes the mask, else what SDPA picks) with the
padding as a boolean mask, and FA3's ``flash_attn_with_kvcache`` with
``cache_leftpad`` where FA3 is importable. Every output is judged against
the float64 reference over each row's run of keys first (NaN outside the
runs, in the padding).

    PYTHONPATH=. python -P scripts/padded_decode_bench.py [--shape B,H,HK,SK ...]
    PYTHONPATH=OTHER_TREE python -P scripts/padded_decode_bench.py   (another package, e.g. main's)

Row ``b`` is left-padded by ``b * SK // (2 * B)`` keys; causal, D128, bf16,
one query per row; ``do_bench`` medians (us) of plain calls and of CUDA-graph
replay, the K/V bytes of the live runs over the replay time, and the CPU
time to enqueue one call (``host_timing.enqueue_us``). The "N layers" line
is a model step: N layers' calls on the same mask (``--layers``), its times
divided by N."""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton

import hopper_flash
from hopper_flash.integrations import transformers as hft
from hopper_flash.reference import check_kvcache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # host_timing, also under python -P
from host_timing import enqueue_us  # noqa: E402


class _Module(torch.nn.Module):
    is_causal = True

    def __init__(self, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx


def bench(f) -> tuple[float, float]:
    with torch.no_grad():
        plain = triton.testing.do_bench(f, warmup=30, rep=200) * 1e3
        graph = triton.testing.do_bench_cudagraph(f, rep=200) * 1e3
    return plain, graph


def row(b, h, hk, sk, layers, d=128):
    torch.manual_seed(0)
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hk, sk, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    starts = [i * sk // (2 * b) for i in range(b)]
    mask = torch.ones(b, sk, dtype=torch.long, device="cuda")
    for i, lo in enumerate(starts):
        mask[i, :lo] = 0
        k[i, :, :lo] = v[i, :, :lo] = math.nan
    start_t = torch.tensor(starts, dtype=torch.int32, device="cuda")
    ends_t = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    live_bytes = 2 * hk * d * 2 * sum(sk - lo for lo in starts)
    m = _Module()
    calls = {
        "padded (backend)": lambda: hft.hopper_flash_attention_forward(m, q, k, v, mask, scaling=scale)[0],
        "unpadded (backend, no mask)": lambda: hft.hopper_flash_attention_forward(m, q, k, v, None, scaling=scale)[0],
    }
    modules = [_Module(i) for i in range(layers)]

    def model_step():  # a model's layers on one mask: the runs are found once (also inside a CUDA graph)
        for module in modules:
            out = hft.hopper_flash_attention_forward(module, q, k, v, mask, scaling=scale)[0]
        return out

    per_layer = {f"padded, {layers} layers / layer": layers}
    calls[f"padded, {layers} layers / layer"] = model_step
    bool_mask = mask.bool()[:, None, None, :]
    calls["sdpa, boolean mask"] = lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=bool_mask, scale=scale, enable_gqa=True).transpose(1, 2)
    try:
        from flash_attn_interface import flash_attn_with_kvcache as fa3_kvcache  # FA3's hopper build

        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        calls["fa3 kvcache, cache_leftpad"] = lambda: fa3_kvcache(
            qt, kt, vt, cache_seqlens=ends_t, cache_leftpad=start_t, softmax_scale=scale, causal=True)
    except ImportError:
        pass
    print(f"B{b} H{h}/{hk} Sq1 Sk{sk} D{d}, row b left-padded by {sk // (2 * b)}·b keys "
          f"({live_bytes / 2**20:.0f} MiB of live K/V); hopper_flash from {hopper_flash.__file__}")
    for name, f in calls.items():
        try:
            with torch.no_grad():
                out = f()
        except Exception as e:  # noqa: BLE001 (an outside backend that refuses these views: say so, go on)
            print(f"  {name:30s} error: {type(e).__name__}: {str(e)[:120]}")
            continue
        out = out[0] if isinstance(out, tuple) else out
        if name.startswith("unpadded"):
            ok = True  # a different problem (every key): timed for scale only
        else:
            verdicts = check_kvcache(out.reshape(b, 1, h, d), q.transpose(1, 2), k.transpose(1, 2),
                                     v.transpose(1, 2), [sk] * b, starts=starts, causal=True, softmax_scale=scale)
            ok = all(verdicts)
        plain, graph = bench(f)
        with torch.no_grad():
            enqueue = enqueue_us(f, 100)
        n = per_layer.get(name, 1)
        plain, graph, enqueue = plain / n, graph / n, enqueue / n
        rate = live_bytes / (graph * 1e-6) / 1e12
        print(f"  {name:30s} {'ok  ' if ok else 'FAIL'} plain {plain:8.1f} us  graph {graph:8.1f} us  "
              f"live K/V {rate:5.2f} TB/s  enqueue {enqueue:6.1f} us")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", nargs="*", default=["8,32,8,4096", "8,32,8,16384", "4,32,8,32768"])
    p.add_argument("--layers", type=int, default=8, help="layers of the model step line (its times per layer)")
    args = p.parse_args()
    for shape in args.shape:
        row(*(int(x) for x in shape.split(",")), args.layers)


if __name__ == "__main__":
    main()
