"""The package's layering, read statically from its source: no import cycles among kvroute's
modules and the wheel never needs the developer tooling in ``tools/`` (the order of the layers:
test_layers.py)."""

from __future__ import annotations

import functools
import tomllib

from kvroute_dev.import_graph import PACKAGE, SRC, imported_names, module_name
from kvroute_dev.import_graph import import_graph as read_import_graph


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """kvroute module -> the kvroute modules it imports (read once per test session)."""
    return read_import_graph()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports() -> None:
    graph = import_graph()
    assert "kvroute.routing.scheduler" in graph["kvroute.server.context"]
    assert "kvroute.server.app" in graph["kvroute.server.processes"]  # imported inside a function


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_wheel_never_imports_developer_tooling() -> None:
    """``tools/kvroute_dev`` is not in the wheel, so nothing in ``src/kvroute`` may import it."""
    for path in (SRC / PACKAGE).rglob("*.py"):
        names = set(imported_names(path, module_name(path)))
        assert not {n for n in names if n.split(".")[0] == "kvroute_dev"}, path
    assert not (SRC / PACKAGE / "dev").exists()
    pyproject = tomllib.loads((SRC.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["src/kvroute"]
    assert "tools" in pyproject["tool"]["pytest"]["ini_options"]["pythonpath"]
