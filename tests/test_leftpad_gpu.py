"""``flash_attn_with_kvcache(..., cache_leftpad=...)`` on a Hopper GPU:
each row attends to its cache keys ``cache_leftpad[b] .. seqlen_k - 1``, its
causal mask and window counted from its first live key (flash-attn's
``leftpad_k``), judged against the float64 reference over exactly those keys
(``reference.check_kvcache``'s ``starts``: within twice SDPA's error on
them, LSE to 2e-5 relative). Every cache holds NaN outside each row's live
keys, before the pad as past the end."""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks
from hopper_flash.reference import check_kvcache
from gpu_inputs import capture, rnd
from rotary_ref import rotate64

pytestmark = pytest.mark.gpu

DEV = "cuda"


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def padded_cache(b_cache, cap, hkv, d, starts, ends, rows=None, dtype=torch.bfloat16, seed=0, dv=None):
    """Random caches with NaN outside each entry's ``[starts[b], ends[b])``
    of cache row ``rows[b]`` (rows no entry names: all NaN)."""
    kc = rnd(b_cache, cap, hkv, d, dtype=dtype, seed=seed)
    vc = rnd(b_cache, cap, hkv, dv or d, dtype=dtype, seed=seed + 1)
    live = torch.zeros(b_cache, cap, dtype=torch.bool, device=DEV)
    for r, s, e in zip(rows or range(len(starts)), starts, ends):
        live[r, s:e] = True
    kc[~live] = math.nan
    vc[~live] = math.nan
    return kc, vc


def assert_judged(out, q, kc, vc, starts, ends, causal, rows=None, lse=None, window=None, softcap=0.0):
    bad = [v.message for v in check_kvcache(out, q, kc, vc, ends, causal=causal, rows=rows, lse=lse, window=window,
                                            softcap=softcap, starts=starts) if not v]
    assert not bad, "\n".join(bad)


# Pads of 0, of the whole length (no key left), odd ones, and rows long
# enough for many KV tiles.
PADS = dict(starts=[0, 5, 129, 1000, 7, 3001], ends=[1, 5, 300, 4099, 1034, 3100])


@pytest.mark.parametrize("seqlen_q", [1, 4, 129])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("nheads,nheads_kv", [(32, 8), (8, 8)], ids=["gqa4", "mha"])
def test_left_pads(seqlen_q, causal, nheads, nheads_kv):
    kc, vc = padded_cache(6, 4200, nheads_kv, 128, **PADS, seed=seqlen_q)
    q = rnd(6, seqlen_q, nheads, 128, seed=seqlen_q + 1)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(PADS["ends"]),
                                                    cache_leftpad=i32(PADS["starts"]), causal=causal,
                                                    return_softmax_lse=True)
    assert_judged(out, q, kc, vc, PADS["starts"], PADS["ends"], causal, lse=lse)


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (256, torch.bfloat16), (128, torch.float16),
                                            (96, torch.bfloat16)])
def test_left_pads_at_other_head_dims_and_dtypes(head_dim, dtype):
    starts, ends = [3, 0, 700], [130, 1, 2000]
    kc, vc = padded_cache(3, 2048, 2, head_dim, starts, ends, dtype=dtype, seed=head_dim)
    q = rnd(3, 3, 8, head_dim, dtype=dtype, seed=2)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(ends), cache_leftpad=i32(starts),
                                                    causal=True, return_softmax_lse=True)
    assert_judged(out, q, kc, vc, starts, ends, True, lse=lse)


@pytest.mark.parametrize("window_size,softcap", [((100, 0), 0.0), ((300, 40), 0.0), ((-1, -1), 30.0)],
                         ids=["left100", "both", "softcap"])
def test_left_pads_with_windows_and_softcap(window_size, softcap):
    """A window counts from each row's own first key, as the causal mask does."""
    starts, ends = [50, 0, 1999], [900, 64, 2048]
    kc, vc = padded_cache(3, 2048, 4, 128, starts, ends, seed=11)
    q = rnd(3, 5, 16, 128, seed=12)
    out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(ends), cache_leftpad=i32(starts),
                                               causal=window_size[1] == 0, window_size=window_size, softcap=softcap)
    window = checks.window_bounds(window_size, window_size[1] == 0)
    assert_judged(out, q, kc, vc, starts, ends, window_size[1] == 0, window=window, softcap=softcap)


def test_left_pads_with_cache_batch_idx_and_a_sliced_cache():
    """Cache rows picked by ``cache_batch_idx`` from a cache that is a slice
    of a longer one (read in place: its rows spaced by the longer one's)."""
    rows, starts, ends = [4, 0, 2], [10, 0, 600], [900, 3, 1500]
    full_k, full_v = padded_cache(5, 2000, 8, 128, starts, ends, rows=rows, seed=21)
    kc, vc = full_k[:, :1600], full_v[:, :1600]
    q = rnd(3, 2, 32, 128, seed=22)
    out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32(ends), cache_leftpad=i32(starts),
                                               cache_batch_idx=i32(rows), causal=True)
    assert_judged(out, q, kc, vc, starts, ends, True, rows=rows)
    # v's rows spaced otherwise than k's: both read from copies, the same result.
    vc2 = vc.contiguous()
    again = hopper_flash.flash_attn_with_kvcache(q, kc, vc2, cache_seqlens=i32(ends), cache_leftpad=i32(starts),
                                                 cache_batch_idx=i32(rows), causal=True)
    assert torch.equal(out, again)


@pytest.mark.parametrize("rotary", [False, True], ids=["append", "append-rotary"])
def test_left_pads_with_an_append(rotary):
    """New keys are written (and rotated) at their absolute cache positions
    ``cache_seqlens + j``, q rotated at ``cache_seqlens + i`` (flash-attn's
    rule with leftpad too); the rows attend from their pads to the new end."""
    B, cap, s_new, D = 3, 1024, 3, 128
    seqlens, starts = [100, 7, 0], [40, 7, 0]
    kc, vc = padded_cache(B, cap, 8, D, starts, seqlens, seed=31)
    q, kn, vn = rnd(B, s_new, 32, D, seed=32), rnd(B, s_new, 8, D, seed=33), rnd(B, s_new, 8, D, seed=34)
    kw = {}
    if rotary:
        angle = torch.rand(cap, D // 2, device=DEV, generator=torch.Generator(DEV).manual_seed(35)) * 6.3
        kw = dict(rotary_cos=torch.cos(angle), rotary_sin=torch.sin(angle), rotary_interleaved=False)
    out = hopper_flash.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=i32(seqlens),
                                               cache_leftpad=i32(starts), causal=True, **kw)
    ends = [L + s_new for L in seqlens]
    for b, L in enumerate(seqlens):
        assert torch.equal(vc[b, L:L + s_new], vn[b])
        assert torch.isnan(kc[b, :starts[b]]).all() and torch.isnan(kc[b, L + s_new:]).all()
    if rotary:
        pos = i32(seqlens).long()[:, None] + torch.arange(s_new, device=DEV)[None, :]
        q = rotate64(q, kw["rotary_cos"], kw["rotary_sin"], pos[..., None], False).to(torch.bfloat16)
        want_k = rotate64(kn, kw["rotary_cos"], kw["rotary_sin"], pos[..., None], False)
        for b, L in enumerate(seqlens):
            got = kc[b, L:L + s_new].double()
            assert ((got - want_k[b]).abs() <= want_k[b].abs() * 2.0 ** -7 + 1e-5).all()
    else:
        for b, L in enumerate(seqlens):
            assert torch.equal(kc[b, L:L + s_new], kn[b])
    assert_judged(out, q, kc, vc, starts, ends, True)


def test_left_pads_under_cuda_graphs_and_torch_compile():
    """A captured step replayed with new lengths and pads (nothing read on
    the host), and the same step traced by torch.compile: the eager
    step's output, each judged."""
    B, cap = 4, 4096
    k0, v0 = rnd(B, cap, 8, 128, seed=41), rnd(B, cap, 8, 128, seed=42)
    kc, vc = k0.clone(), v0.clone()
    q = rnd(B, 1, 32, 128, seed=43)
    cs, pads = i32([100, 200, 300, 400]), i32([0, 0, 0, 0])

    def step():
        return hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, cache_leftpad=pads, causal=True)

    graph, out = capture(step)
    for lens, lp in (([1, 4095, 2048, 77], [0, 4000, 1, 77]), ([3000, 3, 129, 4096], [2999, 0, 128, 17])):
        cs.copy_(i32(lens))
        pads.copy_(i32(lp))
        kc.copy_(k0)
        vc.copy_(v0)
        for b, (s, e) in enumerate(zip(lp, lens)):  # NaN outside this step's live keys
            for t in (kc, vc):
                t[b, :s] = math.nan
                t[b, e:] = math.nan
        graph.replay()
        assert torch.equal(out, step())
        assert_judged(out, q, kc, vc, lp, lens, True)

    def compiled_step(q, kc, vc, cs, pads):
        return hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, cache_leftpad=pads, causal=True)

    assert torch.equal(torch.compile(compiled_step, fullgraph=True)(q, kc, vc, cs, pads), step())


def test_the_contract_check_names_the_left_pads():
    kc, vc = rnd(2, 256, 8, 128, seed=1), rnd(2, 256, 8, 128, seed=2)
    q = rnd(2, 1, 32, 128, seed=3)
    with pytest.raises(ValueError, match="cache_leftpad must lie"):
        hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=i32([10, 30]), cache_leftpad=i32([11, 0]),
                                             check_contract=True)


@pytest.mark.parametrize("num_splits,pack_gqa", [(1, False), (1, True), (3, False), (3, True), (0, None)])
def test_left_pads_with_splits_and_packing(num_splits, pack_gqa):
    """The decode modes read each row from its pad (LEFTPAD) whatever the
    split count and packing: each judged, and the packed query rows of
    FA3's cu_seqlens_q (one length: the same launch) the same bits."""
    starts, ends = [0, 5, 1000, 4000], [3000, 5, 4099, 4001]
    kc, vc = padded_cache(4, 4200, 8, 128, starts, ends, seed=71)
    q = rnd(4, 2, 32, 128, seed=72)
    kw = dict(cache_seqlens=i32(ends), cache_leftpad=i32(starts), causal=True, num_splits=num_splits,
              pack_gqa=pack_gqa)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw)
    assert_judged(out, q, kc, vc, starts, ends, True, lse=lse)
    cu = torch.arange(0, 10, 2, dtype=torch.int32, device=DEV)
    packed = hopper_flash.flash_attn_with_kvcache(q.flatten(0, 1), kc, vc, cu_seqlens_q=cu, max_seqlen_q=2, **kw)
    assert torch.equal(packed.view(out.shape), out)
