"""The peers benchmark's helpers live in ``benchmarks/peers/`` (imported as ``peers``)."""

from __future__ import annotations

import sys
from pathlib import Path

_BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)
