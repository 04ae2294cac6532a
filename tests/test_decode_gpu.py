"""Decode and chunked prefill on a Hopper GPU: ``flash_attn_with_kvcache``
and the decode path of ``flash_attn_func`` against the float64 reference.

Every cache is filled with NaN past each row's live length (uninitialised
memory may hold anything; 0 * NaN = NaN in PV), and every batch row is judged
by ``hopper_flash.reference.check_kvcache``: within twice the error SDPA makes
on the same inputs, LSE to 2e-5 relative.
"""

import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks, plan
from hopper_flash.reference import check_kvcache
from gpu_inputs import capture, nan_tailed_cache, paged_copy, rnd
from rotary_ref import rotate64

pytestmark = pytest.mark.gpu

DEV = "cuda"


def assert_close(out, q, kc, vc, lens, causal, rows=None, lse=None, window=None):
    """Each batch row against the float64 reference over its live keys,
    within twice the error SDPA makes on them (hopper_flash.reference)."""
    bad = [v.message for v in check_kvcache(out, q, kc, vc, lens, causal=causal, rows=rows, lse=lse, window=window)
           if not v]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("lens", [[1, 777, 4099], [0, 5, 129, 65536], [17, 128, 129, 3001]],
                         ids=["1-777-4099", "0-5-129-65536", "17-128-129-3001"])
@pytest.mark.parametrize("seqlen_q", [1, 2, 4, 16, 128])
def test_kvcache_lengths(seqlen_q, lens):
    B, H, Hkv, D = len(lens), 32, 8, 128
    kc, vc = nan_tailed_cache(B, max(lens) + 77, Hkv, D, lens, seed=seqlen_q)
    q = rnd(B, seqlen_q, H, D, seed=seqlen_q + 100)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, return_softmax_lse=True)
    assert_close(out, q, kc, vc, lens, True, lse=lse)


@pytest.mark.parametrize("nheads,nheads_kv", [(8, 8), (32, 8), (16, 2), (8, 1)], ids=["g1", "g4", "g8", "mqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_kvcache_gqa(nheads, nheads_kv, causal, seqlen_q):
    lens = [3000, 17, 1]
    kc, vc = nan_tailed_cache(3, 3100, nheads_kv, 128, lens, seed=nheads)
    q = rnd(3, seqlen_q, nheads, 128, seed=nheads_kv)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=causal)
    assert_close(out, q, kc, vc, lens, causal)


def ran_view(launches, group: int) -> bool:
    """Whether one of ``launches`` (the ``planned_launches`` fixture's: this
    test's) packed from a packed view of q (plan.Mode.pack_view) by ``group``."""
    return any(lp.mode.pack_view and lp.mode.pack_g == group for lp in launches)


def ran_rows(launches, group: int) -> bool:
    """Whether one of ``launches`` copied its packed view's rows from q
    itself (plan.Mode.q_rows: no packed copy of q)."""
    return any(lp.mode.q_rows and lp.mode.pack_g == group for lp in launches)


# Groups that are not powers of two (Llama 4's 40/8, Qwen2.5-7B's 28/4, 24/8, 12/2): PackGQA from q
# packed into a view (plan.Mode.pack_view: q restrided at one query per row, past it copied from q
# row by row by the kernel, plan.Mode.q_rows), O by address. A tile's 128 rows hold 128 / g
# queries: groups straddle warpgroups and tiles (48 queries of 5 heads: 2 tiles).
@pytest.mark.parametrize("nheads,nheads_kv", [(40, 8), (28, 4), (24, 8), (12, 2)], ids=["g5", "g7", "g3", "g6"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlen_q,num_splits", [(1, 0), (1, 1), (3, 4), (16, 1), (48, 0)])
def test_kvcache_groups_not_powers_of_two(planned_launches, nheads, nheads_kv, head_dim, seqlen_q, num_splits):
    lens = [4099, 17, 1, 0]
    kc, vc = nan_tailed_cache(4, 4200, nheads_kv, head_dim, lens, seed=nheads)
    q = rnd(4, seqlen_q, nheads, head_dim, seed=nheads_kv)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, num_splits=num_splits,
                                                    return_softmax_lse=True)
    assert_close(out, q, kc, vc, lens, True, lse=lse)
    kp, vp, pt = paged_copy(kc, vc, 64, lens, seed=3)
    paged = hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cs, page_table=pt, causal=True,
                                                 num_splits=num_splits)
    assert_close(paged, q, kc, vc, lens, True)
    assert ran_view(planned_launches, nheads // nheads_kv)
    assert ran_rows(planned_launches, nheads // nheads_kv) == (seqlen_q > 1)


@pytest.mark.parametrize("layout", ["fused", "contiguous", "interleaved"])
@pytest.mark.parametrize("seqlen_q", [1, 48, 100])
def test_flash_attn_func_packed_view_every_launch_path(planned_launches, seqlen_q, layout):
    """flash_attn_func over a group of 5 (the fill rule packs 1-100 queries):
    the JIT's first launch, the direct launch and the prepared call
    (plan.PreparedForward, the C launch) each pass the packed view as Q's
    descriptor (q itself, restrided, at one query per row), for q a slice
    of a fused QKV projection's output (tokens 56 heads apart) or
    contiguous, whose rows past one query the kernel copies itself
    (plan.Mode.q_rows), and for q's heads interleaved with other features
    (a packed copy past one query). Each call's q is a new tensor (its
    address the kernel's pointer); NaN in the wider tensors' other parts."""
    shapes = {"fused": (2, seqlen_q, 40 + 16, 128), "contiguous": (2, seqlen_q, 40, 128),
              "interleaved": (2, seqlen_q, 40, 2, 128)}
    held = []
    for call in range(3):
        wide = torch.full(shapes[layout], math.nan, device=DEV, dtype=torch.bfloat16)
        held.append(wide)  # (held: the next tensor gets a new address)
        q = {"fused": lambda: wide[:, :, :40], "contiguous": lambda: wide,
             "interleaved": lambda: wide[:, :, :, 0]}[layout]()
        k, v = rnd(2, 3001, 8, 128, seed=10 * call + 1), rnd(2, 3001, 8, 128, seed=10 * call + 2)
        q.copy_(rnd(2, seqlen_q, 40, 128, seed=10 * call + 3))
        out, lse = hopper_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
        assert_close(out, q, k, v, [3001] * 2, True, lse=lse)
    assert ran_view(planned_launches, 5)
    assert ran_rows(planned_launches, 5) == (layout != "interleaved" and seqlen_q > 1)


def test_packed_view_with_sinks_and_graph_replay():
    """Sinks index each row's head (a tile's rows span the group's heads
    unevenly), and a captured decode step replays with new lengths."""
    lens = [3000, 5]
    kc, vc = nan_tailed_cache(2, 3100, 8, 128, lens, seed=7)
    q = rnd(2, 1, 40, 128, seed=8)
    sink = torch.randn(40, device=DEV)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, learnable_sink=sink,
                                               num_splits=1)
    from hopper_flash.reference import assert_judged, attention_reference, sink_eager
    for b, n in enumerate(lens):
        one = (q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n])
        ref, _ = attention_reference(*one, causal=True, sink=sink)
        assert_judged(f"row {b}", out[b:b + 1], ref, sink_eager(*one, sink, causal=True))
    graph, g_out = capture(lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True))
    cs.copy_(torch.tensor([17, 2999], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(g_out, q, kc, vc, [17, 2999], True)


@pytest.mark.parametrize("num_splits", [1, 0])
def test_q_rows_under_graph_replay(planned_launches, num_splits):
    """Drafts of 4 queries at a group of 7, q read by rows (plan.Mode.q_rows),
    captured once and replayed with new queries and lengths: the graph
    keeps q's address, the kernel reads the new rows."""
    lens = [3000, 5, 700]
    kc, vc = nan_tailed_cache(3, 3100, 4, 128, lens, seed=17)
    q = rnd(3, 4, 28, 128, seed=18)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    call = lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True,  # noqa: E731
                                                        num_splits=num_splits)
    assert_close(call(), q, kc, vc, lens, True)
    graph, g_out = capture(call)
    q.copy_(rnd(3, 4, 28, 128, seed=19))
    cs.copy_(torch.tensor([17, 3001, 64], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(g_out, q, kc, vc, [17, 3001, 64], True)
    assert ran_rows(planned_launches, 7)


@pytest.mark.parametrize("num_splits,pack_gqa", [(1, False), (1, True), (3, False), (3, True), (7, None), (0, None)])
def test_kvcache_splits_and_packing_agree(num_splits, pack_gqa):
    lens = [3000, 1000, 0]
    kc, vc = nan_tailed_cache(3, 3100, 8, 128, lens, seed=5)
    q = rnd(3, 4, 32, 128, seed=6)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, num_splits=num_splits,
                                                    pack_gqa=pack_gqa, return_softmax_lse=True)
    assert_close(out, q, kc, vc, lens, True, lse=lse)


@pytest.mark.parametrize("nheads,nheads_kv", [(28, 4), (32, 8)], ids=["g7-view", "g4-box"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "pages64"])
def test_split_items_past_one_wave(planned_launches, nheads, nheads_kv, paged):
    """96-query blocks over 8192 keys: 96 packed items that the split rule
    splits 4 ways, one CTA per split item (plan.deal_split), more CTAs than
    SMs; rows of different lengths, so some items have no keys."""
    lens = [8192, 8000, 4099, 96]
    kc, vc = nan_tailed_cache(4, 8192, nheads_kv, 128, lens, seed=nheads + 96)
    q = rnd(4, 96, nheads, 128, seed=nheads_kv + 96)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    caches = paged_copy(kc, vc, 64, lens, seed=4) if paged else (kc, vc, None)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, caches[0], caches[1], cache_seqlens=cs, page_table=caches[2],
                                                    causal=True, return_softmax_lse=True)
    assert_close(out, q, kc, vc, lens, True, lse=lse)
    (lp,) = planned_launches
    assert lp.mode.split and lp.mode.pack_g > 1 and lp.n_ctas == 96 * lp.num_splits > plan.sm_count()


@pytest.mark.parametrize("head_dim,num_splits", [(64, 70), (128, 40), (256, 20)])
def test_kvcache_many_splits(head_dim, num_splits):
    # Explicit split counts far above the heuristic's, at every head dim: the
    # combine's split mask (S_MAX = 128 at 70 splits) and empty rows.
    lens = [11000, 5000, 0]
    kc, vc = nan_tailed_cache(3, 11100, 8, head_dim, lens, seed=head_dim + 7)
    q = rnd(3, 1, 32, head_dim, seed=head_dim + 8)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, num_splits=num_splits,
                                                    return_softmax_lse=True)
    assert_close(out, q, kc, vc, lens, True, lse=lse)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kvcache_head_dims_and_dtypes(head_dim, dtype):
    lens = [2000, 9]
    kc, vc = nan_tailed_cache(2, 2100, 8, head_dim, lens, dtype=dtype, seed=head_dim)
    q = rnd(2, 2, 32, head_dim, dtype=dtype, seed=head_dim + 1)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True)
    assert_close(out, q, kc, vc, lens, True)


def test_kvcache_int_seqlens_and_full_cache():
    kc, vc = nan_tailed_cache(2, 1000, 8, 128, [600, 600], seed=9)
    q = rnd(2, 1, 32, 128, seed=10)
    out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=600, causal=True)
    assert_close(out, q, kc, vc, [600, 600], True)
    kc2, vc2 = rnd(2, 1000, 8, 128, seed=11), rnd(2, 1000, 8, 128, seed=12)
    out = hopper_flash.flash_attn_with_kvcache(q, kc2, vc2)  # no cache_seqlens: the whole cache is live
    assert_close(out, q, kc2, vc2, [1000, 1000], False)


@pytest.mark.parametrize("page_size", [1, 2, 8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_paged_equals_contiguous(page_size, seqlen_q):
    lens = [1, 700, 3001]
    kc, vc = nan_tailed_cache(3, 3301, 8, 128, lens, seed=page_size)
    kp, vp, pt = paged_copy(kc, vc, page_size, lens, seed=page_size)
    q = rnd(3, seqlen_q, 32, 128, seed=3)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cs, page_table=pt, causal=True)
    contig = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True)
    assert_close(out, q, kc, vc, lens, True)
    # Read on the same tiles (by TMA, pages under 128 keys one box each, or
    # gathered row by row under 16), same splits: bitwise.
    assert torch.equal(out, contig)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("page_size", [1, 4, 16, 32])  # (D=256: pages under 16 copied first)
def test_paged_boxes_at_other_head_dims(head_dim, page_size):
    # One TMA box per page, or rows gathered, at the head dims whose tiles
    # differ from D=128's (D=64: 128-key tiles at half the row width; D=256:
    # 64-key tiles, so four pages of 16 per tile), NaN-filled pages and
    # garbage table entries.
    lens = [1, 129, 2000]
    kc, vc = nan_tailed_cache(3, 2100, 2, head_dim, lens, seed=head_dim + page_size)
    kp, vp, pt = paged_copy(kc, vc, page_size, lens, seed=page_size)
    q = rnd(3, 2, 8, head_dim, seed=4)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cs, page_table=pt, causal=True,
                                                    return_softmax_lse=True)
    contig, contig_lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True,
                                                              return_softmax_lse=True)
    assert_close(out, q, kc, vc, lens, True)
    assert torch.equal(out, contig)
    assert torch.equal(lse, contig_lse)  # the LSE kernels' producers too (plan.register_split)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlen_new", [1, 3, 200])
def test_append_matches_appending_by_hand(paged, seqlen_new):
    lens, cap, B = [0, 500, 1300], 2048, 3
    kc, vc = nan_tailed_cache(B, cap, 8, 128, lens, seed=seqlen_new)
    q = rnd(B, seqlen_new, 32, 128, seed=1)
    kn, vn = rnd(B, seqlen_new, 8, 128, seed=2), rnd(B, seqlen_new, 8, 128, seed=3)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kh, vh = kc.clone(), vc.clone()
    for b, L in enumerate(lens):
        kh[b, L:L + seqlen_new] = kn[b]
        vh[b, L:L + seqlen_new] = vn[b]
    if paged:
        kp, vp, pt = paged_copy(kc, vc, 128, [cap] * B)
        out = hopper_flash.flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=cs, block_table=pt, causal=True)
        back = torch.stack([kp[pt[b].long()].reshape(cap, 8, 128) for b in range(B)])
        vback = torch.stack([vp[pt[b].long()].reshape(cap, 8, 128) for b in range(B)])
        for b, L in enumerate(lens):
            assert torch.equal(back[b, :L + seqlen_new], kh[b, :L + seqlen_new])
            assert torch.equal(vback[b, :L + seqlen_new], vh[b, :L + seqlen_new])
    else:
        out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=cs, causal=True)
        for b, L in enumerate(lens):
            assert torch.equal(kc[b, :L + seqlen_new], kh[b, :L + seqlen_new])
            assert torch.equal(vc[b, :L + seqlen_new], vh[b, :L + seqlen_new])
            assert torch.isnan(kc[b, L + seqlen_new:]).all(), "the append wrote past its rows"
    byhand = hopper_flash.flash_attn_with_kvcache(q, kh, vh, cache_seqlens=cs + seqlen_new, causal=True)
    assert torch.equal(out, byhand)
    assert_close(out, q, kh, vh, [L + seqlen_new for L in lens], True)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("rotary_dim", [128, 64], ids=["rot128", "rot64"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
@pytest.mark.parametrize("mask", ["causal", "full", "local"])
def test_rotary_matches_rotating_by_hand(mask, interleaved, rotary_dim, paged):
    """flash-attn's rotary embedding: the appended keys rotated at their
    cache positions (within one bf16 rounding of a float64 rotation), the
    rest of the cache untouched, q rotated at cache_seqlens + i under a
    causal or local mask and at cache_seqlens otherwise, and the output the
    float64 reference's over the rotated q and the cache."""
    lens, cap, B, s_new, D = [0, 500, 1300], 2048, 3, 3, 128
    causal, window_size = mask == "causal", (700, 0) if mask == "local" else (-1, -1)
    kc, vc = nan_tailed_cache(B, cap, 8, D, lens, seed=rotary_dim)
    q = rnd(B, s_new, 32, D, seed=51)
    kn, vn = rnd(B, s_new, 8, D, seed=52), rnd(B, s_new, 8, D, seed=53)
    angle = torch.rand(cap, rotary_dim // 2, device=DEV, generator=torch.Generator(DEV).manual_seed(54)) * 6.3
    cos, sin = torch.cos(angle).to(torch.bfloat16), torch.sin(angle).to(torch.bfloat16)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q0, kn0 = q.clone(), kn.clone()
    kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved, cache_seqlens=cs, causal=causal,
              window_size=window_size)
    before = kc.clone()
    if paged:
        kp, vp, pt = paged_copy(kc, vc, 128, [cap] * B)
        out = hopper_flash.flash_attn_with_kvcache(q, kp, vp, kn, vn, block_table=pt, **kw)
        kc = torch.stack([kp[pt[b].long()].reshape(cap, 8, D) for b in range(B)])
        vc = torch.stack([vp[pt[b].long()].reshape(cap, 8, D) for b in range(B)])
    else:
        out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, **kw)
    assert torch.equal(q, q0) and torch.equal(kn, kn0), "the caller's q and k are not written"
    pos = cs.long()[:, None] + torch.arange(s_new, device=DEV)[None, :]
    want_k = rotate64(kn, cos, sin, pos[..., None], interleaved)
    q_pos = pos if mask != "full" else cs.long()[:, None].expand(B, s_new)
    q_rot = rotate64(q, cos, sin, q_pos[..., None], interleaved).to(torch.bfloat16)
    for b, L in enumerate(lens):
        got = kc[b, L:L + s_new].double()
        assert ((got - want_k[b]).abs() <= want_k[b].abs() * 2.0 ** -7 + 1e-5).all()
        assert torch.equal(got[..., rotary_dim:], kn[b, ..., rotary_dim:].double())
        assert torch.equal(vc[b, L:L + s_new], vn[b])
        assert torch.equal(kc[b, :L], before[b, :L]), "the append wrote before its rows"
        if not paged:
            assert torch.isnan(kc[b, L + s_new:]).all(), "the append wrote past its rows"
    window = checks.window_bounds(window_size, causal)
    assert_close(out, q_rot, kc, vc, [L + s_new for L in lens], causal, window=window)


def test_rotary_under_torch_compile_and_cuda_graphs():
    """A decode step with rotary embedding traced by torch.compile (the
    fake checks the rotary arguments) and captured in a CUDA graph: both
    give the eager step's output and caches."""
    B, cap, D = 2, 1024, 128
    kc, vc = rnd(B, cap, 8, D, seed=61), rnd(B, cap, 8, D, seed=62)
    q, kn, vn = rnd(B, 1, 32, D, seed=63), rnd(B, 1, 8, D, seed=64), rnd(B, 1, 8, D, seed=65)
    angle = torch.rand(cap, D // 2, device=DEV, generator=torch.Generator(DEV).manual_seed(66)) * 6.3
    cos, sin = torch.cos(angle), torch.sin(angle)  # float32 tables
    cs = torch.tensor([10, 600], dtype=torch.int32, device=DEV)

    def step(q, kc, vc, kn, vn, cs):
        return hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin,
                                                    rotary_interleaved=False, cache_seqlens=cs, causal=True)

    k1, v1 = kc.clone(), vc.clone()
    eager = step(q, k1, v1, kn, vn, cs)
    k2, v2 = kc.clone(), vc.clone()
    compiled = torch.compile(step, fullgraph=True)(q, k2, v2, kn, vn, cs)
    assert torch.equal(eager, compiled)
    assert torch.equal(k1, k2) and torch.equal(v1, v2), "the compiled append must mutate the caches"
    k3, v3 = kc.clone(), vc.clone()
    graph, out = capture(lambda: step(q, k3, v3, kn, vn, cs))
    for lens in ([0, 1023], [500, 7]):
        cs.copy_(torch.tensor(lens, dtype=torch.int32))
        k4, v4 = k3.clone(), v3.clone()  # the graph's caches as they stand, earlier appends included
        graph.replay()
        assert torch.equal(out, step(q, k4, v4, kn, vn, cs))
        for b, L in enumerate(lens):
            assert torch.equal(k3[b, L], k4[b, L]) and torch.equal(v3[b, L], v4[b, L])


@pytest.mark.parametrize("num_splits", [0, 1], ids=["split-heuristic", "no-split"])
def test_cuda_graph_replay_with_an_append_and_changing_lengths(num_splits):
    """A decode step with an append of two tokens captured in a CUDA graph
    and replayed with new ``cache_seqlens``: the attention reads the lengths
    after the append from the vector the append kernel writes on each replay
    (``kvcache._append``), so every replay attends over ``cache_seqlens + 2``
    keys, judged against the float64 reference, and writes the new tokens
    there. The caches hold NaN past the live keys."""
    B, cap, s_new = 3, 8192, 2
    k0, v0 = rnd(B, cap, 8, 128, seed=71), rnd(B, cap, 8, 128, seed=70)
    kc, vc = k0.clone(), v0.clone()
    q, kn, vn = rnd(B, 1, 32, 128, seed=72), rnd(B, s_new, 8, 128, seed=73), rnd(B, s_new, 8, 128, seed=74)
    cs = torch.tensor([100, 5000, 0], dtype=torch.int32, device=DEV)
    graph, out = capture(lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=cs,
                                                                      causal=True, num_splits=num_splits))
    for lens in ([1, 8190, 4095], [7000, 0, 129], [0, 3, 2]):
        kc.copy_(k0)
        vc.copy_(v0)
        for b, L in enumerate(lens):  # the rows past this replay's live keys hold NaN
            kc[b, L:] = float("nan")
            vc[b, L:] = float("nan")
        cs.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        for b, L in enumerate(lens):
            assert torch.equal(kc[b, L:L + s_new], kn[b]) and torch.equal(vc[b, L:L + s_new], vn[b])
            assert torch.isnan(kc[b, L + s_new:]).all(), "the append wrote past its rows"
        assert_close(out, q, kc, vc, [L + s_new for L in lens], True)


def test_cache_batch_idx():
    lens, rows = [900, 5, 2000], [4, 0, 2]
    kc, vc = nan_tailed_cache(5, 2100, 8, 128, [2100] * 5, seed=21)
    for r, L in zip(rows, lens):
        kc[r, L:] = float("nan")
        vc[r, L:] = float("nan")
    q = rnd(3, 2, 32, 128, seed=22)
    out = hopper_flash.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        cache_batch_idx=torch.tensor(rows, dtype=torch.int32, device=DEV), causal=True)
    assert_close(out, q, kc, vc, lens, True, rows=rows)


@pytest.mark.parametrize("window_size", [(-1, -1), (1023, 0)], ids=["no-window", "window1023"])
def test_cuda_graph_replay_with_changing_lengths(window_size):
    B, cap = 4, 8192
    kc, vc = rnd(B, cap, 8, 128, seed=31), rnd(B, cap, 8, 128, seed=32)
    q = rnd(B, 1, 32, 128, seed=33)
    cs = torch.tensor([100, 200, 300, 400], dtype=torch.int32, device=DEV)
    window = checks.window_bounds(window_size, True)

    def step():
        return hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, window_size=window_size)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lens in ([1, 8191, 4096, 77], [5000, 3, 129, 8192], [0, 1, 2, 3]):
        cs.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        assert torch.equal(out, step())
        assert_close(out, q, kc, vc, lens, True, window=window)


def test_torch_compile_with_append():
    B, cap = 2, 1024
    kc, vc = rnd(B, cap, 8, 128, seed=41), rnd(B, cap, 8, 128, seed=42)
    q, kn, vn = rnd(B, 1, 32, 128, seed=43), rnd(B, 1, 8, 128, seed=44), rnd(B, 1, 8, 128, seed=45)
    cs = torch.tensor([10, 600], dtype=torch.int32, device=DEV)
    k1, v1 = kc.clone(), vc.clone()

    def step(q, kc, vc, kn, vn, cs):
        return hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=cs, causal=True)

    eager = step(q, k1, v1, kn, vn, cs)
    compiled = torch.compile(step, fullgraph=True)(q, kc, vc, kn, vn, cs)
    assert torch.equal(eager, compiled)
    assert torch.equal(k1, kc) and torch.equal(v1, vc), "the compiled append must mutate the caches"


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_kv,causal", [
    (1, 1, 4099, 32, 8, True), (2, 3, 1000, 8, 8, False), (3, 128, 8192, 32, 8, True), (1, 1, 65536, 32, 8, True),
    (4, 16, 2049, 16, 2, True)])
def test_flash_attn_func_decode_shapes(batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal):
    q = rnd(batch, seqlen_q, nheads, 128, seed=1)
    k, v = rnd(batch, seqlen_k, nheads_kv, 128, seed=2), rnd(batch, seqlen_k, nheads_kv, 128, seed=3)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_close(out, q, k, v, [seqlen_k] * batch, causal, lse=lse)


def test_contract_check_opt_in():
    kc, vc = rnd(2, 256, 8, 128, seed=1), rnd(2, 256, 8, 128, seed=2)
    q = rnd(2, 1, 32, 128, seed=3)
    cs = torch.tensor([10, 300], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="cache_seqlens"):
        hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, check_contract=True)


def test_small_pages_in_a_strided_pool_are_copied_first():
    # Pages under 16 keys are gathered by the kernel from contiguous pools;
    # a pool with gaps between its pages takes the copying path, still exact.
    lens = [3, 1000]
    kc, vc = nan_tailed_cache(2, 1100, 8, 128, lens, seed=21)
    kp, vp, pt = paged_copy(kc, vc, 4, lens, seed=4)
    wide_k = torch.full((kp.shape[0], 8, *kp.shape[2:]), float("nan"), device=DEV, dtype=kp.dtype)
    wide_v = wide_k.clone()
    wide_k[:, :4], wide_v[:, :4] = kp, vp
    ks, vs = wide_k[:, :4], wide_v[:, :4]  # pages of 4 keys, 8 apart
    assert not ks.is_contiguous()
    q = rnd(2, 1, 32, 128, seed=22)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = hopper_flash.flash_attn_with_kvcache(q, ks, vs, cache_seqlens=cs, page_table=pt, causal=True)
    assert_close(out, q, kc, vc, lens, True)
    assert torch.equal(out, hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cs, page_table=pt,
                                                                 causal=True))
