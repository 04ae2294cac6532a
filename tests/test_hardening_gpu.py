"""Hardening checks of the forward kernel on a Hopper GPU, beyond accuracy on
ordinary shapes (``test_forward_gpu.py``):

* edge sizes: empty problems return at once without a launch (proved by
  replacing ``plan.launch_forward`` with a function that fails); sequence
  length 1 on either side for every head dim;
* NaN and Inf inputs propagate like the float32 reference, and masked
  positions stay clean (the mask is a select, not an additive -inf);
* huge problems: tensors of more than 2**31 elements, 262144-long sequences,
  65535 and 65536 batches or heads (past CUDA's 65535 limit on grid axes y
  and z, which a launch must not use for them), and a clear error for a
  problem with more work items than the kernel numbers in int32;
* streams and devices: work goes on the caller's current stream, two streams
  run side by side, inputs on cuda:1 while cuda:0 is current;
* inputs are never written, outputs are fresh tensors.

Accuracy is judged as everywhere (``hopper_flash.reference``): against the
float64 reference, relative to SDPA's error on the same inputs; where inputs
hold NaN or inf, SDPA runs on the inputs with those zeroed and only the
elements they cannot reach are judged.

Peak memory of the huge tests is printed (also without ``-s``).
"""
import gc

import pytest
import torch

import hopper_flash
from hopper_flash import dispatch, plan
from hopper_flash.reference import (assert_judged, attention_baseline, attention_reference, judge, judge_lse,
                                    score_scale)

try:  # pytest's default import mode puts tests/ on sys.path
    from test_forward_gpu import (assert_attention_correct, assert_guards_intact, check_forward, guarded_out,
                                  make_qkv)
except ImportError:  # --import-mode=importlib, run from the repository root
    from tests.test_forward_gpu import (assert_attention_correct, assert_guards_intact, check_forward,
                                        guarded_out, make_qkv)

pytestmark = pytest.mark.gpu

HEAD_DIMS = (64, 128, 256)  # the supported head dims, written out
# CUDA's limit on grid axes y and z.
GRID_YZ_MAX = 65535


@pytest.fixture(autouse=True)
def _release_cuda_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture
def no_launch(monkeypatch):
    """Make any kernel launch fail the test."""

    def launch_forward(*args, **kwargs):
        raise AssertionError("plan.launch_forward was called")

    monkeypatch.setattr(plan, "launch_forward", launch_forward)


def assert_lse_matches(lse, ref_lse, q, k, what="LSE", softmax_scale=None):
    """The kernel's LSE against the reference's (same NaN/inf positions), with
    the score scale of the inputs with any NaN/inf zeroed."""
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape, (lse.dtype, lse.shape, ref_lse.shape)
    assert_judged(what, lse, ref_lse, score_scale=score_scale(_zeroed(q), _zeroed(k), softmax_scale=softmax_scale))


def _zeroed(x):
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


# --------------------------------------------------------------------------
# Edge sizes
# --------------------------------------------------------------------------

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv): no output element at all.
EMPTY_OUTPUT = {
    "batch0": (0, 5, 7, 4, 2),
    "batch0-k0": (0, 3, 0, 4, 4),
    "seqlen_q0": (2, 0, 9, 4, 2),
    "seqlen_q0-k0": (2, 0, 0, 4, 2),
    "nheads0": (2, 5, 7, 0, 2),  # 0 q heads, 2 kv heads: 0 is a multiple of 2
}


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", list(EMPTY_OUTPUT), ids=list(EMPTY_OUTPUT))
def test_empty_output_without_launch(no_launch, case, head_dim, causal, return_lse):
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = EMPTY_OUTPUT[case]
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, seed=head_dim)
    res = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.numel() == 0
    if return_lse:
        assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32 and lse.device == q.device


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("shape", [(2, 5, 4, 2), (1, 300, 8, 8)], ids=["small", "multi-tile"])
def test_zero_length_kv_gives_zeros_without_launch(no_launch, shape, head_dim, causal, dtype):
    batch, seqlen_q, nheads, nheads_kv = shape
    q, k, v = make_qkv(batch, seqlen_q, 0, nheads, nheads_kv, head_dim, dtype, seed=head_dim + 1)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert (out == 0).all()
    assert lse.shape == (batch, nheads, seqlen_q) and torch.isneginf(lse).all()
    # A caller's (poisoned) buffer is zeroed, and nothing around it is touched.
    buf, out = guarded_out(q)
    out = dispatch.forward(q, k, v, None, causal, False, out=out)
    assert_guards_intact(buf, q.numel())
    assert (out == 0).all()


@pytest.mark.parametrize("nheads", [4, 0])
def test_zero_kv_heads_is_rejected(no_launch, nheads):
    q, k, v = make_qkv(1, 4, 4, nheads, 0, 128)
    with pytest.raises(ValueError, match=r"k and v must have at least one head \(k.shape\[2\] >= 1\), got 0"):
        hopper_flash.flash_attn_func(q, k, v, causal=True)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 517), (517, 1)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_seqlen_one(head_dim, causal, seqlen_q, seqlen_k):
    check_forward(2, seqlen_q, seqlen_k, 4, 2, head_dim=head_dim, causal=causal,
                  seed=head_dim * 7 + seqlen_q * 3 + seqlen_k)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_single_query_long_kv(head_dim, causal):
    # One query row against 65537 keys (512 KV tiles + 1 key): a decode step.
    q, k, v = make_qkv(1, 1, 65537, 8, 2, head_dim, seed=head_dim + 1)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_attention_correct(q, k, v, out, lse, causal=causal, what="decode")


# --------------------------------------------------------------------------
# NaN and Inf inputs. The kernel masks with a select, so a NaN score at a
# hidden position never reaches the softmax; at a visible position it poisons
# the whole row, as in the reference.
# --------------------------------------------------------------------------

def _run_nonfinite(q, k, v, causal):
    """The kernel's (out, lse), the reference's, and SDPA's output on the
    inputs with NaN/inf zeroed: the baseline for the elements those values
    cannot reach."""
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, causal=causal)
    base = attention_baseline(_zeroed(q), _zeroed(k), _zeroed(v), causal=causal)
    return out, lse, ref, ref_lse, base


def _assert_pattern(got, want, what):
    for name, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        a, b = fn(got), fn(want)
        if not torch.equal(a, b):
            where = (a != b).nonzero()
            raise AssertionError(f"{what}: {name} pattern differs at {where.shape[0]} positions, "
                                 f"first (b, s, h, d) {where[:4].tolist()}")


def _assert_close_where(out, ref, base, mask, what):
    """Elements selected by ``mask`` are finite in both and pass the judge."""
    assert torch.isfinite(ref[mask]).all(), f"{what}: reference not finite where it should be"
    assert_judged(what, out[mask], ref[mask], base[mask])


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_nan_in_query_row(head_dim, causal):
    q, k, v = make_qkv(2, 300, 300, 4, 2, head_dim, seed=head_dim + 11)
    q[1, 150, 3, 7] = float("nan")
    out, lse, ref, ref_lse, base = _run_nonfinite(q, k, v, causal)
    expected = torch.zeros_like(out, dtype=torch.bool)
    expected[1, 150, 3, :] = True
    assert torch.equal(torch.isnan(out), expected), "NaN must fill exactly the row of the NaN query"
    _assert_pattern(out, ref, "out vs reference")
    _assert_close_where(out, ref, base, ~expected, "rows without NaN")
    expected_lse = torch.zeros_like(lse, dtype=torch.bool)
    expected_lse[1, 3, 150] = True
    assert torch.equal(torch.isnan(lse), expected_lse)
    assert_lse_matches(lse, ref_lse, q, k)


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_nan_in_query_row_that_sees_no_key(head_dim):
    # Causal, seqlen_q > seqlen_k: rows 0..99 see no key, so row 50 stays 0 / -inf.
    q, k, v = make_qkv(2, 300, 200, 4, 2, head_dim, seed=head_dim + 12)
    q[0, 50, 1, 3] = float("nan")
    out, lse, ref, ref_lse, base = _run_nonfinite(q, k, v, True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0, :100] == 0).all() and torch.isneginf(lse[0, :, :100]).all()
    assert_judged("masked NaN row", out, ref, base)
    assert_lse_matches(lse, ref_lse, q, k)


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_nan_in_key(head_dim, causal):
    # seqlen_k - seqlen_q = 100: causal row i sees key j iff j <= i + 100.
    seqlen_q, seqlen_k, nheads, nheads_kv = 300, 400, 4, 2
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, seed=head_dim + 13)
    k[0, 200, 1, 5] = float("nan")  # kv head 1 = q heads 2, 3; seen by rows >= 100 when causal
    k[1, 0, 0, 9] = float("nan")  # kv head 0 = q heads 0, 1; key 0 is seen by every row
    out, lse, ref, ref_lse, base = _run_nonfinite(q, k, v, causal)
    rows_nan = torch.zeros(2, seqlen_q, nheads, dtype=torch.bool, device="cuda")
    rows_nan[0, 100 if causal else 0:, 2:4] = True
    rows_nan[1, :, 0:2] = True
    expected = rows_nan[..., None].expand_as(out)
    assert torch.equal(torch.isnan(out), expected), "NaN must fill exactly the rows that see the NaN key"
    _assert_pattern(out, ref, "out vs reference")
    _assert_close_where(out, ref, base, ~expected, "rows that do not see the NaN key")
    assert torch.equal(torch.isnan(lse), rows_nan.transpose(1, 2))
    assert_lse_matches(lse, ref_lse, q, k)


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_inf_in_value_full(head_dim):
    # Every row sees every key with a positive weight: column 5 of the rows
    # reading kv head 1 is +inf, everything else finite, exactly as the reference.
    q, k, v = make_qkv(2, 300, 400, 4, 2, head_dim, seed=head_dim + 14)
    v[0, 200, 1, 5] = float("inf")
    out, lse, ref, ref_lse, base = _run_nonfinite(q, k, v, False)
    expected = torch.zeros_like(out, dtype=torch.bool)
    expected[0, :, 2:4, 5] = True
    assert torch.equal(torch.isposinf(out), expected)
    _assert_pattern(out, ref, "out vs reference")
    _assert_close_where(out, ref, base, ~expected, "entries without the inf")
    assert_lse_matches(lse, ref_lse, q, k)


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("seqlen_q,seqlen_k,row_sees_inf", [(100, 100, 60), (300, 400, 100)],
                         ids=["one-tile", "multi-tile"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_inf_in_value_causal(head_dim, seqlen_q, seqlen_k, row_sees_inf):
    """Rows that see the +inf value get +inf in its column, as in the reference.

    Rows that do not see it give weight exactly 0 to it; the reference then
    computes 0 * inf = NaN in that column. The kernel gives NaN there too when
    its query tile reads the KV tile holding the inf, and the finite (correct
    masked) value when causal tile skipping never reads it: both are accepted,
    nothing else is.
    """
    j = seqlen_k - seqlen_q + row_sees_inf  # row i sees key j iff i >= row_sees_inf
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, seed=head_dim + 15)
    v[0, j, 1, 5] = float("inf")
    out, lse, ref, ref_lse, base = _run_nonfinite(q, k, v, True)
    ref_masked, _ = attention_reference(q, k, _zeroed(v), causal=True)  # base is SDPA on these inputs

    sees = torch.zeros_like(out, dtype=torch.bool)
    sees[0, row_sees_inf:, 2:4, 5] = True
    blind = torch.zeros_like(out, dtype=torch.bool)
    blind[0, :row_sees_inf, 2:4, 5] = True
    assert torch.equal(torch.isposinf(out), sees), "+inf must fill the column of the rows that see it"
    assert torch.equal(torch.isposinf(ref), sees)
    assert not torch.isneginf(out).any()
    assert torch.equal(torch.isnan(out) & ~blind, torch.zeros_like(blind)), "NaN outside the masked column"
    blind_finite = blind & torch.isfinite(out)
    if blind_finite.any():
        _assert_close_where(out, ref_masked, base, blind_finite, "masked column, finite entries")
    _assert_close_where(out, ref, base, ~(sees | blind), "entries away from the inf column")
    assert_lse_matches(lse, ref_lse, q, k)


# --------------------------------------------------------------------------
# Huge problems
# --------------------------------------------------------------------------

def _skip_unless_free(nbytes):
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs about {nbytes / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")


def _huge_samples(batch, seqlen, nheads, n_random, seed):
    """(batch, query row, head) triples: tile edges, the very last rows, one per batch, random ones."""
    b1, s1, h1 = batch - 1, seqlen - 1, nheads - 1
    samples = [(0, 0, 0), (0, 127, 0), (0, 128, h1), (b1, 0, h1), (b1, s1, h1), (b1, s1 - 1, h1),
               (b1, s1 - 63, h1), (b1, s1 - 64, nheads // 2), (b1, s1 - 127, h1), (b1, s1 - 128, 0),
               (batch // 2, seqlen // 2, nheads // 2)]
    samples += [(b, max(0, s1 - 1000 * b), (7 * b) % nheads) for b in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    target = len(set(samples)) + n_random
    while len(set(samples)) < target:
        samples.append(tuple(int(torch.randint(0, n, (1,), generator=gen)) for n in (batch, seqlen, nheads)))
    return sorted(set(samples))


def _run_huge_causal(batch, seqlen, nheads, head_dim, samples, seed, capsys):
    """Causal self-attention, then check sampled rows against the reference of
    that row alone (its query against its visible keys, float32, on the GPU).

    Failures are collected and raised after the big tensors are freed, so a
    failing test's traceback does not hold tens of GiB."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    q, k, v = make_qkv(batch, seqlen, seqlen, nheads, nheads, head_dim, seed=seed)
    buf, out = guarded_out(q)
    out, lse = dispatch.forward(q, k, v, None, True, True, out=out)
    torch.cuda.synchronize()
    failures = []
    try:
        assert_guards_intact(buf, q.numel())
    except AssertionError as e:
        failures.append(str(e))
    unwritten = [b for b in range(batch) if torch.isnan(out[b]).any()]
    if unwritten:
        failures.append(f"NaN (unwritten or NaN-producing) output elements in batches {unwritten}")
    got, ref, baseline, got_lse, ref_lse, scales = [], [], [], [], [], []
    for b, i, h in samples:
        # Causal with seqlen_q == seqlen_k: row i sees keys 0..i.
        qs, ks, vs = q[b:b + 1, i:i + 1, h:h + 1], k[b:b + 1, :i + 1, h:h + 1], v[b:b + 1, :i + 1, h:h + 1]
        r, r_lse = attention_reference(qs, ks, vs, causal=False)
        ref.append(r[0, 0, 0])
        ref_lse.append(r_lse[0, 0, 0])
        baseline.append(attention_baseline(qs, ks, vs, causal=False)[0, 0, 0])
        scales.append(score_scale(qs, ks)[0, 0, 0])
        got.append(out[b, i, h])
        got_lse.append(lse[b, h, i])
    # All sampled rows judged together ([rows, head_dim]: row_rel is per sampled row).
    verdicts = [judge("sampled rows", torch.stack(got), torch.stack(ref), torch.stack(baseline)),
                judge_lse("sampled rows' LSE", torch.stack(got_lse), torch.stack(ref_lse),
                          score_scale=torch.stack(scales))]
    failures += [v.message for v in verdicts if not v]
    peak = torch.cuda.max_memory_allocated() - base
    numel = q.numel()
    del q, k, v, out, lse, buf
    gc.collect()
    torch.cuda.empty_cache()
    with capsys.disabled():
        print(f"\n[huge] B={batch} S={seqlen} H={nheads} D={head_dim} causal: {numel} elements per tensor, "
              f"peak {peak / 2**30:.1f} GiB allocated, {len(samples)} sampled rows; {verdicts[0].message}")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(300)
def test_more_than_2_31_elements_per_tensor(capsys):
    # 8 * 131072 * 32 * 128 = 2**32 elements = 8 GiB per bf16 tensor; batches
    # 4..7 start past element 2**31. Peak ~40 GiB: q, k, v, out and one
    # float32 randn temporary (16 GiB) in make_qkv.
    batch, seqlen, nheads, head_dim = 8, 131072, 32, 128
    _skip_unless_free(44 * 2**30)
    samples = _huge_samples(batch, seqlen, nheads, 8, seed=1)
    _run_huge_causal(batch, seqlen, nheads, head_dim, samples, seed=101, capsys=capsys)


@pytest.mark.timeout(300)
def test_seqlen_262144(capsys):
    # 2048 query tiles, up to 2048 KV tiles per CTA (many trips around the rings).
    batch, seqlen, nheads, head_dim = 1, 262144, 8, 128
    _skip_unless_free(4 * 2**30)
    samples = _huge_samples(batch, seqlen, nheads, 8, seed=2)
    _run_huge_causal(batch, seqlen, nheads, head_dim, samples, seed=102, capsys=capsys)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_grid_many_batches_and_heads(causal):
    # 1024 x 64 = 65536 (batch, head) pairs, one query tile each; 512 MiB per tensor.
    q, k, v = make_qkv(1024, 64, 64, 64, 64, 64, seed=103)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_attention_correct(q, k, v, out, lse, causal=causal, what="B=1024 H=64")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_grid_65535_batches(causal):
    # One key per row: softmax weight exactly 1, out == v bit for bit, lse == the one score.
    q, k, v = make_qkv(GRID_YZ_MAX, 1, 1, 1, 1, 64, seed=104)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out, v)
    _, ref_lse = attention_reference(q, k, v, causal=causal)
    assert_lse_matches(lse, ref_lse, q, k, "B=65535 LSE")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_grid_65535_heads(causal):
    # 65535 q heads over 5 kv heads (groups of 13107).
    q, k, v = make_qkv(1, 3, 3, GRID_YZ_MAX, 5, 64, seed=105)
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert_attention_correct(q, k, v, out, lse, causal=causal, what="H=65535")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch,nheads", [(GRID_YZ_MAX + 1, 1), (1, GRID_YZ_MAX + 1)], ids=["batch", "nheads"])
def test_batch_or_heads_past_65535(batch, nheads):
    """65536 batches or heads of one query tile each are 65536 work items,
    far below the kernel's int32 limit: the launch must not put them on grid
    axes y or z (65535 at most). One key per row, so out == v exactly."""
    q, k, v = make_qkv(batch, 1, 1, nheads, 1, 64, seed=110)
    out = hopper_flash.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, v.expand(out.shape)), "one key per row: out must equal v"


def test_too_many_work_items_is_a_clear_error(no_launch):
    # 65536 batches x 32768 heads x 1 query tile = 2**31 work items: one past
    # the kernel's int32 item numbering. The inputs are stride-0 expansions of
    # one row, so nothing big is allocated; the work-item check must come
    # before the stride checks.
    row = torch.zeros(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16)
    q, k = row.expand(65536, 1, 32768, 64), row.expand(65536, 1, 1, 64)
    with pytest.raises(ValueError, match=r"batch \(65536\).*limit of 2147483647 work items"):
        hopper_flash.flash_attn_func(q, k, k, causal=True)


# --------------------------------------------------------------------------
# Streams and devices
# --------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_two_streams_side_by_side():
    p1 = make_qkv(2, 1000, 1000, 8, 8, 128, seed=106)
    p2 = make_qkv(1, 777, 1500, 4, 2, 64, dtype=torch.float16, seed=107)
    default = torch.cuda.current_stream()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(default)
    s2.wait_stream(default)
    outs1, outs2 = [], []
    for _ in range(3):
        with torch.cuda.stream(s1):
            outs1.append(hopper_flash.flash_attn_func(*p1, causal=True, return_lse=True))
        with torch.cuda.stream(s2):
            outs2.append(hopper_flash.flash_attn_func(*p2, causal=False, return_lse=True))
    torch.cuda.synchronize()
    for (o1, l1), (o2, l2) in zip(outs1, outs2):
        assert torch.equal(o1, outs1[0][0]) and torch.equal(l1, outs1[0][1])
        assert torch.equal(o2, outs2[0][0]) and torch.equal(l2, outs2[0][1])
    assert_attention_correct(*p1, *outs1[0], causal=True, what="stream 1")
    assert_attention_correct(*p2, *outs2[0], causal=False, what="stream 2")


SLEEP_CYCLES = 2**31  # about 1.1 s at the H200's 1.98 GHz


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["cached", "jit"])
def test_work_is_enqueued_on_the_current_stream(monkeypatch, path):
    """The default stream is kept busy by a long sleep kernel; the call is made
    inside ``torch.cuda.stream(side)`` between two events recorded on ``side``.
    Once the second event has completed, and while the default stream is still
    asleep, the output must already be complete: the kernel ran on ``side``.
    ``jit`` empties the launcher cache so the call takes Triton's JIT launch path."""
    q, k, v = make_qkv(2, 1000, 1000, 8, 8, 128, seed=108)
    if path == "jit":
        monkeypatch.setattr(plan, "_COMPILED", {})
    # Warm up through the same path: nothing may compile while the default stream sleeps.
    hopper_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    if path == "jit":
        plan._COMPILED.clear()
    default = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    buf, out = guarded_out(q)  # NaN-poisoned until the kernel writes it
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    host_out = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
    host_lse = torch.empty(lse_shape, dtype=torch.float32, pin_memory=True)
    with torch.cuda.stream(side):  # a cached block in side's pool: no cudaMalloc (which may sync) later
        torch.empty(lse_shape, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()

    torch.cuda._sleep(SLEEP_CYCLES)
    busy = torch.cuda.Event()
    busy.record(default)
    with torch.cuda.stream(side):
        before, after = torch.cuda.Event(), torch.cuda.Event()
        before.record()
        out, lse = dispatch.forward(q, k, v, None, True, True, out=out)
        after.record()
        after.synchronize()
        host_out.copy_(out, non_blocking=True)
        host_lse.copy_(lse, non_blocking=True)
        side.synchronize()
    default_still_busy = not busy.query()
    assert before.query() and after.query()
    torch.cuda.synchronize()
    assert default_still_busy, "the default stream finished its sleep too early: the test proved nothing"
    assert not torch.isnan(host_out).any(), "output incomplete after the side stream's event: wrong stream"
    assert_guards_intact(buf, q.numel())
    assert_attention_correct(q, k, v, host_out.cuda(), host_lse.cuda(), causal=True, what="side stream")


@pytest.mark.timeout(120)
# Without any GPU the conftest's reason shows; with one Hopper GPU, this one.
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_inputs_on_second_device():
    if torch.cuda.get_device_capability(1)[0] != 9:
        pytest.skip("cuda:1 is not a Hopper GPU")
    assert torch.cuda.current_device() == 0
    dev = torch.device("cuda", 1)
    gc.collect()
    torch.cuda.synchronize(0)
    torch.cuda.reset_peak_memory_stats(0)
    before = torch.cuda.memory_allocated(0)
    gen = torch.Generator(device=dev).manual_seed(109)

    def rnd(*shape, dtype):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    problems = [  # (q shape, kv shape, dtype, causal)
        ((2, 300, 8, 128), (2, 300, 8, 128), torch.bfloat16, True),
        ((1, 129, 4, 64), (1, 517, 2, 64), torch.float16, False),
        ((1, 5, 2, 256), (1, 0, 2, 256), torch.bfloat16, False),  # no key: zeros, no launch
    ]
    for q_shape, kv_shape, dtype, causal in problems:
        q, k, v = rnd(*q_shape, dtype=dtype), rnd(*kv_shape, dtype=dtype), rnd(*kv_shape, dtype=dtype)
        # The first call of a specialisation on cuda:1 goes through Triton's JIT, the second the cached launcher.
        results = [hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True) for _ in range(2)]
        torch.cuda.synchronize(dev)
        assert torch.cuda.current_device() == 0, "the call left cuda:1 current"
        for out, lse in results:
            assert out.device == dev and lse.device == dev
            assert_attention_correct(q, k, v, out, lse, causal=causal, what=f"cuda:1 {q_shape}")
    assert torch.cuda.memory_allocated(0) <= before, "memory left allocated on cuda:0"
    assert torch.cuda.max_memory_allocated(0) == before, "memory was allocated on cuda:0 during the calls"


# --------------------------------------------------------------------------
# Inputs are read only; outputs are fresh
# --------------------------------------------------------------------------

def _storage_ptr(t):
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_inputs_are_not_modified(head_dim, causal):
    q, k, v = make_qkv(2, 300, 517, 8, 2, head_dim, seed=head_dim + 16)
    clones = [t.clone() for t in (q, k, v)]
    out, lse = hopper_flash.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    for name, t, c in zip("qkv", (q, k, v), clones):
        assert torch.equal(t, c), f"{name} was modified"
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, 8, 300) and lse.dtype == torch.float32 and lse.is_contiguous()
    inputs = {_storage_ptr(t) for t in (q, k, v)}
    assert _storage_ptr(out) not in inputs and _storage_ptr(lse) not in inputs


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_packed_qkv_is_not_modified(head_dim):
    qkv = torch.randn(2, 300, 3, 4, head_dim, device="cuda", dtype=torch.bfloat16)
    clone = qkv.clone()
    q, k, v = qkv.unbind(dim=2)
    out = hopper_flash.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(qkv, clone)
    assert out.shape == q.shape and out.is_contiguous() and _storage_ptr(out) != _storage_ptr(qkv)
    assert_attention_correct(q, k, v, out, causal=True, what="packed")
