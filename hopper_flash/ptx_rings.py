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

Safety net: the barriers go only if, from every generic shared-memory
access of those warpgroups, every control-flow path meets a kept barrier
first (so any later access it conflicts with stays ordered after it); if
not, the kernel keeps all of triton's (``strip`` reports 0). Without
line information (``TRITON_DISABLE_LINE_INFO``) nothing is found and
nothing changes. ``HOPPER_FLASH_RING_BARRIERS=1`` keeps triton's barriers
everywhere (``ACTIVE`` false); the host picks per specialisation
(``version_for``), and the kernel's ``RING_PTX`` constexpr records which
form (and which version of this module) compiled it.
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
# Control flow, for the safety net: block labels, branches, jump tables, returns.
_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"^\s*(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_JUMP = re.compile(r"^\s*(@!?%p\d+\s+)?brx\.idx\s+%r\d+,\s*(\$L_brx_\d+);")
_TABLE = re.compile(r"^\s*(\$L_brx_\d+):\s*\.branchtargets")
_END = re.compile(r"^\s*(@!?%p\d+\s+)?(?:ret|exit);")


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


def _control_flow(lines: list[str]) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Block labels by name (their line), and jump tables by name (their targets)."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    tables = {}
    for i, line in enumerate(lines):
        if m := _TABLE.match(line):
            text, j = "", i
            while ";" not in text and j < len(lines):
                text, j = text + lines[j], j + 1
            tables[m.group(1)] = re.findall(r"\$L__BB\d+_\d+", text)
    return labels, tables


def _first_barriers(lines: list[str], i: int, labels, tables) -> set[int]:
    """The barrier lines first met on the paths forward from line ``i``
    (a path that leaves the kernel meets none)."""
    found, entered, starts = set(), set(), [i + 1]
    while starts:
        j = starts.pop()
        while j < len(lines):
            line = lines[j]
            if _BAR.match(line):
                found.add(j)
                break
            if _LABEL.match(line):
                if j in entered:
                    break
                entered.add(j)
            if m := _BRANCH.match(line):
                starts.append(labels[m.group(2)])
                if not m.group(1):
                    break
            elif m := _JUMP.match(line):
                starts.extend(labels[t] for t in tables[m.group(2)])
                if not m.group(1):
                    break
            elif (m := _END.match(line)) and not m.group(1):
                break
            j += 1
    return found


def strip(ptx: str) -> tuple[str, int]:
    """``ptx`` without the ring barriers, and how many went (0: unchanged)."""
    lines = ptx.split("\n")
    drop = set(candidates(lines))
    if not drop:
        return ptx, 0
    # Two generic shared-memory accesses of a warpgroup, the earlier one on
    # line i, are ordered by the first barrier on each path from line i: if
    # none of those goes, every such pair keeps its barrier (the membar pass
    # puts one before the later access unless an earlier barrier serves).
    ids = {_WG_BAR.match(lines[i]).group(1) for i in drop}
    labels, tables = _control_flow(lines)
    try:
        safe = _accesses_keep_barriers(lines, drop, ids, labels, tables)
    except KeyError:  # a branch to a label this reading did not find: keep everything
        safe = False
    if not safe:
        return ptx, 0
    return "\n".join(line for i, line in enumerate(lines) if i not in drop), len(drop)


def _accesses_keep_barriers(lines, drop, ids, labels, tables) -> bool:
    """Whether every generic shared-memory access of the warpgroups whose
    named barriers ``ids`` are meets a kept barrier first on every path."""
    for i, line in enumerate(lines):
        if not _GENERIC_SMEM.search(line) or line.lstrip().startswith("//"):
            continue
        # The access's warpgroup: the named barrier nearest before it.
        j = i - 1
        while j >= 0 and not _BAR.match(lines[j]):
            j -= 1
        if j < 0 or _BAR.match(lines[j]).group(1) not in ids:
            continue
        if _first_barriers(lines, i, labels, tables) & drop:
            return False
    return True


# The rewrite's version: the forward kernel's RING_PTX constexpr (0 where
# triton's barriers stay), so a kernel compiled by an earlier form of this
# module or without it never serves from triton's cache (3.6 keys the cache
# on the source and the constexprs alone); bump it with any change to what
# ``strip`` takes out. Triton 3.9 also asks the hook itself for a key.
VERSION = 2
PIPELINE_KEY = f"hopper_flash.ptx_rings/{VERSION}"
_PIPELINE_DIGEST = hashlib.sha256(PIPELINE_KEY.encode()).hexdigest()


def _hook(previous):
    def hook(*args):
        if not args:  # triton 3.9: what this pipeline adds to the cache key
            if previous is None:
                return PIPELINE_KEY, _PIPELINE_DIGEST
            key, digest = previous()
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


def version_for(head_dim: int) -> int:
    """The forward specialisation's ``RING_PTX``: ``VERSION`` where the
    rewrite applies, 0 where triton's barriers stay. Head dim 256 keeps
    them: its causal S=8192 row ran 1.8% slower without (BENCHMARKS.md,
    thirty-ninth session), and one of its split-KV kernels spilled 16 bytes
    (soft-capped, with sequence lengths; triton 3.6 CPU census)."""
    return VERSION if ACTIVE and head_dim != 256 else 0


@contextlib.contextmanager
def compiling(ring_ptx: int):
    """Around a launch or ``triton.compile`` that may compile a forward
    specialisation whose ``RING_PTX`` is ``ring_ptx``: where not 0, its PTX
    loses the ring barriers. Triton's stage hook is one global slot: an
    existing hook is chained, then put back."""
    if not ring_ptx:
        yield
        return
    previous = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = _hook(previous)
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
