"""The recorded result of one (config, backend) cell, and its JSON/CSV files.

Everything the report, the files and the plot show comes from these records,
so a JSON file from the GPU machine can be re-rendered anywhere.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

OK = "ok"
FAIL = "FAIL"  # ran, but the output is wrong: fails the run
ERROR = "error"  # crashed unexpectedly: fails the run
UNSUPPORTED = "unsupported"  # the backend declines this config
UNAVAILABLE = "unavailable"  # the backend is not installed / importable
BAD_STATUSES = (FAIL, ERROR)


@dataclass
class Result:
    # config (Config.to_record field names)
    batch: int
    heads: int
    kv_heads: int
    seqlen: int
    seqlen_k: int
    headdim: int
    causal: bool
    dtype: str
    label: str
    backend: str
    status: str
    message: str = ""
    flops: int = 0
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    reps: int | None = None
    tflops: float | None = None
    matmul_tflops: float | None = None
    pct_matmul: float | None = None  # tflops / matmul_tflops * 100
    speedup_vs_cudnn: float | None = None  # cuDNN median / this median; > 1 is faster
    kv_tbs: float | None = None  # K/V bytes (configs.kv_bytes) / median time, TB/s
    max_abs_err: float | None = None
    tolerance: float | None = None  # the judge's max-abs limit for this cell (2x SDPA's error + a floor)
    rel_fro_err: float | None = None
    rel_fro_limit: float | None = None
    rows_checked: int | None = None
    bench_pass: str = "fwd"  # "fwd", "bwd" or "fwd+bwd" (runner.PASSES); records before passes existed are "fwd"
    peak_mib: float | None = None  # --memory: peak MiB allocated during one call beyond what was allocated before
    window: list | None = None  # [left, right] of a sliding window (configs.Config.window), or None
    headdim_v: int | None = None  # v's head dim (configs.Config.head_dim_v); None in records before it existed

    @property
    def failed(self) -> bool:
        return self.status in BAD_STATUSES


FIELDS = tuple(f.name for f in dataclasses.fields(Result))


def _json_value(x):
    # JSON has no NaN; a NaN error is written as null plus the FAIL status.
    return None if isinstance(x, float) and math.isnan(x) else x


def write_json(path: str | Path, results: list[Result], meta: dict) -> None:
    records = [{k: _json_value(v) for k, v in dataclasses.asdict(r).items()} for r in results]
    Path(path).write_text(json.dumps({"meta": meta, "results": records}, indent=2) + "\n")


def read_json(path: str | Path) -> tuple[list[Result], dict]:
    data = json.loads(Path(path).read_text())
    return [Result(**rec) for rec in data["results"]], data.get("meta", {})


def write_csv(path: str | Path, results: list[Result]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for r in results:
            writer.writerow({k: "" if v is None else v for k, v in dataclasses.asdict(r).items()})


def _parse(field: dataclasses.Field, text: str):
    kind = field.type if isinstance(field.type, str) else str(field.type)
    if text == "":
        return None if "None" in kind else ""
    if kind.startswith("bool"):
        return text == "True"
    if kind.startswith("int"):
        return int(text)
    if kind.startswith("float"):
        return float(text)
    if kind.startswith("list"):
        return json.loads(text)
    return text


def read_csv(path: str | Path) -> list[Result]:
    fields = {f.name: f for f in dataclasses.fields(Result)}
    with open(path, newline="") as f:
        return [Result(**{k: _parse(fields[k], v) for k, v in row.items()}) for row in csv.DictReader(f)]
