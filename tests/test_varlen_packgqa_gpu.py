"""PackGQA in the forward kernel's VARLEN mode on a Hopper GPU: the query
rows of the heads that share a KV head share one tile, in packed (THD)
batches too (FA3 packs every varlen batch with GQA; ``plan.choose_varlen_pack_gqa``).

Each case runs the same inputs packed and unpacked (``dispatch.forward_varlen``'s
``pack_gqa``) and judges both against the float64 reference run sequence by
sequence, relative to PyTorch's own attention on the same inputs
(``reference.judge``). NaN sits where no kernel may look (rows past
``seqused``, pages past the live ones), and outputs are poisoned first.
The mixes put decode-like sequences (one or a few queries over long keys)
beside a prefill chunk, the batch a serving engine sends: there a packed
tile holds the queries of every head of the group, and the items of the
short sequences past their first tile are dead (skipped by the dynamic
order, ``forward._skip_dead_run``).
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks, dispatch, plan
from hopper_flash.reference import assert_judged, varlen_baseline, varlen_reference, varlen_spans
from gpu_inputs import (assert_varlen_forward, capture, cu, live_rows, packed_queries_over_cache, paged_pools,
                        rnd, varlen_batch, varlen_expected, varlen_sink_expected)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


# The plans of the running test's launches (conftest's planned_launches), for
# ran_packed and ran_tokens: a kernel compiled by an earlier test does not count.
_THIS_TEST = {"launches": []}


@pytest.fixture(autouse=True)
def _record_launches(planned_launches):
    _THIS_TEST["launches"] = planned_launches


def ran_rows(group: int) -> bool:
    """Whether this test launched a packed view whose rows the kernel copied
    from q itself (``plan.Mode.q_rows``: no packed copy of q)."""
    return any(lp.mode.varlen and lp.mode.q_rows and lp.mode.pack_g == group for lp in _THIS_TEST["launches"])


def ran_packed(group: int, view: bool = False) -> bool:
    """Whether this test launched the VARLEN mode packed by ``group``;
    ``view``: from a packed view of q (``plan.Mode.pack_view``)."""
    return any(lp.mode.varlen and lp.mode.pack_g == group and lp.mode.pack_view == view
               for lp in _THIS_TEST["launches"])


def run_both(q, k, v, cq, ck, uq, uk, causal, *, window=None, softcap=0.0, sink=None):
    """The forward packed and unpacked into NaN-poisoned outputs: ``{pack: (out, lse)}``."""
    mq = max([n for _, n in varlen_spans(cq, uq)] + [1])
    mk = max([n for _, n in varlen_spans(ck, uk)] + [1])
    results = {}
    for pack in (True, False):
        out = torch.full(plan.out_shape(q, v), math.nan, dtype=q.dtype, device=DEV)
        if uq is not None:
            out.zero_()  # rows past seqused_q are the caller's zeros (dispatch.forward_varlen_validated)
        results[pack] = dispatch.forward_varlen(q, k, v, cq, ck, mq, mk, uq, uk, None, causal, True, out=out,
                                                window=window, softcap=softcap, sink=sink, pack_gqa=pack)
    return results


def check_both(lq, lk, h, hkv, d, causal, *, used_q=None, used_k=None, dtype=torch.bfloat16, window_size=(-1, -1),
               softcap=0.0, seed=0, view=False):
    q, k, v, cq, ck, uq, uk = varlen_batch(lq, lk, h, hkv, d, used_q=used_q, used_k=used_k, dtype=dtype, seed=seed)
    window = checks.window_bounds(window_size, causal)
    results = run_both(q, k, v, cq, ck, uq, uk, causal, window=window, softcap=softcap)
    expected = varlen_expected(q, k, v, cq, ck, uq, uk, causal, window, softcap)
    for pack, (out, lse) in results.items():
        assert_varlen_forward(f"pack_gqa={pack}", out, lse, expected)
    assert ran_packed(h // hkv, view)
    return results


MIX = dict(lq=[1, 0, 127, 128, 129, 1000, 3001, 17], lk=[1, 5, 127, 128, 129, 1000, 3001, 0])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_length_mix(d, causal):
    check_both(MIX["lq"], MIX["lk"], 8, 2, d, causal)


@pytest.mark.parametrize("h,hkv", [(4, 2), (16, 2), (16, 1)], ids=["g2", "g8", "mqa16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_group_sizes(h, hkv, causal):
    check_both(MIX["lq"], MIX["lk"], h, hkv, 128, causal, seed=1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decodes_beside_a_prefill_chunk(causal):
    """A serving batch: one- and few-query sequences over long, odd key
    lengths next to a 700-query chunk (max_seqlen_q = 700: most items of the
    short sequences are dead), GQA 32/8."""
    lq = [1] * 20 + [4, 3, 700, 1, 2, 16]
    lk = [1, 2, 127, 129, 1000, 3001, 4097, 5, 64, 65, 200, 300, 999, 1023, 1025, 2048, 77, 33, 8192, 12,
          4100, 3, 1400, 1, 9, 16]
    check_both(lq, lk, 32, 8, 128, causal, seed=2)


def test_queries_longer_than_keys_and_empty_sequences():
    check_both([300, 5, 0, 64, 1], [100, 0, 7, 64, 1], 8, 2, 128, True, seed=3)


@pytest.mark.parametrize("d", [64, 256])
def test_seqused_shorter_than_slots_with_nan_gaps(d):
    check_both([200, 50, 9, 1], [400, 60, 30, 5000], 8, 4, d, True, used_q=[130, 0, 9, 1],
               used_k=[300, 60, 11, 4099], seed=4)


def test_fp16_windows_and_softcap():
    check_both(MIX["lq"], MIX["lk"], 8, 2, 128, True, dtype=torch.float16, window_size=(100, 0), softcap=30.0,
               seed=5)
    check_both(MIX["lq"], MIX["lk"], 8, 2, 64, False, window_size=(64, 37), seed=6)


@pytest.mark.parametrize("lq,h,hkv,view", [([1, 129, 33, 4], 8, 2, False), ([1, 16, 3, 4], 40, 8, True)],
                         ids=["g4", "g5-view"])
def test_sinks(lq, h, hkv, view):
    """Attention sinks: each packed row's normaliser takes its own head's
    logit (a packed view's rows span the group's heads unevenly across tiles)."""
    lk = [900, 129, 2000, 4]
    q, k, v, cq, ck, uq, uk = varlen_batch(lq, lk, h, hkv, 128, seed=7 + h)
    sink = rnd(h, dtype=torch.float32, seed=8 + h) * 2.0 + 1.0
    ref, ref_lse, base = varlen_sink_expected(q, k, v, cq, ck, sink)
    for pack, (out, lse) in run_both(q, k, v, cq, ck, uq, uk, True, sink=sink).items():
        assert_judged(f"out (pack_gqa={pack})", out, ref, base)
        assert_judged(f"lse (pack_gqa={pack})", lse, ref_lse.to(lse.device))
    assert ran_packed(h // hkv, view)


@pytest.mark.parametrize("page", [4, 16, 64])
def test_paged_keys(page):
    """flash_attn_varlen_func(block_table=...) packs by default: against the
    same keys packed (THD), judged against the reference."""
    lq, lk = [1, 1, 37, 1, 3], [5000, 17, 300, 1, 129]
    h, hkv, d = 16, 4, 128
    q, k, v, cq, ck, _, _ = varlen_batch(lq, lk, h, hkv, d, seed=9)
    kp, vp, table = paged_pools(k, v, ck, page, seed=12)
    out, lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, max(lq), max(lk), seqused_k=i32(lk),
                                                   causal=True, return_lse=True, block_table=table)
    ref, ref_lse = varlen_reference(q, k, v, cq, ck, causal=True)
    base = varlen_baseline(q, k, v, cq, ck, causal=True)
    assert_judged("out", out, ref, base)
    assert_judged("lse", lse, ref_lse.to(lse.device))
    assert ran_packed(h // hkv)


def test_kvcache_mixed_packed_queries():
    """flash_attn_with_kvcache with packed queries of mixed lengths (the
    varlen route over the cache) honours pack_gqa and packs by default."""
    lq, lens = [1, 5, 1, 130], [4000, 9, 1, 700]
    h, hkv, d, cap = 16, 4, 128, 4096
    q, kc, vc, cq, ref, base = packed_queries_over_cache(lq, lens, h, hkv, d, cap, seed=13)
    for pack in (None, True, False):
        out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(lens), causal=True,
                                                   cu_seqlens_q=cq, max_seqlen_q=max(lq), pack_gqa=pack)
        assert_judged(f"out (pack_gqa={pack})", out, ref, base)
    assert ran_packed(h // hkv)


def test_cuda_graph_replay_with_new_lengths():
    """A captured packed call replayed with new cu_seqlens and seqused of the
    same batch size (what a serving loop does each step)."""
    h, hkv, d, slots = 16, 4, 128, 6
    q = rnd(slots * 300, h, d, seed=16)
    k, v = rnd(slots * 3000, hkv, d, seed=17), rnd(slots * 3000, hkv, d, seed=18)
    cq, ck = (torch.zeros(slots + 1, dtype=torch.int32, device=DEV) for _ in range(2))
    uq, uk = torch.zeros(slots, dtype=torch.int32, device=DEV), torch.zeros(slots, dtype=torch.int32, device=DEV)

    def step():
        return hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 300, 3000, seqused_q=uq, seqused_k=uk,
                                                   causal=True)

    def set_lengths(lq, lk):
        cq.copy_(cu([300] * slots))
        ck.copy_(cu([3000] * slots))
        uq.copy_(i32(lq))
        uk.copy_(i32(lk))

    set_lengths([1] * slots, [1] * slots)
    graph, out = capture(step)
    for seed, (lq, lk) in enumerate([([1, 2, 300, 1, 0, 4], [2999, 5, 300, 1, 0, 77]),
                                     ([7, 1, 1, 1, 129, 1], [7, 3000, 1000, 2, 129, 1])]):
        set_lengths(lq, lk)
        graph.replay()
        ref, _ = varlen_reference(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True)
        base = varlen_baseline(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True)
        live = live_rows(q.shape[0], cq, uq)
        assert_judged(f"replay {seed}", out[live], ref[live], base[live])
    assert ran_packed(h // hkv)


# ---- Groups that are not powers of two (Llama 4's 40/8, Qwen2.5-7B's 28/4,
# 12/4, 12/2): packed from a packed view of q, whose rows the kernel copies
# from q itself where a token's heads are adjacent (plan.Mode.q_rows) and the host from any other
# (plan.packed_q), by default where the batch has decodes to save K/V reads
# on, and from a host copy only where they outweigh it (plan.choose_varlen_view). A tile's 128 rows hold 128 / g queries, so a
# group straddles tiles and warpgroups, and a tile's last query is partial.
PAD_MIX = dict(lq=[1, 1, 3, 16, 0, 1, 7, 1, 2], lk=[4097, 1, 129, 1000, 5, 0, 3001, 127, 65])


@pytest.mark.parametrize("h,hkv", [(40, 8), (28, 4), (12, 4), (12, 2)], ids=["g5", "g7", "g3", "g6"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_view_decode_mix(h, hkv, d, causal):
    check_both(PAD_MIX["lq"], PAD_MIX["lk"], h, hkv, d, causal, seed=h + d, view=True)
    assert ran_rows(h // hkv)  # a contiguous q: its rows copied by the kernel


@pytest.mark.parametrize("h,hkv", [(40, 8), (28, 4)], ids=["g5", "g7"])
@pytest.mark.parametrize("d", [64, 128])
def test_packed_view_of_a_strided_q(h, hkv, d):
    """q as a slice of a wider tensor: its tokens strided (a fused QKV
    projection's q), read by the kernel row by row all the same
    (plan.rows_of_q: a token's heads adjacent); its heads interleaved with
    other features, packed from the host's copy (plan.packed_q); and the
    same values contiguous. The same results; NaN in the wider tensors'
    other parts, which no path may read."""
    q, k, v, cq, ck, _, _ = varlen_batch(PAD_MIX["lq"], PAD_MIX["lk"], h, hkv, d, seed=h + d + 7)
    tokens = torch.full((q.shape[0], 2, h, d), math.nan, dtype=q.dtype, device=DEV)
    tokens[:, 0] = q
    heads = torch.full((q.shape[0], h, 2, d), math.nan, dtype=q.dtype, device=DEV)
    heads[:, :, 0] = q
    mq, mk = max(PAD_MIX["lq"]), max(PAD_MIX["lk"])
    expected = varlen_expected(q, k, v, cq, ck, None, None, True, None, 0.0)
    for name, qq, rows in (("strided tokens", tokens[:, 0], True), ("interleaved heads", heads[:, :, 0], False),
                           ("contiguous", q, True)):
        _THIS_TEST["launches"].clear()
        out = torch.full(plan.out_shape(q, v), math.nan, dtype=q.dtype, device=DEV)
        results = dispatch.forward_varlen(qq, k, v, cq, ck, mq, mk, None, None, None, True, True, out=out,
                                          pack_gqa=True)
        assert_varlen_forward(name, *results, expected)
        assert ran_packed(h // hkv, view=True) and ran_rows(h // hkv) == rows, name


def ran_tokens(group: int) -> bool:
    """Whether this test launched a VARLEN kernel that read q by token (one
    query per sequence, ``plan.Mode.q_tokens``: no copy of q) for ``group``."""
    return any(lp.mode.varlen and lp.mode.q_tokens and lp.mode.pack_g == group for lp in _THIS_TEST["launches"])


ONE_QUERY = dict(lq=[1, 0, 1, 1, 1, 0, 1], lk=[4097, 5, 1, 129, 0, 17, 3001])


@pytest.mark.parametrize("h,hkv", [(40, 8), (28, 4)], ids=["g5", "g7"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_view_one_query_per_sequence(h, hkv, d, causal):
    """max_seqlen_q 1 (a decode batch): q read by token, no copy; empty
    sequences, a query over no keys, and (seqused_q) a query row of NaN
    that no kernel may read."""
    check_both(ONE_QUERY["lq"], ONE_QUERY["lk"], h, hkv, d, causal, seed=h + d + 3, view=True)
    check_both([1, 1, 1, 1], [300, 7000, 1, 64], h, hkv, d, causal, used_q=[1, 0, 1, 1], used_k=[300, 6000, 1, 3],
               seed=h + d + 4, view=True)
    assert ran_tokens(h // hkv)


@pytest.mark.parametrize("lq", [[1] * 5, [1, 0, 1, 1, 1]], ids=["decode-route", "varlen"])
@pytest.mark.parametrize("page", [16, 64])
def test_packed_view_one_query_paged_split_and_graph_replay(page, lq):
    """vLLM's decode batch at 28/4 over pages, split 3 ways, and a captured
    call replayed with new queries and lengths. One query in every sequence
    takes the decode route (q viewed ``[batch, 1, H, D]``: the fixed-length
    packed view, q restrided); with an empty sequence among them the varlen
    kernel reads q by token. Neither copies q."""
    lk = [5000, 17, 300, 1, 129]
    h, hkv, d = 28, 4, 128
    q, k, v, cq, ck, _, _ = varlen_batch(lq, lk, h, hkv, d, seed=40 + page)
    kp, vp, table = paged_pools(k, v, ck, page, seed=41)
    used = i32(lk)

    def call():
        return hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, 1, max(lk), seqused_k=used, causal=True,
                                                   block_table=table, num_splits=3)

    assert_judged("out", call(), varlen_reference(q, k, v, cq, ck, causal=True)[0],
                  varlen_baseline(q, k, v, cq, ck, causal=True))
    decode_route = sum(lq) == len(lq)
    assert ran_tokens(7) != decode_route
    assert decode_route == any(not lp.mode.varlen and lp.mode.pack_view and lp.mode.pack_g == 7
                               for lp in _THIS_TEST["launches"])
    graph, g_out = capture(call)
    new = [4999, 1, 290, 1, 64]  # (at most the pages' keys)
    used.copy_(i32(new))
    q.copy_(rnd(*q.shape, dtype=q.dtype, seed=42))
    graph.replay()
    torch.cuda.synchronize()
    k2, v2 = (torch.cat([t[int(ck[b]):int(ck[b]) + n] for b, n in enumerate(new)]) for t in (k, v))
    ck2 = cu(new)
    assert_judged("replay", g_out, varlen_reference(q, k2, v2, cq, ck2, causal=True)[0],
                  varlen_baseline(q, k2, v2, cq, ck2, causal=True))


def test_packed_view_asked_for_over_long_queries():
    """pack_gqa=True packs whatever the query lengths: tiles of 25.6 queries
    x 5 heads across sequences of 127-3001 queries."""
    check_both(MIX["lq"], MIX["lk"], 40, 8, 128, True, seed=20, view=True)


def test_packed_view_seqused_with_nan_gaps():
    check_both([16, 9, 4, 1], [400, 60, 30, 5000], 28, 4, 128, True, used_q=[13, 0, 4, 1],
               used_k=[300, 60, 11, 4099], seed=21, view=True)


@pytest.mark.parametrize("page", [4, 16, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_packed_view_paged_and_split(page, num_splits):
    """vLLM's decode batch (flash_attn_varlen_func with block_table) at
    40/8, split and not, judged against the same keys packed."""
    lq, lk = [1, 1, 3, 1, 16], [5000, 17, 300, 1, 129]
    h, hkv, d = 40, 8, 128
    q, k, v, cq, ck, _, _ = varlen_batch(lq, lk, h, hkv, d, seed=24 + page)
    kp, vp, table = paged_pools(k, v, ck, page, seed=25)
    out, lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, max(lq), max(lk), seqused_k=i32(lk),
                                                   causal=True, return_lse=True, block_table=table,
                                                   num_splits=num_splits)
    ref, ref_lse = varlen_reference(q, k, v, cq, ck, causal=True)
    base = varlen_baseline(q, k, v, cq, ck, causal=True)
    assert_judged("out", out, ref, base)
    assert_judged("lse", lse, ref_lse.to(lse.device))
    assert ran_packed(5, view=True)


def test_packed_view_kvcache_packed_queries_and_graph_replay():
    """flash_attn_with_kvcache with packed decode queries at 28/4 packs from
    a packed view by default (q's rows copied by the kernel), and a captured
    step replays with new lengths and new queries."""
    lq, lens = [1, 5, 1, 16], [4000, 9, 1, 700]
    q, kc, vc, cq, ref, base = packed_queries_over_cache(lq, lens, 28, 4, 128, 4096, seed=26)
    cs = i32(lens)
    for pack in (None, False):
        out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, cu_seqlens_q=cq,
                                                   max_seqlen_q=max(lq), pack_gqa=pack)
        assert_judged(f"out (pack_gqa={pack})", out, ref, base)
    assert ran_packed(7, view=True) and ran_rows(7)
    graph, g_out = capture(lambda: hopper_flash.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=cs, causal=True, cu_seqlens_q=cq, max_seqlen_q=max(lq)))
    new = [3999, 7, 1, 64]  # (at most the live keys: NaN past them)
    cs.copy_(i32(new))
    q.copy_(rnd(*q.shape, dtype=q.dtype, seed=29))  # new queries: the replayed step must read them
    graph.replay()
    torch.cuda.synchronize()
    k, v = (torch.cat([c[b, :n] for b, n in enumerate(new)]) for c in (kc, vc))
    ck = cu(new)
    assert_judged("replay", g_out, varlen_reference(q, k, v, cq, ck, causal=True)[0],
                  varlen_baseline(q, k, v, cq, ck, causal=True))


def test_packed_view_by_default_beside_a_prefill_chunk():
    """flash_attn_varlen_func's default packs a 40/8 batch of decodes beside a
    512-query chunk from a packed view, and one whose chunk dominates too
    where the kernel copies q's rows itself (plan.choose_varlen_view: no copy
    of q to outweigh the decodes' K/V reads): from a contiguous q and from
    a strided one whose token's heads are adjacent, but not from a q whose
    heads are interleaved with other features, which would take a copy."""
    lq = [1] * 40 + [512]
    lk = [1000 + 97 * i for i in range(40)] + [1536]
    q, k, v, cq, ck, _, _ = varlen_batch(lq, lk, 40, 8, 128, seed=27)
    _THIS_TEST["launches"].clear()
    out = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True)
    ref, _ = varlen_reference(q, k, v, cq, ck, causal=True)
    assert_judged("out", out, ref, varlen_baseline(q, k, v, cq, ck, causal=True))
    assert ran_packed(5, view=True)
    assert ran_rows(5)
    lq, lk = [1] * 4 + [8000], [900] * 4 + [8000]
    q, k, v, cq, ck, _, _ = varlen_batch(lq, lk, 40, 8, 128, seed=28)
    ref, _ = varlen_reference(q, k, v, cq, ck, causal=True)
    base = varlen_baseline(q, k, v, cq, ck, causal=True)
    _THIS_TEST["launches"].clear()
    out = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True)
    assert_judged("out", out, ref, base)
    assert ran_rows(5)
    tokens = torch.stack([q, torch.full_like(q, math.nan)], dim=1)[:, 0]
    _THIS_TEST["launches"].clear()
    out = hopper_flash.flash_attn_varlen_func(tokens, k, v, cq, ck, max(lq), max(lk), causal=True)
    assert_judged("out (strided tokens)", out, ref, base)
    assert ran_packed(5, view=True) and ran_rows(5)
    heads = torch.stack([q, torch.full_like(q, math.nan)], dim=2)[:, :, 0]
    _THIS_TEST["launches"].clear()
    out = hopper_flash.flash_attn_varlen_func(heads, k, v, cq, ck, max(lq), max(lk), causal=True)
    assert_judged("out (interleaved heads)", out, ref, base)
    assert not ran_packed(5, view=True)
