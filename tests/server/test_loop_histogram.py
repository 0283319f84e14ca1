"""The router's hot-path histograms (``LoopHistogram``) and its requests counter (``LoopCounter``)
expose exactly what prometheus_client's ``Histogram`` and ``Counter`` expose for the same
observations: dashboards, alerts and the multi-process merge read the same samples."""

from __future__ import annotations

import random
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvroute.server.metrics import BLOCK_BUCKETS, TTFB_BUCKETS, LoopCounter, LoopHistogram


def _text(registry: CollectorRegistry) -> str:
    # The creation times differ by the microseconds between the two constructions.
    return re.sub(r"^(\S+_created(\{.*\})?) \S+$", r"\1 T", generate_latest(registry).decode(), flags=re.M)


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


def test_counter_same_exposition_as_prometheus_client() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    names = ("worker", "model", "kind")
    reference = Counter("kvroute_x", "what it counts", names, registry=theirs)
    fast = LoopCounter("kvroute_x", "what it counts", names, ours)
    assert _text(theirs) == _text(ours)  # no label set yet: the family's head only
    rng = random.Random(7)
    # Label sets first counted in a random order (the exposition keeps that order), some many
    # times, values that need escaping among them.
    sets = [(f"w{i}", "m", k) for i in range(5) for k in ("cold", "sticky")] + [('a"b\\c', "m\n2", "cold")]
    for _ in range(300):
        labels = rng.choice(sets)
        reference.labels(*labels).inc()
        fast.inc(labels)
    text = _text(ours)
    assert _text(theirs) == text
    assert "kvroute_x_total{" in text and "kvroute_x_created{" in text
