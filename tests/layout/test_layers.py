"""The order of kvroute's layers (docs/design.md, "Layers"), read statically from the source: no
part imports a part of its own layer or above, every part is placed, and the design page's table
is the checker's ``LAYERS``."""

from __future__ import annotations

import re
from pathlib import Path

from kvroute_dev.import_graph import LAYERS, PACKAGE, ROOT, import_graph, part_graph, part_of, violations

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def test_no_module_imports_up_or_sideways() -> None:
    found = violations(import_graph())
    assert not found, "imports against the layers (docs/design.md, Layers):\n" + "\n".join(map(str, found))


def test_every_layer_names_parts_that_exist_once() -> None:
    placed = [part for _, parts in LAYERS for part in parts]
    assert len(placed) == len(set(placed)), "a part placed in two layers"
    assert set(placed) == set(part_graph(import_graph())) - {ROOT}


def test_the_design_page_lists_the_same_layers() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    section = text[text.index("### Layers"):]
    section = section[: section.index("\n#", 1)]
    rows = re.findall(r"^\| (\d+) ([^|]+?) \| ([^|]+) \|", section, flags=re.MULTILINE)
    listed = [(int(i), name, tuple(re.findall(r"`([^`]+)`", parts))) for i, name, parts in rows]
    assert listed == [(i, name, parts) for i, (name, parts) in enumerate(LAYERS)]


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A made-up kvroute tree under ``tmp_path/src`` with ``files`` (path -> source)."""
    src = tmp_path / "src"
    for rel, code in {"__init__.py": "", **files}.items():
        path = src / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code, encoding="utf-8")
    return src


def test_the_checker_finds_upward_sideways_and_unplaced_imports(tmp_path: Path) -> None:
    src = _package(tmp_path, {
        "routing/__init__.py": "",
        # Up, inside a function and under TYPE_CHECKING: each is still a dependency.
        "routing/core.py": "from typing import TYPE_CHECKING\n"
                           "if TYPE_CHECKING:\n    from kvroute.fleet.registry import Registry\n"
                           "def f():\n    from kvroute.server import app\n",
        "fleet/__init__.py": "",
        "fleet/registry.py": "from ..routing import core\nfrom kvroute.api import requests\n",  # down; peer
        "api/__init__.py": "",
        "api/requests.py": "import kvroute.rings\n",  # down
        "rings.py": "",
        "server/__init__.py": "",
        "server/app.py": "from kvroute.routing.core import f\nfrom kvroute import helpers\n",
        "helpers.py": "",  # a part in no layer
    })
    found = {(v.importer, part_of(v.imported), v.why.split()[0]) for v in violations(import_graph(src))}
    assert found == {
        ("kvroute.routing.core", "fleet", "up"),
        ("kvroute.routing.core", "server", "up"),
        ("kvroute.fleet.registry", "api", "'fleet'"),  # peers in one layer
        ("kvroute.helpers", "helpers", "'helpers'"),  # in no layer
    }


def test_the_checker_passes_a_tree_that_only_imports_down(tmp_path: Path) -> None:
    src = _package(tmp_path, {
        "routing/__init__.py": "",
        "routing/core.py": "from . import keys\nimport kvroute\n",
        "routing/keys.py": "",
        "server/__init__.py": "",
        "server/app.py": "from kvroute.routing.core import f\nfrom kvroute.fleet import registry\n",
        "fleet/__init__.py": "",
        "fleet/registry.py": "from kvroute.routing import keys\n",
    })
    assert violations(import_graph(src)) == []
