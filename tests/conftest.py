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


def _spy_on_plans(monkeypatch, record):
    """Call ``record(lp)`` with the plan (plan.LaunchPlan) of every forward
    launch planned from here on, fixed-length and varlen
    (plan._plan_launch and plan._plan_varlen uncached)."""
    from hopper_flash import plan

    def spying(real):
        def spy(*args, **kwargs):
            lp = real(*args, **kwargs)
            record(lp)
            return lp
        return spy
    monkeypatch.setattr(plan, "_plan_launch", spying(plan._plan_launch.__wrapped__))
    monkeypatch.setattr(plan, "_plan_varlen", spying(plan._plan_varlen.__wrapped__))


@pytest.fixture
def signature_memory(monkeypatch):
    """A function that empties checks' memory of passed argument signatures
    (``validate``, ``validate_varlen``), keys it for CPU tensors, and
    returns the list that grows by one each time ``checks.<name>`` (the
    checks themselves) runs."""
    from hopper_flash import checks

    def fresh(name):
        monkeypatch.setattr(checks, "_PASSED", {})
        monkeypatch.setattr(checks, "_PASSED_DEVICE_TYPE", "cpu")
        runs = []
        real = getattr(checks, name)
        monkeypatch.setattr(checks, name, lambda *a: runs.append(1) or real(*a))
        return runs
    return fresh


@pytest.fixture
def planned_rows(monkeypatch):
    """The tile height (block_m) of every forward launch planned from here on."""
    seen = []
    _spy_on_plans(monkeypatch, lambda lp: seen.append(lp.cfg.block_m))
    return seen


@pytest.fixture
def planned_launches(monkeypatch):
    """The plan (plan.LaunchPlan) of every forward launch planned from here
    on, fixed-length and varlen, to check which kernel a test ran (its
    ``mode`` and ``cfg``). No launch is a prepared one
    (plan.PreparedForward replays an earlier plan)."""
    from hopper_flash import plan

    seen = []
    _spy_on_plans(monkeypatch, seen.append)
    monkeypatch.setattr(plan, "_PREPARED", {})
    return seen


@pytest.fixture
def wide_tiles(monkeypatch, planned_rows):
    """Run the wide tiles (plan.WIDE_CONFIGS: three consumer warpgroups, 192
    rows) at every length, where plan.choose_wide picks them only for long
    prefill. Yields the tile heights the launches planned, to check that the
    wide kernel is what ran."""
    from hopper_flash import plan

    if not plan.WIDE_CONFIGS:
        pytest.skip("no wide tiles under this triton (plan.wide_configs)")
    monkeypatch.setattr(plan, "WIDE_MIN_KEYS_FULL", 0)
    monkeypatch.setattr(plan, "WIDE_MIN_KEYS_CAUSAL", 0)
    monkeypatch.setattr(plan, "WIDE_MIN_ROWS", 0)
    # Small problems would take split-KV (a decode mode, on two consumers).
    monkeypatch.setattr(plan, "choose_num_splits", lambda *args: 1)
    return planned_rows
