"""Shared test fixtures. GPU tests carry the `gpu` marker and skip, with the
reason, wherever no Hopper GPU is present (CI is CPU-only)."""
import pytest
import torch


def _hopper_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device: hopper_flash's GPU tests need a Hopper GPU (sm_90)"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"GPU is {torch.cuda.get_device_name()} (sm_{major}{minor}); these tests need Hopper (sm_90)"
    return None


HOPPER_SKIP_REASON = _hopper_skip_reason()


def pytest_collection_modifyitems(config, items):
    if HOPPER_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=HOPPER_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """``HOPPER_FLASH_TEST_CONFIG="field=value,..."`` runs the whole suite on a
    variant of every head dim's ForwardConfig (e.g. ``persistent=1``), so a
    kernel variant is tested before it is shipped."""
    import os

    spec = os.environ.get("HOPPER_FLASH_TEST_CONFIG", "")
    if spec:
        from hopper_flash import plan

        plan.use_variant(spec)


def pytest_report_header(config):
    """Which package runs, and on which config variant. pyproject's
    ``pythonpath = ["."]`` puts the checkout first on sys.path, so a patched
    copy of the package (scripts/kernel_variant.py) on PYTHONPATH is tested
    only with ``-o pythonpath=COPY`` (``device_session.sh variant`` does it);
    this line says which one ran."""
    import os

    import hopper_flash

    lines = [f"hopper_flash imported from {os.path.dirname(hopper_flash.__file__)}"]
    spec = os.environ.get("HOPPER_FLASH_TEST_CONFIG", "")
    if spec:
        lines.append(f"hopper_flash config variant: {spec}")
    return lines
