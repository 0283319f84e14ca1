"""``auto`` counts on the cache the engines report they keep, not only on what the index saw served;
what it expects to prefill is also what it adds to the worker's backlog."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from routing_helpers import Clock, fleet, key, send, text

from kvroute.routing.decision import DecisionKind
from kvroute.routing.scheduler import Scheduler

MakeScheduler = Callable[..., Scheduler]


def evicting_worker(s: Scheduler, clock: Clock, home: str, reported_hit: float) -> None:
    """The index predicts full hits on ``home``; the engine reports ``reported_hit`` of that."""
    w = fleet(1)[0]
    w.id = home
    repeated = key(text(10, 4096))  # eight whole blocks: the index predicts a full hit
    for _ in range(40):  # the caller reads the figure as the last report leaves it
        clock.advance(5)
        s.commit(repeated, s.decide(repeated, [w]))
        s.on_finished(home, prompt_tokens=1000, cached_tokens=round(1000 * reported_hit), ttft_s=None)


def test_expected_prefill_follows_the_reported_hit_share(make_scheduler: MakeScheduler, clock: Clock) -> None:
    s, ws = make_scheduler("auto"), fleet(2)
    conv = key(text(1, 40_000), session="a")  # 10k tokens
    home = send(s, conv, ws)
    clock.advance(30)
    follow = key(text(1, 40_000) + text(2, 2_000), session="a")
    trusting = s.decide(follow, ws)
    assert trusting.kind is DecisionKind.STICKY and trusting.prefill_tokens < 1000
    evicting_worker(s, clock, home, reported_hit=0.4)
    assert s.stats()["workers"][home]["cache_realisation"] == pytest.approx(0.4, rel=0.05)
    d = s.decide(follow, ws)
    # 40 % of the 10k matched tokens are expected to be there: ~6k to prefill, not ~500.
    assert d.prefill_tokens == pytest.approx(follow.est_prompt_tokens - 0.4 * 10_000, rel=0.05)
    # ...and that is what the worker's backlog grows by when it is sent.
    def backlog() -> float:
        return float(s.stats()["workers"][d.worker_id]["backlog_tokens"])

    before = backlog()
    s.commit(follow, d)
    assert backlog() - before == pytest.approx(d.prefill_tokens, abs=1)


def test_realisation_weight_zero_trusts_the_index(make_scheduler: MakeScheduler, clock: Clock) -> None:
    s, ws = make_scheduler("auto", realisation_weight=0.0), fleet(2)
    conv = key(text(1, 40_000), session="a")
    home = send(s, conv, ws)
    evicting_worker(s, clock, home, reported_hit=0.1)
    d = s.decide(key(text(1, 40_000) + text(2, 2_000), session="a"), ws)
    assert d.worker_id == home and d.prefill_tokens < 1000


def test_realisation_is_learned_against_the_index_not_against_itself(make_scheduler: MakeScheduler,
                                                                     clock: Clock) -> None:
    """The learned ratio compares the engine's report with the index's prediction; were it compared
    with the already discounted prediction it would drift towards the square root."""
    s = make_scheduler("auto")
    evicting_worker(s, clock, "w0", reported_hit=0.25)
    assert s.stats()["workers"]["w0"]["cache_realisation"] == pytest.approx(0.25, rel=0.02)


def test_a_follow_up_queued_behind_its_own_prefill_stays_home(make_scheduler: MakeScheduler,
                                                              clock: Clock) -> None:
    """The backlog ahead of it is the prefill that creates its cached prefix: below the cache
    (nothing evicted) it counts once, and the cached worker is still the cheaper one."""
    s, ws = make_scheduler("auto"), fleet(3)
    conv = text(1, 40_000)
    home = send(s, key(conv, session="a"), ws, keep_inflight=True)
    assert send(s, key(conv + text(2, 2_000), session="a"), ws, keep_inflight=True) == home
    d = s.decide(key(conv + text(2, 2_000) + text(3, 2_000), session="a"), ws)
    assert d.worker_id == home and d.kind is DecisionKind.STICKY, d.reason


def test_queued_prefill_weighs_more_where_the_engine_evicts(make_scheduler: MakeScheduler,
                                                           clock: Clock) -> None:
    def leaves_home(eviction_weight: float) -> bool:
        s, ws = make_scheduler("auto", eviction_weight=eviction_weight), fleet(2)
        conv = text(1, 40_000)
        home = send(s, key(conv, session="a"), ws)
        evicting_worker(s, clock, home, reported_hit=0.5)
        for i in range(2):  # other work queued (in flight) on home right now
            send(s, key(text(50 + i, 20_000)), [w for w in ws if w.id == home], keep_inflight=True)
        return s.decide(key(conv + text(2, 2_000), session="a"), ws).worker_id != home

    assert leaves_home(1.0) and not leaves_home(0.0)
