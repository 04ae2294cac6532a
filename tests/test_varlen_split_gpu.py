"""Split-KV in the forward kernel's VARLEN mode on a Hopper GPU: each
sequence's KV tiles are split across ``num_splits`` items, which write fp32
partials over the packed rows, merged by the combine kernel (the packed rows
as its one sequence of ``total_q`` rows). The KV cache's mixed packed-query
route and ``flash_attn_varlen_func`` ask for the heuristic (``num_splits=0``,
their default), so a few long decodes beside a short chunk are spread over
the GPU.

Every case is judged against the float64 reference run sequence by sequence,
relative to PyTorch's own attention on the same inputs (``reference.judge``);
NaN sits in the gaps past ``seqused`` and past each cache row's live keys,
outputs are poisoned first, and rows outside every sequence must come back
zero with an LSE of -inf (or the sink).
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks, dispatch, plan
from hopper_flash.reference import (assert_judged, attention_baseline_grads, attention_reference_grads,
                                   grads_abs_tol, varlen_baseline, varlen_grads, varlen_reference, varlen_spans)
from gpu_inputs import (assert_varlen_forward, capture, cu, packed_queries_over_cache, rnd,
                        varlen_batch, varlen_expected, varlen_sink_expected)

pytestmark = pytest.mark.gpu
DEV = "cuda"


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def ran_split() -> bool:
    """Whether a split VARLEN kernel was launched (its plan keys the compiled kernel)."""
    return any(isinstance(key[5], plan.Mode) and key[5].varlen and key[5].split
               for key in plan._COMPILED if isinstance(key, tuple) and len(key) > 5)


def ran_split_table() -> bool:
    """Whether a split-table VARLEN kernel was launched (kernels/split_table.py)."""
    return any(isinstance(key[5], plan.Mode) and key[5].split_table
               for key in plan._COMPILED if isinstance(key, tuple) and len(key) > 5)


def check_splits(lq, lk, h, hkv, d, causal, splits=(2, 3, 7), *, used_q=None, used_k=None, pack_gqa=None,
                 window_size=(-1, -1), softcap=0.0, dtype=torch.bfloat16, seed=0):
    q, k, v, cq, ck, uq, uk = varlen_batch(lq, lk, h, hkv, d, used_q=used_q, used_k=used_k, dtype=dtype, seed=seed)
    mq = max([n for _, n in varlen_spans(cq, uq)] + [1])
    mk = max([n for _, n in varlen_spans(ck, uk)] + [1])
    window = checks.window_bounds(window_size, causal)
    expected = varlen_expected(q, k, v, cq, ck, uq, uk, causal, window, softcap)
    for s in splits:
        out = torch.full(plan.out_shape(q, v), math.nan, dtype=q.dtype, device=DEV)
        out, lse = dispatch.forward_varlen(q, k, v, cq, ck, mq, mk, uq, uk, None, causal, True, out=out,
                                           window=window, softcap=softcap, pack_gqa=pack_gqa, num_splits=s)
        assert_varlen_forward(f"{s} splits", out, lse, expected)
    assert ran_split()


MIX = dict(lq=[1, 0, 127, 128, 129, 1000, 3001, 17], lk=[1, 5, 127, 128, 129, 1000, 3001, 0])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_length_mix(d, causal):
    check_splits(MIX["lq"], MIX["lk"], 8, 2, d, causal)


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["unpacked", "packed"])
def test_long_decodes_beside_a_chunk(pack_gqa):
    """The case split-KV is for: a few decodes over long, odd key lengths
    beside a short chunk, GQA 32/8."""
    check_splits([1, 1, 4, 200, 1], [40000, 17, 9001, 1300, 1], 32, 8, 128, True, splits=(2, 5, 16),
                 pack_gqa=pack_gqa, seed=1)


def test_seqused_gaps_windows_softcap_fp16():
    check_splits([200, 50, 9, 1], [400, 60, 30, 5000], 8, 4, 128, True, used_q=[130, 0, 9, 1],
                 used_k=[300, 60, 11, 4099], seed=2)
    check_splits(MIX["lq"], MIX["lk"], 8, 2, 128, True, window_size=(300, 0), softcap=30.0, dtype=torch.float16,
                 seed=3)


def test_sinks_join_the_combine():
    """With sinks the combine adds each head's logit once per row (the split
    kernels leave it out)."""
    lq, lk = [1, 129, 33, 4], [9000, 129, 2000, 4]
    q, k, v, cq, ck, _, _ = varlen_batch(lq, lk, 8, 2, 128, seed=4)
    sink = rnd(8, dtype=torch.float32, seed=5) * 2.0 + 1.0
    ref, ref_lse, base = varlen_sink_expected(q, k, v, cq, ck, sink)
    for s in (2, 6):
        out, lse = dispatch.forward_varlen(q, k, v, cq, ck, max(lq), max(lk), None, None, None, True, True,
                                           sink=sink, num_splits=s)
        assert_judged(f"out ({s} splits)", out, ref, base)
        assert_judged(f"lse ({s} splits)", lse, ref_lse.to(lse.device))


@pytest.mark.parametrize("page", [None, 4, 16])
def test_kvcache_mixed_route_splits_by_default(page):
    """flash_attn_with_kvcache with packed queries of mixed lengths over a
    contiguous or paged cache: the heuristic splits the long rows, and an
    explicit count is honoured; against the same keys packed."""
    lq, lens = [1, 3, 1, 64], [30000, 9, 17000, 700]
    h, hkv, d, cap = 16, 4, 128, 32768
    q, kc, vc, cq, ref, base = packed_queries_over_cache(lq, lens, h, hkv, d, cap, seed=6)
    kwargs = {}
    if page is not None:
        pages = cap // page
        perm = torch.randperm(len(lq) * pages, device=DEV, generator=torch.Generator(device=DEV).manual_seed(9))
        table = perm.view(len(lq), pages).to(torch.int32)
        kp = torch.empty(len(lq) * pages, page, hkv, d, dtype=q.dtype, device=DEV)
        vp = torch.empty_like(kp)
        kp[table.flatten().long()] = kc.reshape(len(lq) * pages, page, hkv, d)
        vp[table.flatten().long()] = vc.reshape(len(lq) * pages, page, hkv, d)
        kc, vc, kwargs = kp, vp, dict(page_table=table)
    for num_splits in (0, 1, 9):
        out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(lens), causal=True, cu_seqlens_q=cq,
                                                   max_seqlen_q=max(lq), num_splits=num_splits, **kwargs)
        assert_judged(f"out (num_splits={num_splits})", out, ref, base)
    assert ran_split()


def test_cuda_graph_replay_with_new_lengths():
    """A captured split call (partials allocated and initialised inside the
    capture) replayed with new cu_seqlens and seqused."""
    h, hkv, d, slots = 16, 4, 128, 4
    q = rnd(slots * 64, h, d, seed=10)
    k, v = rnd(slots * 20000, hkv, d, seed=11), rnd(slots * 20000, hkv, d, seed=12)
    cq, ck = (torch.zeros(slots + 1, dtype=torch.int32, device=DEV) for _ in range(2))
    uq, uk = (torch.zeros(slots, dtype=torch.int32, device=DEV) for _ in range(2))
    cq.copy_(cu([64] * slots))
    ck.copy_(cu([20000] * slots))

    def step():
        return dispatch.forward_varlen(q, k, v, cq, ck, 64, 20000, uq, uk, None, True, False, num_splits=0)[0]

    uq.copy_(i32([1] * slots))
    uk.copy_(i32([1] * slots))
    graph, out = capture(step)
    for seed, (lq, lk) in enumerate([([1, 2, 64, 0], [19999, 5, 300, 0]), ([7, 1, 1, 1], [7, 20000, 1000, 2])]):
        uq.copy_(i32(lq))
        uk.copy_(i32(lk))
        graph.replay()
        ref, _ = varlen_reference(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True)
        base = varlen_baseline(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True)
        assert_judged(f"replay {seed}", out, ref, base)
    assert ran_split()


def test_flash_attn_varlen_func_splits_by_default_forward_and_backward(monkeypatch):
    """flash_attn_varlen_func's default (num_splits=0): three decodes over
    long caches beside a 256-query chunk look like four chunks to
    max_seqlen_q, but q's 259 rows bound the live items under one per SM,
    so the keys are split (the combine runs); the backward, through the
    combine's LSE, is judged as every varlen backward is. num_splits=1
    leaves the call unsplit."""
    combines = []
    launch_combine = plan.launch_combine
    monkeypatch.setattr(plan, "launch_combine", lambda *a, **kw: (combines.append(1), launch_combine(*a, **kw))[1])
    lq, lk = [1, 1, 1, 256], [20000, 9001, 30000, 1280]
    q, k, v, cq, ck, _, _ = varlen_batch(lq, lk, 32, 8, 128, seed=13)
    ref, _ = varlen_reference(q, k, v, cq, ck, causal=True)
    base = varlen_baseline(q, k, v, cq, ck, causal=True)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = hopper_flash.flash_attn_varlen_func(qg, kg, vg, cq, ck, max(lq), max(lk), causal=True)
    assert combines, "the default call did not split"
    assert_judged("out", out, ref, base)
    dout = rnd(*out.shape, seed=14)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    dref = varlen_grads(lambda a, b, c, e: attention_reference_grads(a, b, c, e, causal=True), q, k, v, dout, cq, ck,
                        out_dtype=torch.float64)
    dbase = varlen_grads(lambda a, b, c, e: attention_baseline_grads(a, b, c, e, causal=True), q, k, v, dout, cq, ck)
    for name, g, r, bl in zip(("dq", "dk", "dv"), grads, dref, dbase):
        assert_judged(name, g, r, bl, abs_tol=grads_abs_tol(dref, q.dtype))
    combines.clear()
    unsplit = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, num_splits=1)
    assert not combines
    assert_judged("out (num_splits=1)", unsplit, ref, base)


def test_skewed_keys_split_by_default(monkeypatch):
    """Many short decodes beside one long one (plan.varlen_skew_splits): the
    items fill the SMs, so FA3's rule alone would not split, but the long
    decode's items would read its keys alone; the default call splits
    (the combine runs), NaN past each sequence's live keys, and is judged
    as every varlen forward is."""
    combines = []
    launch_combine = plan.launch_combine
    monkeypatch.setattr(plan, "launch_combine", lambda *a, **kw: (combines.append(1), launch_combine(*a, **kw))[1])
    lk = [300 + 7 * i for i in range(40)] + [40001]
    lq = [1] * len(lk)
    used_k = [n - (i % 3) for i, n in enumerate(lk)]
    q, k, v, cq, ck, uq, uk = varlen_batch(lq, lk, 32, 8, 128, used_k=used_k, seed=21)
    sms = plan.sm_count(q.device.index)
    assert plan.varlen_skew_splits(k.shape[0], len(lk), 1, max(lk), 32, 4, plan.CONFIGS[128], None, None,
                                   q.device.index) > 1, f"not a skewed batch on {sms} SMs"
    ref, _ = varlen_reference(q, k, v, cq, ck, seqused_k=uk, causal=True)
    base = varlen_baseline(q, k, v, cq, ck, seqused_k=uk, causal=True)
    out = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 1, max(lk), seqused_k=uk, causal=True)
    assert combines, "the default call did not split"
    assert_judged("out", out, ref, base)


def _skewed(n_short, seed):
    """A skewed mix: ``n_short`` decodes and drafts (1-4 queries, one with
    none) over 300-1800 keys, an empty and a one-key sequence, and one
    long decode over 50001 keys, last (the table puts it first)."""
    gen = torch.Generator().manual_seed(seed)
    lk = torch.randint(300, 1800, (n_short,), generator=gen).tolist() + [0, 1, 50001]
    lq = torch.randint(1, 5, (n_short,), generator=gen).tolist() + [1, 1, 1]
    lq[3] = 0
    return lq, lk


def _assert_skewed(total_k, lq, lk, h, hkv, d=128, pack_gqa=None) -> int:
    """Precondition of the split-table tests: the skew rule splits this mix.
    Returns its split count."""
    skew = plan.varlen_skew_splits(total_k, len(lk), max(lq), max(lk), h, h // hkv, plan.CONFIGS[d], pack_gqa,
                                   None, torch.cuda.current_device())
    assert skew > 1, "not a skewed mix on this GPU"
    return skew


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pack_gqa", [None, False], ids=["default", "unpacked"])
def test_split_table_per_sequence_counts(d, causal, pack_gqa):
    """A skewed mix at the default split (``num_splits=0``): each sequence
    split into its own count by the device-written table (``Mode.split_table``),
    the long one first; empty sequences, drafts of several queries and one
    of none; judged against the float64 reference, NaN past every live row,
    outputs poisoned."""
    lq, lk = _skewed(48, seed=d)
    _assert_skewed(sum(lk), lq, lk, 16, 4, d, pack_gqa)
    plan._COMPILED.clear()
    check_splits(lq, lk, 16, 4, d, causal, splits=(0,), pack_gqa=pack_gqa, seed=30 + d)
    assert ran_split_table()


def test_split_table_past_the_static_deal_waves():
    """300 short decodes beside one long one: the table's items (entries x
    KV heads) pass ``deal_split``'s waves, and still run one CTA per item
    (the long sequence's pieces first, the rest as SMs free up)."""
    gen = torch.Generator().manual_seed(60)
    lk = torch.randint(100, 700, (300,), generator=gen).tolist() + [40001]
    lq = [1] * len(lk)
    skew = _assert_skewed(sum(lk), lq, lk, 32, 8)
    sms = plan.sm_count(torch.cuda.current_device())
    entries = plan.varlen_split_table(sum(lk), len(lk), max(lk), skew, plan.CONFIGS[128])
    assert entries * 8 > plan.SPLIT_GRID_MAX_WAVES * sms, "too few items to pass the waves on this GPU"
    plan._COMPILED.clear()
    check_splits(lq, lk, 32, 8, 128, True, splits=(0,), seed=61)
    assert ran_split_table()


def test_split_table_seqused_gaps_and_lse():
    """seqused_q and seqused_k shorter than their slots (NaN in the gaps,
    a sequence with no live key), the LSE asked for."""
    lq, lk = _skewed(40, seed=7)
    used_q = [max(0, n - (i % 2)) for i, n in enumerate(lq)]
    used_k = [max(0, n - 3 * (i % 3)) for i, n in enumerate(lk)]
    used_k[5] = 0
    _assert_skewed(sum(lk), lq, lk, 32, 8)
    plan._COMPILED.clear()
    check_splits(lq, lk, 32, 8, 128, True, splits=(0,), used_q=used_q, used_k=used_k, seed=40)
    assert ran_split_table()


def test_split_table_cuda_graph_replay_with_new_lengths():
    """A captured split-table call (the table written and the partials
    filled inside the capture) replayed with new cu_seqlens_k and
    seqused_q of the same batch: the table follows the device's lengths,
    the long sequence moving between slots."""
    h, hkv, d, slots, rows_k = 32, 8, 128, 50, 150000
    q = rnd(slots * 2, h, d, seed=50)
    k, v = rnd(rows_k, hkv, d, seed=51), rnd(rows_k, hkv, d, seed=52)
    cq, ck = cu([2] * slots), torch.zeros(slots + 1, dtype=torch.int32, device=DEV)
    uq = torch.zeros(slots, dtype=torch.int32, device=DEV)
    max_k = 60000  # the host's bound, as a serving loop gives it
    gen = torch.Generator().manual_seed(53)
    lens = [torch.randint(100, 1800, (slots,), generator=gen).tolist() for _ in range(3)]
    lens[0][-1], lens[1][7], lens[2][0] = 59999, 45000, 60000
    assert all(sum(lk) <= rows_k for lk in lens)
    _assert_skewed(rows_k, [2] * slots, lens[0], h, hkv)

    def step():
        return dispatch.forward_varlen(q, k, v, cq, ck, 2, max_k, uq, None, None, True, False, num_splits=0)[0]

    uq.copy_(i32([1] * slots))
    ck.copy_(cu(lens[0]))
    plan._COMPILED.clear()
    graph, out = capture(step)
    assert ran_split_table()
    for seed, lk in enumerate(lens):
        uq.copy_(i32([1 + (i + seed) % 2 for i in range(slots)]))
        ck.copy_(cu(lk))
        graph.replay()
        ref, _ = varlen_reference(q, k, v, cq, ck, seqused_q=uq, causal=True)
        base = varlen_baseline(q, k, v, cq, ck, seqused_q=uq, causal=True)
        assert_judged(f"replay {seed}", out, ref, base)
