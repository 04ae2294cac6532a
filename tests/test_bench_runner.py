"""The runner with fake backends and a fake timer, on the CPU: statuses,
the correctness check (the package's float64 reference and judge on the
checked rows), the exit status."""

import argparse
import math

import pytest
import torch

from hopper_flash import reference as package_reference
from hopper_flash.bench import reference as reference_mod
from hopper_flash.bench.backends import Backend, Unsupported, _build_sdpa
from hopper_flash.bench.cli import execute
from hopper_flash.bench.configs import Config, attention_flops
from hopper_flash.bench.reference import check_rows, compute_reference, judge_output
from hopper_flash.bench.results import ERROR, FAIL, OK, UNAVAILABLE, UNSUPPORTED
from hopper_flash.bench.runner import make_inputs, run
from hopper_flash.bench.timing import Timing
from hopper_flash.reference import attention_reference, rel_fro_err

SMALL = Config(seqlen=64, batch=2, heads=4, headdim=16)


def fake_timer(fn):
    fn()  # the timed callable must still run
    return Timing(median_ms=2.0, min_ms=1.9, max_ms=2.5, reps=10)


def exact(q, k, v, scale, causal):
    """A correct backend: the float64 reference, rounded like a kernel's output."""
    return attention_reference(q, k, v, causal=causal, softmax_scale=scale)[0].to(q.dtype)


def good_build(cfg, q, k, v, scale):
    return lambda: exact(q, k, v, scale, cfg.causal)


def backend(name, build=good_build, reason=None):
    return Backend(name, lambda: reason, build)


def options(**kw):
    return argparse.Namespace(**{"quiet": True, "json": None, "csv": None, "plot": None, **kw})


def test_statuses_for_each_kind_of_backend():
    def wrong(cfg, q, k, v, scale):
        return lambda: exact(q, k, v, scale, not cfg.causal)  # ignores the mask

    def nan(cfg, q, k, v, scale):
        return lambda: torch.full_like(q, float("nan"))

    def declines(cfg, q, k, v, scale):
        raise Unsupported("only headdim 128")

    def crashes(cfg, q, k, v, scale):
        def fn():
            raise RuntimeError("CUDA error: an illegal memory access\nmore detail")
        return fn

    def bad_shape(cfg, q, k, v, scale):
        return lambda: q.transpose(1, 2)

    backends = [backend("sdpa-cudnn"), backend("good"), backend("wrong", wrong), backend("nan", nan),
                backend("declines", declines), backend("crashes", crashes), backend("shape", bad_shape),
                backend("missing", reason="cannot import flash_attn")]
    results = run([SMALL], backends, fake_timer, device="cpu", matmul_tflops=1.0)
    by = {r.backend: r for r in results}
    assert [r.backend for r in results] == [b.name for b in backends]
    assert by["good"].status == OK and by["good"].message == ""
    good = by["good"]
    assert 0 <= good.max_abs_err <= good.tolerance and 0 <= good.rel_fro_err <= good.rel_fro_limit
    assert by["good"].median_ms == 2.0 and by["good"].reps == 10
    assert by["good"].tflops == pytest.approx(attention_flops(SMALL) / 2e-3 / 1e12)
    assert by["good"].pct_matmul == pytest.approx(100 * by["good"].tflops)
    assert by["good"].speedup_vs_cudnn == pytest.approx(1.0)
    assert by["good"].rows_checked == 64
    assert by["wrong"].status == FAIL and by["wrong"].message.startswith("output: FAIL: rel_fro ")
    assert by["wrong"].rel_fro_err > 10 * by["wrong"].rel_fro_limit
    assert by["nan"].status == FAIL and math.isnan(by["nan"].max_abs_err)
    assert by["declines"].status == UNSUPPORTED and by["declines"].message == "only headdim 128"
    assert by["crashes"].status == ERROR and by["crashes"].message == "RuntimeError: CUDA error: an illegal memory access"
    assert by["shape"].status == FAIL and "shape" in by["shape"].message
    assert by["missing"].status == UNAVAILABLE and by["missing"].message == "cannot import flash_attn"
    assert {r.backend for r in results if r.failed} == {"wrong", "nan", "crashes", "shape"}


def test_all_backends_get_the_same_random_inputs():
    seen = []

    def spy(cfg, q, k, v, scale):
        seen.append((q, k, v))
        return good_build(cfg, q, k, v, scale)

    run([SMALL], [backend("a", spy), backend("b", spy)], fake_timer, device="cpu")
    (q1, k1, v1), (q2, k2, v2) = seen
    assert q1 is q2 and k1 is k2 and v1 is v2
    assert q1.std() > 0.5 and not torch.equal(q1, k1)  # random, not zeros or copies


def test_failure_makes_exit_status_1_and_the_table_says_fail(capsys):
    def off(cfg, q, k, v, scale):
        return lambda: exact(q, k, v, scale, cfg.causal) + 0.1

    status = execute([SMALL], [backend("good"), backend("fast-but-wrong", off)], fake_timer,
                     options(), "hopper-flash bench", device="cpu", matmul_tflops=1.0)
    assert status == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "fast-but-wrong" in line and "|" in line)
    assert "FAIL" in row
    assert "failed; exit status 1" in out


def test_all_passing_exit_status_0(capsys):
    def declines(cfg, q, k, v, scale):
        raise Unsupported("not yet")

    status = execute([SMALL, Config(seqlen=32, batch=1, heads=2, headdim=16, causal=False)],
                     [backend("good"), backend("later", declines), backend("absent", reason="not installed")],
                     fake_timer, options(), "hopper-flash bench", device="cpu")
    assert status == 0
    out = capsys.readouterr().out
    assert "not yet" in out and "absent: unavailable (not installed)" in out
    assert "All 2 timed results match" in out


# --- the checked rows -------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [
    SMALL,
    Config(seqlen=48, seqlen_k=80, batch=1, heads=4, kv_heads=2, headdim=16),   # GQA, more keys
    Config(seqlen=80, seqlen_k=48, batch=1, heads=2, headdim=16),               # rows with no visible key
    Config(seqlen=48, seqlen_k=80, batch=2, heads=4, kv_heads=1, headdim=16, causal=False),
])
def test_reference_is_the_package_reference_and_baseline_is_close(cfg):
    q, k, v = make_inputs(cfg, "cpu")
    scale = cfg.headdim ** -0.5
    ref = compute_reference(cfg, q, k, v, scale)
    full, _ = attention_reference(q, k, v, causal=cfg.causal, softmax_scale=scale)
    assert ref.out.dtype == torch.float64 and ref.baseline.dtype == q.dtype
    torch.testing.assert_close(ref.out, full[:, ref.rows], atol=1e-12, rtol=0)
    assert rel_fro_err(ref.baseline, ref.out) < 1e-2  # SDPA, in bf16
    assert judge_output(exact(q, k, v, scale, cfg.causal), ref)


def test_long_sequences_check_sampled_rows_in_every_block(monkeypatch):
    monkeypatch.setattr(reference_mod, "FULL_CHECK_MAX_SEQLEN", 100)
    monkeypatch.setattr(package_reference, "_CHUNK_ELEMS", 1000)  # forces chunking over pairs and rows
    rows = check_rows(1000, "cpu")
    assert rows[0] == 0 and rows[-1] == 999
    assert set((rows // 64).tolist()) == set(range(16))  # every 64-row block
    cfg = Config(seqlen=1000, batch=1, heads=3, headdim=8)
    q, k, v = make_inputs(cfg, "cpu")
    ref = compute_reference(cfg, q, k, v, 8 ** -0.5)
    assert ref.num_rows == len(rows) < 1000
    monkeypatch.undo()
    full, _ = attention_reference(q, k, v, causal=True, softmax_scale=8 ** -0.5)
    torch.testing.assert_close(ref.out, full[:, ref.rows], atol=1e-12, rtol=0)
    verdict = judge_output(full.to(q.dtype), ref)
    assert verdict and verdict.rel_fro > 0


def test_nan_anywhere_is_an_error_even_outside_checked_rows(monkeypatch):
    monkeypatch.setattr(reference_mod, "FULL_CHECK_MAX_SEQLEN", 100)
    cfg = Config(seqlen=1000, batch=1, heads=1, headdim=8)
    q, k, v = make_inputs(cfg, "cpu")
    ref = compute_reference(cfg, q, k, v, 8 ** -0.5)
    out = exact(q, k, v, 8 ** -0.5, True)
    unchecked = next(i for i in range(1000) if i not in set(ref.rows.tolist()))
    out[0, unchecked, 0, 0] = float("nan")
    verdict = judge_output(out, ref)
    assert not verdict and verdict.message == "non-finite values in output" and math.isnan(verdict.max_abs)


# --- a real backend builder, on the CPU -------------------------------------------------


def test_sdpa_backend_transposes_and_declines_unequal_causal():
    build = _build_sdpa("MATH")
    q, k, v = make_inputs(SMALL, "cpu")
    out = build(SMALL, q, k, v, 0.25)()
    assert out.shape == q.shape
    assert rel_fro_err(out, attention_reference(q, k, v, causal=True, softmax_scale=0.25)[0]) < 1e-2
    unequal = Config(seqlen=32, seqlen_k=64, batch=1, heads=2, headdim=16)
    with pytest.raises(Unsupported, match="top-left"):
        build(unequal, *make_inputs(unequal, "cpu"), 0.25)


def test_json_keeps_the_finished_configs_when_the_process_dies_later(tmp_path):
    """--json is written after every config, marked partial, so a process
    that dies mid-block (FA3 has segfaulted so on the H200) leaves the rows
    it finished; the final write drops the mark."""
    from hopper_flash.bench.results import read_json

    second = Config(seqlen=32, batch=1, heads=2, headdim=16, causal=False)

    class ProcessDied(BaseException):
        pass

    def dies_on_second(cfg, q, k, v, scale):
        if cfg == second:
            raise ProcessDied  # not an Exception: nothing in the runner survives it, as with a signal
        return good_build(cfg, q, k, v, scale)

    path = tmp_path / "r.json"
    with pytest.raises(ProcessDied):
        execute([SMALL, second], [backend("good", dies_on_second)], fake_timer, options(json=str(path)),
                "hopper-flash bench", device="cpu")
    results, meta = read_json(path)
    assert [(r.label, r.status) for r in results] == [(SMALL.label, OK)]
    assert meta["partial"] is True

    status = execute([SMALL, second], [backend("good")], fake_timer, options(json=str(path)),
                     "hopper-flash bench", device="cpu")
    results, meta = read_json(path)
    assert status == 0 and len(results) == 2 and "partial" not in meta


def test_rounds_interleave_the_backends_and_pool_their_calls():
    """--rounds 3: each backend once per round, the order rotated by one each
    round; a backend's result is over all its rounds' calls; one that raises
    in a later round drops out with an ERROR and no time."""
    timed = []  # (backend, round) in the order the timer ran them
    calls = {}

    def build(name):
        def b(cfg, q, k, v, scale):
            def fn():
                calls[name] = calls.get(name, 0) + 1
                if name == "flaky" and calls[name] > 2:  # set-up call and round 0 pass, round 1 raises
                    raise RuntimeError("CUDA error: launch failure")
                return exact(q, k, v, scale, cfg.causal)
            return fn
        return b

    def timer(fn):
        before = dict(calls)
        fn()
        (name,) = [n for n in calls if calls[n] != before.get(n, 0)]
        n = sum(1 for b, _ in timed if b == name)
        timed.append((name, n))
        ms = {"a": [1.0, 3.0, 2.0], "b": [5.0, 5.0, 5.0]}.get(name, [1.0] * 3)[n]
        return Timing(ms, ms, ms, 2, (ms, ms))

    names = ["a", "b", "flaky"]
    results = run([SMALL], [backend(n, build(n)) for n in names], timer, device="cpu", rounds=3)
    # Round 1 runs b, flaky (raises: not timed), a; round 2 the two left, rotated by 2 mod 2.
    assert [b for b, _ in timed] == ["a", "b", "flaky", "b", "a", "a", "b"]
    by = {r.backend: r for r in results}
    assert (by["a"].median_ms, by["a"].min_ms, by["a"].max_ms, by["a"].reps) == (2.0, 1.0, 3.0, 6)
    assert (by["b"].median_ms, by["b"].reps) == (5.0, 6)
    assert by["flaky"].status == ERROR and "launch failure" in by["flaky"].message
    assert by["flaky"].median_ms is None


def test_rounds_pool_medians_where_the_timer_keeps_no_calls():
    from hopper_flash.bench.timing import merge_timings

    assert merge_timings([Timing(1.0, 0.5, 2.0, 3), Timing(4.0, 3.0, 5.0, 3), Timing(2.0, 1.5, 2.5, 3)]) == \
        Timing(2.0, 0.5, 5.0, 9)
    assert merge_timings([Timing(1.0, 1.0, 1.0, 1, (1.0,)), Timing(3.0, 2.0, 4.0, 2, (2.0, 4.0))]) == \
        Timing(2.0, 1.0, 4.0, 3, (1.0, 2.0, 4.0))
