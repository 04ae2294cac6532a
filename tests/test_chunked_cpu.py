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


def test_attention_chunk_refused_with_pages():
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="attention_chunk with block_table"):
        hopper_flash.flash_attn_varlen_func(q[0], q, q, cu, None, 8, 8, attention_chunk=4, block_table=table,
                                            seqused_k=torch.tensor([8], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="attention_chunk with a paged cache"):
        hopper_flash.flash_attn_with_kvcache(q, q, q, attention_chunk=4, page_table=table)


def test_segments_trace_without_graph_breaks(monkeypatch):
    """The segments are torch ops on the device values (nothing read back to
    the host), so torch.compile traces the chunked calls in one graph
    (``torch._dynamo.explain``: this torch's ``fullgraph=True`` lets a
    ``tolist`` through on the CPU); the kernels are a stand-in that uses the
    prefix sums."""
    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, seqused_q=None, return_lse=False, **_):
        out = q + (cu_q.sum() + cu_k.sum()).to(q.dtype) * 0
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
              (q.reshape(80, 4, 64), cu))]
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
