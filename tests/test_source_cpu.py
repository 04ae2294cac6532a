"""Source-level checks that need no GPU: a module must not define one name
twice at its top level (the later definition silently replaces the first:
the fifty-seventh session's second ``gpu_inputs.nan_tailed_cache`` took
over every decode, window, soft-capping and head-dim GPU test's call with
another signature, and no CPU run could see it)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("hopper_flash/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("scripts/*.py")])


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_top_level_name_defined_twice(path):
    seen, twice = {}, []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if any(getattr(d, "id", getattr(d, "attr", "")) == "overload" for d in node.decorator_list):
            continue  # typing.overload stubs precede their one implementation
        if node.name in seen:
            twice.append(f"{node.name} (lines {seen[node.name]} and {node.lineno})")
        seen.setdefault(node.name, node.lineno)
    assert not twice, f"{path.name} defines twice: {', '.join(twice)}"
