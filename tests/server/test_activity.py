"""The router's bounded activity rings."""

from __future__ import annotations

import tracemalloc

from kvroute.fleet.registry import CounterHistory, CounterSample
from kvroute.rings import PairRing
from kvroute.server.activity import Activity, RoutedRequest


def test_a_sample_ring_keeps_the_last_samples_oldest_first():
    ring = PairRing(4)
    assert list(ring) == [] and len(ring) == 0
    for i in range(3):
        ring.append(float(i), i / 10)
    assert list(ring) == [(0.0, 0.0), (1.0, 0.1), (2.0, 0.2)] and len(ring) == 3
    for i in range(3, 10):
        ring.append(float(i), i / 10)
    assert list(ring) == [(6.0, 0.6), (7.0, 0.7), (8.0, 0.8), (9.0, 0.9)] and len(ring) == 4
    ring.append(10.0, 1.0)  # wraps exactly at the end
    assert [t for t, _ in ring] == [7.0, 8.0, 9.0, 10.0]


def test_recording_requests_allocates_nothing_once_the_rings_exist():
    activity = Activity(max_requests=50, max_ttfb_samples=5000)

    def request(i: int) -> RoutedRequest:
        return RoutedRequest(time=float(i), route="chat", model="m", worker="w", kind="prefix", reason="",
                             matched_blocks=0, total_blocks=0, attempts=1, status=200, ttfb_s=0.01 * i,
                             duration_s=0.1)

    for i in range(100):  # the request ring fills
        activity.record(request(i))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(100, 5100):
            activity.record(request(i))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # 5,000 TTFB samples held: a deque of tuples would have grown by ~550 KB.
    assert len(activity.ttfb) == 5000
    assert grown < 20_000


def test_a_workers_counter_history_keeps_an_hour_in_memory_allocated_up_front():
    history = CounterHistory(3)
    for i in range(5):
        history.append(CounterSample(float(i), i * 2.0, i * 3.0, i * 4.0))
    assert len(history) == 3 and history.first() == CounterSample(2.0, 4.0, 6.0, 8.0)
    assert [s.time for s in history] == [2.0, 3.0, 4.0]
    big = CounterHistory(3600)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(3600):
            big.append(CounterSample(float(i), 1.0, 2.0, 3.0))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # As a deque of samples an hour of them took ~600 KB, allocated as they came.
    assert grown < 20_000 and len(big) == 3600
