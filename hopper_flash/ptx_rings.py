"""The forward kernel's K/V ring without triton's named barriers around it.

triton 3.6's membar pass puts a 128-thread ``bar.sync`` of the warpgroup
before every mbarrier wait and every mbarrier arrive of a partition: four
per consumer step of the forward kernel (the K and V waits and releases).
FA3's consumers have none there. ``kernels/pipeline.py`` says why two of
those operations, ``wait_landed`` and ``release_read``, need none (a wgmma
between each wait and release keeps a warpgroup's warps within one phase
of each other), and the forward kernel's steps use them. This module takes
the barriers before those two out of the PTX while triton compiles the
forward kernel, found by the ``.loc`` directive that precedes each (the
line of the ``mbarrier`` call inside those two functions).

Measured (BENCHMARKS.md, thirty-eighth session, variant ``fwd-ring-nobar``
whose PTX this reproduces): D=128 causal B4 H32 S8192 +2.7%, non-causal
+0.9%, D=64 causal +0.9%.

Safety net: a barrier is taken out only where no generic shared-memory
access of the same warpgroup sits between it and a kept barrier on either
side within the same basic block; if any such access would lose its
barrier, the kernel keeps all of triton's (``strip`` reports 0). Without
line information (``TRITON_DISABLE_LINE_INFO``) nothing is found and
nothing changes. ``HOPPER_FLASH_RING_BARRIERS=1`` keeps triton's barriers
everywhere (``ACTIVE`` false); the kernel's ``RING_PTX`` constexpr records
which, so the two never share a cache entry.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import re

from triton import knobs

ACTIVE = os.environ.get("HOPPER_FLASH_RING_BARRIERS", "0") != "1"

KERNEL = "attention_forward_kernel"


def _call_line(fn, call: str) -> int:
    """The source line of ``call`` inside the Gluon function ``fn``."""
    lines, start = inspect.getsourcelines(fn.fn)
    hits = [start + i for i, text in enumerate(lines) if call in text]
    assert len(hits) == 1, (fn, call, hits)
    return hits[0]


@functools.cache
def ring_lines() -> tuple[int, int]:
    """Source lines of the two mbarrier calls whose barriers go (the kernels
    are imported on first use, as the launches do)."""
    from .kernels import pipeline

    return (_call_line(pipeline.wait_landed, "mbarrier.wait("),
            _call_line(pipeline.release_read, "mbarrier.arrive("))

_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', re.MULTILINE)
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+")
_BAR = re.compile(r"^\s*(?:bar|barrier)\.sync(?:\.aligned)?\s+(\d+)")
_WG_BAR = re.compile(r"^\s*bar\.sync\s+(\d+),\s*128;")
_GENERIC_SMEM = re.compile(r"\b(?:(?:ld|st|atom|red)\.shared|stmatrix|ldmatrix|cp\.async\.c[ag]\.shared)")
# A basic block's edges: its label, or a branch, return or exit.
_BLOCK_EDGE = re.compile(r"^(?:\$L__BB\d+_\d+:|\s*(?:@!?%p\d+\s+)?(?:bra|brx|ret|exit)\b)")


def _pipeline_file(ptx: str) -> str | None:
    for index, path in _FILE.findall(ptx):
        if path.replace("\\", "/").endswith("hopper_flash/kernels/pipeline.py"):
            return index
    return None


def candidates(lines: list[str]) -> list[int]:
    """Indices of the ``bar.sync N, 128`` lines right after a ``.loc`` of
    ``wait_landed``'s or ``release_read``'s mbarrier call."""
    index = _pipeline_file("\n".join(line for line in lines if ".file" in line))
    if index is None:
        return []
    found = []
    for i in range(1, len(lines)):
        loc = _LOC.match(lines[i - 1])
        if loc and loc.group(1) == index and int(loc.group(2)) in ring_lines() and _WG_BAR.match(lines[i]):
            found.append(i)
    return found


def _guarded(lines: list[str], i: int, step: int, drop: set[int]) -> bool:
    """Whether the generic shared-memory access on line ``i`` meets a kept
    barrier before its basic block ends, walking by ``step``."""
    j = i + step
    while 0 <= j < len(lines):
        if _BAR.match(lines[j]):
            return j not in drop
        if _BLOCK_EDGE.match(lines[j]):
            return False
        j += step
    return False


def strip(ptx: str) -> tuple[str, int]:
    """``ptx`` without the ring barriers, and how many went (0: unchanged)."""
    lines = ptx.split("\n")
    drop = set(candidates(lines))
    if not drop:
        return ptx, 0
    ids = {_WG_BAR.match(lines[i]).group(1) for i in drop}
    for i, line in enumerate(lines):
        if not _GENERIC_SMEM.search(line) or line.lstrip().startswith("//"):
            continue
        # The access's warpgroup: the named barrier nearest before it.
        j = i - 1
        while j >= 0 and not _BAR.match(lines[j]):
            j -= 1
        if j < 0 or _BAR.match(lines[j]).group(1) not in ids:
            continue
        if not (_guarded(lines, i, -1, drop) and _guarded(lines, i, 1, drop)):
            return ptx, 0
    return "\n".join(line for i, line in enumerate(lines) if i not in drop), len(drop)


# What this rewrite adds to a compiled kernel's cache key where triton asks
# (3.9 calls the hook with no arguments for it; 3.6 does not, and there the
# kernels' RING_PTX constexpr keeps the two forms apart).
PIPELINE_KEY = "hopper_flash.ptx_rings/1"


def _hook(previous):
    def hook(*args):
        if not args:
            key, digest = previous() if previous is not None else ("", "")
            return key + PIPELINE_KEY, hashlib.sha256((digest + PIPELINE_KEY).encode()).hexdigest()
        if previous is not None:
            previous(*args)
        _backend, stages, _options, _language, _capability = args
        make_ptx = stages["ptx"]

        def ptx(src, metadata):
            text = make_ptx(src, metadata)
            if str(metadata.get("name", "")) == KERNEL:
                text, _ = strip(text)
            return text

        stages["ptx"] = ptx

    return hook


@contextlib.contextmanager
def compiling():
    """Around a launch or ``triton.compile`` that may compile the forward
    kernel: its PTX loses the ring barriers (when ``ACTIVE``). Triton's
    stage hook is one global slot: an existing hook is chained, then put back."""
    if not ACTIVE:
        yield
        return
    previous = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = _hook(previous)
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
