"""Sliding-window (local) attention on a Hopper GPU: ``window_size`` in
``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``
against the float64 reference with the same window
(``reference.window_visible``), judged relative to the error SDPA makes on
the same inputs with the same mask (``reference.judge``).

flash-attn's semantics: query ``i`` sees keys ``i + off - left .. i + off +
right`` (``off = seqlen_k - seqlen_q``, bottom-right aligned, -1 = no bound
on that side); ``causal`` makes ``right`` 0. Cases cover windows narrower and
wider than a tile and not aligned to one, both sides bounded, one side
bounded, windows that leave rows with no key at all (zero output, LSE -inf),
q longer and shorter than k, GQA, every head dim, the wide D=64 tiles, the
varlen mode with length mixes, and the decode modes (split-KV, PackGQA,
NaN-filled cache tails, paged caches; CUDA-graph replay with a window is
tests/test_decode_gpu.py's graph test).
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import checks, dispatch
from hopper_flash.reference import (
    assert_judged,
    check_attention,
    check_kvcache,
    varlen_baseline,
    varlen_reference,
    varlen_spans,
)
from gpu_inputs import check_kernel_backward, cu, nan_tailed_cache, rnd

pytestmark = pytest.mark.gpu
DEV = "cuda"


def check_fixed(batch, seqlen_q, seqlen_k, h, hkv, d, causal, window_size, *, dtype=torch.bfloat16, seed=0):
    q = rnd(batch, seqlen_q, h, d, dtype=dtype, seed=seed)
    k = rnd(batch, seqlen_k, hkv, d, dtype=dtype, seed=seed + 1)
    v = rnd(batch, seqlen_k, hkv, d, dtype=dtype, seed=seed + 2)
    window = checks.window_bounds(window_size, causal)
    # The output buffer starts as NaN: every row must be written.
    poisoned = torch.full_like(q, math.nan)
    out, lse = dispatch.forward(q, k, v, None, causal, True, out=poisoned, window=window)
    bad = [x.message for x in check_attention(out, q, k, v, causal=causal, lse=lse, window=window) if not x]
    assert not bad, "\n".join(bad)
    # The public call computes the same.
    again = hopper_flash.flash_attn_func(q, k, v, causal=causal, window_size=window_size)
    assert torch.equal(again, out)
    return out, lse


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window_size, causal", [
    ((0, 0), True), ((127, 0), True), ((129, 0), True), ((5, 7), False), ((200, 129), False), ((-1, 0), False),
    ((64, -1), False),
], ids=lambda x: str(x).replace(" ", ""))
def test_windows_square(d, window_size, causal):
    check_fixed(2, 1000, 1000, 4, 2, d, causal, window_size, seed=d)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(129, 1000), (1000, 129), (1, 3001), (3001, 3001), (17, 17)])
@pytest.mark.parametrize("window_size, causal", [((100, 0), True), ((3, 40), False), ((0, 0), False)],
                         ids=lambda x: str(x).replace(" ", ""))
def test_windows_unequal_lengths(seqlen_q, seqlen_k, window_size, causal):
    # q longer than k leaves the first rows with no key under a causal window.
    check_fixed(2, seqlen_q, seqlen_k, 8, 2, 128, causal, window_size, seed=seqlen_q)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_window_on_long_prefill(causal):
    # Long enough for the wide D=64 tiles and the dynamic order (causal), and many
    # KV tiles skipped on both sides of each query tile's window.
    check_fixed(2, 8192, 8192, 4, 4, 64, causal, (1000, 0 if causal else 333), seed=7)
    check_fixed(1, 8192, 8192, 8, 2, 128, causal, (2047, 0 if causal else 2048), seed=8)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(385, 385), (250, 315), (577, 700), (1000, 640)])
@pytest.mark.parametrize("window_size, causal", [((100, 0), True), ((200, 70), False), ((-1, 130), False)],
                         ids=lambda x: str(x).replace(" ", ""))
def test_windows_on_the_wide_tiles(wide_tiles, seqlen_q, seqlen_k, window_size, causal):
    # Right-bounded windows on 192-row tiles: a warpgroup passes the KV tiles
    # past its own rows' right edge unread (kernels/forward.py, OWN_DIAGONAL).
    check_fixed(2, seqlen_q, seqlen_k, 3, 3, 64, causal, window_size, seed=seqlen_q + seqlen_k)
    assert set(wide_tiles) == {192}


def test_window_fp16_and_gqa():
    check_fixed(2, 777, 2000, 16, 2, 128, True, (511, 0), dtype=torch.float16, seed=9)


def test_window_rows_that_see_no_key_are_zero_with_lse_minus_inf():
    # Non-causal (0, 0) with seqlen_q = 40 > seqlen_k = 10: row i sees key i - 30 alone,
    # so rows 0 .. 29 see none.
    out, lse = check_fixed(1, 40, 10, 2, 2, 128, False, (0, 0))
    assert (out[0, :30] == 0).all() and (lse[0, :, :30] == -math.inf).all()
    assert (lse[0, :, 30:] > -math.inf).all()


# ---- varlen ----------------------------------------------------------------


@pytest.mark.parametrize("window_size, causal", [((100, 0), True), ((0, 0), True), ((40, 300), False)],
                         ids=lambda x: str(x).replace(" ", ""))
def test_varlen_windows(window_size, causal):
    lq = [1, 0, 127, 128, 129, 1000, 3001, 17, 9000]
    lk = [1, 5, 127, 128, 129, 1000, 3001, 0, 9000]
    h, hkv, d = 8, 2, 128
    q, k, v = rnd(sum(lq), h, d, seed=1), rnd(sum(lk), hkv, d, seed=2), rnd(sum(lk), hkv, d, seed=3)
    cq, ck = cu(lq), cu(lk)
    window = checks.window_bounds(window_size, causal)
    out, lse = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=causal,
                                                   return_lse=True, window_size=window_size)
    ref, ref_lse = varlen_reference(q, k, v, cq, ck, causal=causal, window=window)
    base = varlen_baseline(q, k, v, cq, ck, causal=causal, window=window)
    assert_judged("out", out, ref, base)
    live = torch.zeros(q.shape[0], dtype=torch.bool, device=DEV)
    for start, n in varlen_spans(cq):
        live[start:start + n] = True
    assert_judged("lse", lse[:, live], ref_lse[:, live].to(lse.device))


def test_varlen_window_with_seqused_and_nan_gaps():
    lq, lk = [300, 64, 2000], [500, 64, 2500]
    used_q, used_k = [250, 64, 1000], [400, 1, 2500]
    h, hkv, d = 4, 4, 64
    q, k, v = rnd(sum(lq), h, d, seed=4), rnd(sum(lk), hkv, d, seed=5), rnd(sum(lk), hkv, d, seed=6)
    cq, ck = cu(lq), cu(lk)
    uq = torch.tensor(used_q, dtype=torch.int32, device=DEV)
    uk = torch.tensor(used_k, dtype=torch.int32, device=DEV)
    for t, c, u in ((q, cq, used_q), (k, ck, used_k), (v, ck, used_k)):
        cl = c.tolist()
        for b, n in enumerate(u):
            t[cl[b] + n:cl[b + 1]] = math.nan
    window = checks.window_bounds((129, 0), True)
    out = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), seqused_q=uq, seqused_k=uk,
                                              causal=True, window_size=(129, 0))
    ref, _ = varlen_reference(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True, window=window)
    base = varlen_baseline(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True, window=window)
    assert_judged("out", out, ref, base)
    assert not out.isnan().any()


# ---- KV cache --------------------------------------------------------------

@pytest.mark.parametrize("seqlen_q", [1, 4, 128])
@pytest.mark.parametrize("num_splits, pack_gqa", [(0, None), (1, False), (5, True)])
@pytest.mark.parametrize("window_size", [(255, 0), (4096, 0), (0, 0)], ids=lambda x: str(x).replace(" ", ""))
def test_kvcache_windows(seqlen_q, num_splits, pack_gqa, window_size):
    lens = [1, 777, 20000, 4099, 0]
    B, H, Hkv, D = len(lens), 32, 8, 128
    kc, vc = nan_tailed_cache(B, max(lens) + 77, Hkv, D, lens, seed=seqlen_q)
    q = rnd(B, seqlen_q, H, D, seed=seqlen_q + 100)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out, lse = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, window_size=window_size,
                                                    num_splits=num_splits, pack_gqa=pack_gqa, return_softmax_lse=True)
    window = checks.window_bounds(window_size, True)
    bad = [x.message for x in check_kvcache(out, q, kc, vc, lens, causal=True, lse=lse, window=window) if not x]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page_size", [2, 16, 128])
def test_kvcache_window_paged_equals_contiguous(page_size):
    lens = [3000, 130, 1]
    B, H, Hkv, D = len(lens), 16, 4, 128
    cap = 3072
    kc, vc = nan_tailed_cache(B, cap, Hkv, D, lens, seed=11)
    q = rnd(B, 2, H, D, seed=12)
    cs = torch.tensor(lens, dtype=torch.int32, device=DEV)
    pages_per_row = cap // page_size
    perm = torch.randperm(B * pages_per_row, generator=torch.Generator().manual_seed(0)).to(DEV)
    table = perm.view(B, pages_per_row).to(torch.int32)
    kp = torch.empty(B * pages_per_row, page_size, Hkv, D, dtype=kc.dtype, device=DEV)
    vp = torch.empty_like(kp)
    kp[table.flatten().long()] = kc.reshape(B * pages_per_row, page_size, Hkv, D)
    vp[table.flatten().long()] = vc.reshape(B * pages_per_row, page_size, Hkv, D)
    contiguous = hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, window_size=(700, 0))
    paged = hopper_flash.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cs, page_table=table, causal=True,
                                                 window_size=(700, 0))
    window = checks.window_bounds((700, 0), True)
    for out in (contiguous, paged):
        bad = [x.message for x in check_kvcache(out, q, kc, vc, lens, causal=True, window=window) if not x]
        assert not bad, "\n".join(bad)


def test_kvcache_window_under_torch_compile():
    kc, vc = rnd(2, 2048, 8, 128, seed=41), rnd(2, 2048, 8, 128, seed=42)
    q = rnd(2, 1, 32, 128, seed=43)
    cs = torch.tensor([2000, 1500], dtype=torch.int32, device=DEV)

    def step(q, kc, vc, cs):
        return hopper_flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cs, causal=True, window_size=(511, 0))

    out = torch.compile(step, fullgraph=True)(q, kc, vc, cs)
    assert torch.equal(out, step(q, kc, vc, cs))
    window = checks.window_bounds((511, 0), True)
    bad = [x.message for x in check_kvcache(out, q, kc, vc, [2000, 1500], causal=True, window=window) if not x]
    assert not bad, "\n".join(bad)


# ---- backward ----------------------------------------------------------------

def check_backward(batch, seqlen_q, seqlen_k, h, hkv, d, causal, window_size, **kw):
    """The backward kernel on its own windowed forward (gpu_inputs.check_kernel_backward)."""
    return check_kernel_backward(batch, seqlen_q, seqlen_k, h, hkv, d, causal, window_size=window_size, **kw)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window_size, causal", [((0, 0), True), ((129, 0), True), ((200, 129), False),
                                                 ((-1, 0), False), ((64, -1), False)],
                         ids=lambda x: str(x).replace(" ", ""))
def test_backward_windows(d, window_size, causal):
    check_backward(2, 1000, 1000, 4, 2, d, causal, window_size, seed=d)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(129, 1000), (1000, 129), (3001, 3001)])
@pytest.mark.parametrize("window_size, causal", [((100, 0), True), ((3, 40), False), ((0, 0), False)],
                         ids=lambda x: str(x).replace(" ", ""))
def test_backward_windows_unequal_lengths(seqlen_q, seqlen_k, window_size, causal):
    check_backward(2, seqlen_q, seqlen_k, 8, 2, 128, causal, window_size, seed=seqlen_q)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_backward_window_deterministic_is_bitwise_repeatable(d):
    # The window's left bound starts each query tile's dQ order at its first KV tile.
    first = check_backward(2, 2000, 2000, 4, 2, d, True, (300, 0), deterministic=True, seed=5)
    from hopper_flash import plan_backward

    q, k, v, do = first[:4]
    window = checks.window_bounds((300, 0), True)
    with torch.no_grad():
        out, lse = hopper_flash.flash_attn_func(q, k, v, causal=True, window_size=(300, 0), return_lse=True)
    for _ in range(20):
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        plan_backward.launch_backward(do, q, k, v, out, lse, *grads, d ** -0.5, True, True, window=window)
        assert all(torch.equal(a, b) for a, b in zip(grads, first[4:]))


def test_backward_window_through_autograd_and_compile():
    q, k, v = (rnd(2, 700, 8, 128, seed=s).requires_grad_() for s in (1, 2, 3))
    do = rnd(2, 700, 8, 128, seed=4)

    def loss(q, k, v):
        # deterministic: dQ summed in a fixed order, so eager and compiled agree bit for bit
        return (hopper_flash.flash_attn_func(q, k, v, causal=True, window_size=(150, 0), deterministic=True)
                * do).sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    from hopper_flash.reference import check_attention_grads

    window = checks.window_bounds((150, 0), True)
    verdicts = check_attention_grads(eager, q.detach(), k.detach(), v.detach(), do, causal=True, window=window)
    assert all(verdicts), "; ".join(x.message for x in verdicts if not x)


def test_varlen_backward_window():
    from hopper_flash.reference import (attention_baseline_grads, attention_reference_grads, grads_abs_tol,
                                        judge_grads, varlen_grads)

    lq = [1, 0, 127, 129, 1000, 3001, 17]
    lk = [1, 5, 127, 129, 1000, 3001, 0]
    h, hkv, d = 8, 2, 128
    q, k, v = (rnd(sum(n), hh, d, seed=s).requires_grad_() for n, hh, s in ((lq, h, 1), (lk, hkv, 2), (lk, hkv, 3)))
    do = rnd(sum(lq), h, d, seed=4)
    cq, ck = cu(lq), cu(lk)
    window_size = (200, 0)
    window = checks.window_bounds(window_size, True)
    out = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, window_size=window_size)
    grads = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    ref = varlen_grads(lambda a, b, c, g: attention_reference_grads(a, b, c, g, causal=True, window=window),
                       qd, kd, vd, do, cq, ck, out_dtype=torch.float64)
    base = varlen_grads(lambda a, b, c, g: attention_baseline_grads(a, b, c, g, causal=True, window=window),
                        qd, kd, vd, do, cq, ck)
    verdicts = judge_grads(grads, ref, base, shapes=(q.shape, k.shape, v.shape), abs_tol=grads_abs_tol(ref, q.dtype))
    assert all(verdicts), "; ".join(x.message for x in verdicts if not x)


# ---- packed layouts (ops.EagerPackedAttention carries the window) --------------

@pytest.mark.parametrize("causal, window_size", [(True, (100, 0)), (False, (40, 300))],
                         ids=["causal-100-0", "full-40-300"])
def test_qkvpacked_window_forward_and_backward(causal, window_size):
    """A packed call with a window: its output and gradients against the
    float64 reference with the same window, and bitwise equal to
    flash_attn_func on the same views (deterministic mode: the same kernels)."""
    from hopper_flash.reference import check_attention_grads

    qkv = rnd(2, 1000, 3, 4, 128, seed=21).requires_grad_()
    do = rnd(2, 1000, 4, 128, seed=22)
    out = hopper_flash.flash_attn_qkvpacked_func(qkv, causal=causal, window_size=window_size, deterministic=True)
    assert "EagerPackedAttention" in type(out.grad_fn).__name__
    (dqkv,) = torch.autograd.grad(out, (qkv,), do)
    q, k, v = qkv.detach().unbind(2)
    window = checks.window_bounds(window_size, causal)
    verdicts = check_attention(out.detach(), q, k, v, causal=causal, window=window)
    verdicts += check_attention_grads(dqkv.unbind(2), q, k, v, do, causal=causal, window=window)
    assert all(verdicts), "; ".join(x.message for x in verdicts if not x)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = hopper_flash.flash_attn_func(*leaves, causal=causal, window_size=window_size, deterministic=True)
    assert torch.equal(out.detach(), ref.detach())
    ref_grads = torch.autograd.grad(ref, leaves, do)
    for got, want in zip(dqkv.unbind(2), ref_grads):
        assert torch.equal(got, want)


def test_varlen_kvpacked_window_gradients_equal_the_unpacked_call():
    """Varlen kvpacked with a window: gradients bitwise equal to
    flash_attn_varlen_func on the same views, and within the judge's bounds
    per sequence against the float64 reference."""
    from hopper_flash.reference import (attention_baseline_grads, attention_reference_grads, grads_abs_tol,
                                        judge_grads, varlen_grads)

    lq, lk = [5, 300, 129, 1000], [7, 257, 129, 1000]
    cq, ck = cu(lq), cu(lk)
    q = rnd(sum(lq), 8, 128, seed=31).requires_grad_()
    kv = rnd(sum(lk), 2, 2, 128, seed=32).requires_grad_()
    do = rnd(sum(lq), 8, 128, seed=33)
    window_size = (64, 0)
    out = hopper_flash.flash_attn_varlen_kvpacked_func(q, kv, cq, ck, max(lq), max(lk), causal=True,
                                                       window_size=window_size, deterministic=True)
    dq, dkv = torch.autograd.grad(out, (q, kv), do)
    leaves = [t.detach().clone().requires_grad_() for t in (q, *kv.unbind(1))]
    ref = hopper_flash.flash_attn_varlen_func(*leaves, cq, ck, max(lq), max(lk), causal=True,
                                              window_size=window_size, deterministic=True)
    assert torch.equal(out.detach(), ref.detach())
    rq, rk, rv = torch.autograd.grad(ref, leaves, do)
    assert torch.equal(dq, rq) and torch.equal(dkv[:, 0], rk) and torch.equal(dkv[:, 1], rv)
    window = checks.window_bounds(window_size, True)
    qd, kd, vd = q.detach(), kv.detach()[:, 0], kv.detach()[:, 1]
    exact = varlen_grads(lambda a, b, c, g: attention_reference_grads(a, b, c, g, causal=True, window=window),
                         qd, kd, vd, do, cq, ck, out_dtype=torch.float64)
    base = varlen_grads(lambda a, b, c, g: attention_baseline_grads(a, b, c, g, causal=True, window=window),
                        qd, kd, vd, do, cq, ck)
    verdicts = judge_grads((dq, dkv[:, 0], dkv[:, 1]), exact, base, shapes=(qd.shape, kd.shape, vd.shape),
                           abs_tol=grads_abs_tol(exact, q.dtype))
    assert all(verdicts), "; ".join(x.message for x in verdicts if not x)
