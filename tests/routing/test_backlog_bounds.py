"""The backlog ``auto`` keeps for each worker stays true to the engines whatever the clock says:
never more than the prefill of the requests still in flight, and drained at least as fast as the
engine is seen to prefill.  Without both, a fleet faster than the default rate (or replicas
simulated faster than real time) makes queues that have finished look long, and sessions leave
their cache for nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from routing_helpers import Clock, fleet, key, send, text

from kvroute.routing.decision import DecisionKind
from kvroute.routing.learning import WorkerLearning
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.sync_record import PrefixRecord

MakeScheduler = Callable[..., Scheduler]


def test_backlog_never_exceeds_the_prefill_still_in_flight() -> None:
    w = WorkerLearning()
    for tokens in (4000, 3000, 2000):
        w.on_sent(100.0, 1e-3, tokens, None)
    assert w.drain(100.0, 1e-3) == pytest.approx(9000)  # no in-flight figure: the clock alone
    assert w.drain(100.0, 1e-3, inflight=3) == pytest.approx(9000)
    assert w.drain(100.0, 1e-3, inflight=1) == pytest.approx(2000)  # the newest one is left
    assert w.drain(100.0, 1e-3) == pytest.approx(2000)  # and the bound sticks
    w.on_sent(100.0, 1e-3, 500, None)
    assert w.drain(100.0, 1e-3, inflight=2) == pytest.approx(2500)
    assert w.drain(100.0, 1e-3, inflight=0) == 0


def test_backlog_bound_needs_every_request_in_flight_seen() -> None:
    """Requests the scheduler never saw sent (not cacheable, another path) leave the bound unknown."""
    w = WorkerLearning()
    w.on_sent(0.0, 1e-3, 4000, None)
    assert w.drain(0.0, 1e-3, inflight=3) == pytest.approx(4000)


def fast_engine_history(s: Scheduler, clock: Clock) -> list:
    """Three 10k-token sessions served on w0 by an engine ten times faster than the default rate:
    every request has finished 0.3 s later, while the clock-drained backlog still says ~28k tokens."""
    ws = fleet(2)
    for i in range(3):
        send(s, key(text(i, 40_000), session=f"s{i}"), [ws[0]])
    clock.advance(0.3)
    for _ in range(3):
        s.on_finished("w0", prompt_tokens=10_000, cached_tokens=0, ttft_s=0.1)
    return ws


def test_a_follow_up_stays_home_once_its_queue_has_finished(make_scheduler: MakeScheduler,
                                                            clock: Clock) -> None:
    s = make_scheduler("auto")
    ws = fast_engine_history(s, clock)
    d = s.decide(key(text(0, 40_000) + text(50, 1_600), session="s0"), ws)
    assert d.worker_id == "w0" and d.kind is DecisionKind.STICKY, d.reason


def test_the_backlog_drains_at_the_speed_the_engine_shows(make_scheduler: MakeScheduler,
                                                          clock: Clock) -> None:
    s, ws = make_scheduler("auto"), fleet(1)
    for i in range(8):  # 4000 computed tokens in 0.04 s: 1e-5 s per token
        k = key(text(i, 16_000))
        s.commit(k, s.decide(k, ws))
        s.on_finished("w0", prompt_tokens=4000, cached_tokens=0, ttft_s=0.04)
        clock.advance(10)
    k = key(text(99, 40_000))  # 10k tokens of prefill
    s.commit(k, s.decide(k, ws))
    clock.advance(0.05)
    stats = s.stats()["workers"]["w0"]
    assert stats["prefill_s_per_token"] == pytest.approx(1e-5)
    assert stats["backlog_tokens"] == pytest.approx(5000, rel=0.02)  # not 10000 - 0.05 / 1.5e-4
    slow = make_scheduler("auto", learn_prefill_speed=False)
    slow.commit(k, slow.decide(k, ws))
    clock.advance(0.05)
    assert slow.stats()["workers"]["w0"]["backlog_tokens"] == pytest.approx(10_000 - 0.05 / 1.5e-4, abs=1)


def test_learned_speed_follows_fast_samples_and_rises_slowly() -> None:
    w = WorkerLearning(min_samples=4)
    for _ in range(3):
        w.on_finished(0.0, 2000, 0, 0.02)
    assert w.fastest is None  # not enough samples yet
    w.on_finished(0.0, 2000, 0, 0.02)
    assert w.fastest == pytest.approx(1e-5)
    w.on_finished(0.0, 100, 0, 0.0001)  # too few computed tokens to say anything
    w.on_finished(0.0, 3000, 2000, 0.0001)
    assert w.fastest == pytest.approx(1e-5)
    for _ in range(200):  # a long overload: every request queued, 100x slower
        w.on_finished(0.0, 2000, 0, 2.0)
    assert w.fastest == pytest.approx(1e-5 * 1.001 ** 200)
    risen = w.fastest
    w.on_finished(0.0, 2000, 0, 0.02)  # one fast sample takes half the way back
    assert w.fastest == pytest.approx((risen + 1e-5) / 2)


def test_a_slower_engine_keeps_the_configured_drain(make_scheduler: MakeScheduler, clock: Clock) -> None:
    """TTFT includes queueing, so a slow figure may just be a busy engine: only a faster one than
    configured changes the drain."""
    s, ws = make_scheduler("auto"), fleet(1)
    for i in range(8):
        k = key(text(i, 16_000))
        s.commit(k, s.decide(k, ws))
        s.on_finished("w0", prompt_tokens=4000, cached_tokens=0, ttft_s=4.0)
        clock.advance(10)
    stats = s.stats()["workers"]["w0"]
    assert stats["fastest_s_per_token"] == pytest.approx(1e-3)
    assert stats["prefill_s_per_token"] == 1.5e-4


def test_a_faster_worker_does_not_look_cheaper_for_everything(make_scheduler: MakeScheduler,
                                                              clock: Clock) -> None:
    """The learned speed drains the backlog only; costs keep one scale for every worker, otherwise
    a worker learned fast would win every comparison by that factor."""
    s, ws = make_scheduler("auto"), fleet(2)
    for i in range(8):
        k = key(text(i, 16_000))
        s.commit(k, s.decide(k, [ws[0]]))
        s.on_finished("w0", prompt_tokens=4000, cached_tokens=0, ttft_s=0.04)
        clock.advance(10)
    chosen = {s.decide(key(text(100 + i, 16_000)), ws).worker_id for i in range(4)}
    assert chosen == {"w0", "w1"}


def test_replayed_remote_facts_do_not_invent_a_backlog(make_scheduler: MakeScheduler, clock: Clock) -> None:
    """A fact from another instance adds its prefill less what the worker has drained since it was
    sent, at the same rate as local requests (the learned one once known, here the configured)."""
    s = make_scheduler("auto", prefill_s_per_token=1e-3)
    s.on_worker_epoch("w0", 1.0)
    now = clock()
    s.apply_remote(PrefixRecord("w0", 1.0, now - 0.6, (1, 2), prefill_tokens=500))  # drained long ago
    assert s.stats()["workers"]["w0"]["backlog_tokens"] == 0
    s.apply_remote(PrefixRecord("w0", 1.0, now - 0.1, (3,), prefill_tokens=500))
    assert s.stats()["workers"]["w0"]["backlog_tokens"] == 400
    s.apply_remote(PrefixRecord("w0", 1.0, now, (4,), prefill_tokens=70))
    assert s.stats()["workers"]["w0"]["backlog_tokens"] == 470
