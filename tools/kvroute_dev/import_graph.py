"""kvroute's import graph, read statically from its source, and the layers it must respect.

Every import counts: at top level, inside a function, under ``TYPE_CHECKING`` (a type-only import
is still a dependency a reader has to follow).  Nothing is imported to build the graph.

A *part* is a first-level name under ``kvroute`` (a subpackage such as ``routing`` or a module such as
``rings``).  ``LAYERS`` orders the parts bottom to top (docs/design.md, "Layers"): a part may import
its own modules and any part of a lower layer, never one of its own layer or above.

    python3 tools/kvroute_dev/import_graph.py          # the parts' graph and any violation
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "kvroute"
SRC = Path(__file__).resolve().parents[2] / "src"

# Bottom to top: (layer name, its parts).  Parts within a layer never import each other.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations", ("event_loop", "log_setup", "prometheus_text", "quantiles", "rings", "startup")),
    ("routing core", ("routing",)),
    ("fleet state and requests", ("api", "fleet")),
    ("engines and peers", ("engine_client", "sim", "sync")),
    ("checks", ("canary", "doctor")),
    ("guard", ("guard",)),
    ("settings", ("router_settings",)),
    ("server", ("server",)),
    ("commands", ("bench", "cli")),
)

# The package's own ``__init__`` (its version) imports nothing and may be imported from anywhere.
ROOT = ""


def module_name(path: Path, src: Path = SRC) -> str:
    """The dotted module name of ``path`` (a file under ``src``)."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, module: str) -> Iterator[str]:
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


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """kvroute module -> the kvroute modules it imports (a name resolves to its longest module)."""
    paths = {module_name(p, src): p for p in (src / PACKAGE).rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = {resolve(name) for name in imported_names(path, module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def part_of(module: str) -> str:
    """The first-level name under kvroute that ``module`` belongs to (``ROOT`` for kvroute itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Part -> the other parts its modules import."""
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = part_of(module)
        parts.setdefault(here, set()).update(p for p in map(part_of, targets) if p != here)
    return parts


@dataclass(frozen=True, slots=True)
class Violation:
    """One import the layers forbid: ``importer`` imports ``imported`` (modules), and why not."""

    importer: str
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.importer} imports {self.imported}: {self.why}"


def violations(graph: dict[str, set[str]],
               layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> list[Violation]:
    """Every import in ``graph`` that does not point strictly down ``layers``; a module whose part
    is in no layer is one too (a new part has to be placed before it can be checked)."""
    level = {part: i for i, (_, parts) in enumerate(layers) for part in parts}
    names = [name for name, _ in layers]
    found: list[Violation] = []
    for module in sorted(graph):
        here = part_of(module)
        if here != ROOT and here not in level:
            found.append(Violation(module, module, f"{here!r} is in no layer (add it to LAYERS)"))
            continue
        for target in sorted(graph[module]):
            there = part_of(target)
            if there in (here, ROOT) or there not in level:
                continue  # its own part, the root, or a part reported where it is the importer
            if here == ROOT:
                found.append(Violation(module, target, "the package's __init__ imports nothing"))
            elif level[there] == level[here]:
                found.append(Violation(module, target, f"{here!r} and {there!r} are peers in layer "
                                                       f"{names[level[here]]!r}"))
            elif level[there] > level[here]:
                found.append(Violation(module, target, f"up from layer {names[level[here]]!r} to "
                                                       f"{names[level[there]]!r}"))
    return found


def main(argv: list[str] | None = None) -> int:
    """Print the parts' import graph by layer and every violation; exit 1 if there is one."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=SRC, help="the folder holding the kvroute package")
    args = parser.parse_args(argv)
    graph = import_graph(args.src)
    parts = part_graph(graph)
    for i, (name, members) in enumerate(LAYERS):
        print(f"{i} {name}")
        for part in members:
            print(f"    {part:16} -> {', '.join(sorted(parts.get(part, ()))) or '-'}")
    found = violations(graph)
    for v in found:
        print(f"violation: {v}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
