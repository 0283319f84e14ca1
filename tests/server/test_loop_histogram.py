"""The router's hot-path histograms (``LoopHistogram``) expose exactly what prometheus_client's
``Histogram`` exposes for the same observations: dashboards, alerts and the multi-process merge
read the same samples."""

from __future__ import annotations

import random
import re

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvroute.server.metrics import BLOCK_BUCKETS, TTFB_BUCKETS, LoopHistogram


def _text(registry: CollectorRegistry) -> str:
    # The creation times differ by the microseconds between the two constructions.
    return re.sub(r"_created (\S+)", "_created T", generate_latest(registry).decode())


@pytest.mark.parametrize("buckets", [TTFB_BUCKETS, BLOCK_BUCKETS, (0.5, 1.0, float("inf"))])
def test_same_exposition_as_prometheus_client(buckets: tuple[float, ...]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("kvroute_x_seconds", "what it measures", buckets=buckets, registry=theirs)
    fast = LoopHistogram("kvroute_x_seconds", "what it measures", buckets, ours)
    assert _text(theirs) == _text(ours)  # empty
    rng = random.Random(7)
    # Every bound itself (a value on a bound counts in that bound's bucket), just above and below
    # it, zero, and values past the last finite bound.
    values = [b + d for b in buckets if b != float("inf") for d in (0.0, 1e-9, -1e-9)]
    top = max(b for b in buckets if b != float("inf"))
    values += [0.0, 1e6] + [rng.uniform(0, 2 * top) for _ in range(200)]
    for v in values:
        reference.observe(v)
        fast.observe(v)
    assert _text(theirs) == _text(ours)
    assert "kvroute_x_seconds_created" in _text(ours)
