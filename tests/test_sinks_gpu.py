"""Attention sinks (flash-attn's ``learnable_sink``, gpt-oss's ``sinks``) on
a Hopper GPU: one logit per query head that joins every row's softmax as a
key with no value. Outputs, LSEs and gradients (the sink's included) against
the float64 reference with the sink as an explicit softmax column
(``reference.attention_reference(sink=...)``), judged relative to the error
of the bf16/fp16 PyTorch path transformers' eager gpt-oss layer runs
(``reference.sink_eager``). Output buffers start as NaN where a test hands
them in; varlen gaps and cache tails hold NaN.

Covers every head dim, causal and not, unequal lengths (rows that see no
key), GQA, fp16, soft-capping and a window together with a sink, varlen with
seqused, the KV-cache path (split-KV, PackGQA), the backward through
autograd, deterministic mode and torch.compile, and CUDA-graph replay.
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash.reference import (
    assert_judged,
    attention_reference,
    grads_abs_tol,
    judge_grads,
    score_scale,
    sink_eager,
    sink_eager_grads,
)
from gpu_inputs import cu, rnd

pytestmark = pytest.mark.gpu
DEV = "cuda"


def sinks(h, seed, dtype=torch.float32):
    # Logits of the scores' size (a few units): each sink takes a real share
    # of some rows and almost none of others.
    return (rnd(h, dtype=torch.float32, seed=seed) * 2.0 + 1.0).to(dtype)


def check_forward(batch, seqlen_q, seqlen_k, h, hkv, d, causal, *, dtype=torch.bfloat16, seed=0, window=None,
                  softcap=0.0, sink_dtype=torch.float32):
    q = rnd(batch, seqlen_q, h, d, dtype=dtype, seed=seed)
    k = rnd(batch, seqlen_k, hkv, d, dtype=dtype, seed=seed + 1)
    v = rnd(batch, seqlen_k, hkv, d, dtype=dtype, seed=seed + 2)
    s = sinks(h, seed + 3, sink_dtype)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True, learnable_sink=s,
                                            window_size=window or (-1, -1), softcap=softcap)
    win = hopper_flash.checks.window_bounds(window or (-1, -1), causal)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window=win, softcap=softcap, sink=s)
    assert_judged("out", out, ref, sink_eager(q, k, v, s, causal=causal, window=win, softcap=softcap))
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert_judged("lse", lse, ref_lse, score_scale=score_scale(q, k))
    assert not out.isnan().any()
    return q, k, v, s, out, lse


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sink_forward(d, causal):
    check_forward(2, 1000, 1000, 4, 2, d, causal, seed=d)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 3001), (129, 1000), (1000, 129), (127, 127), (4096, 4096)])
def test_sink_forward_lengths(seqlen_q, seqlen_k):
    # (1000, 129) causal: the first 871 rows see no key: zeros, and an LSE equal to the sink.
    q, k, v, s, out, lse = check_forward(1, seqlen_q, seqlen_k, 8, 2, 128, True, seed=seqlen_q)
    if seqlen_q > seqlen_k:
        blind = seqlen_q - seqlen_k
        assert bool((out[:, :blind] == 0).all())
        assert torch.equal(lse[:, :, :blind], s.float()[None, :, None].expand(1, -1, blind))


def test_sink_forward_fp16_sink_dtypes_window_and_softcap():
    check_forward(2, 700, 900, 8, 8, 128, False, dtype=torch.float16, seed=11)
    check_forward(2, 300, 300, 4, 1, 64, True, seed=12, sink_dtype=torch.bfloat16)
    check_forward(1, 1000, 1000, 4, 2, 128, True, seed=13, window=(127, 0))
    check_forward(1, 500, 500, 4, 2, 128, False, seed=14, softcap=5.0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sinks_on_one_item_launches(planned_launches, causal):
    # Chunked prefill's shape (a short query on a long cache, 128 items on
    # as many CTAs): the one-item kernels (forward.V_AT_ISSUE), with sinks,
    # then with sinks and soft-capping together.
    check_forward(4, 127, 3001, 32, 8, 128, causal, seed=31, sink_dtype=torch.bfloat16)
    check_forward(4, 127, 3001, 32, 8, 128, causal, seed=32, softcap=20.0)
    assert planned_launches and all(lp.mode.one_item and lp.mode.sink for lp in planned_launches)


def test_sink_changes_the_result():
    # Guards the tests above against a sink that silently does nothing.
    q, k, v, s, out, _ = check_forward(1, 256, 256, 4, 4, 128, False, seed=15)
    plain = hopper_flash.flash_attn_func(q, k, v)
    assert (out.float() - plain.float()).abs().max() > 0.01


# ---- backward ------------------------------------------------------------------

def _reference_grads(q, k, v, s, dout, causal, window=None):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    out, _ = attention_reference(*leaves[:3], causal=causal, window=window, sink=leaves[3])
    return torch.autograd.grad(out, leaves, dout.double())


def _baseline_grads(q, k, v, s, dout, causal, window=None):
    # Flash-style (Δ from the rounded output): autograd through sink_eager
    # escapes the cancellation every flash backward has, which a sink makes
    # visible even in one-key rows (reference.sink_eager_grads).
    return sink_eager_grads(*(t.detach() for t in (q, k, v, s)), dout, causal=causal, window=window)


def check_backward(batch, seqlen_q, seqlen_k, h, hkv, d, causal, *, seed=0, deterministic=False, window=None):
    q, k, v = (rnd(batch, n, heads, d, seed=seed + i).requires_grad_()
               for i, (n, heads) in enumerate(((seqlen_q, h), (seqlen_k, hkv), (seqlen_k, hkv))))
    s = sinks(h, seed + 3).requires_grad_()
    dout = rnd(batch, seqlen_q, h, d, seed=seed + 4)
    out = hopper_flash.flash_attn_func(q, k, v, causal=causal, learnable_sink=s, deterministic=deterministic,
                                       window_size=window or (-1, -1))
    grads = torch.autograd.grad(out, (q, k, v, s), dout)
    win = hopper_flash.checks.window_bounds(window or (-1, -1), causal)
    ref = _reference_grads(q, k, v, s, dout, causal, win)
    base = _baseline_grads(q, k, v, s, dout, causal, win)
    bad = [x.message for x in judge_grads(grads[:3], ref[:3], base[:3], shapes=(q.shape, k.shape, v.shape),
                                          abs_tol=grads_abs_tol(ref[:3], q.dtype)) if not x]
    assert not bad, "\n".join(bad)
    assert grads[3].dtype == s.dtype and grads[3].shape == s.shape
    assert_judged("dsink", grads[3], ref[3], base[3].float())
    return grads


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sink_backward(d, causal):
    check_backward(2, 600, 600, 4, 2, d, causal, seed=d)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(129, 1000), (1000, 129), (1, 700)])
def test_sink_backward_lengths(seqlen_q, seqlen_k):
    check_backward(1, seqlen_q, seqlen_k, 8, 2, 128, True, seed=seqlen_q)


def test_sink_backward_deterministic_and_windowed():
    first = check_backward(1, 700, 700, 4, 2, 128, True, seed=21, deterministic=True)
    second = check_backward(1, 700, 700, 4, 2, 128, True, seed=21, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    check_backward(1, 800, 800, 4, 2, 64, True, seed=22, window=(255, 0))


def test_sink_training_step_compiled():
    """torch.compile(fullgraph=True) of a step with a learnable sink: the
    same gradients as the eager step."""
    h, d = 8, 128
    q, k, v = (rnd(2, 300, h if i == 0 else 2, d, seed=30 + i) for i in range(3))
    s = sinks(h, 33)

    def step(q, k, v, s):
        out = hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=s)
        return (out.float() ** 2).sum()

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
        return torch.autograd.grad(fn(*leaves), leaves)

    eager = grads(step)
    compiled = grads(torch.compile(step, fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2 * float(a.float().abs().max()))


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sink_gradient_on_every_backward_path(sink_dtype):
    """The sinks' gradient comes from the backward's preprocess when q, k or
    v need one too (the eager Function, the op's formula under plain autograd
    and under torch.compile), and from its own pass when only the sinks are
    trained: each path's ds, in the sinks' dtype, judged against the float64
    reference (rows of the causal 1000 x 129 case that see no key included)."""
    h, d = 8, 128
    q, k, v = (rnd(2, n, heads, d, seed=60 + i) for i, (n, heads) in enumerate(((1000, h), (129, 2), (129, 2))))
    s = sinks(h, 63, sink_dtype)
    dout = rnd(2, 1000, h, d, seed=64)
    ref = _reference_grads(q, k, v, s, dout, True)
    base = _baseline_grads(q, k, v, s, dout, True)
    scale = d ** -0.5

    def ds_of(fn, train_qkv=True):
        leaves = [t.detach().clone().requires_grad_(train_qkv) for t in (q, k, v)]
        sink = s.detach().clone().requires_grad_()
        out = fn(*leaves, sink)
        return torch.autograd.grad(out, [sink], dout)[0]

    paths = {
        "eager": lambda q, k, v, s: hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=s),
        "op": lambda q, k, v, s: torch.ops.hopper_flash.fwd(q, k, v, scale, True, False, -1, -1, 0.0, s)[0],
        "compiled": torch.compile(lambda q, k, v, s: hopper_flash.flash_attn_func(q, k, v, causal=True,
                                                                                   learnable_sink=s),
                                  fullgraph=True),
    }
    for name, fn in paths.items():
        for train_qkv in (True, False):
            ds = ds_of(fn, train_qkv)
            assert ds.dtype == sink_dtype and ds.shape == s.shape, name
            assert_judged(f"dsink ({name}, q/k/v trained: {train_qkv})", ds, ref[3], base[3].float())


# ---- varlen ------------------------------------------------------------------

def test_varlen_sink_forward_backward_with_seqused_and_nan_gaps():
    lq, lk = [1, 0, 127, 300, 700], [1, 5, 127, 500, 700]
    used_q, used_k = [1, 0, 100, 250, 700], [1, 5, 127, 400, 700]
    h, hkv, d = 8, 2, 128
    q = rnd(sum(lq), h, d, seed=41)
    k, v = rnd(sum(lk), hkv, d, seed=42), rnd(sum(lk), hkv, d, seed=43)
    s = sinks(h, 44).requires_grad_()
    cq, ck = cu(lq), cu(lk)
    uq = torch.tensor(used_q, dtype=torch.int32, device=DEV)
    uk = torch.tensor(used_k, dtype=torch.int32, device=DEV)
    for t, c, u in ((q, cq, used_q), (k, ck, used_k), (v, ck, used_k)):
        cl = c.tolist()
        for b, n in enumerate(u):
            t[cl[b] + n:cl[b + 1]] = math.nan
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), seqused_q=uq, seqused_k=uk,
                                                   causal=True, learnable_sink=s, return_lse=True)
    dout = rnd(*out.shape, seed=45)
    dq, dk, dv, ds = torch.autograd.grad(out, (q, k, v, s), dout)
    assert not out.isnan().any() and not ds.isnan().any()
    ds_ref = torch.zeros(h, dtype=torch.float64, device=DEV)
    ds_base = torch.zeros(h, dtype=torch.float32, device=DEV)
    cql, ckl = cq.tolist(), ck.tolist()
    for b in range(len(lq)):
        a, n, kb, m = cql[b], used_q[b], ckl[b], used_k[b]
        sl = slice(a, a + n)
        qs, ks, vs = q[sl][None], k[kb:kb + m][None], v[kb:kb + m][None]
        if n:
            ref, ref_lse = attention_reference(qs, ks, vs, causal=True, sink=s)
            assert_judged(f"out[{b}]", out[sl][None], ref, sink_eager(qs, ks, vs, s, causal=True))
            assert_judged(f"lse[{b}]", lse[:, sl][None], ref_lse, score_scale=score_scale(qs, ks))
            r = _reference_grads(qs, ks, vs, s, dout[sl][None], True)
            base = _baseline_grads(qs, ks, vs, s, dout[sl][None], True)
            bad = [x.message for x in judge_grads((dq[sl][None], dk[kb:kb + m][None], dv[kb:kb + m][None]), r[:3],
                                                  base[:3], shapes=(qs.shape, ks.shape, vs.shape),
                                                  abs_tol=grads_abs_tol(r[:3], q.dtype)) if not x]
            assert not bad, f"sequence {b}: " + "\n".join(bad)
            ds_ref += r[3]
            ds_base += base[3].float()
        # Rows past seqused: zero output, the sink as LSE, no gradient.
        assert bool((out[a + n:cql[b + 1]] == 0).all()) and bool((dq[a + n:cql[b + 1]] == 0).all())
        gap = cql[b + 1] - a - n
        assert torch.equal(lse[:, a + n:cql[b + 1]], s.detach().float().view(-1, 1).expand(-1, gap))
    assert_judged("dsink", ds, ds_ref, ds_base)


# ---- KV cache -----------------------------------------------------------------

@pytest.mark.parametrize("seqlen_q", [1, 4, 128])
@pytest.mark.parametrize("num_splits, pack_gqa", [(0, None), (1, False), (5, True)])
def test_kvcache_sink(seqlen_q, num_splits, pack_gqa):
    B, H, Hkv, D, cap = 3, 8, 2, 128, 4096
    lens = [1, 1000, 3001][:B]
    q = rnd(B, seqlen_q, H, D, seed=51)
    k_cache, v_cache = rnd(B, cap, Hkv, D, seed=52), rnd(B, cap, Hkv, D, seed=53)
    for b, n in enumerate(lens):
        k_cache[b, n:] = math.nan
        v_cache[b, n:] = math.nan
    s = sinks(H, 54)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                    num_splits=num_splits, pack_gqa=pack_gqa,
                                                    return_softmax_lse=True, learnable_sink=s)
    for b, n in enumerate(lens):
        qb, kb, vb = q[b:b + 1], k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
        ref, ref_lse = attention_reference(qb, kb, vb, causal=True, sink=s)
        assert_judged(f"out[{b}]", out[b:b + 1], ref, sink_eager(qb, kb, vb, s, causal=True))
        assert_judged(f"lse[{b}]", lse[b:b + 1], ref_lse, score_scale=score_scale(qb, kb))


def test_kvcache_sink_decode_in_a_cuda_graph():
    B, H, Hkv, D, cap = 4, 16, 2, 128, 2048
    q = rnd(B, 1, H, D, seed=61)
    k_cache, v_cache = rnd(B, cap, Hkv, D, seed=62), rnd(B, cap, Hkv, D, seed=63)
    s = sinks(H, 64)
    seqlens = torch.tensor([5, 100, 1000, 2048], dtype=torch.int32, device=DEV)

    def step():
        return hopper_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                    learnable_sink=s)

    eager = step()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on a side stream, as capture requires
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = step()
    seqlens.copy_(torch.tensor([2048, 7, 300, 1], dtype=torch.int32))
    graph.replay()
    expected = step()
    assert torch.equal(captured, expected)
    assert not torch.equal(captured, eager)


# ---- the sink's gradient pass (kernels/sink.py) against torch's ops ----------

@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("d", [64, 256])
def test_fused_sink_grad_equals_torch_ops(varlen, d):
    """sinks.sink_grad runs kernels/sink.py on CUDA tensors and torch's ops
    elsewhere (CPU here; torch.compile on the GPU): the two agree, NaN-carrying
    rows that saw no key (LSE equal to the sink) included."""
    from hopper_flash import sinks as sink_mod

    h = 8
    shape = (700, h, d) if varlen else (3, 333, h, d)
    out, dout = rnd(*shape, seed=71), rnd(*shape, seed=72)
    s = sinks(h, 74)
    above = (rnd(h, 700, seed=73) if varlen else rnd(3, h, 333, seed=73)).float().abs() * 4
    lse = (s.view(-1, 1) if varlen else s.view(1, -1, 1)) + above  # LSE' >= the sink: logaddexp(L, s)
    lse[..., :5] = (s.view(-1, 1) if varlen else s.view(1, -1, 1))  # rows with no key: LSE' = s, dO anything
    if varlen:
        dout[:5] = math.nan
        out[:5] = 0
    else:
        dout[:, :5] = math.nan
        out[:, :5] = 0
    got = sink_mod.sink_grad(dout, out, lse, s)
    want = sink_mod.sink_grad(dout.cpu(), out.cpu(), lse.cpu(), s.cpu())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    # An expanded output gradient (stride 0) is read as its values.
    ones = torch.ones(1, device=DEV, dtype=out.dtype).expand(out.shape)
    torch.testing.assert_close(sink_mod.sink_grad(ones, out, lse, s).cpu(),
                               sink_mod.sink_grad(ones.cpu(), out.cpu(), lse.cpu(), s.cpu()),
                               rtol=1e-4, atol=1e-4)


# ---- paths that launch nothing, and the prepared calls ----------------------

def test_no_keys_give_zeros_and_the_sink_as_lse():
    h = 4
    s = sinks(h, 81)
    q = rnd(2, 5, h, 64, seed=82)
    k = rnd(2, 0, 2, 64, seed=83)
    out, lse = hopper_flash.flash_attn_func(q, k, k, return_lse=True, learnable_sink=s)
    assert bool((out == 0).all()) and torch.equal(lse, s.float().view(1, -1, 1).expand(2, -1, 5))
    cq = cu([3, 2])
    out, lse = hopper_flash.flash_attn_varlen_func(q[0], k[0], k[0], cq, cu([0, 0]), 3, 1, return_lse=True,
                                                   learnable_sink=s)
    assert bool((out == 0).all()) and torch.equal(lse, s.float().view(-1, 1).expand(-1, 5))


def test_a_prepared_call_does_not_serve_a_call_with_a_sink():
    """A plain call prepares its signature's launch (plan.PreparedForward);
    the same shapes with a sink must not take it."""
    q, k, v = rnd(2, 1, 8, 128, seed=91), rnd(2, 3000, 2, 128, seed=92), rnd(2, 3000, 2, 128, seed=93)
    s = sinks(8, 94) + 8.0  # near the rows' LSE (~8.5 over 3000 keys): the sink takes a large share
    for _ in range(2):
        plain = hopper_flash.flash_attn_func(q, k, v, causal=True)
    out = hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=s)
    ref, _ = attention_reference(q, k, v, causal=True, sink=s)
    assert_judged("out", out, ref, sink_eager(q, k, v, s, causal=True))
    assert (out.float() - plain.float()).abs().max() > 0.05


def test_decode_with_a_sink_takes_the_prepared_call_reading_the_sinks_in_place(monkeypatch):
    """A model's bf16 sinks: the second call of a signature takes the
    prepared launch (no plan.launch_forward), which reads the sinks where
    they are, so an in-place update is seen; other sinks (another address)
    take the full path."""
    from hopper_flash import plan

    q, k, v = rnd(2, 1, 8, 128, seed=95), rnd(2, 3000, 2, 128, seed=96), rnd(2, 3000, 2, 128, seed=97)
    s = sinks(8, 98).bfloat16() + 6.0
    for _ in range(3):  # compiles (the JIT's launch), then launches directly and prepares (the combine's too)
        first = hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=s)
    calls = []
    real = plan.launch_forward
    monkeypatch.setattr(plan, "launch_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    second = hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=s)
    assert calls == [] and torch.equal(first, second)
    s.add_(3.0)  # in place, as a weight update
    third = hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=s)
    assert calls == []
    ref, _ = attention_reference(q, k, v, causal=True, sink=s)
    assert_judged("out", third, ref, sink_eager(q, k, v, s, causal=True))
    assert (third.float() - second.float()).abs().max() > 0.05
    other = s.clone()
    torch.testing.assert_close(hopper_flash.flash_attn_func(q, k, v, causal=True, learnable_sink=other), third,
                               rtol=0, atol=0)
    assert calls == [1]
