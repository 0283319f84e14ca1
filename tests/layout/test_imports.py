"""The package's layering, read statically from its source: no import cycles among kvroute's
modules, the simulator never depends on the benchmarks, and the wheel never needs the developer
tooling in ``tools/``."""

from __future__ import annotations

import ast
import functools
import tomllib
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "kvroute"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path, module: str) -> Iterator[str]:
    """Every module name ``path`` imports, at top level or inside functions, made absolute."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            # ``from kvroute.sim import engine`` imports the module kvroute.sim.engine.
            yield from (f"{base}.{alias.name}" for alias in node.names)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """kvroute module -> the kvroute modules it imports (a name resolves to its longest module)."""
    paths = {_module_name(p): p for p in (SRC / PACKAGE).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = {resolve(name) for name in _imported_names(path, module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


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


def test_sim_never_imports_bench() -> None:
    offenders = sorted((src, dst) for src, targets in import_graph().items() for dst in targets
                       if src.startswith("kvroute.sim") and dst.startswith("kvroute.bench"))
    assert not offenders


def test_the_wheel_never_imports_developer_tooling() -> None:
    """``tools/kvroute_dev`` is not in the wheel, so nothing in ``src/kvroute`` may import it."""
    for path in (SRC / PACKAGE).rglob("*.py"):
        names = set(_imported_names(path, _module_name(path)))
        assert not {n for n in names if n.split(".")[0] == "kvroute_dev"}, path
    assert not (SRC / PACKAGE / "dev").exists()
    pyproject = tomllib.loads((SRC.parent / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["src/kvroute"]
    assert "tools" in pyproject["tool"]["pytest"]["ini_options"]["pythonpath"]
