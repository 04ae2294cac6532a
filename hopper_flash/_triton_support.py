"""Which triton versions hopper_flash runs on, decided in one place.

Two separate questions, answered by version:

1. Is the installed triton supported at all? ``SUPPORTED`` is the range the
   kernels compile on (the sm_90a census, ``python -m hopper_flash.compile_check``,
   passes on 3.6.0, 3.7.1, 3.8.0 and 3.9.0) and ``pyproject.toml`` declares.
   Outside it the package refuses to import with a message naming both
   versions, before any Gluon module is touched (a Gluon traceback from a
   renamed builtin tells a user nothing).

2. May ``plan.launch_forward`` call a compiled kernel's launcher directly
   (``CompiledKernel.run``), skipping the JIT's per-call work? That launcher
   is private, so the fast path is taken only on the minor versions listed in
   ``FAST_LAUNCH_MINORS``, whose calling convention was read or run; any
   other version takes the public ``kernel[grid](...)`` launch. One step
   further, ``DIRECT_LAUNCH_MINORS``: where ``launcher.KernelLaunch`` may call
   the C launch function under ``CompiledKernel.run`` itself.

This module imports nothing from triton but ``triton.__version__`` (plain
triton, never Gluon), so it is safe to run first.
"""
from __future__ import annotations

import os
import re

# [lowest, highest] minor versions, inclusive; pyproject.toml says
# "triton>=3.6,<3.10". Every torch >= 2.10 pins one of these: torch 2.10 and
# 2.11 pin 3.6.0, 2.12 pins 3.7.0, 2.13 pins 3.7.1, 2.14 pins ~=3.8.0, 2.15
# pins 3.9.0.
SUPPORTED = ((3, 6), (3, 9))
SUPPORTED_TEXT = ">=3.6,<3.10"

# Minor versions on which ``CompiledKernel.run(grid_x, grid_y, grid_z, stream,
# function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``
# is what the JIT itself calls (runtime/jit.py, JITFunction.run), with the
# kernel's arguments in signature order, constexprs included, and host
# tensor descriptors read by the nvidia driver's launcher (make_tensordesc_arg)
# through the attributes base, shape, strides, padding and, from 3.7 on,
# round_f32_to_tf32. Sources read for 3.6.0, 3.7.1, 3.8.0 and 3.9.0
# (compiler/compiler.py CompiledKernel.run, backends/nvidia/driver.py
# CudaLauncher.__call__): the convention is the same in all four. Run on the
# H200: 3.6.0, 3.7.1, 3.8.0 and 3.9.0 (the whole GPU suite; 3.7.1 in the
# twenty-seventh session, 3.9.0 in the twenty-eighth and 3.8.0 in the
# twenty-ninth, through scripts/triton_gpu_tarball.sh);
# tests/test_launch_gpu.py compares the fast path with the public launch
# bitwise.
# Add a minor version here only after reading its sources the same way.
FAST_LAUNCH_MINORS = frozenset({(3, 6), (3, 7), (3, 8), (3, 9)})

# Minor versions on which ``launcher.KernelLaunch`` may call a compiled
# kernel's C launch function itself (``launcher``'s docstring gives the two
# conventions, 3.6 and 3.7-3.9). tests/test_launcher_cpu.py checks the call
# against the installed triton's own launch wrapper (CI: 3.7.1; 3.6.0, 3.8.0
# and 3.9.0 by hand); the GPU suite ran it on the H200 under 3.6.0, 3.7.1,
# 3.8.0 and 3.9.0.
# Elsewhere a fast launch goes through ``CompiledKernel.run``.
DIRECT_LAUNCH_MINORS = frozenset({(3, 6), (3, 7), (3, 8), (3, 9)})

# Set to 1 to import under an unsupported triton anyway (to try a new
# release); the fast launch path stays off there.
ALLOW_ANY_ENV = "HOPPER_FLASH_ALLOW_ANY_TRITON"


class UnsupportedTritonError(ImportError):
    """The installed triton is outside the range hopper_flash supports."""


def parse_minor(version: str) -> tuple[int, int] | None:
    """``"3.9.0+git1a2b"`` -> ``(3, 9)``; None when unreadable."""
    m = re.match(r"\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def installed_version() -> str:
    """The version of the triton that ``import triton`` loads (which may be a
    ``--target`` directory on PYTHONPATH, not the environment's own)."""
    try:
        import triton
    except ImportError as e:
        raise UnsupportedTritonError(
            f"hopper_flash needs triton{SUPPORTED_TEXT}, and `import triton` failed ({e}). "
            f"Install it with: pip install 'triton{SUPPORTED_TEXT}'") from None
    return str(getattr(triton, "__version__", "unknown"))


def is_supported(version: str) -> bool:
    minor = parse_minor(version)
    return minor is not None and SUPPORTED[0] <= minor <= SUPPORTED[1]


def check_supported(version: str | None = None) -> str:
    """Return the installed triton version, or raise UnsupportedTritonError
    naming it and the supported range."""
    version = installed_version() if version is None else version
    if is_supported(version) or os.environ.get(ALLOW_ANY_ENV) == "1":
        return version
    raise UnsupportedTritonError(
        f"hopper_flash supports triton{SUPPORTED_TEXT} (3.6.x to 3.9.x); the installed triton is {version}. "
        f"Install a supported one, e.g. the one your torch pins (torch 2.10/2.11: 3.6.0, 2.12: 3.7.0, "
        f"2.13: 3.7.1, 2.14: 3.8.x, 2.15: 3.9.0), or set {ALLOW_ANY_ENV}=1 to try this one anyway.")


def fast_launch_supported(version: str | None = None) -> bool:
    """Whether the private-launcher fast path was checked on this triton."""
    version = installed_version() if version is None else version
    return parse_minor(version) in FAST_LAUNCH_MINORS


__all__ = ["SUPPORTED", "SUPPORTED_TEXT", "FAST_LAUNCH_MINORS", "DIRECT_LAUNCH_MINORS", "ALLOW_ANY_ENV",
           "UnsupportedTritonError", "parse_minor", "installed_version", "is_supported", "check_supported",
           "fast_launch_supported"]
