"""Percentiles as the benchmark, the canary and the dashboard report them: linear interpolation
between order statistics (numpy's default), one definition so their figures agree."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile_of_sorted(ordered: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of values already sorted ascending; None when empty.
    Callers taking several percentiles of one sample sort it once."""
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be in [0, 100]")
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of unsorted ``values``; None when empty."""
    return percentile_of_sorted(sorted(values), q)
