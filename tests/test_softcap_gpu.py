"""Logit soft-capping (flash-attn's ``softcap``, Gemma 2's attention) on a
Hopper GPU: each scaled score ``x`` becomes ``softcap * tanh(x / softcap)``
before the mask and the softmax. Outputs, LSEs and gradients against the
float64 reference with the same cap (``reference.attention_reference``),
judged relative to the error of the bf16/fp16 PyTorch path that transformers'
eager Gemma 2 layer runs (``reference.softcap_eager``: SDPA cannot express
the cap). Output and gradient buffers start as NaN.

Covers every head dim, causal and not, unequal lengths, GQA, fp16, the
varlen mode (NaN past seqused), the KV-cache modes (split-KV, PackGQA,
NaN-filled cache tails, pages), the backward (including the 64-query D=64
config a capped backward runs) through autograd and torch.compile, and a
cap so small that every score saturates.
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import dispatch
from hopper_flash.reference import (
    assert_judged,
    attention_baseline_grads,
    attention_reference_grads,
    check_attention,
    check_attention_grads,
    check_kvcache,
    grads_abs_tol,
    judge_grads,
    varlen_baseline,
    varlen_grads,
    varlen_reference,
    varlen_spans,
)
from gpu_inputs import check_kernel_backward, cu, nan_tailed_cache, rnd

pytestmark = pytest.mark.gpu
DEV = "cuda"


def check_fixed(batch, seqlen_q, seqlen_k, h, hkv, d, causal, softcap, *, dtype=torch.bfloat16, seed=0,
                magnitude=1.0, softmax_scale=None):
    q = rnd(batch, seqlen_q, h, d, dtype=dtype, seed=seed, magnitude=magnitude)
    k = rnd(batch, seqlen_k, hkv, d, dtype=dtype, seed=seed + 1, magnitude=magnitude)
    v = rnd(batch, seqlen_k, hkv, d, dtype=dtype, seed=seed + 2)
    poisoned = torch.full_like(q, math.nan)
    out, lse = dispatch.forward(q, k, v, softmax_scale, causal, True, out=poisoned, softcap=softcap)
    bad = [x.message for x in check_attention(out, q, k, v, causal=causal, softmax_scale=softmax_scale, lse=lse,
                                              softcap=softcap) if not x]
    assert not bad, "\n".join(bad)
    again = hopper_flash.flash_attn_func(q, k, v, causal=causal, softcap=softcap, softmax_scale=softmax_scale)
    assert torch.equal(again, out)
    return q, k, v, out


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_softcap_forward(d, causal):
    # Inputs of magnitude 3: scores of tens, so a cap of 30 bends them (tanh far from linear).
    check_fixed(2, 1000, 1000, 4, 2, d, causal, 30.0, seed=d, magnitude=3.0)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 3001), (129, 1000), (1000, 129), (127, 127), (8192, 8192)])
def test_softcap_forward_lengths(seqlen_q, seqlen_k):
    # 8192: long enough for the wide D=64-free path's dynamic order at D=128.
    check_fixed(1, seqlen_q, seqlen_k, 8, 2, 128, True, 50.0, seed=seqlen_q, magnitude=3.0)


def test_softcap_forward_wide_tiles_and_fp16():
    check_fixed(2, 4096, 4096, 4, 4, 64, True, 20.0, seed=3, magnitude=3.0)  # three consumer warpgroups
    check_fixed(2, 1000, 1000, 8, 8, 128, False, 30.0, dtype=torch.float16, seed=4, magnitude=3.0)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_softcap_on_one_item_launches(planned_launches, causal):
    # Chunked prefill's shape (a short query on a long cache, 128 items on
    # as many CTAs): the one-item kernels (forward.V_AT_ISSUE), capped.
    check_fixed(4, 127, 3001, 32, 8, 128, causal, 30.0, seed=21, magnitude=3.0)
    assert planned_launches and all(lp.mode.one_item and lp.mode.softcap for lp in planned_launches)


def test_a_tiny_cap_saturates_every_score():
    # cap 0.5: every score is within 0.5 of 0, the softmax nearly uniform.
    check_fixed(2, 300, 700, 4, 1, 128, False, 0.5, seed=5, magnitude=3.0)


def test_softcap_is_not_the_uncapped_result():
    # Guards the tests above against a cap that silently does nothing.
    q, k, v, out = check_fixed(1, 256, 256, 4, 4, 128, False, 5.0, seed=6, magnitude=3.0)
    plain = hopper_flash.flash_attn_func(q, k, v)
    assert (out.float() - plain.float()).abs().max() > 0.05


# ---- varlen ------------------------------------------------------------------

def test_varlen_softcap_with_seqused_and_nan_gaps():
    lq, lk = [1, 0, 127, 300, 1000, 2000], [1, 5, 127, 500, 1000, 2500]
    used_q, used_k = [1, 0, 100, 250, 1000, 1500], [1, 5, 127, 400, 1000, 2500]
    h, hkv, d, cap = 8, 2, 128, 30.0
    q = rnd(sum(lq), h, d, seed=1, magnitude=3.0)
    k, v = rnd(sum(lk), hkv, d, seed=2, magnitude=3.0), rnd(sum(lk), hkv, d, seed=3)
    cq, ck = cu(lq), cu(lk)
    uq = torch.tensor(used_q, dtype=torch.int32, device=DEV)
    uk = torch.tensor(used_k, dtype=torch.int32, device=DEV)
    for t, c, u in ((q, cq, used_q), (k, ck, used_k), (v, ck, used_k)):
        cl = c.tolist()
        for b, n in enumerate(u):
            t[cl[b] + n:cl[b + 1]] = math.nan
    out, lse = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), seqused_q=uq, seqused_k=uk,
                                                   causal=True, softcap=cap, return_lse=True)
    ref, ref_lse = varlen_reference(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True, softcap=cap)
    base = varlen_baseline(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True, softcap=cap)
    assert_judged("out", out, ref, base)
    live = torch.zeros(q.shape[0], dtype=torch.bool, device=DEV)
    for start, n in varlen_spans(cq, uq):
        live[start:start + n] = True
    assert_judged("lse", lse[:, live], ref_lse[:, live].to(lse.device))
    assert not out.isnan().any()


# ---- KV cache ----------------------------------------------------------------

@pytest.mark.parametrize("seqlen_q", [1, 4, 128])
@pytest.mark.parametrize("num_splits, pack_gqa", [(0, None), (1, False), (5, True)])
def test_kvcache_softcap(seqlen_q, num_splits, pack_gqa):
    lens = [1, 777, 20000, 4099, 0]
    B, H, Hkv, D = len(lens), 32, 8, 128
    kc, vc = nan_tailed_cache(B, max(lens) + 77, Hkv, D, lens, seed=seqlen_q, k_magnitude=3.0)
    q = rnd(B, seqlen_q, H, D, seed=seqlen_q + 100, magnitude=3.0)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, softcap=50.0,
                                                    num_splits=num_splits, pack_gqa=pack_gqa,
                                                    return_softmax_lse=True)
    bad = [x.message for x in check_kvcache(out, q, kc, vc, lens, causal=True, lse=lse, softcap=50.0) if not x]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_kvcache_softcap_paged_equals_contiguous(page_size):
    lens = [3000, 130, 1]
    B, H, Hkv, D = len(lens), 16, 4, 128
    cap = 3072
    kc, vc = nan_tailed_cache(B, cap, Hkv, D, lens, seed=11, k_magnitude=3.0)
    q = rnd(B, 2, H, D, seed=12, magnitude=3.0)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    pages_per_row = cap // page_size
    perm = torch.randperm(B * pages_per_row, generator=torch.Generator().manual_seed(0)).to(DEV)
    table = perm.view(B, pages_per_row).to(torch.int32)
    kp = torch.empty(B * pages_per_row, page_size, Hkv, D, dtype=kc.dtype, device=DEV)
    vp = torch.empty_like(kp)
    kp[table.flatten().long()] = kc.reshape(B * pages_per_row, page_size, Hkv, D)
    vp[table.flatten().long()] = vc.reshape(B * pages_per_row, page_size, Hkv, D)
    contiguous = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, softcap=30.0)
    paged = hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cs, page_table=table, causal=True,
                                                 softcap=30.0)
    for out in (contiguous, paged):
        bad = [x.message for x in check_kvcache(out, q, kc, vc, lens, causal=True, softcap=30.0) if not x]
        assert not bad, "\n".join(bad)


def test_decode_softcap_in_a_cuda_graph_and_compiled():
    kc, vc = nan_tailed_cache(2, 4096, 8, 128, [3000, 1000], seed=41, k_magnitude=3.0)
    q = rnd(2, 1, 32, 128, seed=43, magnitude=3.0)
    cs = torch.tensor([3000, 1000], dtype=torch.int32, device=DEV)

    def step(q, kc, vc, cs):
        return hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, softcap=50.0)

    eager = step(q, kc, vc, cs)
    compiled = torch.compile(step, fullgraph=True)(q, kc, vc, cs)
    assert torch.equal(compiled, eager)
    step(q, kc, vc, cs)  # warm (compile, prepare) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step(q, kc, vc, cs)
    cs.copy_(torch.tensor([2500, 4000], dtype=torch.int32, device=DEV))
    kc[1, 1000:4000] = rnd(3000, 8, 128, seed=44, magnitude=3.0)
    vc[1, 1000:4000] = rnd(3000, 8, 128, seed=45)
    graph.replay()
    torch.cuda.synchronize()
    bad = [x.message for x in check_kvcache(replayed, q, kc, vc, [2500, 4000], causal=True, softcap=50.0) if not x]
    assert not bad, "\n".join(bad)


# ---- backward ----------------------------------------------------------------

def check_backward(batch, seqlen_q, seqlen_k, h, hkv, d, causal, softcap, **kw):
    """The backward kernel on its own capped forward (gpu_inputs.check_kernel_backward), logits large enough to cap."""
    return check_kernel_backward(batch, seqlen_q, seqlen_k, h, hkv, d, causal, softcap=softcap, magnitude=3.0, **kw)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_softcap_backward(d, causal):
    check_backward(2, 1000, 1000, 4, 2, d, causal, 30.0, seed=d)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(129, 1000), (1000, 129), (1, 700)])
def test_softcap_backward_lengths(seqlen_q, seqlen_k):
    check_backward(2, seqlen_q, seqlen_k, 8, 2, 128, True, 50.0, seed=seqlen_q)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_softcap_backward_deterministic_is_bitwise_repeatable(d):
    _, _, _, _, dq, dk, dv = check_backward(1, 700, 700, 4, 4, d, True, 20.0, deterministic=True, seed=d + 1)
    again = check_backward(1, 700, 700, 4, 4, d, True, 20.0, deterministic=True, seed=d + 1)[4:]
    for a, b in zip((dq, dk, dv), again):
        assert torch.equal(a, b)


def test_softcap_backward_through_autograd_and_compile():
    q, k, v = (rnd(2, 700, 8, 128, seed=s, magnitude=3.0).requires_grad_() for s in (1, 2, 3))
    do = rnd(2, 700, 8, 128, seed=4)

    def loss(q, k, v):
        return (hopper_flash.flash_attn_func(q, k, v, causal=True, softcap=30.0, deterministic=True) * do).sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    verdicts = check_attention_grads(eager, q.detach(), k.detach(), v.detach(), do, causal=True, softcap=30.0)
    assert all(verdicts), "; ".join(x.message for x in verdicts if not x)


def test_varlen_softcap_backward():
    lq = [1, 0, 127, 129, 1000, 3001, 17]
    lk = [1, 5, 127, 129, 1000, 3001, 0]
    h, hkv, d, cap = 8, 2, 128, 30.0
    q, k, v = (rnd(sum(n), hh, d, seed=s, magnitude=3.0).requires_grad_()
               for n, hh, s in ((lq, h, 1), (lk, hkv, 2), (lk, hkv, 3)))
    do = rnd(sum(lq), h, d, seed=4)
    cq, ck = cu(lq), cu(lk)
    out = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, softcap=cap)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    ref = varlen_grads(lambda a, b, c, g: attention_reference_grads(a, b, c, g, causal=True, softcap=cap),
                       qd, kd, vd, do, cq, ck, out_dtype=torch.float64)
    base = varlen_grads(lambda a, b, c, g: attention_baseline_grads(a, b, c, g, causal=True, softcap=cap),
                        qd, kd, vd, do, cq, ck)
    verdicts = judge_grads(grads, ref, base, shapes=(q.shape, k.shape, v.shape), abs_tol=grads_abs_tol(ref, q.dtype))
    assert all(verdicts), "; ".join(x.message for x in verdicts if not x)


def test_qkvpacked_softcap_forward_and_backward():
    qkv = rnd(2, 500, 3, 4, 64, seed=9, magnitude=3.0).requires_grad_()
    do = rnd(2, 500, 4, 64, seed=10)
    out = hopper_flash.flash_attn_qkvpacked_func(qkv, causal=True, softcap=25.0)
    (dqkv,) = torch.autograd.grad(out, (qkv,), do)
    q, k, v = qkv.detach().unbind(2)
    bad = [x.message for x in check_attention(out.detach(), q, k, v, causal=True, softcap=25.0) if not x]
    assert not bad, "\n".join(bad)
    verdicts = check_attention_grads(dqkv.unbind(2), q, k, v, do, causal=True, softcap=25.0)
    assert all(verdicts), "; ".join(x.message for x in verdicts if not x)
