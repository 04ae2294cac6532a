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


def _checkout_top(package_dir: Path) -> Path | None:
    """The hopper_flash checkout whose top holds ``package_dir``, or None.

    Only a repository whose top level is the package's parent directory and
    whose pyproject.toml names hopper_flash counts: an installed copy (site-
    packages) or a copy of the tree inside some other repository has none,
    and that other repository's commit says nothing about this code."""
    top = package_dir.parent
    pyproject = top / "pyproject.toml"
    try:
        if 'name = "hopper_flash"' not in pyproject.read_text():
            return None
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=top, capture_output=True, text=True,
                             timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or Path(out.stdout.strip()).resolve() != top.resolve():
        return None
    return top


def _git_commit(package_dir: Path | None = None) -> str | None:
    """The commit of the hopper_flash code being measured: HOPPER_FLASH_COMMIT
    when set (a copy of the tree without .git, e.g. on a remote GPU machine),
    else ``git describe`` of the checkout the imported package lives in
    ('-dirty' flags uncommitted changes), else None (an installed package:
    the header then shows its version)."""
    if os.environ.get("HOPPER_FLASH_COMMIT"):
        return os.environ["HOPPER_FLASH_COMMIT"]
    if package_dir is None:
        import hopper_flash

        package_dir = Path(hopper_flash.__file__).resolve().parent
    top = _checkout_top(package_dir)
    if top is None:
        return None
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=10"], cwd=top,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _package_version() -> str:
    import hopper_flash

    return hopper_flash.__version__


def _package_path() -> str:
    """Where the measured hopper_flash was imported from. ``python -m`` puts
    the working directory first on sys.path, so from a checkout's top a
    PYTHONPATH naming a patched copy (scripts/kernel_variant.py) is silently
    ignored; the header shows which code ran."""
    import hopper_flash

    return str(Path(hopper_flash.__file__).resolve().parent)


def collect_meta(command: str, matmul_tflops: float | None = None, hbm_copy_tbs: float | None = None) -> dict:
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
        "hopper_flash_version": _package_version(),
        "hopper_flash_commit": _git_commit(),
        "hopper_flash_path": _package_path(),
        "matmul_tflops": matmul_tflops,
        "hbm_copy_tbs": hbm_copy_tbs,
    }
    if torch.cuda.is_available():
        meta["cudnn"] = torch.backends.cudnn.version()
    return meta
