"""The charts' series: the shared window, prompt-token rates from counter deltas, TTFB percentiles,
the queue's depth."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.fleet.registry import CounterSample
from kvroute.quantiles import percentile_of_sorted
from kvroute.server.activity import QueueActivity
from kvroute.server.dashboard.series import (
    Window,
    choose_window,
    latency_percentiles,
    queue_depths,
    token_rates,
)


def sample(t: float, hits: float, prompt: float) -> CounterSample:
    return CounterSample(time=t, prefix_hits=hits, prefix_queries=prompt, prompt_tokens=prompt)


def test_window_is_an_hour_of_minute_bins_once_there_is_an_hour_of_data() -> None:
    w = choose_window(10_000.0, 10_000.0 - 7200)
    assert (w.bin_s, w.bins) == (60.0, 60)
    assert w.start <= 10_000.0 - 3600 + 60 and w.end > 10_000.0


def test_young_data_gets_a_short_window_with_fine_bins() -> None:
    w = choose_window(1000.0, 990.0)
    assert w.bin_s == 2.0
    assert 120 <= w.end - w.start <= 122
    assert choose_window(1000.0, None).bin_s == 60.0  # nothing yet: the full hour


def test_window_index_bounds() -> None:
    w = Window(end=100.0, bin_s=10.0, bins=5)
    assert w.start == 50.0
    assert w.index(49.9) is None and w.index(100.0) is None
    assert w.index(50.0) == 0 and w.index(99.9) == 4


def test_token_rates_split_cached_and_computed_per_second() -> None:
    w = Window(end=100.0, bin_s=10.0, bins=2)  # bins [80, 90) and [90, 100)
    history = [sample(80, 0, 0), sample(90, 300, 1000), sample(100, 900, 1200)]
    s = token_rates([history], w)
    assert s.cached == pytest.approx((30.0, 60.0))
    assert s.computed == pytest.approx((70.0, 0.0))  # 200 prompt tokens but 600 hits: clamped
    assert (s.cached_tokens, s.prompt_tokens) == (900, 1200)
    assert s.hit_share == pytest.approx(0.75)


def test_an_interval_is_spread_over_the_bins_it_overlaps() -> None:
    w = Window(end=100.0, bin_s=10.0, bins=2)
    s = token_rates([[sample(85, 0, 0), sample(95, 0, 100)]], w)
    assert s.computed == pytest.approx((5.0, 5.0))


def test_a_counter_that_drops_is_a_restart_not_negative_traffic() -> None:
    w = Window(end=100.0, bin_s=10.0, bins=2)
    history = [sample(80, 5000, 9000), sample(90, 5000, 9000), sample(95, 40, 100)]
    s = token_rates([history], w)
    assert s.prompt_tokens == pytest.approx(100)
    assert s.cached_tokens == pytest.approx(40)
    assert min(s.cached + s.computed) >= 0


def test_workers_add_up_and_samples_outside_the_window_are_ignored() -> None:
    w = Window(end=100.0, bin_s=10.0, bins=2)
    a = [sample(10, 0, 0), sample(20, 50, 5000), sample(85, 50, 5100)]  # mostly before the window
    b = [sample(90, 0, 0), sample(99, 90, 90)]
    s = token_rates([a, b], w)
    assert s.prompt_tokens == pytest.approx(100 * 5 / 65 + 90)
    assert s.cached_tokens == pytest.approx(90)


def test_no_traffic_has_no_hit_share() -> None:
    w = Window(end=100.0, bin_s=10.0, bins=2)
    s = token_rates([[sample(80, 7, 7), sample(90, 7, 7)], []], w)
    assert s.hit_share is None
    assert s.to_json()["cached"] == [0.0, 0.0]


@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 50)), max_size=30))
def test_rates_are_never_negative_and_hits_never_exceed_prompt(steps: list[tuple[float, float]]) -> None:
    t, hits, prompt, history = 0.0, 0.0, 0.0, []
    for dh, dp in steps:
        t += 1
        hits, prompt = hits + dh, prompt + dp
        history.append(sample(t, hits, prompt))
    s = token_rates([history], Window(end=40.0, bin_s=5.0, bins=8))
    assert min((*s.cached, *s.computed), default=0) >= 0
    assert s.cached_tokens <= s.prompt_tokens + 1e-9


def test_latency_percentiles_per_bin_and_window() -> None:
    w = Window(end=100.0, bin_s=10.0, bins=3)
    samples = [(75.0, 0.1), (76.0, 0.3), (95.0, 1.0), (10.0, 99.0)]  # the last is outside
    s = latency_percentiles(samples, w)
    assert s.count == 3
    assert s.p50 == pytest.approx((0.2, None, 1.0))
    assert s.window_p50 == pytest.approx(0.3)
    assert s.p95[1] is None


def test_percentile_of_sorted_interpolates() -> None:
    assert percentile_of_sorted([], 50) is None
    assert percentile_of_sorted([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile_of_sorted([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)


def test_queue_history_keeps_one_sample_per_second_with_its_peak() -> None:
    q = QueueActivity(seconds=3)
    q.changed("m", 100.1, 1, 10)
    q.changed("m", 100.5, 4, 40)
    q.changed("m", 100.9, 2, 20)
    (s,) = q.history["m"]
    assert (s.second, s.peak, s.peak_tokens, s.depth, s.tokens) == (100, 4, 40, 2, 20)
    for t in (101, 102, 103):
        q.changed("m", t, 0, 0)
    assert [s.second for s in q.history["m"]] == [101, 102, 103]  # bounded: an hour by default


def test_queue_depth_per_bin_is_the_peak_and_carries_over_quiet_bins() -> None:
    w = Window(end=120.0, bin_s=10.0, bins=6)  # bins start at 60, 70, ..., 110
    q = QueueActivity()
    q.changed("m", 50, 2, 200)  # before the window: the depth it starts with
    q.changed("m", 71, 5, 500)
    q.changed("m", 75, 3, 300)
    q.changed("m", 101, 0, 0)
    series = queue_depths([q.history["m"]], w)
    assert series.depth == (2, 5, 3, 3, 3, 0)
    assert series.tokens == (200, 500, 300, 300, 300, 0)
    # Another router process's queue adds to it, bin by bin.
    other = QueueActivity()
    other.changed("m", 112, 7, 70)
    assert queue_depths([q.history["m"], other.history["m"]], w).depth == (2, 5, 3, 3, 3, 7)
    assert queue_depths([], w).depth == (0,) * 6
