"""TFLOP/s against sequence length, one line per backend, from the records.

Only results that passed the correctness check are plotted. Configs that
differ in more than batch/heads/seqlen (e.g. two dtypes, causal and not) get
separate lines, labelled with the difference, so lines never zigzag between
unrelated shapes.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

from .results import OK, Result


def _family(r: Result) -> tuple:
    # What makes two configs comparable along the seqlen axis; batch and heads
    # vary in the default set to keep the work per call reasonable.
    # The pass too: a backward's TFLOP/s are not a forward's.
    return (r.dtype, r.headdim, r.causal, r.heads // r.kv_heads, r.seqlen_k == r.seqlen, r.bench_pass)


def _family_label(family: tuple) -> str:
    dtype, headdim, causal, group, equal, bench_pass = family
    parts = [dtype, f"D{headdim}", "causal" if causal else "full"]
    if bench_pass != "fwd":
        parts.append(bench_pass)
    if group > 1:
        parts.append(f"GQA {group}:1")
    if not equal:
        parts.append("S_q≠S_k")
    return " ".join(parts)


def write_plot(path: str | Path, results: Sequence[Result], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; works without a display
    import matplotlib.pyplot as plt

    lines: dict[tuple, list[tuple[int, float]]] = defaultdict(list)
    for r in results:
        if r.status == OK and r.tflops is not None:
            lines[(r.backend, _family(r))].append((r.seqlen, r.tflops))
    many_families = len({fam for _, fam in lines}) > 1

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    for (backend, family), points in lines.items():
        points.sort()
        xs, ys = zip(*points)
        label = f"{backend} ({_family_label(family)})" if many_families else backend
        ax.plot(xs, ys, marker="o", label=label)
    rate = meta.get("matmul_tflops")
    if rate:
        ax.axhline(rate, color="gray", linestyle="--", linewidth=1, label=f"bf16 matmul 8192³ ({rate:.0f})")
    ax.set_xscale("log", base=2)
    seqlens = sorted({r.seqlen for r in results})
    if seqlens:
        ax.set_xticks(seqlens, [str(s) for s in seqlens])
    ax.set_xlabel("sequence length (query)")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    title = f"Attention forward on {meta.get('gpu', '?')}"
    if not many_families and lines:
        title += f", {_family_label(next(iter(lines))[1])}"
    versions = f"torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, CUDA {meta.get('cuda', '?')}"
    ax.set_title(f"{title}\n{versions}", fontsize=10)
    if lines or rate:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
