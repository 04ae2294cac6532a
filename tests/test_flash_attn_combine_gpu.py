"""``flash_attn_combine`` on the GPU, on hopper_flash's own partials:
``flash_attn_func`` over parts of the keys (``return_lse``), merged, judged
against float64 attention over all of them, relative to the error SDPA's
bf16 math makes on the same inputs (``reference.check_attention``); and
captured in a CUDA graph with the attention calls."""
import math

import pytest
import torch

import hopper_flash
from hopper_flash.reference import check_attention

pytestmark = pytest.mark.gpu


def _inputs(seed, seqlen_k=3001):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, 129, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, 2, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in "kv")
    return q, k, v


def _merged(q, k, v, bounds):
    parts = [hopper_flash.flash_attn_func(q, k[:, a:b], v[:, a:b], return_lse=True)
             for a, b in zip(bounds, bounds[1:])]
    out_partial = torch.stack([o.float() for o, _ in parts])
    lse_partial = torch.stack([lse for _, lse in parts]).transpose(-1, -2)
    # (float32: the parts' outputs are bf16 already, and one more rounding would
    # only spend the judge's margin on what the CPU tests cover)
    return hopper_flash.flash_attn_combine(out_partial, lse_partial)


@pytest.mark.parametrize("bounds", [[0, 1000, 3001], [0, 1, 129, 2048, 3001], [0, 3001]])
def test_parts_of_the_keys_merge_to_attention_over_all_of_them(bounds):
    q, k, v = _inputs(len(bounds))
    out, lse = _merged(q, k, v, bounds)
    bad = [r.message for r in check_attention(out, q, k, v, causal=False, lse=lse.transpose(1, 2)) if not r]
    assert not bad, bad


def test_merge_under_graph_replay():
    q, k, v = _inputs(7)
    bounds = [0, 1500, 3001]
    _merged(q, k, v, bounds)  # compiled and planned before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _merged(q, k, v, bounds)
    fresh = _inputs(8)
    for dst, src in zip((q, k, v), fresh):
        dst.copy_(src)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    bad = [r.message for r in check_attention(out, q, k, v, causal=False, lse=lse.transpose(1, 2)) if not r]
    assert not bad, bad
