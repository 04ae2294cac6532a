"""``flash_attn_varlen_func(..., block_table=...)`` on the CPU: the argument
checks on every path (eager, the op's fake), the refusal of gradients, the
opt-in contract check, and the three routes of ``hopper_flash.paged``
(uniform query lengths to the KV cache's decode path, mixed ones to the
varlen kernel reading the pages, pages it cannot read copied first), their
arguments recorded by stand-ins and the copying route judged through the
float64 varlen reference."""
import contextlib

import pytest
import torch

import hopper_flash
from hopper_flash import cache_layout, dispatch, kvcache, paged, plan
from hopper_flash.reference import attention_reference, varlen_reference

BF16 = torch.bfloat16


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def paged_batch(lq, lk, h=4, hkv=2, d=64, page=16, seed=0, dv=None):
    """q THD, each sequence's keys in pages of a shuffled pool (NaN where no
    live key lies), the block table (garbage past each row's live pages),
    and the keys as contiguous per-sequence tensors for the reference."""
    g = torch.Generator().manual_seed(seed)
    batch, max_pages = len(lq), max(1, -(-max(lk) // page))
    q = torch.randn(sum(lq), h, d, generator=g).to(BF16)
    ks = [torch.randn(n, hkv, d, generator=g).to(BF16) for n in lk]
    vs = [torch.randn(n, hkv, dv or d, generator=g).to(BF16) for n in lk]
    n_pages = batch * max_pages + 3
    perm = torch.randperm(n_pages, generator=g)[:batch * max_pages].view(batch, max_pages).to(torch.int32)
    kp = torch.full((n_pages, page, hkv, d), float("nan"), dtype=BF16)
    vp = torch.full((n_pages, page, hkv, dv or d), float("nan"), dtype=BF16)
    table = torch.full((batch, max_pages), 10 ** 6, dtype=torch.int32)
    for b, n in enumerate(lk):
        for p in range(-(-n // page)):
            rows = slice(p * page, min((p + 1) * page, n))
            kp[perm[b, p], :rows.stop - rows.start] = ks[b][rows]
            vp[perm[b, p], :rows.stop - rows.start] = vs[b][rows]
            table[b, p] = perm[b, p]
    return q, kp, vp, table, ks, vs


def expected(q, ks, vs, lq, causal):
    """float64 (out [total_q, H, Dv], lse [H, total_q]): each sequence alone."""
    outs, lses = [], []
    for (qs, n), k, v in zip(zip(cu(lq)[:-1].tolist(), lq), ks, vs):
        if n == 0:
            continue
        if k.shape[0] == 0:
            outs.append(torch.zeros(n, q.shape[1], v.shape[2], dtype=torch.float64))
            lses.append(torch.full((q.shape[1], n), float("-inf"), dtype=torch.float64))
            continue
        o, lse = attention_reference(q[None, qs:qs + n], k[None], v[None], causal=causal)
        outs.append(o[0])
        lses.append(lse[0].double())
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.fixture
def no_device(monkeypatch):
    """The device checks pass on CPU tensors; no device context."""
    monkeypatch.setattr(paged.checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(paged.checks, "check_tma_addressable", lambda name, t: None)
    monkeypatch.setattr(kvcache, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(kvcache, "_check_tma_addressable", lambda name, t: None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(plan, "on_device", lambda t: contextlib.nullcontext())


def test_uniform_query_lengths_take_the_kv_cache_decode_path(monkeypatch, no_device):
    """Every sequence with max_seqlen_q queries: flash_attn_with_kvcache's
    decode launch on a [batch, Sq, H, D] view of q, the pages and lengths
    as given; its LSE [B, H, Sq] comes back in the varlen layout [H, total_q]."""
    lq, lk = [2, 2, 2], [5, 40, 17]
    q, kp, vp, table, *_ = paged_batch(lq, lk)
    seen = {}

    def decode(q4, k, v, out, lse, scale, causal, cfg, **kw):
        seen.update(q4=q4, k=k, kw=kw, causal=causal)
        out.zero_()
        lse.copy_(torch.arange(3 * 4 * 2, dtype=torch.float32).view(3, 4, 2))  # [B, H, Sq]

    monkeypatch.setattr(plan, "launch_forward", decode)
    monkeypatch.setattr(plan, "launch_forward_varlen", lambda *a, **k: pytest.fail("the varlen kernel"))
    out, lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cu(lq), None, 2, 40, seqused_k=i32(lk),
                                                   block_table=table, causal=True, return_lse=True,
                                                   window_size=(8, 0))
    assert seen["q4"].shape == (3, 2, 4, 64) and seen["q4"].data_ptr() == q.data_ptr()
    assert seen["k"] is kp and seen["kw"]["page_table"].data_ptr() == table.data_ptr()
    assert seen["kw"]["seqused_k"].tolist() == lk and seen["causal"] is True and seen["kw"]["window"] == (8, 0)
    assert out.shape == q.shape
    want = torch.arange(24, dtype=torch.float32).view(3, 4, 2).permute(1, 0, 2).reshape(4, 6)
    assert torch.equal(lse, want)


def test_mixed_query_lengths_read_the_pages_in_the_varlen_kernel(monkeypatch, no_device):
    """A prefill chunk beside decodes: the varlen kernel's launch with the
    page table, seqused_k (from cu_seqlens_k's slots when only those are
    given) and no cu_seqlens_k; gathered pages (under 16 keys) too."""
    launches = []

    def launch(q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, **kw):
        launches.append(dict(k=k, cu_k=cu_k, used_k=used_k.clone(), pt=kw["page_table"], max_q=max_q))

    monkeypatch.setattr(plan, "launch_forward_varlen", launch)
    for page in (16, 4):
        lq, lk = [1, 100, 1], [30, 120, 1]
        q, kp, vp, table, *_ = paged_batch(lq, lk, page=page)
        hopper_flash.flash_attn_varlen_func(q, kp, vp, cu(lq), cu(lk), 100, 120, block_table=table)
        got = launches.pop()
        assert got["k"] is kp and got["pt"].data_ptr() == table.data_ptr() and got["cu_k"] is None
        assert got["used_k"].tolist() == lk and got["max_q"] == 100


@pytest.mark.parametrize("case", ["head-dim-256-small-pages", "strided-small-pages", "v-head-dim-small-pages"])
def test_pages_the_kernel_cannot_read_are_copied_and_read_as_one_axis(monkeypatch, no_device, case):
    """Small pages at head dim 256, in a strided pool, or with v's own head
    dim: each sequence's pages copied into a row of a contiguous cache, the
    rows read through cu_seqlens_k / seqused_k; through the float64 varlen
    reference standing in for the kernel, each sequence's own attention."""
    d, dv = (256, None) if case.startswith("head-dim-256") else (64, 32 if case.startswith("v-") else None)
    lq, lk = [3, 1, 0, 20], [9, 1, 5, 31]
    q, kp, vp, table, ks, vs = paged_batch(lq, lk, d=d, page=4, seed=2, dv=dv)
    if case.startswith("strided"):
        wide_k = torch.full((kp.shape[0], 8, *kp.shape[2:]), float("nan"), dtype=BF16)
        wide_v = wide_k.clone()
        wide_k[:, :4], wide_v[:, :4] = kp, vp
        kp, vp = wide_k[:, :4], wide_v[:, :4]
    assert not cache_layout.page_plan(4, d, kp, vp)
    seen = {}

    def launch(q3, k3, v3, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, **kw):
        assert kw.get("page_table") is None
        seen["launched"] = True
        if dv is not None:  # (the float64 reference takes one head dim; the copies' layout is what is checked)
            return
        o, l = varlen_reference(q3, k3, v3, cu_q, cu_k, seqused_k=used_k, causal=causal, softmax_scale=scale)
        out.copy_(o)
        lse.copy_(l)

    monkeypatch.setattr(plan, "launch_forward_varlen", launch)
    out, lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cu(lq), None, 20, 31, seqused_k=i32(lk),
                                                   block_table=table, causal=True, return_lse=True)
    assert seen["launched"]
    if dv is None:
        want, want_lse = expected(q, ks, vs, lq, True)
        torch.testing.assert_close(out.double(), want.to(BF16).double(), rtol=0, atol=0)
        torch.testing.assert_close(lse.double(), want_lse.float().double(), rtol=0, atol=0)


def _args(page=16, batch=2, d=64):
    q = torch.zeros(5, 4, d, dtype=BF16)
    pool = torch.zeros(6, page, 2, d, dtype=BF16)
    return q, pool, pool.clone(), i32([0, 2, 5]), i32([3, 7]), torch.zeros(batch, 3, dtype=torch.int32)


@pytest.mark.parametrize("mutate,error,match", [
    (lambda a: a.update(k=a["k"][0]), ValueError, r"k must have 4 dimensions \[num_pages, page_size"),
    (lambda a: a.update(k=a["k"][:, :12], v=a["v"][:, :12]), ValueError, "page size"),
    (lambda a: a.update(block_table=a["block_table"].long()), ValueError, "block_table must have dtype int32"),
    (lambda a: a.update(block_table=a["block_table"][:1]), ValueError,
     r"block_table must have shape \[batch, max_pages\] = \(2, max_pages >= 1\)"),
    (lambda a: a.update(block_table=[[0]]), TypeError, "block_table must be an int32 torch.Tensor"),
    (lambda a: a.update(seqused_k=None), ValueError, "seqused_k or cu_seqlens_k"),
    (lambda a: a.update(seqused_k=i32([1, 2, 3])), ValueError, "seqused_k must have 2 entries"),
    (lambda a: a.update(cu_seqlens_k=i32([0, 1])), ValueError, "cu_seqlens_k must have 3 entries"),
    (lambda a: a.update(v=a["v"][:, :, :1]), ValueError, "k and v must have the same shape"),
    (lambda a: a.update(k=a["k"][:, :, :1, :48], v=a["v"][:, :, :1, :48]), ValueError, "k must have q's head dim"),
    (lambda a: a.update(max_seqlen_q=1), ValueError, "more than batch"),
])
def test_bad_paged_arguments_name_themselves(mutate, error, match):
    """Eagerly, and in the op's fake (what torch.compile traces)."""
    q, kp, vp, cq, lens, table = _args()
    a = dict(q=q, k=kp, v=vp, cu_seqlens_q=cq, cu_seqlens_k=None, max_seqlen_q=3, max_seqlen_k=40,
             seqused_k=lens, block_table=table)
    mutate(a)
    with pytest.raises(error, match=match):
        hopper_flash.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                            a["max_seqlen_q"], a["max_seqlen_k"], seqused_k=a["seqused_k"],
                                            block_table=a["block_table"])
    if error is ValueError:
        meta = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in a.items()}
        with pytest.raises(error, match=match):
            paged._varlen_fwd_paged_fake(meta["q"], meta["k"], meta["v"], meta["cu_seqlens_q"],
                                         meta["cu_seqlens_k"], None, meta["seqused_k"], meta["block_table"],
                                         meta["max_seqlen_q"], meta["max_seqlen_k"], 0.1, False)


def test_a_good_call_reaches_the_device_check_and_the_fake_shapes():
    q, kp, vp, cq, lens, table = _args()
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, 3, 40, seqused_k=lens, block_table=table)
    meta = [t.to("meta") for t in (q, kp, vp.narrow(3, 0, 32), cq, lens, table)]
    out, lse = paged._varlen_fwd_paged_fake(meta[0], meta[1], meta[2], meta[3], None, None, meta[4], meta[5], 3, 40,
                                            0.1, True)
    assert out.shape == (5, 4, 32) and lse.shape == (4, 5)


def test_gradients_are_refused_by_name():
    q, kp, vp, cq, lens, table = _args()
    with pytest.raises(NotImplementedError, match="block_table is forward only"):
        hopper_flash.flash_attn_varlen_func(q.requires_grad_(), kp, vp, cq, None, 3, 40, seqused_k=lens,
                                            block_table=table)
    with torch.no_grad(), pytest.raises(ValueError, match="q must be a CUDA tensor"):
        hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, 3, 40, seqused_k=lens, block_table=table)


def test_the_contract_check():
    q, kp, vp, cq, lens, table = _args()  # 6 pages of 16 keys, 3 per row
    table[:] = i32([[0, 1, 9], [2, 3, 4]])  # row 0's third page invalid, not live below 33 keys
    paged.check_paged_varlen_contract(q, kp, cq, None, 3, 48, None, i32([32, 48]), table)
    with pytest.raises(ValueError, match=r"block_table entries covering live keys must lie in \[0, 6\)"):
        paged.check_paged_varlen_contract(q, kp, cq, None, 3, 48, None, i32([33, 48]), table)
    with pytest.raises(ValueError, match=r"key lengths must lie in \[0, min\(max_seqlen_k"):
        paged.check_paged_varlen_contract(q, kp, cq, None, 3, 40, None, i32([32, 48]), table)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be non-decreasing"):
        paged.check_paged_varlen_contract(q, kp, cq, i32([0, 5, 4]), 3, 48, None, None, table)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(2\) is below the longest sequence \(3\)"):
        paged.check_paged_varlen_contract(q, kp, cq, None, 2, 48, None, i32([1, 1]), table)


def test_the_uniform_route_is_decided_from_shapes_alone(monkeypatch, no_device):
    """total_q == batch * max_seqlen_q (lengths at most max summing to it)
    takes the decode launch; a larger bound, or seqused_q (gaps), the
    varlen kernel."""
    calls = []
    monkeypatch.setattr(plan, "launch_forward", lambda *a, **k: calls.append("decode"))
    monkeypatch.setattr(plan, "launch_forward_varlen", lambda *a, **k: calls.append("varlen"))
    q, kp, vp, table, *_ = paged_batch([2, 2, 2], [5, 40, 17])
    for max_q, used_q in ((2, None), (3, None), (2, i32([2, 2, 2]))):
        hopper_flash.flash_attn_varlen_func(q, kp, vp, cu([2, 2, 2]), None, max_q, 40, seqused_k=i32([5, 40, 17]),
                                            seqused_q=used_q, block_table=table)
    assert calls == ["decode", "varlen", "varlen"]


@pytest.mark.parametrize("lq,max_q", [([1, 1], 1), ([3, 0], 3)], ids=["uniform", "mixed"])
@pytest.mark.parametrize("page,d", [(16, 64), (4, 256)])
def test_pools_without_pages_give_zeros(monkeypatch, no_device, lq, max_q, page, d):
    """No page at all: no key can be live (the contract), zeros and -inf,
    nothing launched (TMA cannot describe an empty pool)."""
    monkeypatch.setattr(plan, "launch_forward_varlen", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(plan, "launch_forward", lambda *a, **k: pytest.fail("launched"))
    q = torch.randn(sum(lq), 4, d).to(BF16)
    pool = torch.zeros(0, page, 2, d, dtype=BF16)
    out, lse = hopper_flash.flash_attn_varlen_func(q, pool, pool, cu(lq), None, max_q, 8, seqused_k=i32([0, 0]),
                                                   block_table=torch.zeros(2, 1, dtype=torch.int32),
                                                   return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all() and lse.shape == (4, sum(lq))


def test_the_benchs_paged_copy_holds_each_sequence_in_its_pages():
    from hopper_flash.bench.varlen import paged_copy

    lengths = [5, 16, 33, 1]
    k = torch.randn(sum(lengths), 2, 8)
    v = torch.randn(sum(lengths), 2, 8)
    kp, vp, table = paged_copy(k, v, cu(lengths), 16, seed=3)
    assert kp.shape == (1 + 1 + 3 + 1, 16, 2, 8) and table.shape == (4, 3) and table.dtype == torch.int32
    for b, (s, n) in enumerate(zip(cu(lengths)[:-1].tolist(), lengths)):
        rows = torch.cat([kp[p] for p in table[b, :-(-n // 16)].tolist()])[:n]
        vrows = torch.cat([vp[p] for p in table[b, :-(-n // 16)].tolist()])[:n]
        assert torch.equal(rows, k[s:s + n]) and torch.equal(vrows, v[s:s + n])
    live = [p for b, n in enumerate(lengths) for p in table[b, :-(-n // 16)].tolist()]
    assert sorted(live) == list(range(kp.shape[0])), "every page used once"


def test_a_signature_that_passed_skips_the_checks(monkeypatch, no_device):
    """Every layer of a continuous batching step makes one call signature: the
    checks run at its first call only; a call that differs in what they read
    (the block table's width or dtype) is checked again, and bad arguments
    still name themselves."""
    monkeypatch.setattr(paged.checks, "_PASSED", {})
    monkeypatch.setattr(paged.checks, "_PASSED_DEVICE_TYPE", "cpu")
    runs = []
    real = paged.check_paged_varlen_arguments
    monkeypatch.setattr(paged, "check_paged_varlen_arguments", lambda *a: runs.append(1) or real(*a))

    def launch(q4, k, v, out, lse, *args, **kwargs):
        out.zero_()
    monkeypatch.setattr(plan, "launch_forward", launch)
    lq, lk = [1, 1, 1], [5, 40, 17]
    q, kp, vp, table, *_ = paged_batch(lq, lk)

    def call(block_table):
        return hopper_flash.flash_attn_varlen_func(q, kp, vp, cu(lq), None, 1, 40, seqused_k=i32(lk),
                                                   block_table=block_table, causal=True)
    for _ in range(3):
        call(table)
    assert len(runs) == 1
    call(torch.cat([table, table[:, :1]], 1))  # one page more per row: checked
    assert len(runs) == 2
    with pytest.raises(ValueError, match="block_table must have dtype int32"):
        call(table.long())
    assert len(runs) == 3
