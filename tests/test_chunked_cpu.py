"""attention_chunk (FA3's chunked attention) on the CPU: the chunk segments
``hopper_flash.chunked`` builds, run through the float64 varlen reference
in place of the kernels, against the reference's own chunk mask applied to
the whole problem (``reference.chunk_visible``: ``floor(a / C) == floor(j /
C)`` with ``a`` the query's key position), forward, LSE and gradients.
The segments are also held to the varlen contract (every live length within
the bounds handed to the kernels), which is what makes the kernels' grid
cover them. The kernels themselves: tests/test_chunked_gpu.py."""
import math
import random

import pytest
import torch

import hopper_flash
from hopper_flash import checks, chunked, interface, plan
from hopper_flash.reference import attention_reference, chunk_visible, varlen_apply, varlen_reference

F64 = torch.float64


def fake_varlen(calls):
    """``flash_attn_varlen_func`` as the float64 reference per sequence, after
    checking the arguments the chunked call hands the kernels: the host
    checks and the device contract."""
    def fn(q, k, v, cu_q, cu_k, max_q, max_k, *, seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
           return_lse=False, window_size=(-1, -1), **_):
        calls.append(dict(batch=cu_q.numel() - 1, max_q=max_q, max_k=max_k))
        checks.check_varlen_arguments(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k, softmax_scale, causal)
        checks.check_varlen_contract(q, k, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k)
        window = None if tuple(window_size) == (-1, -1) else tuple(window_size)
        out, lse = varlen_apply(lambda a, b, c: attention_reference(a, b, c, causal=causal, window=window,
                                                                    softmax_scale=softmax_scale),
                                q, k, v, cu_q, cu_k, seqused_q=seqused_q, seqused_k=seqused_k, out_dtype=F64,
                                with_lse=True)
        return (out, lse) if return_lse else out
    return fn


@pytest.fixture
def calls(monkeypatch):
    """The kernels' stand-ins (the call log), on float64 inputs (which the
    argument checks then take as they take bf16)."""
    record = []
    monkeypatch.setattr(plan, "SUPPORTED_DTYPES", (*plan.SUPPORTED_DTYPES, F64))
    monkeypatch.setattr(interface, "flash_attn_varlen_func", fake_varlen(record))

    def plain(q, k, v, *, causal=False, return_lse=False, window_size=(-1, -1), softmax_scale=None, **_):
        record.append(dict(plain=True))
        window = None if tuple(window_size) == (-1, -1) else tuple(window_size)
        out, lse = attention_reference(q, k, v, causal=causal, window=window, softmax_scale=softmax_scale)
        return (out, lse) if return_lse else out
    monkeypatch.setattr(interface, "flash_attn_func", plain)
    return record


def qkv(batch, sq, sk, h=4, hkv=2, d=16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, h, d, generator=g, dtype=F64)
    k = torch.randn(batch, sk, hkv, d, generator=g, dtype=F64)
    v = torch.randn(batch, sk, hkv, d, generator=g, dtype=F64)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)]


# (seqlen_q, seqlen_k, chunk): equal lengths over several chunks, a chunk that
# does not divide them, queries over a longer cache (keys skipped before the
# first query's chunk), queries longer than the keys (rows that see none),
# and a chunk of one key.
SHAPES = [(64, 64, 16), (18, 18, 16), (70, 70, 32), (5, 100, 16), (40, 100, 32), (100, 60, 32), (33, 33, 1), (9, 9, 64)]


@pytest.mark.parametrize("sq,sk,chunk", SHAPES, ids=[f"{a}x{b}c{c}" for a, b, c in SHAPES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fixed_length_chunks_equal_the_chunk_mask(calls, sq, sk, chunk, causal):
    q, k, v = qkv(2, sq, sk, seed=sq * 7 + sk)
    out, lse = interface._chunked_func(q, k, v, chunk, softmax_scale=None, causal=causal, return_lse=True,
                                       window_size=(-1, -1), softcap=0.0, deterministic=False, learnable_sink=None)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, chunk=chunk)
    assert out.shape == q.shape and lse.shape == (2, 4, sq) and lse.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    if sq <= sk <= chunk:
        assert calls == [dict(plain=True)]  # one chunk holds every key: the plain call
    else:
        (call,) = calls
        blind, skipped = sk < sq, (max(sk - sq, 0) // chunk) * chunk > 0
        chunks = math.ceil(sk / chunk) - max(sk - sq, 0) // chunk  # the first query's chunk to the last key's
        assert call["batch"] == 2 * (chunks + blind + skipped)
        assert call["max_q"] <= max(sq - sk, min(chunk, sq), 1)  # the grid's rows: at most a chunk's


def test_window_and_chunk_together(calls):
    q, k, v = qkv(1, 90, 90, seed=3)
    out = interface._chunked_func(q, k, v, 32, softmax_scale=0.3, causal=True, return_lse=False,
                                  window_size=(10, 0), softcap=0.0, deterministic=False, learnable_sink=None)
    ref, _ = attention_reference(q, k, v, causal=True, window=(10, 0), chunk=32, softmax_scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sq,sk,chunk", [(64, 64, 16), (40, 100, 32), (100, 60, 32)])
def test_fixed_length_gradients_equal_the_chunk_mask(calls, sq, sk, chunk):
    """Through the segments' views back to q, k and v: every key outside
    any query's chunk (skipped before the first) gets a zero gradient."""
    q, k, v = qkv(2, sq, sk, seed=11, requires_grad=True)
    dout = torch.randn(2, sq, 4, 16, dtype=F64)
    out = interface._chunked_func(q, k, v, chunk, softmax_scale=None, causal=True, return_lse=False,
                                  window_size=(-1, -1), softcap=0.0, deterministic=False, learnable_sink=None)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, _ = attention_reference(q, k, v, causal=True, chunk=chunk)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


# (seqlen_q, seqlen_k, chunk) whose every query lies in the last chunk: a
# decode step, a block ending at a chunk's last key, one past a boundary.
ONE_CHUNK = [(1, 100, 16), (4, 96, 32), (3, 100, 16), (1, 33, 1)]


@pytest.mark.parametrize("sq,sk,chunk", ONE_CHUNK, ids=[f"{a}x{b}c{c}" for a, b, c in ONE_CHUNK])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_queries_in_one_chunk_run_the_plain_call_over_its_keys(calls, sq, sk, chunk, causal):
    """No segments where every query sits in the last chunk: the plain call
    over that chunk's keys (views of k and v), outputs, LSE and gradients
    as the chunk mask's over all keys (the keys before it: no gradient)."""
    q, k, v = qkv(2, sq, sk, seed=sq + sk, requires_grad=True)
    out, lse = interface._chunked_func(q, k, v, chunk, softmax_scale=None, causal=causal, return_lse=True,
                                       window_size=(-1, -1), softcap=0.0, deterministic=False, learnable_sink=None)
    assert calls == [dict(plain=True)]
    ref, ref_lse = attention_reference(q, k, v, causal=causal, chunk=chunk)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g, r in zip(grads, torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def varlen_case(lq, lk, used_q=None, used_k=None, seed=0, h=4, hkv=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), h, d, generator=g, dtype=F64)
    k = torch.randn(sum(lk), hkv, d, generator=g, dtype=F64)
    v = torch.randn(sum(lk), hkv, d, generator=g, dtype=F64)
    cu = lambda n: torch.tensor([0] + n).cumsum(0).to(torch.int32)  # noqa: E731
    used = lambda n: None if n is None else torch.tensor(n, dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lq), cu(lk), used(used_q), used(used_k)


def run_varlen(q, k, v, cq, ck, uq, uk, chunk, causal, max_q=None, max_k=None):
    spans_q = [int(x) for x in (uq if uq is not None else cq[1:] - cq[:-1])]
    spans_k = [int(x) for x in (uk if uk is not None else ck[1:] - ck[:-1])]
    return interface._chunked_varlen(
        q, k, v, cq, ck, max_q or max(spans_q + [1]), max_k or max(spans_k + [1]), chunk, seqused_q=uq,
        seqused_k=uk, softmax_scale=None, causal=causal, deterministic=False, return_lse=True, check_contract=None,
        window_size=(-1, -1), softcap=0.0, block_table=None, learnable_sink=None, num_splits=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_chunks_equal_the_chunk_mask_per_sequence(calls, causal):
    """Sequences of 0, 1, tile-odd and multi-chunk lengths, q shorter and
    longer than k, with seqused gaps holding NaN that no result may see."""
    lq, lk = [0, 1, 37, 100, 20, 64, 5], [7, 1, 37, 60, 90, 64, 0]
    used_q, used_k = [0, 1, 30, 100, 20, 50, 5], [7, 1, 37, 51, 77, 64, 0]
    q, k, v, cq, ck, uq, uk = varlen_case(lq, lk, used_q, used_k, seed=5)
    live_q = torch.zeros(q.shape[0], dtype=torch.bool)
    live_k = torch.zeros(k.shape[0], dtype=torch.bool)
    for s, n, u in zip(cq[:-1].tolist(), lq, used_q):
        live_q[s:s + u] = True
    for s, n, u in zip(ck[:-1].tolist(), lk, used_k):
        live_k[s:s + u] = True
    q[~live_q], k[~live_k], v[~live_k] = math.nan, math.nan, math.nan
    out, lse = run_varlen(q, k, v, cq, ck, uq, uk, 16, causal)
    ref, ref_lse = varlen_apply(lambda a, b, c: attention_reference(a, b, c, causal=causal, chunk=16), q, k, v, cq,
                                ck, seqused_q=uq, seqused_k=uk, out_dtype=F64, with_lse=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
    (call,) = calls
    assert call["max_q"] == max(used_q) and call["max_k"] == max(used_k)  # the call's own bounds


def test_packed_self_attention_plans_a_chunk_of_rows(calls):
    """One cu_seqlens tensor for q and k (packed training): no head slots,
    segments of at most a chunk of queries (the grid's rows)."""
    lens = [100, 3, 64, 65]
    q, k, v, cq, _, _, _ = varlen_case(lens, lens, seed=9)
    out, lse = run_varlen(q, k, v, cq, cq, None, None, 32, True)
    ref, ref_lse = varlen_apply(lambda a, b, c: attention_reference(a, b, c, causal=True, chunk=32), q, k, v, cq, cq,
                                out_dtype=F64, with_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    (call,) = calls
    assert call["max_q"] == 32 and call["batch"] == len(lens) * math.ceil(100 / 32)


def test_varlen_random_mixes(calls):
    rng = random.Random(0)
    for trial in range(20):
        b = rng.randint(1, 5)
        lq = [rng.choice([0, 1, rng.randint(1, 80)]) for _ in range(b)]
        lk = [rng.choice([0, 1, rng.randint(1, 120)]) for _ in range(b)]
        chunk = rng.choice([1, 7, 16, 64, 200])
        causal = rng.random() < 0.5
        q, k, v, cq, ck, uq, uk = varlen_case(lq, lk, seed=trial)
        calls.clear()
        out, lse = run_varlen(q, k, v, cq, ck, uq, uk, chunk, causal)
        ref, ref_lse = varlen_apply(lambda a, b_, c: attention_reference(a, b_, c, causal=causal, chunk=chunk),
                                    q, k, v, cq, ck, out_dtype=F64, with_lse=True)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12, msg=f"trial {trial}: {lq} {lk} {chunk}")
        torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12, msg=f"trial {trial}")


def test_varlen_segments_of_packed_self_attention():
    """The prefix sums themselves: sequences of 5 and 35 tokens in chunks
    of 16 (three chunk slots each: 5, 0, 0 and 16, 16, 3)."""
    cu = torch.tensor([0, 5, 40], dtype=torch.int32)
    seg = chunked.varlen_segments(cu, cu, None, None, 35, 35, 16)
    assert seg.cu_seqlens_q.dtype == torch.int32 and seg.cu_seqlens_q.numel() == 2 * 3 + 1
    assert seg.cu_seqlens_q.tolist() == [0, 5, 5, 5, 21, 37, 40] and seg.max_seqlen_q == 16


def test_chunk_visible_is_floor_division_of_key_positions():
    rows, cols = torch.arange(4), torch.arange(10)
    vis = chunk_visible(rows, cols, 4, 10, 4)  # key positions 6..9: chunk 1 for 6, 7; chunk 2 for 8, 9
    assert vis[0].nonzero().flatten().tolist() == [4, 5, 6, 7]
    assert vis[3].nonzero().flatten().tolist() == [8, 9]
    blind = chunk_visible(torch.arange(3), torch.arange(2), 3, 2, 4)  # row 0 at key position -1: chunk -1
    assert not blind[0].any() and blind[1].all()


@pytest.mark.parametrize("value, error, message", [
    (1.5, TypeError, "attention_chunk must be an int"),
    (True, TypeError, "attention_chunk must be an int"),
    (-4, ValueError, r"attention_chunk must be >= 0"),
])
def test_bad_attention_chunk_is_refused_by_name(value, error, message):
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(error, match=message):
        hopper_flash.flash_attn_func(q, q, q, attention_chunk=value)
    with pytest.raises(error, match=message):
        hopper_flash.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 8, 8, attention_chunk=value)


def paged_rows(pool, table_row, n):
    """The first ``n`` keys of the pages a page-table row names."""
    page = pool.shape[1]
    pages = table_row[:-(-n // page)].long() if n else table_row[:0].long()
    return pool[pages].reshape(-1, *pool.shape[2:])[:n]


def paged_varlen_stand_in(log):
    """The paged varlen kernels as the float64 reference: segment ``s``'s keys
    are the first ``seqused_k[s]`` keys of the pages of ``table[s]``, each
    page used a valid one (the kernels' contract) and every length within
    the bounds handed over."""
    def run(q, k_pool, v_pool, cu_q, seqused_q, seqused_k, table, max_q, max_k, scale, causal):
        log.append(dict(batch=cu_q.numel() - 1, max_q=max_q, max_k=max_k, width=table.shape[1]))
        assert table.dtype == torch.int32 and table.shape[0] == cu_q.numel() - 1
        lens = seqused_k.tolist()
        assert all(0 <= n <= min(max_k, table.shape[1] * k_pool.shape[1]) for n in lens)
        slots_q = (cu_q[1:] - cu_q[:-1]).tolist()
        used_q = slots_q if seqused_q is None else seqused_q.tolist()
        assert all(u <= min(n, max_q) for u, n in zip(used_q, slots_q))
        for s, n in enumerate(lens):
            live = table[s, :-(-n // k_pool.shape[1])] if n else table[s, :0]
            assert ((live >= 0) & (live < k_pool.shape[0])).all(), (s, n, table[s])
        k = torch.cat([paged_rows(k_pool, table[s], n) for s, n in enumerate(lens)])
        v = torch.cat([paged_rows(v_pool, table[s], n) for s, n in enumerate(lens)])
        cu_k = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        return varlen_apply(lambda a, b, c: attention_reference(a, b, c, causal=causal, softmax_scale=scale),
                            q, k, v, cu_q, cu_k, seqused_q=seqused_q, out_dtype=F64, with_lse=True)
    return run


def paged_case(lens, page, pool_pages, width, seed):
    """A page pool with NaN in every page and row no sequence's live keys
    use, and a shuffled page table whose entries past the live pages are
    garbage (-1 and out-of-range indices)."""
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(pool_pages, page, 2, 16, generator=g, dtype=F64)
    v_pool = torch.randn(pool_pages, page, 2, 16, generator=g, dtype=F64)
    perm = torch.randperm(pool_pages, generator=g)
    table = torch.full((len(lens), width), -1, dtype=torch.int32)
    live = torch.zeros(pool_pages, page, dtype=torch.bool)
    used = 0
    for b, n in enumerate(lens):
        pages = -(-n // page)
        table[b, :pages] = perm[used:used + pages].to(torch.int32)
        for j in range(pages):
            live[perm[used + j], :min(page, n - j * page)] = True
        used += pages
        table[b, pages:] = torch.tensor([pool_pages + 5, -1], dtype=torch.int32).repeat(width)[:width - pages]
    k_pool[~live], v_pool[~live] = math.nan, math.nan
    return k_pool, v_pool, table


# (page size, chunk): every chunk at a page (read in place), a chunk of one
# page, and a chunk starting inside a page (the pages copied first).
PAGED = [(16, 32), (16, 16), (16, 24)]


@pytest.mark.parametrize("page,chunk", PAGED, ids=[f"p{p}c{c}" for p, c in PAGED])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_varlen_chunks_equal_the_chunk_mask(monkeypatch, page, chunk, causal):
    """``flash_attn_varlen_func(block_table=..., attention_chunk=C)`` (vLLM's
    layout): each sequence judged alone against the chunk mask over its
    pages' keys, with NaN in every unused page row and garbage table
    entries past the live pages; with ``seqused_q`` gaps too."""
    from hopper_flash import dispatch, paged
    log = []
    monkeypatch.setattr(plan, "SUPPORTED_DTYPES", (*plan.SUPPORTED_DTYPES, F64))
    monkeypatch.setattr(paged.checks, "check_device", lambda t, name="q": None)
    monkeypatch.setattr(paged.checks, "check_tma_addressable", lambda name, t: None)
    run = paged_varlen_stand_in(log)

    def validated(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k, scale, causal, return_lse, *rest,
                  page_table=None, **_):
        if page_table is None:  # (the copied route: contiguous rows from cu_k with seqused_k)
            assert cu_k is not None
            table = torch.stack([torch.arange(int(s), int(s) + max_k) for s in cu_k[:-1].tolist()]).to(torch.int32)
            pool = lambda t: torch.cat([t, t.new_zeros(max_k, *t.shape[1:])])[:, None]  # noqa: E731
            return run(q, pool(k), pool(v), cu_q, seqused_q, seqused_k, table, max_q, max_k, scale, causal)
        return run(q, k, v, cu_q, seqused_q, seqused_k, page_table, max_q, max_k, scale, causal)
    monkeypatch.setattr(dispatch, "forward_varlen_validated", validated)
    lk, lq, used_q = [70, 33, 0, 64, 5], [3, 31, 2, 64, 1], [3, 20, 0, 64, 1]
    k_pool, v_pool, table = paged_case(lk, page, 24, 6, seed=page + chunk)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lq), 4, 16, generator=g, dtype=F64)
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    for uq in (None, as_int(used_q)):
        log.clear()
        out, lse = hopper_flash.flash_attn_varlen_func(
            q, k_pool, v_pool, cu_q, None, max(lq), max(lk), seqused_q=uq, seqused_k=as_int(lk), block_table=table,
            softmax_scale=0.25, causal=causal, return_lse=True, attention_chunk=chunk)
        in_place = chunk % page == 0
        assert log and all(c["max_k"] <= (chunk if in_place else max(lk)) for c in log)
        for b, n in enumerate(lk):
            live = lq[b] if uq is None else used_q[b]
            qs = slice(int(cu_q[b]), int(cu_q[b]) + live)
            ref, ref_lse = attention_reference(q[qs][None], paged_rows(k_pool, table[b], n)[None],
                                               paged_rows(v_pool, table[b], n)[None], causal=causal,
                                               softmax_scale=0.25, chunk=chunk)
            torch.testing.assert_close(out[qs], ref[0], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lse[:, qs], ref_lse[0], rtol=1e-12, atol=1e-12)
            gap = slice(int(cu_q[b]) + live, int(cu_q[b + 1]))
            assert (out[gap] == 0).all()


@pytest.mark.parametrize("page,chunk", PAGED, ids=[f"p{p}c{c}" for p, c in PAGED])
@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
def test_paged_kv_cache_chunks_equal_the_chunk_mask(monkeypatch, page, chunk, packed):
    """``flash_attn_with_kvcache(page_table=..., attention_chunk=C)`` after
    the append route: each row judged alone against the chunk mask over its
    pages' live keys (NaN in every other page row)."""
    from hopper_flash import dispatch, kvcache
    log = []
    run = paged_varlen_stand_in(log)

    def validated(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k, scale, causal, return_lse, *rest,
                  page_table=None, **_):
        if page_table is None:  # (pages copied into rows: cu_k gives each row's start)
            table = torch.stack([torch.arange(int(s), int(s) + max_k) for s in cu_k[:-1].tolist()]).to(torch.int32)
            pool = lambda t: torch.cat([t, t.new_zeros(max_k, *t.shape[1:])])[:, None]  # noqa: E731
            return run(q, pool(k), pool(v), cu_q, seqused_q, seqused_k, table, max_q, max_k, scale, causal)
        return run(q, k, v, cu_q, seqused_q, seqused_k, page_table, max_q, max_k, scale, causal)
    monkeypatch.setattr(dispatch, "forward_varlen_validated", validated)
    seqlens = [70, 17, 40]
    k_pool, v_pool, table = paged_case(seqlens, page, 16, 5, seed=7 * page + chunk)
    lq = [3, 1, 31] if packed else [3, 3, 3]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lq), 4, 16, generator=g, dtype=F64)
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out, lse = kvcache.kvcache_forward_validated(
        q if packed else q.view(3, 3, 4, 16), k_pool, v_pool, None, None, as_int(seqlens), None, table, 0.25, True, 0,
        None, True, check=False, cu_seqlens_q=cu_q if packed else None, max_seqlen_q=max(lq) if packed else None,
        chunk=chunk)
    assert log and all(c["max_k"] <= chunk for c in log) == (chunk % page == 0)
    if not packed:
        out, lse = out.reshape(9, 4, 16), lse.permute(1, 0, 2).reshape(4, 9)
    for b, n in enumerate(seqlens):
        qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref, ref_lse = attention_reference(q[qs][None], paged_rows(k_pool, table[b], n)[None],
                                           paged_rows(v_pool, table[b], n)[None], causal=True, softmax_scale=0.25,
                                           chunk=chunk)
        torch.testing.assert_close(out[qs], ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, qs], ref_lse[0], rtol=1e-12, atol=1e-12)


def test_paged_segments_tables():
    """The segments' page rows themselves: a sequence of 70 keys on pages of
    16 with 3 queries in chunks of 32 (its queries at key positions 67-69:
    the keys before chunk 2 are a segment no query reads; chunk 2's row
    starts at the sequence's third page), and one of 0 keys."""
    table = torch.tensor([[9, 4, 7, 1, 3, -1], [5, -1, -1, -1, -1, -1]], dtype=torch.int32)
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32)
    seg, rows = chunked.paged_segments(cu_q, None, 3, torch.tensor([70, 0], dtype=torch.int32), 70, 32, table, 16)
    slots = rows.shape[0] // 2
    assert rows.shape == (2 * slots, 2) and seg.cu_seqlens_k is None and seg.max_seqlen_k == 32
    q_lens = (seg.cu_seqlens_q[1:] - seg.cu_seqlens_q[:-1]).view(2, slots)
    k_lens = seg.seqused_k.view(2, slots)
    live = [(int(q), int(k), rows[s].tolist()) for s, (q, k) in enumerate(zip(q_lens.flatten(), k_lens.flatten()))
            if q]
    assert live == [(3, 6, [3, 3]), (1, 0, rows[slots + int((q_lens[1] > 0).nonzero()[0])].tolist())]
    assert rows[slots:].unique().tolist() == [5]  # a row with no live key: every entry its first page


def test_segments_trace_without_graph_breaks(monkeypatch):
    """The segments are torch ops on the device values (nothing read back to
    the host), so torch.compile traces the chunked calls in one graph
    (``torch._dynamo.explain``: this torch's ``fullgraph=True`` lets a
    ``tolist`` through on the CPU); the kernels are a stand-in that uses the
    prefix sums."""
    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, seqused_q=None, return_lse=False, block_table=None, **_):
        keys = cu_k if block_table is None else block_table
        out = q + (cu_q.sum() + keys.sum()).to(q.dtype) * 0
        return (out, torch.zeros(q.shape[1], q.shape[0])) if return_lse else out
    monkeypatch.setattr(interface, "flash_attn_varlen_func", varlen)
    q = torch.randn(2, 40, 4, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 30, 80], dtype=torch.int32)
    used = torch.tensor([25, 50], dtype=torch.int32)
    calls = [(lambda a: hopper_flash.flash_attn_func(a, a, a, causal=True, attention_chunk=16), (q,)),
             (lambda a, c, u: hopper_flash.flash_attn_varlen_func(a, a, a, c, c, 50, 50, seqused_q=u, seqused_k=u,
                                                                  causal=True, attention_chunk=16),
              (q.reshape(80, 4, 64), cu, used)),
             (lambda a, c: hopper_flash.flash_attn_varlen_func(a, a, a, c, c, 50, 50, attention_chunk=16),
              (q.reshape(80, 4, 64), cu)),
             (lambda a, c, pool, u, t: hopper_flash.flash_attn_varlen_func(
                 a, pool, pool, c, None, 50, 64, seqused_k=u, block_table=t, causal=True, attention_chunk=32),
              (q.reshape(80, 4, 64), cu, q[:, :32].reshape(4, 16, 4, 64), used, torch.tensor(
                  [[3, 0, 2, 1], [2, 1, 0, 3]], dtype=torch.int32)))]
    for fn, args in calls:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*args)
        assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("packed", [False, True], ids=["bshd", "packed"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_kv_cache_chunks_equal_the_chunk_mask_per_row(monkeypatch, packed, causal):
    """flash_attn_with_kvcache's route (after the append): the cache rows
    as the varlen mode's keys, in cache_batch_idx's order and from each
    row's left pad, with NaN outside every live key; each row judged alone
    against the chunk mask counted from its pad."""
    from hopper_flash import dispatch, kvcache

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k, scale, causal, return_lse, **_):
        assert seqused_q is None and seqused_k is not None  # the kernels read cu_k[s] and seqused_k[s] alone
        spans = [(int(s), int(n)) for s, n in zip(cu_k[:-1].tolist(), seqused_k.tolist())]
        assert all(n <= max_k and s + n <= k.shape[0] for s, n in spans)
        assert all(n <= max_q for n in (cu_q[1:] - cu_q[:-1]).tolist())
        return varlen_apply(lambda a, b, c: attention_reference(a, b, c, causal=causal, softmax_scale=scale),
                            q, k, v, cu_q, cu_k, seqused_k=seqused_k, out_dtype=F64, with_lse=True)
    monkeypatch.setattr(dispatch, "forward_varlen_validated", varlen)
    g = torch.Generator().manual_seed(21)
    cap, chunk = 70, 16
    k_cache = torch.randn(4, cap, 2, 16, generator=g, dtype=F64)
    v_cache = torch.randn(4, cap, 2, 16, generator=g, dtype=F64)
    rows, seqlens, pads = [2, 0, 3], [70, 17, 40], [0, 3, 9]
    lq = [3, 1, 31] if packed else [3, 3, 3]
    for r, n, p in zip(rows, seqlens, pads):  # no kernel may read past a row's keys or before its pad
        k_cache[r, n:], v_cache[r, n:], k_cache[r, :p], v_cache[r, :p] = math.nan, math.nan, math.nan, math.nan
    q = torch.randn(sum(lq), 4, 16, generator=g, dtype=F64)
    cu_q = torch.tensor([0] + lq).cumsum(0).to(torch.int32)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    out, lse = kvcache.kvcache_forward_validated(
        q if packed else q.view(3, 3, 4, 16), k_cache, v_cache, None, None, as_int(seqlens), as_int(rows), None, 0.25,
        causal, 0, None, True, check=False, cache_leftpad=as_int(pads), cu_seqlens_q=cu_q if packed else None,
        max_seqlen_q=max(lq) if packed else None, chunk=chunk)
    if not packed:
        assert out.shape == (3, 3, 4, 16) and lse.shape == (3, 4, 3)
        out, lse = out.reshape(9, 4, 16), lse.permute(1, 0, 2).reshape(4, 9)
    for b, (r, n, p) in enumerate(zip(rows, seqlens, pads)):
        qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref, ref_lse = attention_reference(q[qs][None], k_cache[r, p:n][None], v_cache[r, p:n][None], causal=causal,
                                           softmax_scale=0.25, chunk=chunk)
        torch.testing.assert_close(out[qs], ref[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, qs], ref_lse[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["rows", "pages", "pages-unaligned"])
def test_kv_cache_decode_step_runs_the_decode_route_over_the_last_chunk(monkeypatch, layout):
    """One query per row (a decode step): no segments, but the decode launch
    over the row's last chunk, whose start is a left pad added to the row's
    own (``cache_batch_idx`` rows) or, over pages, a page-table row shifted
    by it (a chunk a multiple of the page size; otherwise the segments run
    over the copied pages). Each row judged alone against the chunk mask
    counted from its pad, NaN outside every live key."""
    import contextlib

    from test_kvcache_packed_cpu import _decode_stand_in

    from hopper_flash import dispatch, kvcache
    seen = {}

    def launch(*args, **kw):
        seen.update(kw, route="decode")
        _decode_stand_in(*args, **kw)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q, seqused_k, scale, causal, return_lse, *rest,
               page_table=None, **_):
        seen.update(route="varlen")
        return paged_varlen_stand_in([])(q, *(t[:, None] for t in (k, v)), cu_q, seqused_q, seqused_k, torch.stack(
            [torch.arange(int(s), int(s) + max_k).clamp(max=k.shape[0] - 1) for s in cu_k[:-1].tolist()]).to(
                torch.int32), max_q, max_k, scale, causal)
    monkeypatch.setattr(plan, "launch_forward", launch)
    monkeypatch.setattr(dispatch, "forward_varlen_validated", varlen)
    monkeypatch.setattr(plan, "on_device", lambda t: contextlib.nullcontext())
    g = torch.Generator().manual_seed(5)
    cap, hkv, d = 80, 2, 16
    seqlens = [70, 17, 40, 0]
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q = torch.randn(4, 1, 4, d, generator=g, dtype=F64)
    if layout == "rows":
        chunk, rows, pads = 16, [2, 0, 3, 1], [0, 3, 9, 0]
        k_cache = torch.randn(4, cap, hkv, d, generator=g, dtype=F64)
        v_cache = torch.randn(4, cap, hkv, d, generator=g, dtype=F64)
        for r, n, p in zip(rows, seqlens, pads):
            k_cache[r, n:], v_cache[r, n:], k_cache[r, :p], v_cache[r, :p] = (math.nan,) * 4
        out, lse = kvcache.kvcache_forward_validated(q, k_cache, v_cache, None, None, as_int(seqlens), as_int(rows),
                                                     None, 0.25, True, 0, None, True, check=False,
                                                     cache_leftpad=as_int(pads), chunk=chunk)
        keys = [(k_cache[r, p:n], v_cache[r, p:n]) for r, n, p in zip(rows, seqlens, pads)]
        assert seen["route"] == "decode"
        assert seen["leftpad"].tolist() == [p + (n - p - 1) // chunk * chunk if n > p else p
                                            for n, p in zip(seqlens, pads)]
    else:
        chunk = 32 if layout == "pages" else 24
        k_pool, v_pool, table = paged_case(seqlens, 16, 24, 6, seed=9)
        out, lse = kvcache.kvcache_forward_validated(q, k_pool, v_pool, None, None, as_int(seqlens), None, table, 0.25,
                                                     True, 0, None, True, check=False, chunk=chunk)
        keys = [(paged_rows(k_pool, table[b], n), paged_rows(v_pool, table[b], n)) for b, n in enumerate(seqlens)]
        assert seen["route"] == ("decode" if layout == "pages" else "varlen")
        if layout == "pages":
            assert seen["page_table"].shape == (4, 2)
            assert seen["seqused_k"].tolist() == [n - max(n - 1, 0) // chunk * chunk for n in seqlens]
    for b, (kk, vv) in enumerate(keys):
        ref, ref_lse = attention_reference(q[b:b + 1], kk[None], vv[None], causal=True, softmax_scale=0.25,
                                           chunk=chunk)
        torch.testing.assert_close(out[b:b + 1], ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse.to(lse.dtype).double(), rtol=1e-12, atol=1e-12)


def test_last_chunk_rows_hand_counted():
    """A decode step's last chunk (``chunked.last_chunk_leftpad`` /
    ``last_chunk_pages``, the torch path; the kernel's GPU test checks it
    against the same counts): chunks of 256 keys from each row's pad."""
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    used = as_int([0, 1, 255, 256, 257, 1000, 4096, 70])
    assert chunked.last_chunk_leftpad(used, 256, None).tolist() == [0, 0, 0, 0, 256, 768, 3840, 0]
    pads = as_int([0, 1, 10, 0, 1, 999, 0, 6])  # keys after the pad: 0, 0, 245, 256, 256, 1, 4096, 64
    assert chunked.last_chunk_leftpad(used, 256, pads).tolist() == [0, 1, 10, 0, 1, 999, 3840, 6]
    table = torch.arange(8 * 70, dtype=torch.int32).view(8, 70)
    rest, rows = chunked.last_chunk_pages(used, 256, table, 64, 4)
    assert rest.tolist() == [0, 1, 255, 256, 1, 232, 256, 70]
    assert rows[5].tolist() == [5 * 70 + p for p in (12, 13, 14, 15)]  # key 768: page 12
    assert rows[6].tolist() == [6 * 70 + p for p in (60, 61, 62, 63)]
    rest, rows = chunked.last_chunk_pages(as_int([4500]), 256, table[:1], 64, 4)  # past the row's 70 pages: its last
    assert rest.tolist() == [148] and rows[0].tolist() == [68, 69, 69, 69]  # key 4352: page 68
