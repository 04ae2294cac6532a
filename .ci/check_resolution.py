"""Fail loudly when this project's declared requirements cannot be installed
next to a CUDA build of torch that users have.

Each CUDA torch wheel pins one triton; for every torch release inside the
declared range this asks pip to resolve the project together with that torch
(``pip install --dry-run --ignore-installed``: package metadata only, no
multi-GB download) and checks that pip keeps that torch and picks the triton
it pins. A triton range that excludes a torch's pin shows up here as a pip
ResolutionImpossible, or as a different torch chosen.

Usage: python .ci/check_resolution.py [TORCH_VERSION ...]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# torch release -> the triton its CUDA wheels require (torch's own metadata).
TORCH_PINS = {
    "2.10.0": "3.6.0",
    "2.11.0": "3.6.0",
    "2.12.0": "3.7.0",
    "2.13.0": "3.7.1",
    "2.14.0": "3.8.",   # ~=3.8.0: any 3.8.x
    "2.14.1": "3.8.",
    "2.15.0": "3.9.0",
}


def resolve(torch_version: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        # A machine-wide pip constraint (some CI images cap torch) would hide
        # the newest releases from this check; users have none. "===" asks
        # for exactly that release: a local CPU build such as 2.13.0+cpu
        # (found through find-links) requires no triton and is not what a
        # CUDA user installs.
        env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--disable-pip-version-check", "--report", str(report), "-e", str(ROOT), f"torch==={torch_version}"],
            capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            # pip's own verdict (ResolutionImpossible and the conflict), not
            # the build back-end's warnings around it.
            errors = [line for line in (proc.stdout + proc.stderr).splitlines()
                      if line.startswith(("ERROR", "The conflict", "    The user requested", "    hopper"))]
            raise SystemExit(f"FAIL: pip cannot install hopper_flash next to torch {torch_version}:\n"
                             + "\n".join(errors or (proc.stdout + proc.stderr).splitlines()[-20:]))
        installs = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installs}


def main(versions: list[str]) -> int:
    failures = []
    for torch_version in versions or list(TORCH_PINS):
        chosen = resolve(torch_version)
        want_triton = TORCH_PINS[torch_version]
        got_torch, got_triton = chosen.get("torch"), chosen.get("triton")
        ok = got_torch == torch_version and got_triton is not None and got_triton.startswith(want_triton)
        print(f"{'ok  ' if ok else 'FAIL'} torch {torch_version}: pip resolves torch {got_torch}, "
              f"triton {got_triton}, hopper_flash {chosen.get('hopper_flash')}", flush=True)
        if not ok:
            failures.append(torch_version)
    if failures:
        print(f"FAIL: the declared requirements do not resolve next to torch {', '.join(failures)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
