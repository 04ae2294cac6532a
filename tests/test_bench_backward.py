"""The bench's backward passes (``--pass bwd`` / ``fwd+bwd``) and ``--memory``
on the CPU with fake backends and a fake timer: what is timed, the FLOP
count, every gradient judged against the float64 reference (sampled rows
and keys for long sequences), statuses, the report and the files."""

import argparse
import json
import math
import re

import pytest
import torch

from hopper_flash import reference as package_reference
from hopper_flash.bench import reference as reference_mod
from hopper_flash.bench.backends import Backend, _build_sdpa, all_backends
from hopper_flash.bench.cli import build_parser, execute
from hopper_flash.bench.configs import Config, attention_flops
from hopper_flash.bench.reference import compute_grad_reference, judge_grads, make_grad_out
from hopper_flash.bench.results import ERROR, FAIL, OK, UNSUPPORTED, read_csv, read_json, write_json
from hopper_flash.bench.runner import make_inputs, pass_flops, run
from hopper_flash.bench.timing import Timing
from hopper_flash.reference import attention_reference, attention_reference_grads

SMALL = Config(seqlen=48, seqlen_k=40, batch=2, heads=4, kv_heads=2, headdim=16)


def fake_timer(fn):
    fn()
    return Timing(median_ms=2.0, min_ms=1.9, max_ms=2.5, reps=10)


def exact(q, k, v, scale, causal):
    """A correct, differentiable backend: the float64 reference (autograd
    through it gives the exact gradients), rounded like a kernel's output."""
    return attention_reference(q, k, v, causal=causal, softmax_scale=scale)[0].to(q.dtype)


class NanGrad(torch.autograd.Function):
    """Identity forward, NaN gradient: a backward that writes garbage."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, float("nan"))


def backend(name, build, grad=True):
    return Backend(name, lambda: None, build, grad=grad)


def good(cfg, q, k, v, scale):
    return lambda: exact(q, k, v, scale, cfg.causal)


def options(**kw):
    return argparse.Namespace(**{"quiet": True, "json": None, "csv": None, "plot": None, "passes": ["fwd"],
                                 "memory": False, **kw})


def test_flops_count_the_backward_as_two_and_a_half_forwards():
    for cfg in (SMALL, Config(seqlen=64, batch=1, heads=2, headdim=16, causal=False), Config(seqlen=64)):
        fwd = attention_flops(cfg)
        assert pass_flops(cfg, "fwd") == fwd
        assert pass_flops(cfg, "bwd") == 2.5 * fwd
        assert pass_flops(cfg, "fwd+bwd") == 3.5 * fwd
    causal, full = Config(seqlen=64), Config(seqlen=64, causal=False)
    assert pass_flops(causal, "bwd") * 2 == pass_flops(full, "bwd")  # causal halved


@pytest.mark.parametrize("bench_pass", ["bwd", "fwd+bwd"])
def test_every_gradient_is_judged_and_each_kind_of_backend_gets_its_status(bench_pass):
    def no_dk(cfg, q, k, v, scale):  # forgets K's gradient: dk = 0
        return lambda: exact(q, k.detach(), v, scale, cfg.causal)

    def no_dq(cfg, q, k, v, scale):
        return lambda: exact(q.detach(), k, v, scale, cfg.causal)

    def nan_dv(cfg, q, k, v, scale):
        return lambda: exact(q, k, NanGrad.apply(v), scale, cfg.causal)

    def not_differentiable(cfg, q, k, v, scale):
        return lambda: exact(q.detach(), k.detach(), v.detach(), scale, cfg.causal)

    def backward_declines(cfg, q, k, v, scale):
        class Declines(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                raise NotImplementedError("backward supports head dims (64, 128, 256)")

        return lambda: Declines.apply(exact(q, k, v, scale, cfg.causal))

    def bad_shape(cfg, q, k, v, scale):
        return lambda: exact(q, k, v, scale, cfg.causal).transpose(1, 2)

    backends = [backend("sdpa-cudnn", good), backend("no_dk", no_dk), backend("no_dq", no_dq),
                backend("nan_dv", nan_dv), backend("not_differentiable", not_differentiable),
                backend("declines", backward_declines), backend("forward-only", good, grad=False),
                backend("shape", bad_shape)]
    results = run([SMALL], backends, fake_timer, device="cpu", passes=(bench_pass,), matmul_tflops=1.0)
    by = {r.backend: r for r in results}
    assert all(r.bench_pass == bench_pass for r in results)
    ok = by["sdpa-cudnn"]
    assert ok.status == OK, ok.message
    assert ok.flops == pass_flops(SMALL, bench_pass) and ok.tflops == pytest.approx(ok.flops / 2e-3 / 1e12)
    assert 0 <= ok.max_abs_err <= ok.tolerance and ok.rows_checked == SMALL.seqlen
    assert by["no_dk"].status == FAIL and "dk: FAIL" in by["no_dk"].message
    assert "dq: FAIL" not in by["no_dk"].message and "dv: FAIL" not in by["no_dk"].message
    assert by["no_dq"].status == FAIL and "dq: FAIL" in by["no_dq"].message
    assert by["nan_dv"].status == FAIL and "dv: FAIL" in by["nan_dv"].message and "non-finite" in by["nan_dv"].message
    assert math.isnan(by["nan_dv"].max_abs_err)
    assert by["not_differentiable"].status == ERROR
    assert by["declines"].status == UNSUPPORTED and "head dims" in by["declines"].message
    assert by["forward-only"].status == UNSUPPORTED and "backward is not benchmarked" in by["forward-only"].message
    assert by["shape"].status == FAIL and "output shape" in by["shape"].message


def test_fwd_plus_bwd_also_judges_the_output():
    def wrong_out(cfg, q, k, v, scale):  # right gradients, output off by a constant
        return lambda: exact(q, k, v, scale, cfg.causal) + 0.25

    r, = run([SMALL], [backend("wrong_out", wrong_out)], fake_timer, device="cpu", passes=("fwd+bwd",))
    assert r.status == FAIL and r.message.startswith("output: FAIL")
    r, = run([SMALL], [backend("wrong_out", wrong_out)], fake_timer, device="cpu", passes=("bwd",))
    assert r.status == OK, r.message  # the bwd pass times and checks the gradients only


def test_the_bwd_pass_times_the_backward_alone_with_a_fixed_grad_out():
    calls = {"forward": 0}
    seen_grad_outs = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            seen_grad_outs.append(g.clone())
            return g

    def counting(cfg, q, k, v, scale):
        assert q.requires_grad and k.requires_grad and v.requires_grad and q.is_leaf

        def fn():
            calls["forward"] += 1
            return Spy.apply(exact(q, k, v, scale, cfg.causal))

        return fn

    timed = []

    def timer(fn):
        for _ in range(3):
            timed.append(fn())
        return Timing(1.0, 1.0, 1.0, 3)

    run([SMALL], [backend("spy", counting)], timer, device="cpu", passes=("bwd",))
    assert calls["forward"] == 1  # once, before the timed calls
    assert len(seen_grad_outs) == 1 + 3  # the checked call, then each timed call
    want = make_grad_out(SMALL, "cpu")
    assert all(torch.equal(g, want) for g in seen_grad_outs)
    assert want.std() > 0.5 and not torch.equal(want, make_inputs(SMALL, "cpu")[0])
    assert all(len(grads) == 3 for grads in timed)

    calls["forward"] = 0
    run([SMALL], [backend("spy", counting)], timer, device="cpu", passes=("fwd+bwd",))
    assert calls["forward"] == 2 + 3  # shape check, checked call, then one per timed call


def test_sdpa_backend_backward_on_cpu_passes():
    cfg = Config(seqlen=40, batch=1, heads=2, headdim=16)
    results = run([cfg], [Backend("sdpa-math", lambda: None, _build_sdpa("MATH"))], fake_timer, device="cpu",
                  passes=("fwd", "bwd", "fwd+bwd"))
    assert [r.bench_pass for r in results] == ["fwd", "bwd", "fwd+bwd"]
    assert all(r.status == OK for r in results), [r.message for r in results]


def test_flex_and_kv_cache_backends_are_forward_only_and_the_others_differentiate():
    grads = {b.name: b.grad for b in all_backends()}
    for name in ("flex-compiled", "hopper_flash-kvcache", "fa3-kvcache"):
        assert grads.pop(name) is False, name
    assert all(grads.values())


def test_long_sequences_check_gradients_on_sampled_rows_and_keys(monkeypatch):
    monkeypatch.setattr(reference_mod, "FULL_CHECK_MAX_SEQLEN", 100)
    monkeypatch.setattr(package_reference, "_CHUNK_ELEMS", 5000)
    cfg = Config(seqlen=300, seqlen_k=260, batch=1, heads=2, kv_heads=1, headdim=8)
    q, k, v = make_inputs(cfg, "cpu")
    dout = make_grad_out(cfg, "cpu")
    ref = compute_grad_reference(cfg, q, k, v, dout, 8 ** -0.5)
    assert ref.rows is not None and ref.key_rows is not None
    assert ref.num_rows == len(ref.rows) < 300 and len(ref.key_rows) < 260
    assert set((ref.rows // 64).tolist()) == set(range(5)) and set((ref.key_rows // 64).tolist()) == set(range(5))
    full = attention_reference_grads(q, k, v, dout, causal=True, softmax_scale=8 ** -0.5)
    for got, want in zip(ref.grads, (full[0][:, ref.rows], full[1][:, ref.key_rows], full[2][:, ref.key_rows])):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    exact_grads = [g.to(q.dtype) for g in full]
    assert all(judge_grads(exact_grads, ref))
    # A NaN outside the sampled keys still fails.
    unchecked = next(i for i in range(260) if i not in set(ref.key_rows.tolist()))
    exact_grads[1] = exact_grads[1].clone()
    exact_grads[1][0, unchecked, 0, 0] = float("nan")
    verdicts = judge_grads(exact_grads, ref)
    assert verdicts[0] and not verdicts[1] and verdicts[2]


def test_memory_probe_column_and_files(tmp_path, capsys):
    probed = []

    def memory(fn):
        fn()
        probed.append(1)
        return 3 * 2**20

    path_json, path_csv = tmp_path / "r.json", tmp_path / "r.csv"
    status = execute([SMALL], [backend("sdpa-cudnn", good)], fake_timer,
                     options(passes=["fwd", "bwd", "fwd+bwd", "bwd"], memory=True, json=str(path_json),
                             csv=str(path_csv)),
                     "hopper-flash bench --pass fwd bwd fwd+bwd --memory", device="cpu", memory=memory)
    assert status == 0 and len(probed) == 3  # each pass once
    out = capsys.readouterr().out
    assert "## Attention fwd, bwd, fwd+bwd benchmark" in out and "peak MiB" in out
    rows = [line for line in out.splitlines() if line.startswith("|") and "sdpa-cudnn" in line]
    assert len(rows) == 3 and all(re.search(r"\|\s+3 \|", row) for row in rows)
    assert any(f"{SMALL.label} bwd" in line for line in out.splitlines())
    results, _ = read_json(path_json)
    assert [r.bench_pass for r in results] == ["fwd", "bwd", "fwd+bwd"] and results[1].peak_mib == 3.0
    assert [(r.bench_pass, r.peak_mib) for r in read_csv(path_csv)] == [(r.bench_pass, 3.0) for r in results]


def test_without_memory_option_no_probe_and_no_column(capsys):
    def memory(fn):
        raise AssertionError("not asked for")

    status = execute([SMALL], [backend("sdpa-cudnn", good)], fake_timer, options(passes=["bwd"]),
                     "hopper-flash bench --pass bwd", device="cpu", memory=memory)
    assert status == 0
    out = capsys.readouterr().out
    assert "peak MiB" not in out and "## Attention bwd benchmark" in out


def test_cli_parses_passes_and_memory():
    args = build_parser().parse_args(["bench", "--pass", "bwd", "fwd+bwd", "--memory"])
    assert args.passes == ["bwd", "fwd+bwd"] and args.memory
    args = build_parser().parse_args(["bench"])
    assert args.passes == ["fwd"] and not args.memory
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--pass", "backward"])


def test_old_records_without_a_pass_are_forward(tmp_path):
    r, = run([SMALL], [backend("sdpa-cudnn", good)], fake_timer, device="cpu")
    assert r.bench_pass == "fwd" and r.peak_mib is None
    path = tmp_path / "r.json"
    write_json(path, [r], {})
    data = json.loads(path.read_text())
    for rec in data["results"]:  # a file written before the passes existed
        del rec["bench_pass"], rec["peak_mib"]
    path.write_text(json.dumps(data))
    old, _ = read_json(path)
    assert old[0].bench_pass == "fwd" and old[0].peak_mib is None
