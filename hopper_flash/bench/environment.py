"""What the bench runs on: the Hopper check and the report header facts."""

from __future__ import annotations

import datetime
import platform
import os
import subprocess
from pathlib import Path

REQUIRED = "an NVIDIA Hopper GPU (compute capability 9.x, sm_90)"


def hopper_problem() -> str | None:
    """None on a usable Hopper GPU, else a one-line explanation of what was
    found and what is needed."""
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            found = f"this torch ({torch.__version__}) is a CPU-only build"
        else:
            found = f"no CUDA device is visible (torch {torch.__version__}, CUDA {torch.version.cuda})"
        return f"{found}; the benchmark needs {REQUIRED}."
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        name = torch.cuda.get_device_name()
        return f"found {name} with compute capability {major}.{minor}; the benchmark needs {REQUIRED}."
    return None


def _git_commit() -> str | None:
    # '-dirty' flags numbers measured with uncommitted kernel changes. A copy
    # of the tree without .git (a remote GPU machine) can name its commit in
    # HOPPER_FLASH_COMMIT.
    if os.environ.get("HOPPER_FLASH_COMMIT"):
        return os.environ["HOPPER_FLASH_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=10"],
            cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def collect_meta(command: str, matmul_tflops: float | None = None) -> dict:
    """Facts for the report header and the JSON file."""
    import torch
    import triton

    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "hopper_flash_commit": _git_commit(),
        "matmul_tflops": matmul_tflops,
    }
    if torch.cuda.is_available():
        meta["cudnn"] = torch.backends.cudnn.version()
    return meta
