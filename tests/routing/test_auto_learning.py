"""What ``auto`` learns from finished requests, and how it changes its choices."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from routing_helpers import Clock, fleet, key, send, text

from kvroute.routing.decision import DecisionKind
from kvroute.routing.learning import WorkerLearning
from kvroute.routing.scheduler import Scheduler

MakeScheduler = Callable[..., Scheduler]


def test_prefill_rate_is_learned_from_ttft(make_scheduler: MakeScheduler, clock: Clock) -> None:
    s, ws = make_scheduler("auto"), fleet(1)
    true_rate = 4e-4
    for i in range(60):
        k = key(text(i, 16_000))  # 4000 tokens, nothing cached
        d = s.decide(k, ws)
        s.commit(k, d)
        clock.advance(10)  # idle between requests: the backlog is empty again
        s.on_finished("w0", prompt_tokens=4000, cached_tokens=0, ttft_s=true_rate * 4000)
    stats = s.stats()["workers"]["w0"]
    assert stats["learned_s_per_token"] == pytest.approx(true_rate, rel=0.05)
    assert stats["prefill_s_per_token"] == 1.5e-4  # used only with learn_rate
    learning = make_scheduler("auto", learn_rate=True)
    for i in range(20):
        k = key(text(i, 16_000))
        learning.commit(k, learning.decide(k, ws))
        clock.advance(10)
        learning.on_finished("w0", prompt_tokens=4000, cached_tokens=0, ttft_s=true_rate * 4000)
    assert learning.stats()["workers"]["w0"]["prefill_s_per_token"] == pytest.approx(true_rate, rel=0.05)


def test_prefill_rate_stays_default_until_enough_samples() -> None:
    w = WorkerLearning(min_samples=8)
    for i in range(8):
        assert w.rate is None
        w.on_sent(100.0 * i, 1e-4, 1000, None)  # far apart: nothing queued ahead
        w.on_finished(100.0 * i, 1000, 0, 5.0)
    assert w.rate == pytest.approx(5e-3)


def test_backlog_builds_with_sends_and_drains_with_time() -> None:
    w = WorkerLearning()
    w.on_sent(100.0, 1e-3, 2000, None)
    w.on_sent(100.0, 1e-3, 1000, None)
    assert w.drain(100.0, 1e-3) == pytest.approx(3000)
    assert w.drain(101.0, 1e-3) == pytest.approx(2000)
    assert w.drain(110.0, 1e-3) == 0


def test_realisation_drops_when_the_engine_reports_fewer_hits() -> None:
    w = WorkerLearning()
    for _ in range(20):
        w.on_sent(0.0, 1e-4, 100, predicted_hit=0.9)
        w.on_finished(0.0, 1000, 300, None)
    assert w.realised == pytest.approx(0.3 / 0.9, rel=0.01)
    assert WorkerLearning().realised == 1.0


def test_auto_moves_sessions_off_a_worker_whose_cache_does_not_hold(make_scheduler: MakeScheduler,
                                                                     clock: Clock) -> None:
    """The index believes the worker holds the conversation; the engine says it evicted it.
    (``realisation_weight`` = 1, the default, made explicit here.)"""
    s, ws = make_scheduler("auto", realisation_weight=1.0), fleet(2)
    conv = text(1, 40_000)
    home = send(s, key(conv, session="a"), ws)
    other = "w1" if home == "w0" else "w0"
    clock.advance(30)
    next(w for w in ws if w.id == home).inflight = 6
    assert s.decide(key(conv + text(2, 600), session="a"), ws).kind is DecisionKind.STICKY
    repeated = key(text(10, 4000))
    for _ in range(40):  # the index predicts a full hit each time; the engine reports none
        clock.advance(5)  # (the decision below comes with the last report: nothing has faded)
        s.commit(repeated, s.decide(repeated, [next(w for w in ws if w.id == home)]))
        s.on_finished(home, prompt_tokens=1000, cached_tokens=0, ttft_s=None)
    d = s.decide(key(conv + text(2, 600), session="a"), ws)
    assert d.worker_id == other and d.kind is DecisionKind.OVERFLOW


def test_auto_spreads_a_burst_by_backlog(make_scheduler: MakeScheduler) -> None:
    """Without sessions, a burst of distinct prompts at one instant spreads over the fleet even
    though no request has finished yet (the router's own backlog estimate)."""
    s, ws = make_scheduler("auto", inflight_tokens=0.0), fleet(4)
    chosen = [send(s, key(text(i, 40_000)), ws) for i in range(8)]
    assert sorted(chosen.count(w.id) for w in ws) == [2, 2, 2, 2]


def test_a_models_own_learning_settings_are_honoured_everywhere(clock: Clock) -> None:
    """A model whose [models.NAME] learning settings differ from the default's: its workers learn
    with its weights and sample counts, drain and report at its rate, also for facts from
    another router instance."""
    from kvroute.routing.config import ModelSettings, RoutingConfig
    from kvroute.routing.sync_record import PrefixRecord

    own = ModelSettings(policy="auto", prefill_s_per_token=1e-3, learn_min_samples=1, learn_alpha=1.0,
                      learn_prefill_speed=False)
    s = Scheduler(RoutingConfig(models={"big": own}), clock=clock)
    ws = fleet(1, model="big")
    send(s, key(text(1, 16_000), model="big"), ws)
    assert s.prefill_s_per_token("w0") == 1e-3
    assert s.stats()["workers"]["w0"]["prefill_s_per_token"] == 1e-3
    s.on_finished("w0", prompt_tokens=4000, cached_tokens=0, ttft_s=2.0)
    learned = s.learned("w0")
    assert learned is not None and learned.rate is not None  # one sample is enough for this model
    # Another instance's request: 1000 prefill tokens sent 0.5 s ago, drained at 1e-3 s a token.
    backlog = learned.drain(clock(), 1e-3)
    s.apply_remote(PrefixRecord("w0", 1.0, clock() - 0.5, (1, 2, 3), 1000))
    assert learned.drain(clock(), 1e-3) == pytest.approx(backlog + 500)
