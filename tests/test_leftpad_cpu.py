"""flash_attn_with_kvcache's ``cache_leftpad`` on the CPU: the packed batch
packed queries hand the forward kernel's varlen mode
(``cache_layout.slot_rows_args``),
judged through the float64 varlen reference against each row's own keys
(``cache_leftpad[b] .. seqused[b] - 1``, the causal mask and window counted
from there), the unpacked call through the decode launch (its `LEFTPAD`
mode) with that reference standing in for the
kernel, and the argument checks on every path."""
import contextlib

import pytest
import torch

import hopper_flash
from hopper_flash import cache_layout, kvcache, plan
from hopper_flash.reference import attention_reference, varlen_reference

BF16 = torch.bfloat16


def _i32(x):
    return torch.tensor(x, dtype=torch.int32)


def _cache(b_cache, s_cache, hkv, d, seed, dv=None, spacing=None):
    """Random caches ``[b_cache, s_cache, hkv, d]`` (v: ``dv``), NaN
    everywhere no row's live keys are put; ``spacing``: rows from one cache
    row's start to the next (a slice of a longer cache)."""
    g = torch.Generator().manual_seed(seed)
    rows = spacing or s_cache
    kc = torch.randn(b_cache, rows, hkv, d, generator=g).to(BF16)[:, :s_cache]
    vc = torch.randn(b_cache, rows, hkv, dv or d, generator=g).to(BF16)[:, :s_cache]
    return kc, vc


def _poison_outside(kc, vc, rows, starts, ends):
    """NaN outside each batch entry's live keys (rows no entry reads: all NaN)."""
    live = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for r, s, e in zip(rows, starts, ends):
        live[r, s:e] = True
    kc[~live] = float("nan")
    vc[~live] = float("nan")


def _expected(q, kc, vc, rows, starts, ends, causal, window=None):
    """Each batch entry alone over its live keys: float64 (out, lse [B, H, Sq])."""
    outs, lses = [], []
    for b, (r, s, e) in enumerate(zip(rows, starts, ends)):
        if e == s:
            outs.append(torch.zeros(q.shape[1:3] + vc.shape[3:], dtype=torch.float64))
            lses.append(torch.full((q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float64))
            continue
        o, lse = attention_reference(q[b:b + 1], kc[r:r + 1, s:e], vc[r:r + 1, s:e], causal=causal, window=window)
        outs.append(o[0])
        lses.append(lse[0].double())
    return torch.stack(outs), torch.stack(lses)


CASES = [
    # (batch rows, leftpad, live end per entry, seqlen_q, causal, window, cache rows, spacing)
    dict(rows=None, starts=[0, 3, 129, 7], ends=[5, 3, 300, 200], sq=1, causal=True, window=None),
    dict(rows=None, starts=[17, 0, 64], ends=[140, 77, 65], sq=5, causal=True, window=None),
    dict(rows=None, starts=[2, 100], ends=[150, 290], sq=3, causal=False, window=None),
    dict(rows=None, starts=[30, 1], ends=[250, 31], sq=4, causal=True, window=(20, 0)),
    dict(rows=[3, 0, 2], starts=[9, 0, 255], ends=[200, 1, 300], sq=2, causal=True, window=None, b_cache=4),
    dict(rows=None, starts=[5, 40], ends=[100, 300], sq=2, causal=True, window=None, spacing=333),
]


@pytest.mark.parametrize("case", CASES, ids=["decode", "chunk", "full", "window", "batch-idx", "sliced-cache"])
def test_the_packed_batch_sees_each_rows_keys_from_its_left_pad(case):
    """``slot_rows_args`` through the float64 varlen reference (the
    kernel's contract in that mode) equals each row's attention over its own
    keys, its mask counted from its first live key; NaN everywhere else in
    the caches."""
    batch, s_cache, h, hkv, d = len(case["starts"]), 300, 4, 2, 64
    b_cache = case.get("b_cache", batch)
    rows = case["rows"] or list(range(batch))
    kc, vc = _cache(b_cache, s_cache, hkv, d, seed=batch, spacing=case.get("spacing"))
    _poison_outside(kc, vc, rows, case["starts"], case["ends"])
    q = torch.randn(batch, case["sq"], h, d, generator=torch.Generator().manual_seed(7)).to(BF16)
    idx = _i32(case["rows"]) if case["rows"] is not None else None
    k3, v3, cu_k, used_k = cache_layout.slot_rows_args(kc, vc, batch, idx, _i32(case["starts"]), _i32(case["ends"]))
    q3 = q.reshape(batch * case["sq"], h, d)
    cu_q = torch.arange(0, (batch + 1) * case["sq"], case["sq"], dtype=torch.int32)
    if case.get("spacing"):  # a slice of a longer cache is read in place
        assert k3.data_ptr() == kc.data_ptr() and k3.stride(0) == kc.stride(1)
    assert cu_q.dtype == cu_k.dtype == used_k.dtype == torch.int32
    assert cu_q.shape == cu_k.shape == (batch + 1,) and used_k.shape == (batch,)
    out, lse = varlen_reference(q3, k3, v3, cu_q, cu_k, seqused_k=used_k, causal=case["causal"],
                                window=case["window"])
    want, want_lse = _expected(q, kc, vc, rows, case["starts"], case["ends"], case["causal"], case["window"])
    torch.testing.assert_close(out.view(want.shape), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse.view(h, batch, case["sq"]).permute(1, 0, 2), want_lse, rtol=1e-12, atol=1e-12)


def test_caches_that_cannot_be_one_axis_are_copied():
    """k and v caches whose rows are spaced differently (or not by whole
    rows) are read from contiguous copies; agreeing ones in place."""
    kc, vc = _cache(3, 50, 2, 64, seed=1, spacing=70)
    assert cache_layout.rows_per_slot(kc, vc) == 70
    assert cache_layout.rows_per_slot(kc, vc.contiguous()) is None
    odd = torch.zeros(3 * 50 * 2 * 64 + 7, dtype=BF16)[7:].view(3, 50, 2, 64)
    assert cache_layout.rows_per_slot(odd, odd) == 50
    assert cache_layout.rows_per_slot(kc.transpose(1, 2).contiguous().transpose(1, 2), vc) is None
    assert cache_layout.rows_per_slot(kc[:1], vc[:1].contiguous()) == 50  # one cache row: any spacing
    lens, pads = _i32([50, 20, 3]), _i32([1, 2, 3])
    k3, v3, cu_k, _ = cache_layout.slot_rows_args(kc, vc.contiguous(), 3, None, pads, lens)
    assert k3.data_ptr() != kc.data_ptr() and k3.shape == v3.shape[:2] + (64,) and k3.shape[0] == 150
    assert cu_k.tolist() == [1, 52, 103, 0]


def test_the_call_reads_each_row_from_its_pad_in_the_decode_launch(monkeypatch):
    """The whole call, the float64 reference standing in for the decode
    launch (``test_kvcache_packed_cpu._decode_stand_in``, which reads row
    ``b`` from ``leftpad[b]``): the launch gets the pads (the kernel's
    ``LEFTPAD`` mode: split-KV and PackGQA as without them), the lengths
    after an append at ``cache_seqlens`` (absolute cache rows), and the
    output and LSE are each row's own attention over keys ``cache_leftpad[b] ..``."""
    from test_kvcache_packed_cpu import _decode_stand_in

    batch, s_cache, h, hkv, d, sq = 3, 96, 4, 2, 64, 2
    kc, vc = _cache(batch, s_cache, hkv, d, seed=3)
    seqlens, pads = [40, 10, 0], [5, 10, 0]
    kn = torch.randn(batch, sq, hkv, d, generator=torch.Generator().manual_seed(4)).to(BF16)
    vn = torch.randn(batch, sq, hkv, d, generator=torch.Generator().manual_seed(5)).to(BF16)
    q = torch.randn(batch, sq, h, d, generator=torch.Generator().manual_seed(6)).to(BF16)
    ends = [s + sq for s in seqlens]
    _poison_outside(kc, vc, range(batch), pads, seqlens)
    seen = {}

    def launch(*args, **kw):
        seen.update(kw)
        _decode_stand_in(*args, **kw)

    monkeypatch.setattr(plan, "launch_forward", launch)
    monkeypatch.setattr(plan, "launch_forward_varlen", lambda *a, **k: pytest.fail("the varlen kernel"))
    monkeypatch.setattr(plan, "on_device", lambda t: contextlib.nullcontext())
    monkeypatch.setattr(kvcache, "validate_kvcache", lambda *a: 0.125)  # (its checks: the tests below)
    monkeypatch.setattr(kvcache, "_append", lambda q, kc, vc, k, v, lens, *rest: _append_by_hand(kc, vc, k, v, lens)
                        or (q, lens + k.shape[1]))
    out, lse = kvcache.kvcache_forward(q, kc, vc, kn, vn, _i32(seqlens), None, None, 0.125, True, 0, None, True,
                                       cache_leftpad=_i32(pads))
    assert seen["leftpad"].tolist() == pads and seen["seqused_k"].tolist() == ends
    assert out.shape == (batch, sq, h, d) and lse.shape == (batch, h, sq)
    want, want_lse = _expected(q, kc, vc, range(batch), pads, ends, True)
    torch.testing.assert_close(out.double(), want.to(BF16).double(), rtol=0, atol=0)
    torch.testing.assert_close(lse.double(), want_lse.float().double(), rtol=0, atol=0)


def _append_by_hand(kc, vc, k, v, lens):
    for b, n in enumerate(lens.tolist()):
        kc[b, n:n + k.shape[1]] = k[b]
        vc[b, n:n + v.shape[1]] = v[b]


def _call_args(batch=2, h=4, hkv=2, d=64, s_cache=64):
    q = torch.zeros(batch, 1, h, d, dtype=BF16)
    kc = torch.zeros(batch, s_cache, hkv, d, dtype=BF16)
    return q, kc, kc.clone()


@pytest.mark.parametrize("bad,error,match", [
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int64)), ValueError, "cache_leftpad must have dtype int32"),
    (dict(cache_leftpad=torch.zeros(3, dtype=torch.int32)), ValueError,
     r"cache_leftpad must have shape \[batch\] = \(2,\)"),
    (dict(cache_leftpad=[0, 1]), TypeError, "cache_leftpad must be an int32 torch.Tensor"),
    (dict(cache_leftpad=torch.zeros(2, dtype=torch.int32), page_table=torch.zeros(2, 4, dtype=torch.int32)),
     ValueError, "cache_leftpad cannot be combined with page_table"),
])
def test_bad_left_pads_name_themselves(bad, error, match):
    """Eagerly (before anything runs) and in the custom op's fake (what
    torch.compile traces), each naming the argument."""
    q, kc, vc = _call_args()
    with pytest.raises(error, match=match):
        hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, **bad)
    if isinstance(bad["cache_leftpad"], torch.Tensor):
        pt = bad.get("page_table")
        meta = [t.to("meta") for t in (q, kc, vc)]
        with pytest.raises(error, match=match):
            kvcache._fwd_kvcache_fake(*meta, None, None, None, None, None if pt is None else pt.to("meta"), 0.1,
                                      True, 0, -1, cache_leftpad=bad["cache_leftpad"].to("meta"))


def test_a_good_left_pad_reaches_the_device_check_and_the_fake_shapes():
    q, kc, vc = _call_args()
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, cache_leftpad=_i32([0, 2]))
    meta = [t.to("meta") for t in (q, kc, vc)]
    out, lse = kvcache._fwd_kvcache_fake(*meta, None, None, None, None, None, 0.1, True, 0, -1,
                                         cache_leftpad=_i32([0, 2]).to("meta"))
    assert out.shape == q.shape and lse.shape == (2, 4, 1)


def test_the_contract_check_bounds_the_left_pads():
    kc = torch.zeros(2, 64, 2, 64, dtype=BF16)
    lens = _i32([10, 20])
    kvcache.check_contract(kc, lens + 1, None, None, _i32([10, 0]), lens)
    with pytest.raises(ValueError, match=r"cache_leftpad must lie in \[0, cache_seqlens\], got \[11, 0\]"):
        kvcache.check_contract(kc, lens + 1, None, None, _i32([11, 0]), lens)
    with pytest.raises(ValueError, match="cache_leftpad must lie"):
        kvcache.check_contract(kc, lens, None, None, _i32([0, -1]), lens)
