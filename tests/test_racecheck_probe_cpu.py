"""The racecheck probes (scripts/racecheck_probe.py) are evidence in
docs/sanitizer.md; these checks keep them saying what the doc says they say.

The hand-written PTX is assembled for sm_90a with the ptxas that ships in
triton's wheel (no GPU needed) and its SASS is read: each handshake meets at
CTA-wide barrier 1 four times per thread group, and only the named-barrier
variants add 128-thread barriers between them.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hopper_flash.compile_check import _bindir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import racecheck_probe  # noqa: E402


@pytest.fixture(scope="module")
def sass_by_function(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ptx")
    ptx, cubin = tmp / "probe.ptx", tmp / "probe.cubin"
    ptx.write_text(racecheck_probe.PTX)
    subprocess.run([os.path.join(_bindir(), "ptxas"), "-arch=sm_90a", str(ptx), "-o", str(cubin)],
                   check=True, capture_output=True, text=True)
    sass = subprocess.run([os.path.join(_bindir(), "cuobjdump"), "--dump-sass", str(cubin)],
                          check=True, capture_output=True, text=True).stdout
    parts = re.split(r"Function : (\w+)", sass)[1:]
    return dict(zip(parts[::2], parts[1::2]))


def test_every_ptx_entry_is_assembled_and_checked(sass_by_function):
    assert set(sass_by_function) == set(racecheck_probe.EXPECTED)
    assert {f"ptx_{name}" for name in racecheck_probe.EXPECTED} <= set(racecheck_probe.PROBES)


@pytest.mark.parametrize("name", sorted(racecheck_probe.HANDSHAKES))
def test_handshake_barriers(sass_by_function, name):
    sass = sass_by_function[f"handshake_{name}"]
    default_id, default_n, worker_id, worker_n = racecheck_probe.HANDSHAKES[name]
    # Barrier 1 over the whole CTA: A, B, C, D in each of the two groups' copies.
    assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x1 ;", sass)) == 8
    counted = re.findall(r"BAR\.SYNC\.DEFER_BLOCKING (0x[0-9a-f]+), 0x80 ;", sass)
    assert sorted(counted) == sorted([hex(default_id)] * default_n + [hex(worker_id)] * worker_n)


def test_split_pc_meets_at_two_instructions(sass_by_function):
    assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x1 ;", sass_by_function["split_pc"])) == 2
    assert len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x1 ;", sass_by_function["same_pc"])) == 1
