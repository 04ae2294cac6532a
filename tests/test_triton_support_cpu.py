"""The supported-triton check at import and the version guard of the fast
launch path (no GPU needed)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hopper_flash import _triton_support as ts
from hopper_flash import launcher, plan

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version,minor", [("3.6.0", (3, 6)), ("3.9.0+git1a2b3c4", (3, 9)), ("3.10.0", (3, 10)),
                                           ("3.7.0a0", (3, 7)), ("", None), ("unknown", None)])
def test_parse_minor(version, minor):
    assert ts.parse_minor(version) == minor


@pytest.mark.parametrize("version,ok", [("3.5.1", False), ("3.6.0", True), ("3.7.1", True), ("3.8.0", True),
                                        ("3.9.0", True), ("3.9.7", True), ("3.10.0", False), ("4.0.0", False),
                                        ("2.3.1", False), ("unknown", False)])
def test_supported_range(version, ok):
    assert ts.is_supported(version) is ok
    if not ok:
        with pytest.raises(ts.UnsupportedTritonError, match=version):
            ts.check_supported(version)


@pytest.mark.parametrize("version,fast", [("3.6.0", True), ("3.9.0", True), ("3.10.0", False), ("3.5.1", False),
                                          ("4.1.0", False), ("nightly", False)])
def test_fast_launch_guard(version, fast):
    assert ts.fast_launch_supported(version) is fast


def _import_with_triton_version(version, **env):
    """Import hopper_flash in a fresh interpreter whose triton reports ``version``."""
    code = textwrap.dedent(f"""
        import sys
        import triton
        triton.__version__ = {version!r}
        try:
            import hopper_flash
        except ImportError as e:
            gluon = sorted(m for m in sys.modules if m.startswith("triton.experimental.gluon"))
            print("ERROR", type(e).__name__, e)
            print("GLUON", gluon)
            sys.exit(3)
        from hopper_flash import plan
        print("FAST_LAUNCH", plan.FAST_LAUNCH)
    """)
    full_env = {k: v for k, v in os.environ.items() if k != ts.ALLOW_ANY_ENV}
    full_env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


@pytest.mark.parametrize("version", ["3.5.1", "3.10.0"])
def test_import_refuses_unsupported_triton(version):
    proc = _import_with_triton_version(version)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "ERROR UnsupportedTritonError" in proc.stdout
    assert f"installed triton is {version}" in proc.stdout
    assert ">=3.6,<3.10" in proc.stdout
    # The check runs before any Gluon module is imported.
    assert "GLUON []" in proc.stdout


def test_unchecked_triton_takes_the_public_launch():
    # Forced past the range check, an unknown triton gets no fast path.
    proc = _import_with_triton_version("3.10.0", **{ts.ALLOW_ANY_ENV: "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAST_LAUNCH False" in proc.stdout


def test_supported_triton_imports_with_fast_path():
    proc = _import_with_triton_version("3.6.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAST_LAUNCH True" in proc.stdout


class _FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, object(), object()

    def run(self, *args):
        self.log.append("fast")


class _FakeJIT:
    """Stands in for the Gluon kernel: records each public ``kernel[grid](...)`` launch."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append("jit")
            return _FakeCompiled(self.log)
        return launch


class _FakeDriver:
    class active:
        @staticmethod
        def get_current_stream(device):
            return 0


@pytest.mark.parametrize("fast", [False, True])
def test_launch_forward_follows_the_guard(monkeypatch, fast):
    from hopper_flash.kernels import forward

    log = []
    monkeypatch.setattr(forward, "attention_forward_kernel", _FakeJIT(log))
    monkeypatch.setattr(plan, "driver", _FakeDriver)
    monkeypatch.setattr(plan, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(plan, "_COMPILED", {})
    monkeypatch.setattr(plan, "FAST_LAUNCH", fast)
    q = torch.randn(1, 130, 2, 128).to(torch.bfloat16)
    out = torch.empty_like(q)
    for _ in range(3):
        plan.launch_forward(q, q, q, out, None, 0.1, True)
    assert log == (["jit", "fast", "fast"] if fast else ["jit", "jit", "jit"])


def test_fast_path_descriptor_has_what_the_launcher_reads():
    # The nvidia launcher reads a host descriptor's fields by name
    # (make_tensordesc_arg); launcher.TmaArg must carry every field of this
    # triton's Gluon TensorDescriptor except the compile-time ones.
    import dataclasses

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    runtime_fields = {f.name for f in dataclasses.fields(TensorDescriptor)} - {"block_shape", "layout"}
    assert runtime_fields <= set(launcher.TmaArg.__slots__)
    desc = launcher.TmaArg(torch.empty(2, 3, 4, 64, dtype=torch.bfloat16))
    assert all(hasattr(desc, name) for name in runtime_fields)
