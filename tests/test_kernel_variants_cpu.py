"""The measurement-only kernel variants (scripts/kernel_variant.py) still
apply to the shipped source: a variant that silently stopped applying would
make the next experiment time the shipped kernel under another name."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATCHES = sorted((ROOT / "scripts" / "variants").glob("*.patch"))


def test_there_are_variants():
    assert PATCHES


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_variant_applies_and_changes_the_kernel(patch, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_variant.py"), patch.stem, str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    changed = []
    # The kernels, or the plans that pick a kernel's switches and grid
    # (the forty-second session's bwd-persistent-ctas changed only the backward's grid).
    shipped_files = [*(ROOT / "hopper_flash" / "kernels").glob("*.py"), *(ROOT / "hopper_flash").glob("plan*.py")]
    for shipped_file in sorted(shipped_files):
        variant = (tmp_path / shipped_file.relative_to(ROOT)).read_text()
        if variant != shipped_file.read_text():
            changed.append(shipped_file.name)
    # A module the shipped package lacks changes how the kernel compiles
    # (fwd-ring-nobar rewrites the forward's PTX from one).
    added = [p.name for p in (tmp_path / "hopper_flash").rglob("*.py")
             if not (ROOT / p.relative_to(tmp_path)).exists()]
    assert changed or added, "the patch changed no kernel source or plan and added no module"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_variant_is_valid_python(patch, tmp_path):
    # Every file the patch touches, host planning included: fwd-split-merge's
    # plan.py part stayed a syntax error for sessions while only its kernel
    # was checked.
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_variant.py"), patch.stem, str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for variant_file in sorted((tmp_path / "hopper_flash").rglob("*.py")):
        shipped = ROOT / variant_file.relative_to(tmp_path)
        source = variant_file.read_text()
        if not shipped.exists() or source != shipped.read_text():
            compile(source, str(variant_file), "exec")
