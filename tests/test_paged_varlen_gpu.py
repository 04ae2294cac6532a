"""``flash_attn_varlen_func(..., block_table=...)`` on a Hopper GPU: packed
queries over a paged KV cache (vLLM's layout), each route of
``hopper_flash.paged`` against the float64 reference run sequence by
sequence over the same keys laid out contiguously, judged relative to the
error of PyTorch's own attention on them (``reference.judge``).

Pages come from a shuffled pool whose unused slots hold NaN, table entries
past each row's live pages are garbage (10**6), and q rows past
``seqused_q`` are NaN. Where the varlen kernel reads the pages itself it
reads the same key tiles as on the packed keys, so its output must also be
bitwise the packed call's.
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks
from hopper_flash.reference import assert_judged, varlen_baseline, varlen_reference
from gpu_inputs import capture, cu, paged_pools, rnd, varlen_batch

pytestmark = pytest.mark.gpu

DEV = "cuda"


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def paged_batch(lq, lk, page, h=8, hkv=2, d=128, dtype=torch.bfloat16, seed=0, used_q=None):
    """q THD (NaN past ``used_q``), the keys packed (THD, for the reference
    and the packed call) and the same keys in shuffled pages with their
    block table."""
    q, k, v, cq, ck, _, _ = varlen_batch(lq, lk, h, hkv, d, used_q=used_q, dtype=dtype, seed=seed)
    kp, vp, table = paged_pools(k, v, ck, page, seed=seed + 3)
    return q, k, v, cq, ck, kp, vp, table


def check(out, lse, q, k, v, cq, ck, causal, used_q=None, window=None, softcap=0.0):
    uq = i32(used_q) if used_q is not None else None
    ref, ref_lse = varlen_reference(q, k, v, cq, ck, seqused_q=uq, causal=causal, window=window, softcap=softcap)
    base = varlen_baseline(q, k, v, cq, ck, seqused_q=uq, causal=causal, window=window, softcap=softcap)
    live = torch.zeros(q.shape[0], dtype=torch.bool, device=DEV)
    for b, (start, n) in enumerate(zip(cq[:-1].tolist(), (cq[1:] - cq[:-1]).tolist())):
        live[start:start + (used_q[b] if used_q is not None else n)] = True
    assert_judged("out", out, ref, base)
    if lse is not None:
        assert_judged("lse", lse[:, live], ref_lse[:, live].to(lse.device))


MIXED = dict(lq=[1, 0, 127, 129, 1000, 17, 1, 300], lk=[1, 5, 127, 2000, 1000, 3001, 4099, 300])


@pytest.mark.parametrize("page", [1, 4, 16, 64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_mixed_batches_read_the_pages(page, causal):
    """Prefill chunks beside decodes, the varlen kernel reading the pages
    (a TMA box per page, or rows gathered under 16 keys)."""
    q, k, v, cq, ck, kp, vp, table = paged_batch(**MIXED, page=page, seed=page)
    out, lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, 1000, 4099, seqused_k=ck[1:] - ck[:-1],
                                                   block_table=table, causal=causal, return_lse=True)
    check(out, lse, q, k, v, cq, ck, causal)
    packed, packed_lse = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 1000, 4099, causal=causal,
                                                             return_lse=True)
    assert torch.equal(out, packed) and torch.equal(lse, packed_lse), "the same key tiles as the packed call"


@pytest.mark.parametrize("d,page,dtype", [(64, 1, torch.bfloat16), (64, 32, torch.bfloat16),
                                          (256, 16, torch.bfloat16), (256, 4, torch.bfloat16),
                                          (128, 16, torch.float16), (96, 16, torch.bfloat16)])
def test_mixed_batches_at_other_head_dims_and_dtypes(d, page, dtype):
    """D=256 with pages under 16 keys: copied into a contiguous cache first."""
    q, k, v, cq, ck, kp, vp, table = paged_batch(**MIXED, page=page, d=d, dtype=dtype, seed=d)
    out, lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, ck, 1000, 4099, block_table=table, causal=True,
                                                   return_lse=True)
    check(out, lse, q, k, v, cq, ck, True)


@pytest.mark.parametrize("seqlen_q,page", [(1, 16), (1, 1), (4, 64), (1, 256)])
@pytest.mark.parametrize("h,hkv", [(32, 8), (8, 8)], ids=["gqa4", "mha"])
def test_uniform_query_lengths(seqlen_q, page, h, hkv):
    """A decode step (every sequence one query) or a fixed draft length:
    the KV cache's decode path over the same pages (split-KV, PackGQA)."""
    lk = [1, 4099, 0, 777, 16384, 129]
    lq = [seqlen_q] * len(lk)
    q, k, v, cq, ck, kp, vp, table = paged_batch(lq, lk, page, h=h, hkv=hkv, seed=seqlen_q + page)
    out, lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, seqlen_q, 16384, seqused_k=ck[1:] - ck[:-1],
                                                   block_table=table, causal=True, return_lse=True)
    check(out, lse, q, k, v, cq, ck, True)


def test_seqused_q_gaps_and_cu_seqlens_k_alone():
    """Rows past seqused_q (NaN in q) get zero and -inf; the key lengths
    from cu_seqlens_k's slots."""
    lq, lk, used_q = [40, 10, 300, 1], [60, 10, 1000, 1], [33, 0, 300, 1]
    q, k, v, cq, ck, kp, vp, table = paged_batch(lq, lk, 16, seed=7, used_q=used_q)
    out, lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, ck, 300, 1000, seqused_q=i32(used_q),
                                                   block_table=table, causal=True, return_lse=True)
    check(out, lse, q, k, v, cq, ck, True, used_q=used_q)
    gaps = torch.ones(q.shape[0], dtype=torch.bool, device=DEV)
    for (start, _), u in zip(zip(cq[:-1].tolist(), lq), used_q):
        gaps[start:start + u] = False
    assert (out[gaps] == 0).all() and (lse[:, gaps] == -math.inf).all()


@pytest.mark.parametrize("window_size,softcap,sink", [((300, 0), 0.0, False), ((-1, -1), 30.0, False),
                                                      ((-1, -1), 0.0, True)], ids=["window", "softcap", "sink"])
def test_windows_softcap_and_sinks(window_size, softcap, sink):
    q, k, v, cq, ck, kp, vp, table = paged_batch(**MIXED, page=16, seed=11)
    causal = window_size[1] == 0 or window_size == (-1, -1)
    sinks = rnd(8, dtype=torch.float32, seed=12) if sink else None
    with torch.no_grad():
        out = hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, ck, 1000, 4099, block_table=table, causal=causal,
                                                  window_size=window_size, softcap=softcap, learnable_sink=sinks)
        packed = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 1000, 4099, causal=causal,
                                                     window_size=window_size, softcap=softcap,
                                                     learnable_sink=sinks)
    assert torch.equal(out, packed)
    if not sink:  # (the packed call's sinks are judged by test_sinks_gpu.py)
        check(out, None, q, k, v, cq, ck, causal, window=checks.window_bounds(window_size, causal), softcap=softcap)


def test_cuda_graph_replay_and_torch_compile():
    """A mixed step captured once and replayed with new key lengths (nothing
    read on the host), and traced by torch.compile: the eager step's
    output, each judged."""
    lq, lk = [1, 64, 1, 1], [4000, 4000, 4000, 4000]
    q, k, v, cq, ck, kp, vp, table = paged_batch(lq, lk, 16, seed=21)
    lens = i32(lk)

    def step():
        return hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, 64, 4000, seqused_k=lens, block_table=table,
                                                   causal=True)

    graph, out = capture(step)
    for new in ([1, 64, 3999, 2], [4000, 100, 17, 129]):
        lens.copy_(i32(new))
        graph.replay()
        assert torch.equal(out, step())
        starts = ck[:-1].tolist()
        kk = torch.cat([k[s:s + n] for s, n in zip(starts, new)])
        vv = torch.cat([v[s:s + n] for s, n in zip(starts, new)])
        check(out, None, q, kk, vv, cq, cu(new), True)
    compiled = torch.compile(lambda q, kp, vp, lens: hopper_flash.flash_attn_varlen_func(
        q, kp, vp, cq, None, 64, 4000, seqused_k=lens, block_table=table, causal=True), fullgraph=True)
    assert torch.equal(compiled(q, kp, vp, lens), step())


def test_the_contract_check_names_bad_pages():
    lq, lk = [3, 1], [40, 20]
    q, k, v, cq, ck, kp, vp, table = paged_batch(lq, lk, 16, seed=31)
    table[0, 1] = 10 ** 6  # covers keys 16..31 of a 40-key row
    with pytest.raises(ValueError, match="block_table entries covering live keys"):
        hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, ck, 3, 40, block_table=table, check_contract=True)


# FA3's packed queries in flash_attn_with_kvcache (cu_seqlens_q, max_seqlen_q).

def test_kvcache_packed_queries_over_pages_equal_the_paged_varlen_call():
    q, k, v, cq, ck, kp, vp, table = paged_batch(**MIXED, page=16, seed=41)
    lens = ck[1:] - ck[:-1]
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table,
                                                    cu_seqlens_q=cq, max_seqlen_q=1000, causal=True,
                                                    return_softmax_lse=True)
    check(out, lse, q, k, v, cq, ck, True)
    same, same_lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, 1000, 4099, seqused_k=lens,
                                                         block_table=table, causal=True, return_lse=True)
    assert torch.equal(out, same) and torch.equal(lse, same_lse)


@pytest.mark.parametrize("with_pad", [False, True], ids=["rows", "rows-leftpad"])
def test_kvcache_packed_queries_over_contiguous_rows(with_pad):
    """Cache rows picked by cache_batch_idx, NaN outside each sequence's
    keys (before its pad, past its length, in rows nobody reads)."""
    lq, lk = MIXED["lq"], MIXED["lk"]
    pads = [0, 2, 100, 7, 999, 3000, 1, 0] if with_pad else [0] * len(lk)
    rows = [7, 2, 5, 0, 1, 3, 4, 6]
    cap = 4200
    kc, vc = rnd(9, cap, 2, 128, seed=51), rnd(9, cap, 2, 128, seed=52)
    q = rnd(sum(lq), 8, 128, seed=53)
    live = torch.zeros(9, cap, dtype=torch.bool, device=DEV)
    for r, p, n in zip(rows, pads, lk):
        live[r, p:n] = True
    kc[~live], vc[~live] = math.nan, math.nan
    cq = cu(lq)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(lk), cache_batch_idx=i32(rows),
                                                    cache_leftpad=i32(pads) if with_pad else None, cu_seqlens_q=cq,
                                                    max_seqlen_q=1000, causal=True, return_softmax_lse=True)
    k = torch.cat([kc[r, p:n] for r, p, n in zip(rows, pads, lk)])
    v = torch.cat([vc[r, p:n] for r, p, n in zip(rows, pads, lk)])
    check(out, lse, q, k, v, cq, cu([n - p for p, n in zip(pads, lk)]), True)


def test_kvcache_packed_queries_under_torch_compile():
    q, k, v, cq, ck, kp, vp, table = paged_batch(**MIXED, page=64, seed=61)
    lens = ck[1:] - ck[:-1]

    def step(q, kp, vp, lens):
        return hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table,
                                                    cu_seqlens_q=cq, max_seqlen_q=1000, causal=True)

    eager = step(q, kp, vp, lens)
    assert torch.equal(torch.compile(step, fullgraph=True)(q, kp, vp, lens), eager)
    check(eager, None, q, k, v, cq, ck, True)
