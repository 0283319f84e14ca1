"""A canary run's replies -> counts, bound, latency, hit rate."""

from __future__ import annotations

import pytest

from kvroute.canary.questions import Verdict
from kvroute.canary.summary import CanaryReply, excerpt, summarize
from kvroute.engine_client.cache_counters import CounterChange, PrefixCacheReading


def reply(i: int, verdict: Verdict = Verdict.CORRECT, seconds: float = 1.0) -> CanaryReply:
    return CanaryReply(i, f"What is {i} + 1?", i + 1, verdict, seconds)


def test_clean_run() -> None:
    change = CounterChange(PrefixCacheReading(0, 0, "s"), PrefixCacheReading(1900, 2000, "s"))
    summary = summarize([reply(i, seconds=0.5 + i / 100) for i in range(150)], change)
    assert summary.passed
    assert summary.counts == {"correct": 150, "wrong": 0, "empty": 0, "malformed": 0, "truncated": 0,
                              "error": 0}
    assert summary.bound == pytest.approx(0.019773, abs=1e-6)
    assert summary.rule_of_three == pytest.approx(0.02)
    assert summary.latency["p50"] == pytest.approx(1.245)
    assert summary.latency["max"] == pytest.approx(1.99)
    doc = summary.as_dict()
    assert doc["passed"] is True and doc["failed_examples"] == []
    assert doc["hit_rate"] == {"source": "s", "hits": 1900, "queries": 2000, "rate": 0.95,
                               "rate_before": None, "rate_after": 0.95}


def test_failures_are_counted_bounded_and_shown() -> None:
    verdicts = [Verdict.EMPTY, Verdict.MALFORMED, Verdict.ERROR] + [Verdict.CORRECT] * 297
    summary = summarize([reply(i, v) for i, v in enumerate(verdicts)], None)
    assert not summary.passed
    assert summary.failures == 3
    assert summary.rule_of_three is None
    assert summary.bound > 3 / 300
    assert [r.verdict for r in summary.failed_examples()] == verdicts[:3]
    assert summary.as_dict()["hit_rate"] is None


def test_errors_do_not_count_toward_latency() -> None:
    summary = summarize([reply(0, Verdict.ERROR, seconds=300.0), reply(1, seconds=1.0)], None)
    assert summary.latency["max"] == 1.0


def test_empty_run_is_refused() -> None:
    with pytest.raises(ValueError):
        summarize([], None)


def test_restarted_engine_gives_no_interval_rate() -> None:
    change = CounterChange(PrefixCacheReading(500, 1000, "s"), PrefixCacheReading(10, 20, "s"))
    assert change.rate is None


def test_excerpt() -> None:
    assert excerpt("short") == "short"
    assert excerpt("!" * 200) == "!" * 80 + "…"
