"""The report, the JSON/CSV files and the plot, from hand-made records."""

import math

from rich.console import Console

from hopper_flash.bench.configs import Config, attention_flops
from hopper_flash.bench.plot import write_plot
from hopper_flash.bench.report import build_table, print_report
from hopper_flash.bench.results import FAIL, OK, UNAVAILABLE, UNSUPPORTED, Result, read_csv, read_json, write_csv, write_json

META = {"date": "2025-01-01T00:00:00+00:00", "command": "hopper-flash bench --seqlen 1024 2048",
        "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "cuda": "12.8",
        "hopper_flash_commit": "abc1234", "matmul_tflops": 750.0}


def record(seqlen, backend, status=OK, ms=None, err=1e-3, message="", **kw):
    cfg = Config(seqlen=seqlen)
    flops = attention_flops(cfg)
    timed = ms is not None
    tflops = flops / (ms * 1e-3) / 1e12 if timed else None
    return Result(**cfg.to_record(), label=cfg.label, backend=backend, status=status, message=message,
                  flops=flops, median_ms=ms, min_ms=ms * 0.98 if timed else None, max_ms=ms * 1.1 if timed else None,
                  reps=100 if timed else None, tflops=tflops, matmul_tflops=750.0,
                  pct_matmul=tflops / 7.5 if timed else None, max_abs_err=err if timed else None,
                  tolerance=2e-2, rows_checked=1024 if timed else None, **kw)


def sample_results():
    return [
        record(1024, "hopper_flash", ms=0.40, speedup_vs_cudnn=1.25),
        record(1024, "sdpa-cudnn", ms=0.50, speedup_vs_cudnn=1.0),
        record(1024, "flex-compiled", UNSUPPORTED, message="compile failed: out of resource"),
        record(1024, "fa3", UNAVAILABLE, message="cannot import flash_attn_interface"),
        record(2048, "hopper_flash", FAIL, ms=1.1, err=0.5, message="max abs error 0.5 > 0.02"),
        record(2048, "sdpa-cudnn", ms=1.6, speedup_vs_cudnn=1.0),
        record(2048, "flex-compiled", UNSUPPORTED, message="compile failed: out of resource"),
        record(2048, "fa3", UNAVAILABLE, message="cannot import flash_attn_interface"),
    ]


def render(results):
    console = Console(width=200, record=True, color_system=None)
    print_report(results, META, console)
    return console.export_text()


def test_table_rows_and_header():
    text = render(sample_results())
    for fact in ("2025-01-01", "NVIDIA H200", "torch 2.11.0", "triton 3.6.0", "CUDA 12.8", "750 TFLOP/s",
                 "`hopper-flash bench --seqlen 1024 2048`"):
        assert fact in text
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 6  # header, rule, 3 shown backends x 2 configs (fa3 is listed below instead)
    first = rows[2]
    assert "B4 H32 S1024 D128 causal bf16" in first and "hopper_flash" in first
    assert "0.400" in first and "1.25×" in first and "1.0e-03" in first
    assert f"{attention_flops(Config(seqlen=1024)) / 0.4e-3 / 1e12:.0f}" in first
    fail_row = next(r for r in rows if "FAIL" in r)
    assert "hopper_flash" in fail_row and "5.0e-01" in fail_row
    # One footnote per distinct message, referenced from the rows.
    assert text.count("compile failed: out of resource") == 1
    assert "- fa3: unavailable (cannot import flash_attn_interface)" in text
    assert "1 result(s) failed" in text


def test_table_marks_nan_error():
    bad = record(1024, "hopper_flash", FAIL, ms=0.1, message="non-finite values in output")
    bad.max_abs_err = math.nan
    table, notes = build_table([bad])
    text = render([bad])
    assert "NaN" in text and "FAIL" in text
    assert notes == ["[1] non-finite values in output"]


def test_json_round_trip(tmp_path):
    results = sample_results()
    write_json(tmp_path / "r.json", results, META)
    back, meta = read_json(tmp_path / "r.json")
    assert back == results and meta == META


def test_csv_round_trip(tmp_path):
    results = sample_results()
    write_csv(tmp_path / "r.csv", results)
    header = (tmp_path / "r.csv").read_text().splitlines()[0]
    assert header.startswith("batch,heads,kv_heads,seqlen,seqlen_k,headdim,causal,dtype,label,backend,status")
    assert read_csv(tmp_path / "r.csv") == results


def test_nan_error_survives_files(tmp_path):
    bad = record(1024, "hopper_flash", FAIL, ms=0.1, message="non-finite values in output")
    bad.max_abs_err = math.nan
    write_json(tmp_path / "r.json", [bad], META)  # JSON has no NaN: written as null
    (back,), _ = read_json(tmp_path / "r.json")
    assert back.status == FAIL and back.max_abs_err is None
    write_csv(tmp_path / "r.csv", [bad])
    (back,) = read_csv(tmp_path / "r.csv")
    assert back.status == FAIL and math.isnan(back.max_abs_err)


def test_plot_is_written(tmp_path):
    path = tmp_path / "tflops.png"
    results = sample_results() + [record(512, "sdpa-cudnn", ms=0.2), record(512, "hopper_flash", ms=0.15)]
    write_plot(path, results, META)
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and 5_000 < len(data) < 500_000


def test_plot_with_nothing_to_draw(tmp_path):
    path = tmp_path / "empty.png"
    write_plot(path, [record(1024, "hopper_flash", UNSUPPORTED, message="no")], {})
    assert path.read_bytes().startswith(b"\x89PNG")
