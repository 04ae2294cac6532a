"""FA3's packed queries in ``flash_attn_with_kvcache`` (``cu_seqlens_q``,
``max_seqlen_q``) on the CPU: the argument checks on every path, and the
call through ``cache_layout.varlen_over_cache`` with the float64 varlen reference
standing in for the kernel, against each sequence's attention over its own
cache keys (contiguous rows with ``cache_batch_idx`` and ``cache_leftpad``,
or pages)."""
import contextlib

import pytest
import torch

import hopper_flash
from hopper_flash import cache_layout, kvcache, plan
from hopper_flash.reference import attention_reference, varlen_reference

BF16 = torch.bfloat16


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


@pytest.fixture
def stand_in(monkeypatch):
    """The varlen kernel's contract computed by the float64 reference; the
    launches' page tables recorded."""
    seen = []

    def launch(q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, **kw):
        pt = kw.get("page_table")
        seen.append(pt)
        if pt is not None:  # sequence b's keys: its pages' first used_k[b] rows, packed one after the other
            ks = [k[pt[b].long()].flatten(0, 1)[:n] for b, n in enumerate(used_k.tolist())]
            vs = [v[pt[b].long()].flatten(0, 1)[:n] for b, n in enumerate(used_k.tolist())]
            k, v, cu_k, used_k = torch.cat(ks), torch.cat(vs), cu(used_k.tolist()), None
        o, l = varlen_reference(q, k, v, cu_q, cu_k, seqused_q=used_q, seqused_k=used_k, causal=causal,
                                softmax_scale=scale, window=kw.get("window"))
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)

    monkeypatch.setattr(plan, "launch_forward_varlen", launch)
    monkeypatch.setattr(plan, "on_device", lambda t: contextlib.nullcontext())
    monkeypatch.setattr(kvcache.checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(kvcache, "_check_tma_addressable", lambda name, t: None)
    monkeypatch.setattr(kvcache, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return seen


def _expected(q, lq, kc, vc, rows, starts, ends, causal):
    outs, lses = [], []
    for (qs, n), r, s, e in zip(zip(cu(lq)[:-1].tolist(), lq), rows, starts, ends):
        if n == 0:
            continue
        if e == s:
            outs.append(torch.zeros(n, q.shape[1], vc.shape[3], dtype=torch.float64))
            lses.append(torch.full((q.shape[1], n), float("-inf"), dtype=torch.float64))
            continue
        o, lse = attention_reference(q[None, qs:qs + n], kc[r:r + 1, s:e], vc[r:r + 1, s:e], causal=causal)
        outs.append(o[0])
        lses.append(lse[0].double())
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("with_idx,with_pad", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["plain", "batch-idx", "leftpad", "batch-idx-leftpad"])
def test_packed_queries_over_contiguous_rows(stand_in, causal, with_idx, with_pad):
    lq, ends = [3, 1, 0, 40], [50, 1, 7, 64]
    rows = [2, 0, 4, 1] if with_idx else [0, 1, 2, 3]
    starts = [10, 0, 7, 20] if with_pad else [0, 0, 0, 0]
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(5, 64, 2, 64, generator=g).to(BF16)
    vc = torch.randn(5, 64, 2, 64, generator=g).to(BF16)
    live = torch.zeros(5, 64, dtype=torch.bool)
    for r, s, e in zip(rows, starts, ends):
        live[r, s:e] = True
    kc[~live], vc[~live] = float("nan"), float("nan")
    q = torch.randn(sum(lq), 4, 64, generator=g).to(BF16)
    out, lse = hopper_flash.flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=i32(ends), cache_batch_idx=i32(rows) if with_idx else None,
        cache_leftpad=i32(starts) if with_pad else None, cu_seqlens_q=cu(lq), max_seqlen_q=40, causal=causal,
        return_softmax_lse=True)
    assert stand_in == [None]
    assert out.shape == (sum(lq), 4, 64) and lse.shape == (4, sum(lq))
    want, want_lse = _expected(q, lq, kc, vc, rows, starts, ends, causal)
    torch.testing.assert_close(out.double(), want.to(BF16).double(), rtol=0, atol=0)
    torch.testing.assert_close(lse.double(), want_lse.float().double(), rtol=0, atol=0)


def test_packed_queries_over_pages(stand_in):
    """Pages of 16 keys read by the varlen kernel through the page table."""
    lq, lens = [2, 17, 1], [40, 17, 0]
    g = torch.Generator().manual_seed(2)
    kc = torch.randn(3, 48, 2, 64, generator=g).to(BF16)
    vc = torch.randn(3, 48, 2, 64, generator=g).to(BF16)
    perm = torch.randperm(9, generator=g).view(3, 3).to(torch.int32)
    kp, vp = torch.empty(9, 16, 2, 64, dtype=BF16), torch.empty(9, 16, 2, 64, dtype=BF16)
    for b in range(3):
        for p in range(3):
            kp[perm[b, p]], vp[perm[b, p]] = kc[b, p * 16:(p + 1) * 16], vc[b, p * 16:(p + 1) * 16]
    q = torch.randn(sum(lq), 4, 64, generator=g).to(BF16)
    out = hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=i32(lens), page_table=perm,
                                               cu_seqlens_q=cu(lq), max_seqlen_q=17, causal=True)
    assert len(stand_in) == 1 and stand_in[0].data_ptr() == perm.data_ptr()
    want, _ = _expected(q, lq, kc, vc, [0, 1, 2], [0, 0, 0], lens, True)
    torch.testing.assert_close(out.double(), want.to(BF16).double(), rtol=0, atol=0)


def _call_args():
    q = torch.zeros(6, 4, 64, dtype=BF16)
    kc = torch.zeros(2, 32, 2, 64, dtype=BF16)
    return q, kc, kc.clone(), i32([0, 2, 6])


@pytest.mark.parametrize("kw,error,match", [
    (dict(q=torch.zeros(2, 3, 4, 64, dtype=BF16)), ValueError, r"q must have 3 dimensions \[total_tokens"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 6])), ValueError, "cu_seqlens_q must have dtype int32"),
    (dict(cu_seqlens_q=i32([[0, 2, 6]])), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(max_seqlen_q=None), TypeError, "max_seqlen_q must be a positive int"),
    (dict(max_seqlen_q=2), ValueError, r"more than batch \(2\) x max_seqlen_q \(2\)"),
    (dict(k=torch.zeros(2, 1, 2, 64, dtype=BF16), v=torch.zeros(2, 1, 2, 64, dtype=BF16)), NotImplementedError,
     "appending new keys"),
    (dict(cache_seqlens=i32([1, 2, 3])), ValueError, r"cache_seqlens must have shape \[batch\] = \(2,\)"),
    (dict(cache_leftpad=i32([1])), ValueError, r"cache_leftpad must have shape \[batch\] = \(2,\)"),
])
def test_bad_packed_queries_name_themselves(kw, error, match):
    """Eagerly and in the op's fake (what torch.compile traces)."""
    q, kc, vc, cq = _call_args()
    a = dict(q=q, cu_seqlens_q=cq, max_seqlen_q=4, cache_seqlens=i32([5, 6]), k=None, v=None, cache_leftpad=None)
    a.update(kw)
    with pytest.raises(error, match=match):
        hopper_flash.flash_attn_with_kvcache(a["q"], kc, vc, a["k"], a["v"], cache_seqlens=a["cache_seqlens"],
                                             cu_seqlens_q=a["cu_seqlens_q"], max_seqlen_q=a["max_seqlen_q"],
                                             cache_leftpad=a["cache_leftpad"])
    if not isinstance(a["max_seqlen_q"], int) or "cache_seqlens" in kw:
        return  # (the op takes an int; cache_seqlens is checked where the op runs)
    meta = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in a.items()}
    with pytest.raises(error, match=match):
        kvcache._fwd_kvcache_fake(meta["q"], kc.to("meta"), vc.to("meta"), meta["k"], meta["v"],
                                  meta["cache_seqlens"], None, None, 0.1, True, 0, -1,
                                  cache_leftpad=meta["cache_leftpad"], cu_seqlens_q=meta["cu_seqlens_q"],
                                  max_seqlen_q=meta["max_seqlen_q"])


def test_packed_options_without_packed_queries_and_new_keys():
    q4 = torch.zeros(2, 1, 4, 64, dtype=BF16)
    _, kc, vc, _ = _call_args()
    with pytest.raises(ValueError, match="max_seqlen_q goes with cu_seqlens_q"):
        hopper_flash.flash_attn_with_kvcache(q4, kc, vc, cache_seqlens=3, max_seqlen_q=4)
    new = torch.zeros(2, 1, 2, 64, dtype=BF16)
    with pytest.raises(NotImplementedError, match="cu_seqlens_k_new"):
        hopper_flash.flash_attn_with_kvcache(q4, kc, vc, new, new, cache_seqlens=3, cu_seqlens_k_new=i32([0, 1, 2]))
    # Without new keys FA3 ignores it, and so do we: the call reaches the device check.
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        hopper_flash.flash_attn_with_kvcache(q4, kc, vc, cache_seqlens=3, cu_seqlens_k_new=i32([0, 1, 2]))


def test_the_fake_gives_the_packed_layouts():
    q, kc, vc, cq = _call_args()
    out, lse = kvcache._fwd_kvcache_fake(q.to("meta"), kc.to("meta"), vc[..., :32].to("meta"), None, None,
                                         i32([5, 6]).to("meta"), None, None, 0.1, True, 0, -1,
                                         cu_seqlens_q=cq.to("meta"), max_seqlen_q=4)
    assert out.shape == (6, 4, 32) and lse.shape == (4, 6)


def test_the_contract_check_reads_the_query_prefix_sums():
    kc = torch.zeros(2, 32, 2, 64, dtype=BF16)
    lens = i32([5, 6])
    kvcache.check_contract(kc, lens, None, None, packed=(6, i32([0, 2, 6]), 4))
    with pytest.raises(ValueError, match=r"max_seqlen_q \(3\) is below the longest sequence \(4\)"):
        kvcache.check_contract(kc, lens, None, None, packed=(6, i32([0, 2, 6]), 3))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be non-decreasing"):
        kvcache.check_contract(kc, lens, None, None, packed=(6, i32([0, 3, 2]), 4))


def test_one_query_per_sequence_takes_the_decode_launch(stand_in, monkeypatch):
    """SGLang's decode step (cu_seqlens_q = arange, max_seqlen_q = 1): the
    unpacked call's launch, split-KV and PackGQA free to apply, on a
    [batch, 1, H, D] view of q; the LSE back in the packed layout."""
    seen = {}

    def decode(q4, k, v, out, lse, scale, causal, cfg, **kw):
        seen.update(q4=q4, kw=kw)
        out.fill_(1)
        lse.copy_(torch.arange(3 * 4, dtype=torch.float32).view(3, 4, 1))

    monkeypatch.setattr(plan, "launch_forward", decode)
    q = torch.randn(3, 4, 64).to(BF16)
    kc = torch.zeros(3, 32, 2, 64, dtype=BF16)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, kc.clone(), cache_seqlens=i32([5, 0, 32]),
                                                    cu_seqlens_q=i32([0, 1, 2, 3]), max_seqlen_q=1, causal=True,
                                                    return_softmax_lse=True, num_splits=3)
    assert stand_in == [] and seen["q4"].shape == (3, 1, 4, 64) and seen["q4"].data_ptr() == q.data_ptr()
    assert seen["kw"]["num_splits"] == 3 and seen["kw"]["seqused_k"].tolist() == [5, 0, 32]
    assert out.shape == (3, 4, 64) and (out == 1).all()
    assert torch.equal(lse, torch.arange(12, dtype=torch.float32).view(3, 4).t())


def _decode_stand_in(q4, k, v, out, lse, scale, causal, cfg, seqused_k=None, kv_batch=None, page_table=None,
                     window=None, leftpad=None, **kw):
    """plan.launch_forward's contract in the decode modes, by the float64
    reference: batch row b over the first seqused_k[b] keys of its cache row
    (kv_batch) or of its pages, from leftpad[b] on."""
    for b in range(q4.shape[0]):
        n = int(seqused_k[b])
        start = int(leftpad[b]) if leftpad is not None else 0
        if page_table is not None:
            keys, vals = (t[page_table[b].long().clamp(0, t.shape[0] - 1)].flatten(0, 1)[:n] for t in (k, v))
        else:
            r = int(kv_batch[b]) if kv_batch is not None else b
            keys, vals = k[r, start:n], v[r, start:n]
        n -= start
        if n == 0:
            out[b] = 0
            if lse is not None:
                lse[b] = float("-inf")
            continue
        o, l = attention_reference(q4[b:b + 1], keys[None], vals[None], causal=causal, softmax_scale=scale,
                                   window=window)
        out[b] = o[0].to(out.dtype)
        if lse is not None:
            lse[b] = l[0].float()


@pytest.mark.parametrize("seed", range(24))
def test_random_calls_give_each_sequence_its_own_attention(stand_in, monkeypatch, seed):
    """Random packed or unpacked queries (one length or mixed), contiguous
    rows (cache_batch_idx, cache_leftpad) or pages of 1-64 keys, causal or
    not: whichever route runs them (the decode launch or the varlen kernel,
    both stood in for by the float64 reference), each sequence's output and
    LSE are its attention over its own keys."""
    monkeypatch.setattr(plan, "launch_forward", _decode_stand_in)
    g = torch.Generator().manual_seed(seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    batch, hkv, group, d = pick(1, 2, 3), pick(1, 2), pick(1, 2), 64
    packed, uniform, paged, causal = pick(True, False), pick(True, False), pick(True, False), pick(True, False)
    max_q = pick(1, 3, 7)
    lq = [max_q] * batch if uniform or not packed else [int(x) for x in torch.randint(0, max_q + 1, (batch,),
                                                                                       generator=g)]
    cap = pick(32, 48, 64)
    ends = [int(x) for x in torch.randint(0, cap + 1, (batch,), generator=g)]
    pads = [int(torch.randint(0, e + 1, (1,), generator=g)) for e in ends] if not paged and pick(True, False) \
        else None
    rows = torch.randperm(batch + 2, generator=g)[:batch].tolist() if not paged and pick(True, False) else None
    b_cache = batch + 2 if rows is not None else batch
    kc = torch.randn(b_cache, cap, hkv, d, generator=g).to(BF16)
    vc = torch.randn(b_cache, cap, hkv, d, generator=g).to(BF16)
    q = torch.randn(sum(lq), hkv * group, d, generator=g).to(BF16)
    kw = dict(cache_seqlens=i32(ends), causal=causal, return_softmax_lse=True)
    if paged:
        page = pick(1, 4, 16)
        n_pages = batch * (cap // page)
        perm = torch.randperm(n_pages, generator=g).view(batch, cap // page).to(torch.int32)
        kp = torch.empty(n_pages, page, hkv, d, dtype=BF16)
        vp = torch.empty_like(kp)
        for b in range(batch):
            for p in range(cap // page):
                kp[perm[b, p]], vp[perm[b, p]] = kc[b, p * page:(p + 1) * page], vc[b, p * page:(p + 1) * page]
        k_arg, v_arg, kw["page_table"] = kp, vp, perm
    else:
        k_arg, v_arg = kc, vc
        if rows is not None:
            kw["cache_batch_idx"] = i32(rows)
        if pads is not None:
            kw["cache_leftpad"] = i32(pads)
    if packed:
        out, lse = hopper_flash.flash_attn_with_kvcache(q, k_arg, v_arg, cu_seqlens_q=cu(lq), max_seqlen_q=max_q,
                                                        **kw)
    else:
        out4, lse4 = hopper_flash.flash_attn_with_kvcache(q.view(batch, max_q, *q.shape[1:]), k_arg, v_arg, **kw)
        out, lse = out4.flatten(0, 1), lse4.permute(1, 0, 2).flatten(1)
    want, want_lse = _expected(q, lq, kc, vc, rows or list(range(batch)), pads or [0] * batch, ends, causal)
    torch.testing.assert_close(out.double(), want.to(BF16).double(), rtol=0, atol=0)
    torch.testing.assert_close(lse.double(), want_lse.float().double(), rtol=0, atol=0)
