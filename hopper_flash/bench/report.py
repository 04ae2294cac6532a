"""The printed report: a header of facts, one table row per (config, backend),
footnotes for long messages, and a pass/fail summary.

The table uses rich's MARKDOWN box and the header is a markdown list, so the
whole report pastes into BENCHMARKS.md as is.
"""

from __future__ import annotations

import math
from itertools import groupby
from typing import Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .results import ERROR, FAIL, OK, UNAVAILABLE, UNSUPPORTED, Result

STATUS_STYLE = {OK: "green", FAIL: "bold red", ERROR: "bold red", UNSUPPORTED: "yellow", UNAVAILABLE: "dim"}


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _err(x: float | None) -> str:
    if x is None:
        return "—"
    return "NaN" if math.isnan(x) else f"{x:.1e}"


def header_lines(meta: dict) -> list[str]:
    rate = meta.get("matmul_tflops")
    copy = meta.get("hbm_copy_tbs")
    lines = [
        f"- date: {meta.get('date', '?')}",
        f"- GPU: {meta.get('gpu', '?')}",
        f"- torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, CUDA {meta.get('cuda', '?')}"
        + (f", cuDNN {meta['cudnn']}" if meta.get("cudnn") else ""),
        f"- hopper_flash{' ' + meta['hopper_flash_version'] if meta.get('hopper_flash_version') else ''} "
        f"commit: {meta.get('hopper_flash_commit') or 'unknown (not run from a hopper_flash checkout)'}"
        + (f", imported from {meta['hopper_flash_path']}" if meta.get("hopper_flash_path") else ""),
        f"- bf16 matmul 8192³: {rate:.0f} TFLOP/s" if rate else "- bf16 matmul: not measured",
        f"- command: `{meta.get('command', '?')}`",
        "- K/V TB/s: 2·B·Hkv·S_k·D·2 bytes of K and V per call over the median time; "
        + (f"this GPU's HBM copy rate (1 GiB, read and written, `do_bench`): {copy:.2f} TB/s"
           if copy else "the HBM copy rate not measured (the H200's: ~4.3 TB/s)")
        + " (decode is bound by it)",
    ]
    return lines


def build_table(results: Sequence[Result]) -> tuple[Table, list[str]]:
    """The results table and its footnotes (messages, numbered once each).

    Unavailable backends get no rows (they would repeat on every config);
    they are listed once in the footnotes instead. With passes other than
    the forward, the config column names the pass (``... bf16 bwd``); with
    measured memory a "peak MiB" column is added.
    """
    only_fwd = all(r.bench_pass == "fwd" for r in results)
    with_memory = any(r.peak_mib is not None for r in results)
    table = Table(box=box.MARKDOWN, show_edge=True, pad_edge=True)
    table.add_column("config")
    table.add_column("backend")
    table.add_column("status")
    table.add_column("median ms", justify="right")
    table.add_column("min–max ms", justify="right")
    table.add_column("TFLOP/s", justify="right")
    table.add_column("% matmul", justify="right")
    table.add_column("vs cuDNN", justify="right")
    table.add_column("K/V TB/s", justify="right")
    table.add_column("max err", justify="right")
    if with_memory:
        table.add_column("peak MiB", justify="right")
    table.add_column("note")

    notes: list[str] = []

    def note(text: str) -> str:
        if not text:
            return ""
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    unavailable: dict[str, str] = {}
    for (label, bench_pass), group in groupby(results, key=lambda r: (r.label, r.bench_pass)):
        if not only_fwd:
            label = f"{label} {bench_pass}"
        first = True
        for r in group:
            if r.status == UNAVAILABLE:
                unavailable.setdefault(r.backend, r.message)
                continue
            dim = r.status != OK
            timing = [
                _num(r.median_ms, ".3f"),
                "—" if r.min_ms is None else f"{r.min_ms:.3f}–{r.max_ms:.3f}",
                _num(r.tflops, ".0f"),
                _num(r.pct_matmul, ".0f"),
                "—" if r.speedup_vs_cudnn is None else f"{r.speedup_vs_cudnn:.2f}×",
                _num(getattr(r, "kv_tbs", None), ".2f"),
            ]
            table.add_row(
                label if first else "",
                r.backend,
                Text(r.status, style=STATUS_STYLE.get(r.status, "")),
                *(Text(t, style="dim strike" if dim and t != "—" else "") for t in timing),
                _err(r.max_abs_err),
                *([_num(r.peak_mib, ".0f")] if with_memory else []),
                note(r.message),
            )
            first = False
    footnotes = [f"[{i}] {text}" for i, text in enumerate(notes, 1)]
    footnotes += [f"- {name}: unavailable ({why})" for name, why in unavailable.items()]
    return table, footnotes


def summary(results: Sequence[Result]) -> Text:
    bad = [r for r in results if r.failed]
    if not bad:
        ok = sum(r.status == OK for r in results)
        return Text(f"All {ok} timed results match the float64 reference.", style="green")
    lines = [f"{len(bad)} result(s) failed; exit status 1:"]
    lines += [f"  {r.status}: {r.backend} on {r.label}: {r.message}" for r in bad]
    return Text("\n".join(lines), style="bold red")


def print_report(results: Sequence[Result], meta: dict, console: Console | None = None) -> None:
    # Wide when piped to a file, so the markdown table is never wrapped.
    console = console or Console(width=None if Console().is_terminal else 200)
    passes = list(dict.fromkeys(r.bench_pass for r in results)) or ["fwd"]
    title = "forward" if passes == ["fwd"] else ", ".join(passes)
    console.print(f"## Attention {title} benchmark", markup=False)
    console.print()
    for line in header_lines(meta):
        console.print(line, markup=False, highlight=False)
    console.print()
    table, footnotes = build_table(results)
    console.print(table)
    if footnotes:
        console.print()
        for line in footnotes:
            console.print(line, markup=False, highlight=False)
    console.print()
    console.print(summary(results))
