"""CPU tests for hopper_flash.reference: the float64 reference (against the
textbook formula, written out here independently), SDPA's baseline, the
judge and the error helpers. No GPU needed; the whole file runs in seconds."""
from __future__ import annotations

import math

import pytest
import torch

from hopper_flash import reference
from hopper_flash.reference import (attention_baseline, attention_reference, judge, judge_lse, max_abs_err,
                                    rel_fro_err)

BF16 = torch.bfloat16
FP16 = torch.float16


def _inputs(seed, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype, mul=1.0):
    """Fresh N(0, 1) q, k, v (q and k times ``mul``) in ``dtype``, BSHD, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, seqlen_q, nheads, headdim, generator=g) * mul).to(dtype)
    k = (torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=g) * mul).to(dtype)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, generator=g).to(dtype)
    return q, k, v


def _naive(q, k, v, causal, scale):
    """Textbook dense attention in float64 over the whole [B, H, Sq, Sk] score tensor."""
    nheads, nheads_kv = q.shape[2], k.shape[2]
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    qd = q.double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(nheads // nheads_kv, dim=1)
    vd = v.double().transpose(1, 2).repeat_interleave(nheads // nheads_kv, dim=1)
    s = qd @ kd.transpose(-1, -2) * scale
    if causal:
        i = torch.arange(seqlen_q)[:, None]
        j = torch.arange(seqlen_k)[None, :]
        s = s.masked_fill(j > i + (seqlen_k - seqlen_q), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    # softmax of an all -inf row is NaN; such rows are defined to output 0.
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2), lse


def _same_inf(a, b):
    return bool(torch.equal(torch.isinf(a), torch.isinf(b)))


# --------------------------------------------------------------------------
# attention_reference vs the textbook formula
# --------------------------------------------------------------------------

REF_CASES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, softmax_scale
    pytest.param(2, 16, 16, 2, 2, 32, False, None, id="b2-s16-noncausal"),
    pytest.param(2, 16, 16, 2, 2, 32, True, None, id="b2-s16-causal"),
    pytest.param(1, 5, 17, 2, 2, 16, True, None, id="sq5-sk17-causal"),
    pytest.param(1, 17, 5, 2, 2, 16, True, None, id="sq17-sk5-causal-empty-rows"),
    pytest.param(1, 17, 5, 2, 2, 16, False, None, id="sq17-sk5-noncausal"),
    pytest.param(2, 9, 13, 4, 2, 16, True, None, id="gqa4over2-causal"),
    pytest.param(2, 13, 9, 4, 1, 16, True, None, id="gqa4over1-causal"),
    pytest.param(1, 11, 11, 4, 1, 16, False, None, id="gqa4over1-noncausal"),
    pytest.param(1, 12, 12, 2, 2, 16, True, 0.3, id="scale0.3-causal"),
    pytest.param(1, 1, 1, 1, 1, 8, True, None, id="s1-causal"),
]


@pytest.mark.parametrize("in_dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(BF16, id="bf16")])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_kv,headdim,causal,scale", REF_CASES)
def test_reference_matches_naive(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, scale, in_dtype):
    q, k, v = _inputs(1, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, in_dtype)
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=scale)
    want_out, want_lse = _naive(q, k, v, causal, 1 / math.sqrt(headdim) if scale is None else scale)

    assert out.shape == q.shape and out.dtype == torch.float64
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float64
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert max_abs_err(out, want_out) < 1e-12
    assert _same_inf(lse, want_lse)
    assert max_abs_err(lse, want_lse) < 1e-12


def test_reference_float32_mode():
    q, k, v = _inputs(2, 2, 40, 60, 4, 2, 32, BF16)
    out64, lse64 = attention_reference(q, k, v, causal=True)
    out32, lse32 = attention_reference(q, k, v, causal=True, dtype=torch.float32)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32 and lse64.dtype == torch.float64
    assert rel_fro_err(out32, out64) < 1e-5
    assert max_abs_err(lse32, lse64) < 1e-4


def test_reference_rejects_other_dtypes():
    q, k, v = _inputs(3, 1, 4, 4, 1, 1, 8, BF16)
    with pytest.raises(ValueError):
        attention_reference(q, k, v, dtype=torch.bfloat16)


@pytest.mark.parametrize("fn", [pytest.param(attention_reference, id="reference"),
                                pytest.param(lambda *a, **kw: (attention_baseline(*a, **kw), None), id="baseline")])
def test_rows_without_keys_give_zero_and_neg_inf(fn):
    # seqlen_q > seqlen_k, causal: rows 0 .. (seqlen_q - seqlen_k - 1) see no key.
    seqlen_q, seqlen_k = 200, 70
    q, k, v = _inputs(4, 2, seqlen_q, seqlen_k, 2, 1, 64, BF16)
    out, lse = fn(q, k, v, causal=True)
    n_empty = seqlen_q - seqlen_k
    assert not torch.isnan(out).any()
    assert torch.all(out[:, :n_empty] == 0)
    assert (out[:, n_empty:].abs().amax(dim=-1) > 0).all()
    if lse is not None:
        assert not torch.isnan(lse).any()
        assert torch.all(lse[:, :, :n_empty] == -math.inf)
        assert torch.isfinite(lse[:, :, n_empty:]).all()


@pytest.mark.parametrize("chunk", [37 * 3, 50 * 37 * 2, 50 * 37 * 3 + 1], ids=["rows", "pairs", "pairs-rows"])
def test_reference_chunking_is_invisible(monkeypatch, chunk):
    # Force many small row chunks (the path S ~ 8k takes) or batched (batch, head)
    # pairs (many short problems) and check nothing changes.
    q, k, v = _inputs(5, 3, 50, 37, 4, 2, 16, BF16)
    want_out, want_lse = _naive(q, k, v, True, 0.25)
    monkeypatch.setattr(reference, "_CHUNK_ELEMS", chunk)
    out, lse = attention_reference(q, k, v, causal=True, softmax_scale=0.25)
    assert max_abs_err(out, want_out) < 1e-12
    assert max_abs_err(lse, want_lse) < 1e-12


@pytest.mark.parametrize("causal", [True, False])
def test_reference_on_a_subset_of_rows(monkeypatch, causal):
    # Unequal lengths: the mask of a sampled row depends on its true position.
    q, k, v = _inputs(6, 2, 90, 70, 4, 2, 16, BF16)
    want_out, want_lse = _naive(q, k, v, causal, 0.25)
    rows = torch.tensor([0, 19, 20, 21, 64, 89])
    monkeypatch.setattr(reference, "_CHUNK_ELEMS", 70 * 4)  # rows in several chunks
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.25, rows=rows)
    assert out.shape == (2, 6, 4, 16) and lse.shape == (2, 4, 6)
    assert max_abs_err(out, want_out[:, rows]) < 1e-12
    assert max_abs_err(lse, want_lse[:, :, rows]) < 1e-12
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 90\)"):
        attention_reference(q, k, v, rows=torch.tensor([90]))


def test_reference_empty_problems():
    q, k, v = _inputs(7, 2, 5, 0, 2, 2, 16, BF16)
    out, lse = attention_reference(q, k, v, causal=False)
    assert out.shape == q.shape and (out == 0).all() and torch.isneginf(lse).all()
    q, k, v = _inputs(7, 0, 5, 3, 2, 2, 16, BF16)
    out, lse = attention_reference(q, k, v)
    assert out.shape == q.shape and lse.shape == (0, 2, 5)


def test_reference_propagates_nan_and_inf_like_the_formula():
    q, k, v = _inputs(8, 1, 6, 6, 1, 1, 8, torch.float32)
    q[0, 2, 0, 1] = math.nan
    v[0, 4, 0, 3] = math.inf
    out, lse = attention_reference(q, k, v, causal=True)
    assert torch.isnan(out[0, 2, 0]).all() and torch.isnan(lse[0, 0, 2])
    # Rows 0..3 give key 4 weight exactly 0: 0 * inf = NaN in column 3 only.
    assert torch.isnan(out[0, [0, 1, 3], 0, 3]).all() and torch.isfinite(out[0, [0, 1, 3], 0, :3]).all()
    assert torch.isposinf(out[0, 4:, 0, 3]).all()


# --------------------------------------------------------------------------
# attention_baseline (CPU: SDPA's math backend)
# --------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seqlen_q,seqlen_k,nheads,nheads_kv", [(40, 40, 4, 4), (30, 70, 4, 2), (70, 30, 6, 2)])
def test_baseline_is_sdpa_with_the_bottom_right_mask(causal, seqlen_q, seqlen_k, nheads, nheads_kv):
    q, k, v = _inputs(9, 2, seqlen_q, seqlen_k, nheads, nheads_kv, 32, BF16)
    ref, _ = attention_reference(q, k, v, causal=causal)
    base = attention_baseline(q, k, v, causal=causal)
    assert base.shape == q.shape and base.dtype == BF16
    assert rel_fro_err(base, ref) < 5e-3  # bf16 rounding, not a different mask or head mapping
    rows = torch.tensor([0, 5, seqlen_q - 1])
    # The same rows, masked by their true positions (a kernel shape of its own: equal up to rounding).
    assert rel_fro_err(attention_baseline(q, k, v, causal=causal, rows=rows), base[:, rows]) < 5e-3


# --------------------------------------------------------------------------
# The judge
# --------------------------------------------------------------------------

def _judged_case(seed=10, seqlen=300, dtype=BF16):
    q, k, v = _inputs(seed, 2, seqlen, seqlen, 4, 2, 64, dtype)
    ref, lse = attention_reference(q, k, v, causal=True)
    return ref, lse, attention_baseline(q, k, v, causal=True)


def test_judge_passes_a_kernel_like_error_and_states_the_numbers():
    ref, _, base = _judged_case()
    verdict = judge("out", ref.to(BF16), ref, base)
    assert verdict and verdict.ok
    assert verdict.message.startswith("out: ok: rel_fro ")
    assert verdict.rel_fro_limit == pytest.approx(2 * verdict.baseline_rel_fro + torch.finfo(BF16).eps / 8)
    assert verdict.max_abs_limit == pytest.approx(
        2 * verdict.baseline_max_abs + torch.finfo(BF16).eps / 8 * float(ref.abs().max()))
    assert verdict.row_rel_limit == pytest.approx(2 * verdict.baseline_row_rel + torch.finfo(BF16).eps / 8)
    assert 0 < verdict.rel_fro <= verdict.rel_fro_limit


@pytest.mark.parametrize("damage, measure", [
    (lambda x: x * 1.03, "rel_fro"),                      # 3% everywhere: a fixed 2e-2 tolerance misses it
    (lambda x: x.index_fill(1, torch.tensor([299]), 0.0), "row_rel"),  # the last (small) row lost
    (lambda x: x.index_put((torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([0])),
                           torch.tensor(9.0, dtype=x.dtype), accumulate=True), "max_abs"),  # one element off
])
def test_judge_fails_errors_a_fixed_tolerance_passes(damage, measure):
    ref, _, base = _judged_case()
    verdict = judge("out", damage(ref.to(BF16)), ref, base)
    assert not verdict and verdict.message.startswith("out: FAIL: ")
    assert getattr(verdict, measure) > getattr(verdict, f"{measure}_limit")
    assert "largest error at index" in verdict.message


def test_judge_fails_a_nan_where_the_reference_is_finite():
    ref, _, base = _judged_case()
    out = ref.to(BF16)
    out[1, 17, 3, 5] = math.nan  # e.g. a NaN-poisoned element never written
    verdict = judge("out", out, ref, base)
    assert not verdict and "NaN at 1 positions" in verdict.message and "(1, 17, 3, 5)" in verdict.message


def test_judge_compares_where_the_reference_is_finite():
    ref, _, base = _judged_case()
    ref = ref.clone()
    ref[0, 3, 1] = math.nan
    out = ref.to(BF16)
    assert judge("out", out, ref, base)
    out[0, 3, 1, 0] = 0.0  # a NaN the reference has, missing
    assert not judge("out", out, ref, base)


def test_judge_refuses_a_broken_baseline_and_broadcasting():
    ref, _, base = _judged_case()
    base = base.clone()
    base[0, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="baseline is not finite"):
        judge("out", ref.to(BF16), ref, base)
    with pytest.raises(ValueError, match="shapes differ"):
        judge("out", ref[:1].to(BF16), ref, base)


def test_judge_floor_covers_an_exact_baseline():
    # One key per row: softmax weight 1, out == v exactly for the baseline; the floor admits rounding.
    ref = torch.randn(4, 64, dtype=torch.float64)
    exact = ref.to(BF16).double()
    assert judge("out", exact.to(BF16), exact, exact.to(BF16))
    assert not judge("out", (exact * 1.01).to(BF16), exact, exact.to(BF16))


def test_judge_lse_is_tight_and_checks_the_inf_pattern():
    _, lse, _ = _judged_case()
    kernel_lse = lse.float()  # fp32 rounding alone: ~1e-7 relative
    assert judge_lse("lse", kernel_lse, lse)
    off = kernel_lse.clone()
    off[1, 2, 100] += 1e-3 * max(1.0, abs(float(off[1, 2, 100])))  # the old 1e-3 tolerance would pass it
    verdict = judge_lse("lse", off, lse)
    assert not verdict and "(1, 2, 100)" in verdict.message
    empty = lse.clone()
    empty[0, 0, 0] = -math.inf
    assert not judge_lse("lse", kernel_lse, empty)


@pytest.mark.parametrize("fn", [pytest.param(attention_reference, id="reference"),
                                pytest.param(attention_baseline, id="baseline")])
@pytest.mark.parametrize("q_shape,kv_shape", [
    pytest.param((1, 8, 3, 16), (1, 8, 2, 16), id="heads-not-multiple"),
    pytest.param((1, 8, 2, 16), (1, 8, 2, 32), id="headdim-mismatch"),
    pytest.param((2, 8, 2, 16), (1, 8, 2, 16), id="batch-mismatch"),
    pytest.param((8, 2, 16), (8, 2, 16), id="not-4d"),
])
def test_bad_shapes_raise(fn, q_shape, kv_shape):
    q = torch.randn(q_shape).to(BF16)
    k = torch.randn(kv_shape).to(BF16)
    with pytest.raises(ValueError):
        fn(q, k, k.clone())


# --------------------------------------------------------------------------
# error helpers
# --------------------------------------------------------------------------

def test_error_helpers_values():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([1.0, 2.5, 3.0])
    assert max_abs_err(a, b) == 0.5
    assert isinstance(max_abs_err(a, b), float) and isinstance(rel_fro_err(a, b), float)
    assert rel_fro_err(a, b) == pytest.approx(0.5 / math.sqrt(1 + 2.5 ** 2 + 9))
    assert max_abs_err(b, b) == 0.0 and rel_fro_err(b, b) == 0.0
    # Mixed dtypes are compared in float64.
    assert max_abs_err(b.to(BF16), b.double()) == 0.0


@pytest.mark.parametrize("helper", [pytest.param(max_abs_err, id="max_abs_err"),
                                    pytest.param(rel_fro_err, id="rel_fro_err")])
@pytest.mark.parametrize("where", [pytest.param(0, id="first"), pytest.param(500, id="middle"),
                                   pytest.param(-1, id="last")])
def test_nan_in_candidate_fails_the_check(helper, where):
    ref = torch.randn(1000, generator=torch.Generator().manual_seed(31))
    cand = ref.clone()
    cand[where] = math.nan
    err = helper(cand, ref)
    assert not err <= 1.0  # a "<= tol" check fails ...
    assert err > 1.0 or math.isnan(err)  # ... and a "> tol" check flags it
    # NaN in the reference must not pass either.
    assert not helper(ref, cand) <= 1.0


def test_nan_everywhere_fails_the_check():
    cand = torch.full((4, 4), math.nan)
    ref = torch.zeros(4, 4)
    assert not max_abs_err(cand, ref) <= 1e9
    assert not rel_fro_err(cand, ref) <= 1e9


def test_error_helpers_infinities():
    # Matching -inf (empty-row LSE) counts as agreement; -inf against a finite value does not.
    a = torch.tensor([-math.inf, 1.0])
    assert max_abs_err(a, a.clone()) == 0.0
    assert max_abs_err(a, torch.tensor([0.0, 1.0])) == math.inf
    assert rel_fro_err(torch.tensor([math.inf, 1.0]), torch.tensor([1.0, 1.0])) == math.inf
    # An all-zero reference: exact zeros pass, anything else does not.
    assert rel_fro_err(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_fro_err(torch.ones(3), torch.zeros(3)) == math.inf


def test_error_helpers_refuse_broadcasting():
    with pytest.raises(ValueError):
        max_abs_err(torch.zeros(3, 1), torch.zeros(3))
    with pytest.raises(ValueError):
        rel_fro_err(torch.zeros(3), torch.zeros(1))


def test_problem_draws_inputs_and_checks_an_output():
    p = reference.Problem(2, 70, 90, 4, 2, 32, causal=True, softmax_scale=0.2)
    q, k, v = p.inputs(seed=3, device="cpu")
    assert q.shape == (2, 70, 4, 32) and k.shape == v.shape == (2, 90, 2, 32) and q.dtype == BF16
    assert torch.equal(q, p.inputs(seed=3, device="cpu")[0]) and not torch.equal(q, p.inputs(seed=4, device="cpu")[0])
    out, lse = attention_reference(q, k, v, causal=True, softmax_scale=0.2)
    assert all(p.check(out.to(BF16), q, k, v, lse.float()))
    bad = p.check(out.to(BF16), q, k, v, lse.float() + 1e-2)
    assert bad[0] and not bad[1] and bad[1].name == "out lse"


# --------------------------------------------------------------------------
# Gradients: the reference's backward and SDPA's, for judging a backward kernel
# --------------------------------------------------------------------------

def _naive_grads(q, k, v, dout, causal, scale):
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, _ = _naive(*leaves, causal, scale)
    grads = torch.autograd.grad(out, leaves, dout.double(), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


@pytest.mark.parametrize("chunk", [1 << 24, 37 * 5], ids=["one-chunk", "many-chunks"])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,nheads,nheads_kv,headdim,causal,scale", REF_CASES)
def test_reference_grads_match_autograd_of_the_formula(monkeypatch, chunk, batch, seqlen_q, seqlen_k, nheads,
                                                       nheads_kv, headdim, causal, scale):
    monkeypatch.setattr(reference, "_CHUNK_ELEMS", chunk)
    q, k, v = _inputs(12, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, BF16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(13)).to(BF16)
    got = reference.attention_reference_grads(q, k, v, dout, causal=causal, softmax_scale=scale)
    want = _naive_grads(q, k, v, dout, causal, 1 / math.sqrt(headdim) if scale is None else scale)
    for name, g, w, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == torch.float64, name
        assert max_abs_err(g, w) < 1e-12, name


@pytest.mark.parametrize("causal", [True, False])
def test_baseline_grads_pass_the_judge_and_a_wrong_gradient_does_not(causal):
    q, k, v = _inputs(14, 2, 70, 90, 4, 2, 32, BF16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(15)).to(BF16)
    ref = reference.attention_reference_grads(q, k, v, dout, causal=causal)
    base = reference.attention_baseline_grads(q, k, v, dout, causal=causal)
    assert [g.dtype for g in base] == [BF16] * 3
    for name, b, r in zip(("dq", "dk", "dv"), base, ref):
        assert judge(name, r.to(BF16), r, b), name
    # dk of the second kv head only from one of its two query heads: a GQA reduction slip.
    q1 = q.clone()
    q1[:, :, 3] = 0
    half = reference.attention_reference_grads(q1, k, v, dout, causal=causal)[1]
    assert not judge("dk", half.to(BF16), ref[1], base[1])


def test_grads_without_keys_are_zero():
    q, k, v = _inputs(16, 1, 5, 0, 2, 1, 16, BF16)
    dout = torch.ones(q.shape, dtype=BF16)
    for grads in (reference.attention_reference_grads(q, k, v, dout),
                  reference.attention_baseline_grads(q, k, v, dout)):
        assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
        assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [1 << 24, 37 * 5], ids=["one-chunk", "many-chunks"])
def test_sampled_reference_grads_are_the_full_ones_on_the_samples(monkeypatch, chunk, causal):
    monkeypatch.setattr(reference, "_CHUNK_ELEMS", chunk)
    q, k, v = _inputs(17, 2, 70, 45, 4, 2, 16, BF16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(18)).to(BF16)
    full = reference.attention_reference_grads(q, k, v, dout, causal=causal)
    rows, keys = torch.tensor([0, 3, 24, 25, 69]), torch.tensor([1, 2, 44])
    dq, dk, dv = reference.attention_reference_grads(q, k, v, dout, causal=causal, rows=rows, key_rows=keys)
    assert dq.shape == (2, 5, 4, 16) and dk.shape == dv.shape == (2, 3, 2, 16)
    for got, want in ((dq, full[0][:, rows]), (dk, full[1][:, keys]), (dv, full[2][:, keys])):
        assert max_abs_err(got, want) < 1e-12
    base = reference.attention_baseline_grads(q, k, v, dout, causal=causal, rows=rows, key_rows=keys)
    full_base = reference.attention_baseline_grads(q, k, v, dout, causal=causal)
    assert torch.equal(base[0], full_base[0][:, rows]) and torch.equal(base[1], full_base[1][:, keys])


def test_baseline_grads_with_rows_that_see_no_key_are_finite_and_zero_there():
    q, k, v = _inputs(19, 2, 40, 25, 4, 4, 16, BF16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(20)).to(BF16)
    base = reference.attention_baseline_grads(q, k, v, dout, causal=True)
    ref = reference.attention_reference_grads(q, k, v, dout, causal=True)
    assert all(torch.isfinite(g).all() for g in base)
    assert (base[0][:, :15] == 0).all()
    for name, b, r in zip(("dq", "dk", "dv"), base, ref):
        assert judge(name, r.to(BF16), r, b), name


def test_judge_abs_tol_passes_noise_on_an_exact_zero_only_below_it():
    ref = torch.zeros(4, 8, dtype=torch.float64)
    value = torch.full((4, 8), 1e-6).to(BF16)
    exact_baseline = torch.zeros(4, 8, dtype=BF16)
    assert not judge("dq", value, ref, exact_baseline)
    verdict = judge("dq", value, ref, exact_baseline, abs_tol=1e-5)
    assert verdict and "abs_tol" in verdict.message and verdict.max_abs_limit == 1e-5
    assert not judge("dq", value * 100, ref, exact_baseline, abs_tol=1e-5)
    nan = value.clone()
    nan[0, 0] = float("nan")
    assert not judge("dq", nan, ref, exact_baseline, abs_tol=1.0)


def test_judge_abs_tol_drops_rows_of_noise_from_row_rel_only():
    """A row ~1e-6 in size (dK of the last key of a long causal row) off by
    10% is noise at the tensor's scale: with abs_tol it leaves row_rel; a
    row of ordinary size off by 10% still fails."""
    ref = torch.randn(16, 64, generator=torch.Generator().manual_seed(30), dtype=torch.float64)
    ref[5] *= 1e-6
    baseline = ref.to(BF16)
    value = ref.clone()
    value[5] *= 1.1
    value = value.to(BF16)
    assert not judge("dk", value, ref, baseline)
    verdict = judge("dk", value, ref, baseline, abs_tol=1e-3)
    assert verdict and verdict.row_rel < 1e-2, verdict.message
    wrong = ref.clone()
    wrong[7] *= 1.1
    assert not judge("dk", wrong.to(BF16), ref, baseline, abs_tol=1e-3)


@pytest.mark.parametrize("sq,sk,causal", [(33, 20, True), (20, 33, False), (5, 1, False), (1, 1, True)])
def test_check_attention_grads_passes_rounded_exact_grads_and_fails_slips(sq, sk, causal):
    q, k, v = _inputs(21, 2, sq, sk, 4, 2, 16, BF16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(22)).to(BF16)
    ref = reference.attention_reference_grads(q, k, v, dout, causal=causal)
    good = [g.to(BF16) for g in ref]
    if sk == 1:  # dq, dk exactly 0: kernel-like rounding noise must pass on the absolute floor
        good[0] = good[0] + 1e-6 * torch.randn(good[0].shape, generator=torch.Generator().manual_seed(2)).to(BF16)
    verdicts = reference.check_attention_grads(good, q, k, v, dout, causal=causal)
    assert [v_.name for v_ in verdicts] == ["dq", "dk", "dv"] and all(verdicts), [v_.message for v_ in verdicts]
    for i in range(3):
        bad = list(good)
        bad[i] = bad[i].clone()
        bad[i][0, -1] += 0.5  # one wrong row
        assert not reference.check_attention_grads(bad, q, k, v, dout, causal=causal)[i]
        nan = list(good)
        nan[i] = nan[i].clone()
        nan[i][-1, -1, -1, -1] = float("nan")
        assert "non-finite" in reference.check_attention_grads(nan, q, k, v, dout, causal=causal)[i].message
    wrong_shape = [good[0][:, :, :1], good[1], good[2]]
    assert "shape" in reference.check_attention_grads(wrong_shape, q, k, v, dout, causal=causal)[0].message


def test_baseline_grads_fall_back_when_cudnn_declines_the_backward(monkeypatch):
    """cuDNN can accept a forward and refuse its backward: the baseline then
    comes from the efficient/math backends, not an exception."""
    q, k, v = _inputs(23, 1, 20, 20, 2, 2, 16, BF16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(24)).to(BF16)
    real = reference.attention_baseline
    used = []

    class Refuses(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("cuDNN backward: head dim not supported")

    def baseline(q, k, v, *, cudnn=True, **kw):
        used.append(cudnn)
        out = real(q, k, v, cudnn=cudnn, **kw)
        return Refuses.apply(out) if cudnn else out

    monkeypatch.setattr(reference, "attention_baseline", baseline)
    base = reference.attention_baseline_grads(q, k, v, dout, causal=True)
    assert used == [True, False]
    ref = reference.attention_reference_grads(q, k, v, dout, causal=True)
    for name, b, r in zip(("dq", "dk", "dv"), base, ref):
        assert judge(name, r.to(BF16), r, b), name


def _cache_attention_like_a_kernel(q, kc, vc, lens, causal):
    """float32 scores, P rounded to bf16, fp32 accumulation, one rounding of O."""
    from hopper_flash.reference import attention_reference

    out = torch.zeros(q.shape, dtype=q.dtype)
    for b, length in enumerate(lens):
        if length:
            ref, _ = attention_reference(q[b:b + 1], kc[b:b + 1, :length], vc[b:b + 1, :length], causal=causal,
                                         dtype=torch.float32)
            out[b] = ref[0].to(q.dtype)
    return out


def test_check_kvcache_judges_live_keys_only():
    from hopper_flash.reference import check_kvcache

    torch.manual_seed(3)
    lens, sq, h, hkv, d = [0, 1, 40, 97], 3, 4, 2, 64
    kc = torch.randn(len(lens), 100, hkv, d).to(torch.bfloat16)
    vc = torch.randn_like(kc)
    for b, length in enumerate(lens):  # uninitialised cache tail
        kc[b, length:] = float("nan")
        vc[b, length:] = float("nan")
    q = torch.randn(len(lens), sq, h, d).to(torch.bfloat16)
    out = _cache_attention_like_a_kernel(q, kc, vc, lens, causal=False)
    assert all(check_kvcache(out, q, kc, vc, lens, causal=False))

    wrong = out.clone()
    wrong[3, -1, 0] *= 1.05  # one row of the longest sequence 5% off
    assert not all(check_kvcache(wrong, q, kc, vc, lens, causal=False))
    wrong = out.clone()
    wrong[0, 0, 0, 0] = 1.0  # the row with no live key must stay 0
    verdicts = check_kvcache(wrong, q, kc, vc, lens, causal=False)
    assert not verdicts[0] and all(verdicts[1:])
    swapped = out.clone()
    swapped[[2, 3]] = out[[3, 2]]  # rows judged against their own cache rows
    assert not all(check_kvcache(swapped, q, kc, vc, lens, causal=False, rows=None))
    assert all(check_kvcache(out[[0, 1, 3, 2]], q[[0, 1, 3, 2]], kc, vc, [0, 1, 97, 40], causal=False,
                             rows=[0, 1, 3, 2]))


@pytest.mark.parametrize("sq,sk,causal,window", [(7, 11, True, (3, 0)), (11, 7, False, (2, 1)),
                                                 (9, 9, False, (-1, 2)), (5, 12, True, (0, 0))])
def test_reference_and_its_grads_apply_the_window_as_a_dense_mask_does(sq, sk, causal, window):
    """attention_reference / attention_reference_grads (whole and sampled)
    with a sliding window against float64 autograd through a dense masked
    softmax written out here: row i sees key j iff i + off - left <= j <= i +
    off + right (and j <= i + off when causal), off = sk - sq."""
    q, k, v = _inputs(40, 2, sq, sk, 4, 2, 16, torch.float64)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(41), dtype=torch.float64)
    left, right = window
    i, j = torch.arange(sq)[:, None] + (sk - sq), torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right

    def dense(q, k, v):
        kr, vr = (x.repeat_interleave(2, dim=2) for x in (k, v))
        s = torch.einsum("bqhd,bkhd->bhqk", q, kr) * 0.25
        s = s.masked_fill(~visible, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.where(visible.any(-1)[:, None], torch.softmax(s, -1), 0.0)
        return torch.einsum("bhqk,bkhd->bqhd", p, vr), lse

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want_out, want_lse = dense(*leaves)
    want = torch.autograd.grad(want_out, leaves, dout)
    out, lse = attention_reference(q, k, v, causal=causal, softmax_scale=0.25, window=window)
    torch.testing.assert_close(out, want_out.detach())
    torch.testing.assert_close(lse, want_lse.detach())
    for got, exp in zip(reference.attention_reference_grads(q, k, v, dout, causal=causal, softmax_scale=0.25,
                                                            window=window), want):
        torch.testing.assert_close(got, exp)
    rows, keys = torch.tensor([0, sq // 2, sq - 1]), torch.tensor([1, sk - 1])
    dq, dk, dv = reference.attention_reference_grads(q, k, v, dout, causal=causal, softmax_scale=0.25, rows=rows,
                                                     key_rows=keys, window=window)
    torch.testing.assert_close(dq, want[0][:, rows])
    torch.testing.assert_close(dk, want[1][:, keys])
    torch.testing.assert_close(dv, want[2][:, keys])


@pytest.mark.parametrize("causal", [True, False])
def test_v_of_its_own_head_dim_is_the_zero_padded_problem_cut_back(causal):
    """FA3's hdim_v: v's head dim other than q's and k's. The reference, its
    gradients, the sampled gradients and the baseline give what the same
    problem with v zero-padded to q's head dim gives, cut back to v's."""
    g = torch.Generator().manual_seed(21)
    q = torch.randn(2, 9, 4, 16, generator=g).to(BF16)
    k = torch.randn(2, 13, 2, 16, generator=g).to(BF16)
    v = torch.randn(2, 13, 2, 8, generator=g).to(BF16)
    dout = torch.randn(2, 9, 4, 8, generator=g).to(BF16)
    wide = torch.nn.functional.pad(v, (0, 8))
    out, lse = attention_reference(q, k, v, causal=causal)
    out_w, lse_w = attention_reference(q, k, wide, causal=causal)
    # (Not bitwise: float64 matmuls of v's width and the padded width may sum in another order, by BLAS kernel.)
    assert out.shape == (2, 9, 4, 8) and max_abs_err(out, out_w[..., :8]) < 1e-12 and max_abs_err(lse, lse_w) < 1e-12
    base = attention_baseline(q, k, v, causal=causal)
    assert base.shape == out.shape and max_abs_err(base.double(), out) < 0.05
    dq, dk, dv = reference.attention_reference_grads(q, k, v, dout, causal=causal)
    dq_w, dk_w, dv_w = reference.attention_reference_grads(q, k, wide, torch.nn.functional.pad(dout, (0, 8)),
                                                           causal=causal)
    assert dv.shape == v.shape
    for a, b in ((dq, dq_w), (dk, dk_w), (dv, dv_w[..., :8])):
        assert max_abs_err(a, b) < 1e-12
    sq, sk, sv = reference._sampled_reference_grads(q, k, v, dout, causal, None, [0, 8], [1, 12])
    assert sv.shape == (2, 2, 2, 8) and max_abs_err(sv, dv[:, [1, 12]]) < 1e-12


@pytest.mark.parametrize("cap,page", [(300, 64), (256, 64), (5, 16)])
def test_paged_cache_reads_back_the_rows_and_fills_past_them(cap, page):
    k, v = (torch.randn(3, cap, 2, 8, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in (1, 2))
    kp, vp, table = reference.paged_cache(k, v, page, seed=4)
    pages = -(-cap // page)
    assert table.dtype == torch.int32 and table.shape == (3, pages) and kp.shape == (3 * pages, page, 2, 8)
    assert sorted(table.flatten().tolist()) == list(range(3 * pages))  # every page once
    assert table.flatten().tolist() != list(range(3 * pages))  # shuffled
    for pool, cache in ((kp, k), (vp, v)):
        rows = pool[table.long()].flatten(1, 2)  # [B, pages * page, Hkv, D]
        assert torch.equal(rows[:, :cap], cache)
        assert rows[:, cap:].isnan().all()
