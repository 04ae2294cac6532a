"""flash_attn_varlen_func on a Hopper GPU, forward and backward, against the
float64 reference run sequence by sequence (``reference.varlen_*``), judged
relative to the error of PyTorch's own attention on the same bf16/fp16
inputs (``reference.judge``).

Every case puts NaN where no kernel may look: q/k/v rows past ``seqused``
(the gaps), and (backward) the output gradient of rows outside every live
part. Lengths mix 0, 1, tile edges (127, 128, 129) and odd sizes; one batch
has a sequence above 8192.
"""
import math

import pytest
import torch

import hopper_flash
from hopper_flash import plan
from hopper_flash.reference import (
    assert_judged,
    attention_baseline_grads,
    attention_reference_grads,
    grads_abs_tol,
    varlen_baseline,
    varlen_grads,
    varlen_reference,
    varlen_spans,
)
from gpu_inputs import capture, cu, live_rows, varlen_batch

pytestmark = pytest.mark.gpu
DEV = "cuda"


def make(lq, lk, h, hkv, d, *, used_q=None, used_k=None, dtype=torch.bfloat16, seed=0):
    """THD q, k, v with NaN in the gaps past seqused, and the int32 metadata."""
    return varlen_batch(lq, lk, h, hkv, d, used_q=used_q, used_k=used_k, dtype=dtype, seed=seed)


def check_forward(lq, lk, h, hkv, d, causal, *, used_q=None, used_k=None, dtype=torch.bfloat16, seed=0):
    q, k, v, cq, ck, uq, uk = make(lq, lk, h, hkv, d, used_q=used_q, used_k=used_k, dtype=dtype, seed=seed)
    mq = max([n for _, n in varlen_spans(cq, uq)] + [1])
    mk = max([n for _, n in varlen_spans(ck, uk)] + [1])
    out, lse = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk, seqused_q=uq, seqused_k=uk,
                                                   causal=causal, return_lse=True)
    ref, ref_lse = varlen_reference(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=causal)
    base = varlen_baseline(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=causal)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0]) and lse.dtype == torch.float32
    assert_judged("out", out, ref, base)
    live = live_rows(q.shape[0], cq, uq)
    assert_judged("lse", lse[:, live], ref_lse[:, live].to(lse.device))
    # Rows outside every live part: zero output, -inf LSE.
    assert (out[~live] == 0).all() and (lse[:, ~live] == -math.inf).all()
    return q, k, v, cq, ck, uq, uk, out, lse


MIX = dict(lq=[1, 0, 127, 128, 129, 1000, 3001, 17], lk=[1, 5, 127, 128, 129, 1000, 3001, 0])


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa4", "mqa"])
def test_forward_length_mix(d, causal, h, hkv):
    check_forward(MIX["lq"], MIX["lk"], h, hkv, d, causal)


def test_forward_fp16():
    check_forward(MIX["lq"], MIX["lk"], 8, 2, 128, True, dtype=torch.float16)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_long_sequence(causal):
    check_forward([8193, 1, 300], [8193, 9000, 300], 2, 1, 128, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_q_longer_and_shorter_than_k(causal):
    check_forward([300, 10, 129, 64], [40, 700, 128, 1], 8, 2, 128, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_seqused_shorter_than_slots_with_nan_gaps(d):
    check_forward([300, 140, 90, 33], [310, 150, 40, 260], 8, 2, d, True,
                  used_q=[257, 100, 0, 33], used_k=[300, 129, 40, 1])


WIDE_CASE = dict(lq=[2100, 140, 1, 2049], lk=[2200, 150, 3001, 2049], used_q=[2049, 100, 1, 2049],
                 used_k=[2100, 129, 3000, 1900])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d64_wide_tiles_with_seqused_and_nan_gaps(causal):
    """Head dim 64 with a query of WIDE_MIN_ROWS or more takes the 192-row
    tiles (plan._plan_varlen), PackGQA and per-sequence lengths with them;
    the backward reads their O and LSE."""
    lp = plan._plan_varlen(torch.cuda.current_device(), torch.bfloat16, 4, 2049, 3000, 8, 4, plan.CONFIGS[64],
                           True, True, causal, True)
    assert lp.cfg == plan.WIDE_CONFIGS.get(64, plan.CONFIGS[64]), "this case is meant for the wide tiles"
    lq, lk, used_q, used_k = WIDE_CASE.values()
    check_forward(lq, lk, 8, 2, 64, causal, used_q=used_q, used_k=used_k, seed=11)
    check_backward(lq, lk, 8, 2, 64, causal, used_q=used_q, used_k=used_k, seed=13)


@pytest.mark.xfail(strict=True, reason="known: on these inputs (seed 12) dQ's worst row, one that sees two keys, "
                   "is 1.36e-2 off against a limit of 1.14e-2 (2x the bf16 baseline's row error), the same bits "
                   "on the tree before the wide varlen tiles; flash-attn's Delta = rowsum(dO * O) from the bf16 O "
                   "alone puts such rows 1.5e-2 to 1.6e-1 off in exact arithmetic (scripts/dq_delta_sim.py)")
def test_d64_backward_row_with_two_keys_known_deviation():
    lq, lk, used_q, used_k = WIDE_CASE.values()
    check_backward(lq, lk, 8, 2, 64, True, used_q=used_q, used_k=used_k, seed=12)


def test_forward_equals_each_sequence_alone():
    lq = [1, 129, 1000, 77]
    lk = [5, 129, 1200, 1]
    q, k, v, cq, ck, uq, uk, out, lse = check_forward(lq, lk, 8, 2, 128, True)
    for (qs, nq), (ks, nk) in zip(varlen_spans(cq), varlen_spans(ck)):
        alone, alone_lse = hopper_flash.flash_attn_func(q[None, qs:qs + nq], k[None, ks:ks + nk],
                                                        v[None, ks:ks + nk], causal=True, return_lse=True)
        torch.testing.assert_close(out[qs:qs + nq], alone[0], atol=2e-3, rtol=1e-2)
        torch.testing.assert_close(lse[:, qs:qs + nq], alone_lse[0], atol=1e-4, rtol=1e-4)


def test_no_key_anywhere():
    q, k, v, cq, ck, uq, uk = make([3, 4], [0, 0], 4, 4, 64)
    out, lse = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 4, 1, return_lse=True)
    assert (out == 0).all() and (lse == -math.inf).all()


def test_cuda_graph_replay_with_new_cu_seqlens():
    h, hkv, d = 8, 2, 128
    total = 4096
    gen = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(total, h, d, generator=gen, device=DEV).bfloat16()
    k = torch.randn(total, hkv, d, generator=gen, device=DEV).bfloat16()
    v = torch.randn(total, hkv, d, generator=gen, device=DEV).bfloat16()
    cq = cu([1000, 1000, 1000, 1096])
    ck = cq.clone()

    def step():
        return hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 4096, 4096, causal=True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lens_q, lens_k in (([1, 4000, 0, 95], [1, 4000, 0, 95]), ([2048, 1, 1, 2046], [100, 3000, 1, 995]),
                           ([4096, 0, 0, 0], [4096, 0, 0, 0])):
        cq.copy_(cu(lens_q))
        ck.copy_(cu(lens_k))
        graph.replay()
        ref, _ = varlen_reference(q, k, v, cq, ck, causal=True)
        base = varlen_baseline(q, k, v, cq, ck, causal=True)
        live = live_rows(total, cq, None)
        assert_judged("graph out", out[live], ref[live].to(out.device), base[live])
        assert torch.equal(out[live], step()[live])


def test_torch_compile_fullgraph():
    q, k, v, cq, ck, _, _ = make([100, 1, 300], [200, 7, 300], 8, 2, 128)

    @torch.compile(fullgraph=True)
    def f(q, k, v, cq, ck):
        return hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 300, 300, causal=True) * 2

    torch.testing.assert_close(f(q, k, v, cq, ck),
                               2 * hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, 300, 300, causal=True))


# ------------------------------------------------------------------ backward

def backward_case(lq, lk, h, hkv, d, causal, *, used_q=None, used_k=None, deterministic=False, seed=0):
    """One varlen backward on fresh inputs: ``((dq, dk, dv), reference
    grads, baseline grads, abs_tol)``, for ``check_backward`` to judge (and
    ``scripts/judge_sweep.py`` to sweep over seeds)."""
    q, k, v, cq, ck, uq, uk = make(lq, lk, h, hkv, d, used_q=used_q, used_k=used_k, seed=seed)
    mq = max([n for _, n in varlen_spans(cq, uq)] + [1])
    mk = max([n for _, n in varlen_spans(ck, uk)] + [1])
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = hopper_flash.flash_attn_varlen_func(qg, kg, vg, cq, ck, mq, mk, seqused_q=uq, seqused_k=uk,
                                              causal=causal, deterministic=deterministic)
    gen = torch.Generator(device=DEV).manual_seed(seed + 100)
    dout = torch.randn(out.shape, generator=gen, device=DEV).to(out.dtype)
    live = live_rows(q.shape[0], cq, uq)
    dout[~live] = math.nan  # never read
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    dref = dout.masked_fill(~live[:, None, None], 0.0)
    ref = varlen_grads(lambda a, b, c, e: attention_reference_grads(a, b, c, e, causal=causal), q, k, v, dref, cq,
                       ck, seqused_q=uq, seqused_k=uk, out_dtype=torch.float64)
    base = varlen_grads(lambda a, b, c, e: attention_baseline_grads(a, b, c, e, causal=causal), q, k, v, dref, cq,
                        ck, seqused_q=uq, seqused_k=uk)
    # As reference.check_attention_grads: the absolute floor for exactly-zero gradients (single-key rows).
    return (dq, dk, dv), ref, base, grads_abs_tol(ref, q.dtype)


def check_backward(lq, lk, h, hkv, d, causal, *, used_q=None, used_k=None, deterministic=False, seed=0):
    grads, ref, base, tol = backward_case(lq, lk, h, hkv, d, causal, used_q=used_q, used_k=used_k,
                                          deterministic=deterministic, seed=seed)
    for name, g, r, bl in zip(("dq", "dk", "dv"), grads, ref, base):
        assert_judged(name, g, r, bl, abs_tol=tol)
    return grads


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_backward_length_mix(d, causal, h, hkv):
    check_backward(MIX["lq"], MIX["lk"], h, hkv, d, causal)


@pytest.mark.parametrize("d", [40, 96, 192])
def test_other_head_dims(d):
    """Head dims without kernels of their own run on the next one's, read as
    they are (``plan.kernel_head_dim``: varlen's O, dK and dV stored to the
    head dim), forward and backward, NaN gaps included."""
    check_forward([300, 140, 90, 33], [310, 150, 40, 260], 8, 2, d, True, used_q=[257, 100, 0, 33],
                  used_k=[300, 129, 40, 1], seed=d)
    check_backward(MIX["lq"], MIX["lk"], 8, 2, d, True, seed=d)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_q_longer_and_shorter_than_k_mqa(causal):
    check_backward([300, 10, 129, 64], [40, 700, 128, 1], 4, 1, 128, causal)


def test_backward_seqused_with_nan_gaps():
    check_backward([300, 140, 90, 33], [310, 150, 40, 260], 8, 2, 128, True,
                   used_q=[257, 100, 0, 33], used_k=[300, 129, 40, 1])


def test_backward_long_sequence():
    check_backward([8193, 1, 300], [8193, 9000, 300], 2, 1, 128, True)


def test_backward_deterministic_is_bitwise_reproducible():
    a = check_backward([1000, 3001, 17], [1000, 3001, 300], 8, 2, 128, True, deterministic=True, seed=5)
    b = check_backward([1000, 3001, 17], [1000, 3001, 300], 8, 2, 128, True, deterministic=True, seed=5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_backward_cuda_graph_replay_with_new_cu_seqlens():
    """Forward and backward captured in one CUDA graph, replayed with new
    cu_seqlens of the same batch: each replay's gradients are judged against
    the reference for its lengths, and dQ's rows past the last sequence are
    zero. At D = 128 the fast backward runs on the persistent grid, whose
    item counter each replay's preprocess zeroes: a counter left at the last
    replay's count would hand out no tile, and the gradients would be the
    last replay's."""
    h, hkv, d, total = 8, 2, 128, 4096
    gen = torch.Generator(device=DEV).manual_seed(11)
    q, k, v = (torch.randn(total, n, d, generator=gen, device=DEV).bfloat16().requires_grad_() for n in (h, hkv, hkv))
    dout = torch.randn(total, h, d, generator=gen, device=DEV).bfloat16()
    cq = cu([1000, 1000, 1000, 1096])
    ck = cq.clone()

    def step():
        out = hopper_flash.flash_attn_varlen_func(q, k, v, cq, ck, total, total, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    graph, grads = capture(step)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    for lens_q, lens_k in (([1, 4000, 0, 95], [1, 4000, 0, 95]), ([2048, 1, 1, 2046], [100, 3000, 1, 995]),
                           ([500, 7, 0, 300], [600, 1, 33, 3000]), ([4096, 0, 0, 0], [4096, 0, 0, 0])):
        cq.copy_(cu(lens_q))
        ck.copy_(cu(lens_k))
        graph.replay()
        live_q, live_k = live_rows(total, cq, None), live_rows(total, ck, None)
        dref = dout.masked_fill(~live_q[:, None, None], 0.0)
        ref = varlen_grads(lambda a, b, c, e: attention_reference_grads(a, b, c, e, causal=True), qd, kd, vd, dref,
                           cq, ck, out_dtype=torch.float64)
        base = varlen_grads(lambda a, b, c, e: attention_baseline_grads(a, b, c, e, causal=True), qd, kd, vd, dref,
                            cq, ck)
        tol = grads_abs_tol(ref, q.dtype)
        for name, g, r, bl, live in zip(("dq", "dk", "dv"), grads, ref, base, (live_q, live_k, live_k)):
            assert_judged(f"{lens_q}/{lens_k} {name}", g[live], r[live], bl[live], abs_tol=tol)
        assert (grads[0][sum(lens_q):] == 0).all()


def test_backward_equals_each_sequence_alone():
    lq, lk = [129, 1000, 77], [129, 1200, 1]
    dq, dk, dv = check_backward(lq, lk, 8, 2, 128, True, seed=7)
    q, k, v, cq, ck, _, _ = make(lq, lk, 8, 2, 128, seed=7)
    gen = torch.Generator(device=DEV).manual_seed(107)
    dout = torch.randn(q.shape, generator=gen, device=DEV).to(q.dtype)
    for (qs, nq), (ks, nk) in zip(varlen_spans(cq), varlen_spans(ck)):
        qa, ka, va = (x.detach().clone().requires_grad_() for x in (q[None, qs:qs + nq], k[None, ks:ks + nk],
                                                                    v[None, ks:ks + nk]))
        oa = hopper_flash.flash_attn_func(qa, ka, va, causal=True)
        ga = torch.autograd.grad(oa, (qa, ka, va), dout[None, qs:qs + nq])
        torch.testing.assert_close(dq[qs:qs + nq], ga[0][0], atol=5e-3, rtol=2e-2)
        torch.testing.assert_close(dk[ks:ks + nk], ga[1][0], atol=5e-3, rtol=2e-2)
        torch.testing.assert_close(dv[ks:ks + nk], ga[2][0], atol=5e-3, rtol=2e-2)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_forward_writes_exactly_the_live_rows(d):
    """A NaN-poisoned output buffer: every live row is written (finite, judged), every gap row past
    seqused_q keeps its NaN (no tile writes into rows outside its sequence's live part)."""
    from hopper_flash import dispatch

    lq, lk = [300, 140, 90, 33, 129], [310, 150, 40, 260, 129]
    used_q, used_k = [257, 100, 0, 33, 1], [300, 129, 40, 1, 129]
    q, k, v, cq, ck, uq, uk = make(lq, lk, 8, 2, d, used_q=used_q, used_k=used_k, seed=9)
    out = torch.full_like(q, math.nan)
    out, lse = dispatch.forward_varlen(q, k, v, cq, ck, 257, 300, uq, uk, None, True, True, out=out)
    live = live_rows(q.shape[0], cq, uq)
    assert out[~live].isnan().all(), "a tile wrote outside its sequence's live rows"
    ref, _ = varlen_reference(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True)
    base = varlen_baseline(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, causal=True)
    assert_judged("out", out[live], ref[live].to(out.device), base[live])


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "kvpacked"])
def test_backward_zeroes_rows_past_the_last_sequence(packed):
    """K and V longer than ``cu_seqlens_k[-1]`` (a buffer with a live
    prefix; the contract allows it for k): their rows past it are NaN and
    never read, and ``backward_varlen``, handed NaN-filled gradients (as
    uninitialised memory may hold), leaves exactly zero there; every live
    row equals the same call's on the trimmed tensors, bitwise
    (deterministic mode). ``packed``: dK and dV as views of one [total, 2,
    Hkv, D] gradient, as the kvpacked function hands them in."""
    from hopper_flash import dispatch, plan_backward

    lq, lk, tail = [300, 129, 77], [310, 1, 200], 100
    q, k, v, cq, ck, _, _ = make(lq, lk, 8, 2, 128, seed=11)
    gen = torch.Generator(device=DEV).manual_seed(111)
    dout = torch.randn(q.shape, generator=gen, device=DEV).to(q.dtype)
    batch = plan_backward.VarlenBatch(cq, ck, None, None, 300, 310)

    def grads(k, v):
        out, lse = dispatch.forward_varlen(q, k, v, cq, ck, 300, 310, None, None, None, True, True)
        dq = torch.full_like(q, math.nan)
        if packed:
            dkv = torch.full((k.shape[0], 2, *k.shape[1:]), math.nan, dtype=k.dtype, device=DEV)
            dk, dv = dkv.unbind(1)
        else:
            dk, dv = torch.full_like(k, math.nan), torch.full_like(v, math.nan)
        plan_backward.backward_varlen(dout, q, k, v, out, lse, batch, 128 ** -0.5, True, deterministic=True,
                                      grads=(dq, dk, dv))
        return dq, dk, dv

    live = grads(k, v)
    nan_tail = torch.full((tail, *k.shape[1:]), math.nan, dtype=k.dtype, device=DEV)
    long = grads(torch.cat([k, nan_tail]), torch.cat([v, nan_tail]))
    n = k.shape[0]
    for name, g in zip(("dk", "dv"), long[1:]):
        assert bool((g[n:] == 0).all()), f"{name}: a row past cu_seqlens_k[-1] is not zero"
    for name, g, g_live in zip(("dq", "dk", "dv"), long, live):
        assert not bool(g_live.isnan().any()), f"{name}: a live row left unwritten"
        assert torch.equal(g[:g_live.shape[0]], g_live), f"{name}: the live rows differ from the trimmed call's"
