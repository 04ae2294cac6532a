"""No module of hopper_flash imports a module that imports it back, directly
or through others, counting imports inside functions too (a lazy import
still ties the two modules' designs together)."""
import ast
from pathlib import Path

import hopper_flash

PACKAGE_DIR = Path(hopper_flash.__file__).parent
PACKAGE = "hopper_flash"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the hopper_flash modules it imports. Importing ``a.b`` runs
    ``a/__init__`` first; that implicit parent import is not an edge (every
    submodule would otherwise 'import' the package that imports it)."""
    files = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module
                # `from pkg import sub` imports the submodule when there is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_the_api_layers():
    graph = import_graph()
    # The walker must see real edges, or an empty graph would pass the test below.
    assert {"hopper_flash.ops", "hopper_flash.dispatch", "hopper_flash.checks"} <= graph["hopper_flash.interface"]
    assert "hopper_flash.dispatch" in graph["hopper_flash.ops"]
    assert "hopper_flash.plan" in graph["hopper_flash.checks"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
