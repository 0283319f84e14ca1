"""Statistics of a step: percentiles, counter deltas (with resets) and the table's figures."""

from __future__ import annotations

import pytest

from kvroute.bench.results import RequestRecord
from kvroute.bench.stats import (
    CacheCounters,
    busy_count,
    cache_delta,
    counter_delta,
    histogram_quantile,
    parse_samples,
    percentile,
    queue_figures,
    session_figures,
    stayed_share,
    summarize_step,
)

EXPO = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}
"""


def expo(hits: float, queries: float, running: int = 0, waiting: int = 0) -> str:
    return EXPO.format(hits=hits, queries=queries, running=running, waiting=waiting)


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_parse_samples_keeps_total_suffix_and_labels() -> None:
    samples = parse_samples(expo(10, 40, running=3))
    key = ("vllm:prefix_cache_hits_total", (("engine", "0"), ("model_name", "m")))
    assert samples[key] == 10.0
    assert samples[("vllm:num_requests_running", (("engine", "0"), ("model_name", "m")))] == 3.0


def test_counter_delta_plain_and_summed_over_series() -> None:
    before = parse_samples(expo(100, 400))
    after = parse_samples(expo(160, 500))
    assert counter_delta(before, after, "vllm:prefix_cache_hits_total") == 60.0
    assert counter_delta(before, after, "vllm:prefix_cache_queries_total") == 100.0
    two = parse_samples(expo(5, 10) + 'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 7\n')
    assert counter_delta({}, two, "vllm:prefix_cache_hits_total") == 12.0


def test_counter_delta_after_a_reset_counts_from_zero() -> None:
    before = parse_samples(expo(1000, 4000))
    after = parse_samples(expo(30, 90))  # the engine restarted in between
    assert counter_delta(before, after, "vllm:prefix_cache_hits_total") == 30.0
    assert counter_delta(before, after, "vllm:prefix_cache_queries_total") == 90.0


def test_cache_delta_over_replicas_and_hit_share() -> None:
    before = [parse_samples(expo(0, 0)), parse_samples(expo(50, 100))]
    after = [parse_samples(expo(30, 100)), parse_samples(expo(100, 200))]
    cache = cache_delta(before, after)
    assert (cache.hits, cache.queries) == (80.0, 200.0)
    assert cache.hit_pct == pytest.approx(40.0)
    assert CacheCounters(0, 0).hit_pct is None
    with pytest.raises(ValueError):
        cache_delta(before, after[:1])


def test_busy_count_counts_running_or_waiting_replicas() -> None:
    scrapes = [parse_samples(expo(0, 0, running=2)), parse_samples(expo(0, 0, waiting=1)),
               parse_samples(expo(0, 0)), None]
    assert busy_count(scrapes) == 2


def rec(session: str | None, rnd: int, worker: str | None, **kw: object) -> RequestRecord:
    return RequestRecord(session, rnd, start_s=0.0, worker=worker, **kw)  # type: ignore[arg-type]


def test_stayed_share_compares_each_follow_up_with_the_previous_round() -> None:
    records = [rec("a", 0, "w1"), rec("a", 1, "w1"), rec("a", 2, "w2"), rec("a", 3, "w2"),
               rec("b", 0, "w3"), rec("b", 1, None), rec(None, 0, "w1")]
    # a: stayed, moved, stayed; b's follow-up has no worker header and does not count.
    assert stayed_share(records) == pytest.approx(200 / 3)
    assert stayed_share([rec("a", 0, "w1")]) is None


def test_summarize_step_counts_throughput_inside_the_window_and_ttfb_of_all() -> None:
    records = [
        rec("a", 0, "w1", ttfb_s=1.0, end_s=5.0, output_tokens=100, prompt_tokens=1000, cached_tokens=0),
        rec("a", 1, "w1", ttfb_s=0.5, end_s=9.0, output_tokens=50, prompt_tokens=1100, cached_tokens=1000,
            last_round=True),
        # Ended during the drain: its TTFB counts, its tokens and session do not.
        rec("b", 0, "w2", ttfb_s=4.0, end_s=12.0, output_tokens=70, prompt_tokens=900, last_round=True),
        rec("c", 0, "w2", error="HTTP 500: boom"),
        rec("d", 0, "w1"),  # cut off after the drain
    ]
    step = summarize_step("session", 4, 10.0, records, busy_samples=[1, 2, 3], cache=None)
    assert step.requests == 5 and step.errors == 1 and step.unfinished == 1
    assert step.sessions_completed == 1
    assert step.sessions_per_hour == pytest.approx(360.0)
    assert step.output_tokens_per_min == pytest.approx(150 * 6.0)
    assert step.ttfb_p50_s == pytest.approx(1.0)
    assert step.replicas_busy == pytest.approx(2.0)
    # No counters scraped: the share comes from usage.
    assert step.prefix_hit_pct == pytest.approx(100 * 1000 / 3000)
    assert step.stayed_pct == 100.0
    with_counters = summarize_step("s", 4, 10.0, records, [], CacheCounters(30, 60))
    assert with_counters.prefix_hit_pct == pytest.approx(50.0)
    assert with_counters.replicas_busy is None


def test_histogram_quantile_interpolates_inside_buckets_with_zeros_first() -> None:
    inf = float("inf")
    buckets = {1.0: 2.0, 2.0: 6.0, inf: 8.0}   # 2 in (0,1], 4 in (1,2], 2 beyond 2
    assert histogram_quantile(0.5, buckets) == pytest.approx(1.5)   # rank 4: halfway into (1,2]
    assert histogram_quantile(0.99, buckets) == 2.0                 # +Inf bucket: the largest bound
    assert histogram_quantile(0.5, buckets, zeros=8.0) == 0.0       # half the requests never waited
    assert histogram_quantile(0.75, buckets, zeros=8.0) == pytest.approx(1.5)
    assert histogram_quantile(0.5, {}, zeros=0.0) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def _router_expo(at_once: int, waited: dict[str, int], shed: int) -> str:
    lines = ["# TYPE kvroute_admitted_total counter",
             f'kvroute_admitted_total{{model="m",when="at_once"}} {at_once}',
             f'kvroute_admitted_total{{model="m",when="after_wait"}} {waited["+Inf"]}',
             "# TYPE kvroute_queue_wait_seconds histogram"]
    lines += [f'kvroute_queue_wait_seconds_bucket{{le="{le}",model="m"}} {n}' for le, n in waited.items()]
    lines += [f'kvroute_queue_wait_seconds_count{{model="m"}} {waited["+Inf"]}',
              "# TYPE kvroute_shed_total counter",
              f'kvroute_shed_total{{model="m",reason="ttl"}} {shed}']
    return "\n".join(lines) + "\n"


def test_queue_figures_from_two_scrapes_of_the_router() -> None:
    before = parse_samples(_router_expo(10, {"1.0": 1, "2.0": 1, "+Inf": 1}, 2))
    # During the step: 4 admitted at once, 4 after a wait (all in (1, 2] s), 3 shed.
    after = parse_samples(_router_expo(14, {"1.0": 1, "2.0": 5, "+Inf": 5}, 5))
    figures = queue_figures(before, after, time_scale=10.0)
    assert figures is not None
    assert figures.wait_p50_s == 0.0                               # half were admitted at once
    assert figures.wait_p95_s == pytest.approx(10 * (1 + 0.9))     # 95th: 3.6 of 4 into (1, 2]
    assert figures.shed == 3
    # A router without flow control exposes no admissions: nothing to report.
    assert queue_figures(parse_samples(EXPO.format(hits=0, queries=0, running=0, waiting=0)),
                         parse_samples(EXPO.format(hits=1, queries=1, running=0, waiting=0))) is None


def test_shed_requests_are_counted_apart_from_errors() -> None:
    records = [RequestRecord("a", 0, 0.0, ttfb_s=0.5, end_s=2.0, output_tokens=10),
               RequestRecord("b", 0, 0.0, error="HTTP 429: queue full", shed=True, retry_after_s=2.0),
               RequestRecord("c", 0, 0.0, error="HTTP 500: boom")]
    step = summarize_step("p", 3, 10.0, records, [], None)
    assert (step.requests, step.shed, step.errors) == (3, 1, 1)
    assert step.ttfb_p50_s == step.ttfb_p99_s == 0.5


def test_session_figures_from_hand_made_sessions() -> None:
    def rec(sid: str | None, rnd: int, start: float, ttfb: float | None, end: float | None, *,
            last: bool = False, queue: float = 0.0, error: str | None = None) -> RequestRecord:
        return RequestRecord(sid, rnd, start, ttfb_s=ttfb, end_s=end, last_round=last, queue_s=queue,
                             error=error)

    records = [
        # a: two rounds, finished: 0 -> 9 s; round 0 waited 1 s at the gate (TTFB 2 s).
        rec("a", 0, 0.0, 2.0, 4.0, queue=1.0), rec("a", 1, 5.0, 0.5, 9.0, last=True),
        # b: finished: 1 -> 21 s, its first turn 4 s (3 s of it at the gate).
        rec("b", 0, 1.0, 4.0, 8.0, queue=3.0), rec("b", 1, 10.0, 1.5, 21.0, last=True),
        # c: its last round was cut off: no duration, but its turns count.
        rec("c", 0, 2.0, 1.0, 5.0), rec("c", 1, 6.0, 2.5, None, last=True),
        # d: gave up after an error in round 0: no TTFB, no duration.
        rec("d", 0, 3.0, None, None, error="HTTP 500: boom"),
        # No session id (an open-loop request): not a session.
        rec(None, 0, 4.0, 9.0, 12.0, last=True),
    ]
    fig = session_figures(records)
    assert fig.duration_p50_s == pytest.approx(14.5)  # of 9 and 20
    assert fig.duration_p95_s == pytest.approx(9 + 0.95 * 11)
    assert fig.first_ttfb_p50_s == pytest.approx(2.0)  # of 1, 2, 4
    assert fig.first_ttfb_p95_s == pytest.approx(2 + 0.9 * 2)
    assert fig.first_queue_p50_s == pytest.approx(1.0)  # of 0, 1, 3
    assert fig.first_queue_p95_s == pytest.approx(1 + 0.9 * 2)
    assert fig.continuing_ttfb_p50_s == pytest.approx(1.5)  # of 0.5, 1.5, 2.5
    assert fig.continuing_ttfb_p95_s == pytest.approx(1.5 + 0.9 * 1.0)
    step = summarize_step("p", 4, 30.0, records, [], None)
    assert (step.session_p50_s, step.first_ttfb_p95_s, step.continuing_ttfb_p95_s) == (
        fig.duration_p50_s, fig.first_ttfb_p95_s, fig.continuing_ttfb_p95_s)
    assert step.completed_per_s == pytest.approx(6 / 30.0)  # a's, b's, c's first and the open one
    assert session_figures([]).duration_p50_s is None
