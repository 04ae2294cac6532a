"""attention_chunk (FA3's chunked attention, Llama 4's local layers) on a
Hopper GPU: flash_attn_func and flash_attn_varlen_func against the float64
reference with the chunk mask (``reference.chunk_visible``), judged
relative to PyTorch's attention with the same explicit mask, forward and
backward; NaN in varlen gaps; CUDA-graph replay with new cu_seqlens;
torch.compile; and paged caches (pages read in place where the chunk is a
multiple of the page size, copied otherwise). The segments themselves are checked on the CPU
(tests/test_chunked_cpu.py)."""
import math

import pytest
import torch

import hopper_flash
from hopper_flash.reference import (
    assert_judged,
    attention_baseline,
    attention_reference,
    attention_reference_grads,
    grads_abs_tol,
)
from gpu_inputs import (assert_varlen_forward, capture, cu, nan_tailed_cache, paged_copy, paged_pools, rnd, varlen_batch,
                        varlen_expected)

pytestmark = pytest.mark.gpu


# (batch, seqlen_q, seqlen_k, chunk): several chunks with a partial last one,
# queries over a longer cache (keys skipped before the first query's chunk),
# queries longer than the keys, and chunks smaller than a tile.
FORWARD = [(2, 1000, 1000, 256), (1, 300, 3001, 1024), (2, 129, 127, 64), (1, 3001, 3001, 8192),
           (2, 257, 257, 48)]


@pytest.mark.parametrize("b,sq,sk,chunk", FORWARD, ids=[f"b{b}-{q}x{k}-c{c}" for b, q, k, c in FORWARD])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_equals_the_chunk_mask(b, sq, sk, chunk, causal):
    q, k, v = rnd(b, sq, 8, 128, seed=1), rnd(b, sk, 2, 128, seed=2), rnd(b, sk, 2, 128, seed=3)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, attention_chunk=chunk, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, chunk=chunk)
    base = attention_baseline(q, k, v, causal=causal, chunk=chunk)
    assert out.shape == q.shape and lse.shape == (b, 8, sq)
    assert_judged("out", out, ref, base)
    seen = torch.isfinite(ref_lse)
    assert_judged("lse", lse[seen], ref_lse[seen].to(lse.device))
    assert (lse[~seen] == -math.inf).all() and (out.transpose(1, 2)[~seen] == 0).all()


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_equals_the_chunk_mask(d):
    b, s, chunk = 2, 777, 256
    q, k, v = (rnd(b, s, h, d, seed=i).requires_grad_() for i, h in ((1, 4), (2, 2), (3, 2)))
    dout = rnd(b, s, 4, d, seed=4)
    out = hopper_flash.flash_attn_func(q, k, v, causal=True, attention_chunk=chunk)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = attention_reference_grads(q.detach(), k.detach(), v.detach(), dout, causal=True, chunk=chunk)
    with torch.enable_grad():
        base_out = attention_baseline(q, k, v, causal=True, chunk=chunk, cudnn=False)
        base = torch.autograd.grad(base_out, (q, k, v), dout)
    tol = grads_abs_tol(ref, q.dtype)
    for name, g, r, bl in zip(("dq", "dk", "dv"), grads, ref, base):
        assert_judged(name, g, r, bl, abs_tol=tol)


def test_keys_skipped_before_the_first_chunk_get_no_gradient():
    q, k, v = rnd(1, 100, 4, 128, seed=1), rnd(1, 1000, 4, 128, seed=2), rnd(1, 1000, 4, 128, seed=3)
    k.requires_grad_()
    v.requires_grad_()
    out = hopper_flash.flash_attn_func(q, k, v, causal=True, attention_chunk=256)  # queries at 900..999
    dk, dv = torch.autograd.grad(out, (k, v), torch.ones_like(out))
    assert (dk[:, :768] == 0).all() and (dv[:, :768] == 0).all()
    assert dk[:, 768:].abs().sum() > 0


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_with_nan_gaps(causal):
    lq, lk = [1, 0, 127, 1000, 3001, 17, 600], [1, 5, 127, 1000, 3001, 0, 2000]
    used_q, used_k = [1, 0, 100, 1000, 2900, 17, 600], [1, 5, 127, 999, 3001, 0, 1700]
    q, k, v, cq, ck, uq, uk = varlen_batch(lq, lk, 8, 2, 128, used_q=used_q, used_k=used_k, seed=7)
    out, lse = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(used_q), max(used_k), seqused_q=uq,
                                                   seqused_k=uk, causal=causal, attention_chunk=512, return_lse=True)
    assert_varlen_forward("chunked", out, lse, varlen_expected(q, k, v, cq, ck, uq, uk, causal, chunk=512))


def test_packed_self_attention_forward_and_backward():
    """Packed training's call (one cu_seqlens for q and k): each sequence
    judged alone against the chunk mask, its gradients too."""
    lens = [2048, 1, 700, 4096, 129]
    q, k, v, cq, _, _, _ = varlen_batch(lens, lens, 8, 2, 128, seed=11)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = hopper_flash.flash_attn_varlen_func(q, k, v, cq, cq, max(lens), max(lens), causal=True,
                                              attention_chunk=1024)
    dout = rnd(*out.shape, seed=12)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for s, n in zip(cq[:-1].tolist(), lens):
        rows = slice(s, s + n)
        one = [x.detach()[rows][None] for x in (q, k, v)]
        ref, _ = attention_reference(*one, causal=True, chunk=1024)
        assert_judged(f"out ({n})", out.detach()[rows][None], ref,
                      attention_baseline(*one, causal=True, chunk=1024))
        ref_g = attention_reference_grads(*one, dout[rows][None], causal=True, chunk=1024)
        leaves = [x.clone().requires_grad_() for x in one]
        with torch.enable_grad():
            base_g = torch.autograd.grad(attention_baseline(*leaves, causal=True, chunk=1024, cudnn=False), leaves,
                                         dout[rows][None])
        for name, g, r, bl in zip(("dq", "dk", "dv"), grads, ref_g, base_g):
            assert_judged(f"{name} ({n})", g[rows][None], r, bl, abs_tol=grads_abs_tol(ref_g, q.dtype))


def test_cuda_graph_replay_with_new_cu_seqlens():
    lens = [900, 100, 1500]
    q, k, v, cq, _, _, _ = varlen_batch(lens, lens, 8, 2, 128, seed=13)
    cu_in = cq.clone()
    graph, out = capture(lambda: hopper_flash.flash_attn_varlen_func(q, k, v, cu_in, cu_in, 2048, 2048, causal=True,
                                                                      attention_chunk=256))
    for new in ([500, 500, 1500], [2000, 1, 499]):
        cu_in.copy_(cu(new))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        expected = varlen_expected(q, k, v, cu_in, cu_in, None, None, True, chunk=256)
        ref, _, base, _ = expected
        assert_judged(f"out {new}", out, ref, base)


def test_torch_compile_fullgraph_matches_eager():
    q, k, v = rnd(2, 1000, 8, 128, seed=1), rnd(2, 1000, 2, 128, seed=2), rnd(2, 1000, 2, 128, seed=3)
    eager = hopper_flash.flash_attn_func(q, k, v, causal=True, attention_chunk=256)
    compiled = torch.compile(lambda a, b, c: hopper_flash.flash_attn_func(a, b, c, causal=True, attention_chunk=256),
                             fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)


@pytest.mark.parametrize("seqlen_q", [1, 4, 300])
def test_kv_cache_with_append_and_nan_tails(seqlen_q):
    """flash_attn_with_kvcache(attention_chunk=...): the new keys appended
    in place, then each row's queries against its chunk of cache + new keys
    (rows whose queries straddle a chunk boundary included), NaN past every
    row's keys."""
    b, cap, chunk = 3, 5000, 1024
    lens = [4000, 17, 2047]
    k_cache, v_cache = nan_tailed_cache(b, cap, 2, 128, lens, seed=31)
    q = rnd(b, seqlen_q, 8, 128, seed=33)
    k_new, v_new = rnd(b, seqlen_q, 2, 128, seed=34), rnd(b, seqlen_q, 2, 128, seed=35)
    keys = [torch.cat([k_cache[i, :n], k_new[i]]) for i, n in enumerate(lens)]
    values = [torch.cat([v_cache[i, :n], v_new[i]]) for i, n in enumerate(lens)]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = hopper_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                               attention_chunk=chunk)
    for i in range(b):
        assert torch.equal(k_cache[i, lens[i]:lens[i] + seqlen_q], k_new[i])  # the append
        ref, _ = attention_reference(q[i:i + 1], keys[i][None], values[i][None], causal=True, chunk=chunk)
        base = attention_baseline(q[i:i + 1], keys[i][None], values[i][None], causal=True, chunk=chunk)
        assert_judged(f"out row {i}", out[i:i + 1], ref, base)


# (page size, chunk): pages read in place (the chunk a multiple of the
# page, small and large pages), and a chunk starting inside a page (copied).
PAGED = [(16, 1024), (256, 1024), (64, 1000)]


@pytest.mark.parametrize("page,chunk", PAGED, ids=[f"p{p}-c{c}" for p, c in PAGED])
@pytest.mark.parametrize("seqlen_q", [1, 300])
def test_paged_kv_cache_with_append(page, chunk, seqlen_q):
    """flash_attn_with_kvcache(page_table=..., attention_chunk=...): the new
    keys appended into shuffled pages, NaN in every unused page row and
    garbage past each row's live pages; each row judged against its chunk
    of cache + new keys, and against the contiguous cache's call."""
    b, cap = 3, 5000
    lens = [4000, 17, 2047]
    k_cache, v_cache = nan_tailed_cache(b, cap, 2, 128, lens, seed=41)
    kp, vp, table = paged_copy(k_cache, v_cache, page, [n + seqlen_q for n in lens], seed=42)
    q = rnd(b, seqlen_q, 8, 128, seed=43)
    k_new, v_new = rnd(b, seqlen_q, 2, 128, seed=44), rnd(b, seqlen_q, 2, 128, seed=45)
    keys = [torch.cat([k_cache[i, :n], k_new[i]]) for i, n in enumerate(lens)]
    values = [torch.cat([v_cache[i, :n], v_new[i]]) for i, n in enumerate(lens)]
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, cache_seqlens=seqlens, page_table=table,
                                                    causal=True, attention_chunk=chunk, return_softmax_lse=True)
    contiguous = hopper_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                      causal=True, attention_chunk=chunk)
    for i in range(b):
        ref, ref_lse = attention_reference(q[i:i + 1], keys[i][None], values[i][None], causal=True, chunk=chunk)
        base = attention_baseline(q[i:i + 1], keys[i][None], values[i][None], causal=True, chunk=chunk)
        assert_judged(f"out row {i}", out[i:i + 1], ref, base)
        assert_judged(f"lse row {i}", lse[i:i + 1], ref_lse.to(lse.device))
        assert_judged(f"contiguous row {i}", contiguous[i:i + 1], ref, base)


@pytest.mark.parametrize("page,chunk", PAGED, ids=[f"p{p}-c{c}" for p, c in PAGED])
def test_paged_varlen_block_table(page, chunk):
    """flash_attn_varlen_func(block_table=..., attention_chunk=...) (vLLM's
    layout): decodes, a prefill chunk and a query block over longer keys,
    judged against the same batch packed, NaN in every unused page row."""
    lq, lk = [1, 300, 5, 2000, 0], [4000, 300, 17, 2100, 9]
    q, k, v, cq, ck, _, _ = varlen_batch(lq, lk, 8, 2, 128, seed=51)
    kp, vp, table = paged_pools(k, v, ck, page, seed=52)
    used_k = (ck[1:] - ck[:-1]).to(torch.int32)
    out, lse = hopper_flash.flash_attn_varlen_func(q, kp, vp, cq, None, max(lq), max(lk), seqused_k=used_k,
                                                   block_table=table, causal=True, attention_chunk=chunk,
                                                   return_lse=True)
    assert_varlen_forward("paged", out, lse, varlen_expected(q, k, v, cq, ck, None, None, True, chunk=chunk))


def test_last_chunk_rows_in_one_launch():
    """kernels/last_chunk.py: each row's last chunk as a left pad (from the
    row's own pad) or as its page-table row shifted to the chunk's first
    page, with its live keys from there; hand-counted starts, and equal to
    the torch ops it replaces (the CPU path) on a strided table."""
    from hopper_flash import chunked
    chunk, page = 256, 64
    used = torch.tensor([0, 1, 255, 256, 257, 1000, 4096, 70], dtype=torch.int32, device="cuda")
    pads = torch.tensor([0, 1, 10, 0, 1, 999, 0, 6], dtype=torch.int32, device="cuda")
    assert chunked.last_chunk_leftpad(used, chunk, None).tolist() == [0, 0, 0, 0, 256, 768, 3840, 0]
    # keys after the pad: 0, 0, 245, 256, 256, 1, 4096, 64
    assert chunked.last_chunk_leftpad(used, chunk, pads).tolist() == [0, 1, 10, 0, 1, 999, 3840, 6]
    wide = torch.randint(0, 10**6, (8, 80), dtype=torch.int32, device="cuda")
    table = wide[:, :70]  # 70 entries a row, rows 80 apart
    for width in (4, 3):
        got_used, got_table = chunked.last_chunk_pages(used, chunk, table, page, width)
        ref_used, ref_table = chunked.last_chunk_pages(used.cpu(), chunk, table.cpu(), page, width)
        assert torch.equal(got_used.cpu(), ref_used) and torch.equal(got_table.cpu(), ref_table)
    assert got_used.tolist() == [0, 1, 255, 256, 1, 232, 256, 70]
    assert torch.equal(got_table[6].cpu(), table[6, 60:63].cpu())  # 4096 keys: the chunk from key 3840, page 60
    assert torch.equal(got_table[7].cpu(), table[7, 0:3].cpu())


@pytest.mark.parametrize("page", [0, 64], ids=["contiguous", "pages64"])
def test_chunked_decode_step_under_graph_replay(page):
    """A decode step with attention_chunk captured once and replayed with
    growing cache_seqlens across chunk boundaries (contiguous caches with
    cache_leftpad, or pages read in place); each replay judged against the
    float64 reference over the row's keys from its pad, NaN outside them."""
    b, cap, chunk = 3, 2048, 512
    pads = [0, 7, 100] if not page else [0, 0, 0]
    lens0 = [1024, 519, 1600] if not page else [1024, 512, 1600]  # keys after the pad: 1024, 512, 1500 (1600)
    k_cache, v_cache = nan_tailed_cache(b, cap, 2, 128, [n + 2 for n in lens0], seed=61)
    for i, p in enumerate(pads):
        k_cache[i, :p], v_cache[i, :p] = math.nan, math.nan
    q = rnd(b, 1, 8, 128, seed=62)
    seqlens = torch.tensor(lens0, dtype=torch.int32, device="cuda")
    if page:
        kc, vc, table = paged_copy(k_cache, v_cache, page, [cap] * b, seed=63)
        extra = {"page_table": table}
    else:
        kc, vc = k_cache, v_cache
        extra = {"cache_leftpad": torch.tensor(pads, dtype=torch.int32, device="cuda")}
    graph, out = capture(lambda: hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                                                     attention_chunk=chunk, **extra))
    for step in (0, 1, 2):  # 1: each row's first key of a new chunk
        lens = [n + step for n in lens0]
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        for i, (n, p) in enumerate(zip(lens, pads)):
            keys, values = k_cache[i, p:n][None], v_cache[i, p:n][None]
            ref, _ = attention_reference(q[i:i + 1], keys, values, causal=True, chunk=chunk)
            base = attention_baseline(q[i:i + 1], keys, values, causal=True, chunk=chunk)
            assert_judged(f"step {step} row {i}", out[i:i + 1], ref, base)
