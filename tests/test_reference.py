"""CPU tests for hopper_flash.reference: the ground truth, the kernel emulator
and the error helpers. No GPU needed; the whole file runs in seconds."""
from __future__ import annotations

import math

import pytest
import torch

from hopper_flash import reference
from hopper_flash.reference import attention_reference, emulate_forward, max_abs_err, rel_fro_err

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
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert max_abs_err(out, want_out) < 1e-12
    assert _same_inf(lse, want_lse.float())
    # lse is float32: compare at float32 resolution.
    assert max_abs_err(lse, want_lse.float()) < 1e-5


def test_reference_float32_mode():
    q, k, v = _inputs(2, 2, 40, 60, 4, 2, 32, BF16)
    out64, lse64 = attention_reference(q, k, v, causal=True)
    out32, lse32 = attention_reference(q, k, v, causal=True, dtype=torch.float32)
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    assert rel_fro_err(out32, out64) < 1e-5
    assert max_abs_err(lse32, lse64) < 1e-4


def test_reference_rejects_other_dtypes():
    q, k, v = _inputs(3, 1, 4, 4, 1, 1, 8, BF16)
    with pytest.raises(ValueError):
        attention_reference(q, k, v, dtype=torch.bfloat16)


@pytest.mark.parametrize("fn", [pytest.param(attention_reference, id="reference"),
                                pytest.param(emulate_forward, id="emulator")])
def test_rows_without_keys_give_zero_and_neg_inf(fn):
    # seqlen_q > seqlen_k, causal: rows 0 .. (seqlen_q - seqlen_k - 1) see no key.
    seqlen_q, seqlen_k = 200, 70
    q, k, v = _inputs(4, 2, seqlen_q, seqlen_k, 2, 1, 64, BF16)
    out, lse = fn(q, k, v, causal=True)
    n_empty = seqlen_q - seqlen_k
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[:, :n_empty] == 0)
    assert torch.all(lse[:, :, :n_empty] == -math.inf)
    assert torch.isfinite(lse[:, :, n_empty:]).all()
    assert (out[:, n_empty:].abs().amax(dim=-1) > 0).all()


def test_reference_row_chunking_is_invisible(monkeypatch):
    # Force many small row chunks (the path S ~ 8k takes) and check nothing changes.
    q, k, v = _inputs(5, 2, 50, 37, 2, 1, 16, BF16)
    want_out, want_lse = attention_reference(q, k, v, causal=True)
    monkeypatch.setattr(reference, "_SCORE_CHUNK_ELEMS", 37 * 3)
    out, lse = attention_reference(q, k, v, causal=True)
    assert max_abs_err(out, want_out) < 1e-12
    assert max_abs_err(lse, want_lse) < 1e-6


@pytest.mark.parametrize("fn", [pytest.param(attention_reference, id="reference"),
                                pytest.param(emulate_forward, id="emulator")])
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
# emulate_forward vs attention_reference
# --------------------------------------------------------------------------

def _check_emulator(q, k, v, *, causal, softmax_scale=None, block_m=128, block_n=128):
    """Emulator output within 1e-2 rel-Frobenius of the float64 reference, and
    within 2x (+1e-4) of the error of merely rounding that reference to bf16.

    The emulator rounds P to the input dtype before PV and its output to the
    input dtype, so for bf16 it lands at ~1.2x the bf16 rounding floor (~2e-3);
    the second bound catches algorithm slips too small for the 1e-2 one.
    """
    out, lse = emulate_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                               block_m=block_m, block_n=block_n)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)

    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()

    err = rel_fro_err(out, ref_out)
    floor = rel_fro_err(ref_out.to(BF16), ref_out)
    assert err <= 1e-2, f"rel_fro_err {err:.3e} (bf16 rounding floor {floor:.3e})"
    assert err <= 2 * floor + 1e-4, f"rel_fro_err {err:.3e} vs bf16 rounding floor {floor:.3e}"

    assert _same_inf(lse, ref_lse), "emulator and reference disagree on which rows see no key"
    finite = torch.isfinite(ref_lse)
    assert max_abs_err(lse[finite], ref_lse[finite]) < 1e-3


SEQLENS = [1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 1000]


@pytest.mark.parametrize("causal", [pytest.param(False, id="noncausal"), pytest.param(True, id="causal")])
@pytest.mark.parametrize("seqlen", [pytest.param(s, id=f"s{s}") for s in SEQLENS])
@pytest.mark.parametrize("nheads", [pytest.param(h, id=f"h{h}") for h in (1, 2)])
@pytest.mark.parametrize("batch", [pytest.param(b, id=f"b{b}") for b in (1, 3)])
def test_emulator_equal_lengths(batch, nheads, seqlen, causal):
    q, k, v = _inputs(100 + seqlen, batch, seqlen, seqlen, nheads, nheads, 64, BF16)
    _check_emulator(q, k, v, causal=causal)


UNEQUAL = [(100, 300), (300, 100), (129, 1), (1, 129), (64, 256), (256, 64),
           (200, 333), (333, 200), (127, 129), (129, 127), (1, 1000), (1000, 1)]


@pytest.mark.parametrize("causal", [pytest.param(False, id="noncausal"), pytest.param(True, id="causal")])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [pytest.param(sq, sk, id=f"sq{sq}-sk{sk}") for sq, sk in UNEQUAL])
def test_emulator_unequal_lengths(seqlen_q, seqlen_k, causal):
    q, k, v = _inputs(7 * seqlen_q + seqlen_k, 2, seqlen_q, seqlen_k, 2, 2, 64, BF16)
    _check_emulator(q, k, v, causal=causal)


SMALL_SHAPES = [pytest.param(255, 255, id="s255"),
                pytest.param(100, 300, id="sq100-sk300"),
                pytest.param(300, 100, id="sq300-sk100")]


@pytest.mark.parametrize("causal", [pytest.param(False, id="noncausal"), pytest.param(True, id="causal")])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SMALL_SHAPES)
@pytest.mark.parametrize("headdim", [pytest.param(d, id=f"d{d}") for d in (64, 128)])
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")])
def test_emulator_dtypes_and_headdims(dtype, headdim, seqlen_q, seqlen_k, causal):
    q, k, v = _inputs(11, 2, seqlen_q, seqlen_k, 2, 2, headdim, dtype)
    _check_emulator(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [pytest.param(False, id="noncausal"), pytest.param(True, id="causal")])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [pytest.param(129, 129, id="s129")] + SMALL_SHAPES[1:])
@pytest.mark.parametrize("nheads,nheads_kv", [pytest.param(4, 2, id="gqa4over2"),
                                              pytest.param(4, 1, id="gqa4over1"),
                                              pytest.param(8, 2, id="gqa8over2")])
def test_emulator_gqa(nheads, nheads_kv, seqlen_q, seqlen_k, causal):
    q, k, v = _inputs(13, 2, seqlen_q, seqlen_k, nheads, nheads_kv, 64, BF16)
    # Give each kv head a different scale so a wrong head mapping cannot hide.
    k = k * torch.arange(1, nheads_kv + 1, dtype=BF16)[None, None, :, None]
    _check_emulator(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [pytest.param(False, id="noncausal"), pytest.param(True, id="causal")])
@pytest.mark.parametrize("softmax_scale", [pytest.param(s, id=f"scale{s}") for s in (0.05, 0.3, 1.0)])
def test_emulator_softmax_scale(softmax_scale, causal):
    q, k, v = _inputs(17, 2, 200, 333, 2, 2, 64, BF16)
    _check_emulator(q, k, v, causal=causal, softmax_scale=softmax_scale)


@pytest.mark.parametrize("causal", [pytest.param(False, id="noncausal"), pytest.param(True, id="causal")])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [pytest.param(1000, 1000, id="s1000")] + SMALL_SHAPES[1:])
@pytest.mark.parametrize("block_m,block_n", [pytest.param(bm, bn, id=f"bm{bm}-bn{bn}")
                                             for bm, bn in ((64, 64), (64, 128), (128, 64), (192, 128), (128, 176))])
def test_emulator_block_sizes(block_m, block_n, seqlen_q, seqlen_k, causal):
    # Other tile shapes exercise the tile-count and mask-skipping rules off the 128 grid.
    q, k, v = _inputs(19, 1, seqlen_q, seqlen_k, 2, 2, 64, BF16)
    _check_emulator(q, k, v, causal=causal, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("causal", [pytest.param(False, id="noncausal"), pytest.param(True, id="causal")])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [pytest.param(129, 129, id="s129"),
                                               pytest.param(1, 129, id="sq1-sk129")] + SMALL_SHAPES[1:])
def test_emulator_fp32_inputs_are_tight(seqlen_q, seqlen_k, causal):
    # With fp32 inputs rounding P is a no-op, so only float32 arithmetic separates
    # the tiled online softmax from the exact answer: any algorithm slip shows.
    q, k, v = _inputs(23, 2, seqlen_q, seqlen_k, 2, 1, 64, torch.float32)
    out, lse = emulate_forward(q, k, v, causal=causal)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
    assert rel_fro_err(out, ref_out) < 1e-5
    assert _same_inf(lse, ref_lse)
    finite = torch.isfinite(ref_lse)
    assert max_abs_err(lse[finite], ref_lse[finite]) < 1e-5


@pytest.mark.parametrize("causal", [pytest.param(False, id="noncausal"), pytest.param(True, id="causal")])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [pytest.param(256, 256, id="s256"),
                                               pytest.param(300, 100, id="sq300-sk100")])
@pytest.mark.parametrize("mul", [pytest.param(10.0, id="x10"), pytest.param(100.0, id="x100")])
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")])
def test_emulator_large_magnitude_scores(dtype, mul, seqlen_q, seqlen_k, causal):
    # q, k scaled by 100 put raw scores at ~1e4-1e5: the online softmax must
    # subtract the running max before exp2, or it overflows to inf / NaN.
    q, k, v = _inputs(29, 2, seqlen_q, seqlen_k, 2, 2, 64, dtype, mul=mul)
    out, lse = emulate_forward(q, k, v, causal=causal)
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal)
    assert torch.isfinite(out).all()
    assert not torch.isnan(lse).any()
    assert _same_inf(lse, ref_lse)
    assert rel_fro_err(out, ref_out) <= 1e-2
    finite = torch.isfinite(ref_lse)
    # LSE is ~1e4 here; float32 resolves it only to a few ulps, so compare relatively.
    lse_err = (lse[finite].double() - ref_lse[finite].double()).abs()
    assert (lse_err <= 1e-3 + 1e-6 * ref_lse[finite].double().abs()).all()


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
