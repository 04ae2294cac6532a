"""CPU tests of the bench command: options, config files, FLOP counting and
the no-GPU exit."""

import json

import pytest
import torch

from hopper_flash.bench.cli import build_parser, main, resolve_configs
from hopper_flash.bench.configs import (
    Config,
    ConfigError,
    attention_flops,
    causal_pairs,
    default_configs,
    load_config_file,
)


def configs_for(*argv):
    return resolve_configs(build_parser().parse_args(["bench", *argv]))


# --- options -------------------------------------------------------------------


def test_defaults_are_the_seven_default_configs():
    cfgs = configs_for()
    assert cfgs == default_configs()
    assert [(c.batch, c.heads, c.seqlen) for c in cfgs] == [
        (4, 32, 1024), (4, 32, 2048), (4, 32, 4096), (4, 32, 8192), (4, 32, 16384),
        (16, 16, 512), (1, 32, 32768),
    ]
    for c in cfgs:
        assert (c.causal, c.dtype, c.headdim, c.nheads_kv, c.seqlen_kv) == (True, "bf16", 128, c.heads, c.seqlen)


def test_seqlen_list_and_overrides():
    cfgs = configs_for("--seqlen", "1024", "2048", "--batch", "2", "--heads", "16", "--kv-heads", "4",
                       "--no-causal", "--dtype", "fp16", "--headdim", "64")
    assert [c.seqlen for c in cfgs] == [1024, 2048]
    for c in cfgs:
        assert (c.batch, c.heads, c.nheads_kv, c.causal, c.dtype, c.headdim) == (2, 16, 4, False, "fp16", 64)
        assert c.seqlen_kv == c.seqlen


def test_overrides_apply_to_the_default_set_and_keep_kv_heads_equal():
    cfgs = configs_for("--heads", "8", "--dtype", "fp16")
    assert len(cfgs) == 7
    assert all(c.heads == 8 and c.nheads_kv == 8 and c.dtype == "fp16" for c in cfgs)


def test_seqlen_k_one_or_one_per_seqlen():
    assert [c.seqlen_kv for c in configs_for("--seqlen", "128", "256", "--seqlen-k", "512")] == [512, 512]
    assert [c.seqlen_kv for c in configs_for("--seqlen", "128", "256", "--seqlen-k", "64", "32")] == [64, 32]
    with pytest.raises(ConfigError, match="one per --seqlen"):
        configs_for("--seqlen", "128", "256", "--seqlen-k", "1", "2", "3")
    with pytest.raises(ConfigError, match="needs --seqlen"):
        configs_for("--seqlen-k", "128")


def test_bad_option_values_exit_2_with_message(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--seqlen", "128", "--heads", "6", "--kv-heads", "4"])
    assert e.value.code == 2
    assert "multiple of kv_heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--backends", "nonsense"])
    with pytest.raises(SystemExit) as e:
        main(["bench", "--rounds", "0"])
    assert e.value.code == 2 and "--rounds must be at least 1" in capsys.readouterr().err


# --- config files ----------------------------------------------------------------


def test_config_file_list(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps([
        {"seqlen": 1024},
        {"seqlen": 512, "seqlen_k": 2048, "batch": 2, "heads": 8, "kv_heads": 2,
         "headdim": 64, "causal": False, "dtype": "fp16"},
    ]))
    a, b = load_config_file(path)
    assert a == Config(seqlen=1024)
    assert (b.seqlen_q, b.seqlen_kv, b.batch, b.heads, b.nheads_kv, b.headdim, b.causal, b.dtype) == (
        512, 2048, 2, 8, 2, 64, False, "fp16")
    # Options still override the file's fields.
    assert [c.dtype for c in configs_for("--config", str(path), "--dtype", "bf16")] == ["bf16", "bf16"]


@pytest.mark.parametrize("text, message", [
    ("[{\"seqlen\": 1024,}]", "invalid JSON"),
    ("[{\"seqlen\": 1024, \"seq_len\": 5}]", "unknown field(s) 'seq_len'"),
    ("[{\"batch\": 2}]", "missing required field 'seqlen'"),
    ("[{\"seqlen\": 1024, \"dtype\": \"fp8\"}]", "dtype must be one of"),
    ("[{\"seqlen\": -3}]", "seqlen must be a positive integer"),
    ("[{\"seqlen\": 1024, \"causal\": 1}]", "causal must be true or false"),
    ("[]", "non-empty JSON list"),
    ("[3]", "expected an object"),
])
def test_bad_config_file_gives_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config_file(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_bad_config_file_through_main_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text("[{\"seqlen\": 1024, \"nheads\": 4}]")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--config", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown field(s) 'nheads'" in err and "Traceback" not in err


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config_file(tmp_path / "nope.json")


# --- FLOPs -------------------------------------------------------------------------


def brute_force_pairs(sq, sk):
    return sum(1 for i in range(sq) for j in range(sk) if j <= i + sk - sq)


def test_non_causal_flops():
    c = Config(seqlen=1024, seqlen_k=3000, batch=2, heads=8, kv_heads=2, headdim=64, causal=False)
    assert attention_flops(c) == 4 * 2 * 8 * 1024 * 3000 * 64  # query heads count, not kv heads


def test_causal_equal_lengths_is_exactly_half():
    c = Config(seqlen=4096, batch=4, heads=32, headdim=128, causal=True)
    assert attention_flops(c) * 2 == attention_flops(Config(seqlen=4096, causal=False))
    assert attention_flops(c) == 2 * 4 * 32 * 4096**2 * 128


@pytest.mark.parametrize("sq, sk", [(1, 1), (5, 5), (3, 8), (8, 3), (1, 100), (100, 1), (17, 64), (64, 17)])
def test_causal_pairs_bottom_right(sq, sk):
    assert causal_pairs(sq, sk) == brute_force_pairs(sq, sk)


def test_causal_unequal_lengths_counts_visible_pairs():
    c = Config(seqlen=128, seqlen_k=512, batch=2, heads=4, headdim=64)
    # Bottom-right: every query sees the 384 keys before the query block plus its own prefix.
    pairs = 128 * 384 + 128 * 129 // 2
    assert causal_pairs(128, 512) == pairs
    assert attention_flops(c) == 4 * 2 * 4 * 64 * pairs
    # More queries than keys: the first 384 rows see nothing.
    assert causal_pairs(512, 128) == 128 * 129 // 2


# --- no Hopper GPU --------------------------------------------------------------------


def test_no_cuda_prints_plain_message_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also when run on a GPU machine
    assert main(["bench"]) == 2
    captured = capsys.readouterr()
    assert "Hopper" in captured.err and "sm_90" in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_non_hopper_gpu_names_it(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert main(["bench", "--seqlen", "1024"]) == 2
    err = capsys.readouterr().err
    assert "NVIDIA A100-SXM4-80GB" in err and "8.0" in err and "sm_90" in err


def test_module_entry_point_runs_without_traceback():
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this would run the benchmark")
    proc = subprocess.run([sys.executable, "-m", "hopper_flash.bench", "--seqlen", "128"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "sm_90" in proc.stderr and "Traceback" not in proc.stderr


def test_cuda_graph_option_selects_graph_replay_timing(monkeypatch):
    import triton.testing

    from hopper_flash.bench import timing

    assert build_parser().parse_args(["bench", "--cuda-graph"]).cuda_graph
    assert not build_parser().parse_args(["bench"]).cuda_graph
    seen = {}

    def fake_do_bench_cudagraph(fn, rep, return_mode):
        seen.update(rep=rep, return_mode=return_mode)
        fn()
        return [3.0, 1.0, 2.0]

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", fake_do_bench_cudagraph)
    calls = []
    t = timing.cuda_graph_timer(rep_ms=123)(lambda: calls.append(1))
    assert calls == [1] and seen == {"rep": 123, "return_mode": "all"}
    assert (t.median_ms, t.min_ms, t.max_ms, t.reps) == (2.0, 1.0, 3.0, 3)


@pytest.mark.parametrize("call_ms,min_calls,expected", [(13.0, 3, 3), (13.0, 1, 1), (2.0, 3, 12)])
def test_do_bench_timer_times_at_least_min_calls(monkeypatch, call_ms, min_calls, expected):
    """Under --rounds each round gets a share of the budget: a call longer
    than the share over ``min_calls`` is timed again, in a second do_bench
    sized for the calls still missing (do_bench times rep / its estimate)."""
    import triton.testing

    from hopper_flash.bench import timing

    budgets = []

    def fake_do_bench(fn, warmup, rep, return_mode):
        budgets.append((warmup, rep))
        return [call_ms] * max(1, int(rep / call_ms))

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    t = timing.do_bench_timer(10, 25, min_calls)(lambda: None)
    assert t.reps == expected and t.median_ms == call_ms
    assert budgets[0] == (10, 25)
    if len(budgets) > 1:
        assert budgets[1][0] == 0 and int(budgets[1][1] / call_ms) == expected - 1


# ---- FA3 on dtypes its build may lack (bench/backends.fa3_probe) ------------

def _completed(returncode, stderr=""):
    import subprocess

    return subprocess.CompletedProcess(args=[], returncode=returncode, stdout="", stderr=stderr)


def test_fa3_probe_reports_a_crash_and_an_exception_and_passes_a_clean_run():
    from hopper_flash.bench import backends

    calls = []

    def run_as(code, stderr=""):
        def run(argv, **kwargs):
            calls.append(argv[-3:])
            return _completed(code, stderr)
        return run

    crashed = backends.fa3_probe("flash_attn_func", "float16", 128, run=run_as(-11))
    assert "crashed (signal 11)" in crashed and "float16" in crashed
    failed = backends.fa3_probe("flash_attn_func", "float16", 64,
                                run=run_as(1, "Traceback ...\nRuntimeError: FA3 was built without fp16"))
    assert "RuntimeError: FA3 was built without fp16" in failed
    assert backends.fa3_probe("flash_attn_func", "float16", 256, run=run_as(0)) is None
    windowed = backends.fa3_probe("flash_attn_func", "bfloat16", 128, (4095, 0), run=run_as(-11))
    assert "window (4095, 0)" in windowed
    assert calls == [["float16", "128", "none"], ["float16", "64", "none"], ["float16", "256", "none"],
                     ["bfloat16", "128", "4095,0"]]


def test_fa3_is_unsupported_where_its_probe_fails_and_bf16_is_never_probed(monkeypatch):
    from hopper_flash.bench import backends
    from hopper_flash.bench.configs import Config

    probed = []

    def probe(func, dtype_name, head_dim, window=None, run=None):
        probed.append((func, dtype_name, head_dim, window))
        return "this FA3 build crashed (signal 11) on a float16 head-dim-128 probe"

    monkeypatch.setattr(backends, "fa3_probe", probe)
    build = backends._build_flash_attn("flash_attn_interface")
    q16 = torch.zeros(1, 8, 2, 128, dtype=torch.float16)
    with pytest.raises(backends.Unsupported, match="crashed"):
        build(Config(seqlen=8), q16, q16, q16, 1.0)
    with pytest.raises(backends.Unsupported, match="crashed"):
        backends._build_fa3_kvcache(Config(seqlen=8), q16, q16, q16, 1.0)
    assert probed == [("flash_attn_func", "float16", 128, None), ("flash_attn_with_kvcache", "float16", 128, None)]
    # bf16 with a window is probed too (shared/tools/fa3 builds no local kernels).
    q = q16.to(torch.bfloat16)
    with pytest.raises(backends.Unsupported, match="crashed"):
        build(Config(seqlen=8, window=(3, 0)), q, q, q, 1.0)
    assert probed[-1] == ("flash_attn_func", "bfloat16", 128, (3, 0))
    # bf16 without a window goes straight to the import (absent on the CPU machine), with no probe.
    with pytest.raises(ImportError):
        build(Config(seqlen=8), q, q, q, 1.0)
    assert len(probed) == 3


# ---- sliding windows (Config.window, --window) -------------------------------

def test_window_config_counts_visible_pairs_and_labels_itself():
    from hopper_flash.bench.configs import Config, ConfigError, attention_flops, window_pairs

    # Brute force against the closed loop: every (row, key) pair the window shows.
    for sq, sk, left, right in [(7, 11, 3, 0), (11, 7, 2, 1), (5, 5, 0, 0), (9, 4, -1, 2), (4, 9, 2, -1)]:
        off = sk - sq
        brute = sum(1 for i in range(sq) for j in range(sk)
                    if (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right))
        assert window_pairs(sq, sk, left, right) == brute
    c = Config(seqlen=1000, batch=2, heads=4, headdim=64, causal=True, window=[127, 5])
    assert c.window == (127, 5) and c.window_bounds == (127, 0)  # causal makes right 0
    assert "win127,0" in c.label
    assert attention_flops(c) == 4 * 2 * 4 * 64 * window_pairs(1000, 1000, 127, 0)
    assert c.to_record()["window"] == [127, 5]
    # No left bound under causal is plain causal: same FLOPs and label as without a window.
    plain = Config(seqlen=1000, batch=2, heads=4, headdim=64, causal=True)
    assert Config(seqlen=1000, batch=2, heads=4, headdim=64, window=[-1, 3]).window_bounds is None
    assert attention_flops(plain) == attention_flops(Config(seqlen=1000, batch=2, heads=4, headdim=64,
                                                            window=[-1, 3]))
    for bad in ([1], [1, 2, 3], [-2, 0], ["a", 0], [True, 0]):
        with pytest.raises(ConfigError, match="window must be a pair"):
            Config(seqlen=8, window=bad)


def test_window_kv_bytes_count_only_the_keys_some_row_sees():
    from hopper_flash.bench.configs import Config, kv_bytes, window_keys

    for sq, sk, left, right in [(7, 11, 3, 0), (11, 7, 2, 1), (5, 5, 0, 0), (9, 4, -1, 2), (4, 9, 2, -1),
                                (12, 4, 1, 0), (3, 20, 0, -1), (0, 5, 1, 1)]:
        off = sk - sq
        brute = len({j for i in range(sq) for j in range(sk)
                     if (left < 0 or j >= i + off - left) and (right < 0 or j <= i + off + right)})
        assert window_keys(sq, sk, left, right) == brute, (sq, sk, left, right)
    # One decode row against 65536 keys with a 4096-key window reads 4096 keys' K and V.
    dec = Config(seqlen=1, seqlen_k=65536, batch=1, heads=32, kv_heads=8, headdim=128, causal=True, window=[4095, 0])
    assert kv_bytes(dec) == 2 * 8 * 4096 * 128 * 2
    assert kv_bytes(Config(seqlen=1, seqlen_k=65536, batch=1, heads=32, kv_heads=8, headdim=128)) == \
        2 * 8 * 65536 * 128 * 2


def test_window_option_sets_every_config():
    args = build_parser().parse_args(["bench", "--seqlen", "1024", "2048", "--window", "255", "0"])
    configs = resolve_configs(args)
    assert [c.window for c in configs] == [(255, 0), (255, 0)]


def test_window_passes_to_flash_attn_style_backends_and_sdpa_declines(monkeypatch):
    import types

    from hopper_flash.bench import backends
    from hopper_flash.bench.configs import Config

    cfg = Config(seqlen=8, batch=1, heads=2, headdim=64, window=[3, 0])
    seen = {}
    fake = types.SimpleNamespace(flash_attn_func=lambda q, k, v, **kw: seen.update(kw) or q)
    monkeypatch.setattr(backends.importlib, "import_module", lambda name: fake)
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    backends._build_flash_attn("flash_attn")(cfg, q, q, q, 1.0)()
    assert seen["window_size"] == (3, 0) and seen["causal"] is True
    with pytest.raises(backends.Unsupported, match="no sliding window"):
        backends._build_sdpa("CUDNN_ATTENTION")(cfg, q, q, q, 1.0)


def test_headdim_v_counts_each_matmul_at_its_depth_and_labels_itself(tmp_path):
    """FA3's hdim_v: QK at q's head dim, PV at v's (2 B H Sq Sk (D + Dv)
    FLOPs without a mask, half of it causal), K and V read at their own
    widths; the option, the JSON field and the record carry it."""
    from hopper_flash.bench.configs import kv_bytes

    cfg = Config(seqlen=1000, seqlen_k=3000, batch=2, heads=16, kv_heads=4, headdim=192, headdim_v=128,
                 causal=False)
    assert attention_flops(cfg) == 2 * 2 * 16 * 1000 * 3000 * (192 + 128)
    causal = Config(seqlen=1024, batch=2, heads=16, headdim=192, headdim_v=128)
    assert attention_flops(causal) == 2 * 16 * 1024 * 1024 * (192 + 128)
    square = Config(seqlen=1024, batch=2, heads=16, headdim=128)  # one head dim: the convention unchanged
    assert attention_flops(square) == 2 * 2 * 16 * 1024 * 1024 * 128
    assert attention_flops(Config(seqlen=7, seqlen_k=11, headdim=192, headdim_v=128)) == \
        2 * 4 * 32 * (192 + 128) * causal_pairs(7, 11)
    assert kv_bytes(cfg) == 2 * 4 * 3000 * (192 + 128) * 2
    assert "D192x128" in cfg.label and "D128 " in square.label
    assert cfg.to_record()["headdim_v"] == 128 and square.to_record()["headdim_v"] == 128
    (c,) = configs_for("--seqlen", "512", "--headdim", "192", "--headdim-v", "128")
    assert (c.headdim, c.head_dim_v) == (192, 128)
    path = tmp_path / "dv.json"
    path.write_text('[{"seqlen": 512, "headdim": 192, "headdim_v": 128}]')
    assert load_config_file(path)[0].head_dim_v == 128
    with pytest.raises(ConfigError, match="headdim_v must be a positive integer"):
        Config(seqlen=512, headdim_v=0)
