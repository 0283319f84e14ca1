"""Large fleets are decided over the few workers that can win (``Pruning``, routing/loadbook.py):
the choice must be as good as looking at every worker — the same scores, whatever the loads,
sessions, cached prefixes, backlogs, health and soft-filter states."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
from routing_helpers import Clock, fleet, key, text

from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.decision import Decision
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.hashing import token_block_hashes
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState


def _pair(policy: str, clock: Clock) -> tuple[Dispatcher, Dispatcher]:
    """Two dispatch paths with the same settings: one prunes above 8 workers, one never does."""
    def make(prune_above: int) -> Dispatcher:
        config = RoutingConfig(default=ModelSettings(policy=policy), prune_above=prune_above)
        return Dispatcher(Scheduler(config, clock=clock), timer=clock)
    return make(8), make(1_000_000)


def _copy(ws: list[WorkerState]) -> list[WorkerState]:
    return [dataclasses.replace(w) for w in ws]


def _shuffle_loads(rng: random.Random, pruned: Dispatcher, full: Dispatcher, a: list[WorkerState],
                   b: list[WorkerState]) -> None:
    for wa, wb in zip(a, b, strict=True):
        inflight, peer = rng.choice((0, 0, 1, 2, 3, 5, 8)), rng.choice((0, 0, 0, 1, 2))
        running, waiting = rng.choice((None, 0, 2, 6)), rng.choice((None, 0, 0, 1, 3))
        healthy, draining = rng.random() > 0.05, rng.random() < 0.03
        sent_since_scrape = rng.choice((0, 0, 1))
        for w, d in ((wa, pruned), (wb, full)):
            w.healthy, w.draining = healthy, draining  # the registry's, not load: never filed
            w.inflight = inflight
            d.peer_load(w, peer)
            d.scraped(w, running, waiting, None)
            w.inflight += sent_since_scrape
            d.book.touch(w)


@pytest.mark.parametrize("policy", ["auto", "least-loaded"])
@pytest.mark.parametrize("seed", range(6))
def test_pruned_choices_score_as_well_as_looking_at_every_worker(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    pruned, full = _pair(policy, clock)
    n = rng.choice((20, 70, 150))
    a = fleet(n, max_num_seqs=rng.choice((8, 32)))
    if seed % 3 == 0:  # a few workers with a short context window: the soft filter's fallback
        for w in a[:3]:
            w.max_model_len = 2000
    b = _copy(a)
    for d, ws in ((pruned, a), (full, b)):
        for w in ws:
            d.worker_epoch(w.id, w.epoch)
    conversations = [text(100 + i, rng.choice((3000, 20_000, 60_000))) for i in range(12)]
    compared = 0
    looked_at: list[tuple[int, int]] = []
    for step in range(60):
        _shuffle_loads(rng, pruned, full, a, b)
        conv = rng.randrange(len(conversations))
        conversations[conv] += text(step, rng.choice((200, 2000)))
        k = key(conversations[conv], session=f"s{conv}" if rng.random() < 0.8 else None, max_tokens=100)
        da, db = pruned.route(k, a), full.route(k, b)
        assert da.scores == db.scores, (step, da.reason, db.reason)
        looked_at.append((da.considered, db.considered))
        assert (da.worker_id is None) == (db.worker_id is None)
        if da.worker_id is None:
            continue
        compared += 1
        # Both remember the pruned choice, so that the two histories stay the same.
        wa = next(w for w in a if w.id == da.worker_id)
        wb = next(w for w in b if w.id == da.worker_id)
        fa, _ = pruned.sent(k, da, wa)
        fb, _ = full.sent(k, _same_worker(db, da), wb)
        clock.advance(rng.choice((0.0, 0.5, 3.0)))
        if rng.random() < 0.7:
            for d, f in ((pruned, fa), (full, fb)):
                d.first_byte(f)
                d.finished(f, ok=True, prompt_tokens=k.est_prompt_tokens, cached_tokens=0)
    assert compared > 40
    if n > 64 and policy == "auto":  # the pruning did happen, mostly
        assert sum(p < f for p, f in looked_at) > len(looked_at) // 2


def _same_worker(decision: Decision, other: Decision) -> Decision:
    """``decision`` as if it had chosen ``other``'s worker (equal scores: an equally good choice)."""
    return dataclasses.replace(decision, worker_id=other.worker_id, worker_epoch=other.worker_epoch,
                               matched_blocks=other.matched_blocks, prefill_tokens=other.prefill_tokens)


def test_small_fleets_are_never_pruned() -> None:
    clock = Clock()
    d = Dispatcher(Scheduler(RoutingConfig(), clock=clock), timer=clock)
    ws = fleet(4)
    for w in ws:
        d.worker_epoch(w.id, w.epoch)
    decision = d.route(key(text(1, 4000)), ws)
    assert decision.considered == 4
    assert len(d.book) == 0  # nothing was even filed


# --- the pruned decision against a brute-force reference on the very same state ----------------

def _token_hashes(seed: int, n_blocks: int) -> tuple[int, ...]:
    return tuple(token_block_hashes([seed * 7 + i for i in range(16 * n_blocks)], 16))


def _busy_fleet(rng: random.Random, n: int, clock: Clock) -> tuple[Dispatcher, list[WorkerState], list[str]]:
    """A dispatcher over ``n`` workers after a random history: shared heads held by a few workers,
    sessions bound (so active-session counts vary), backlogs, a few workers whose KV events are
    exact (some with speculative entries only), random loads, unhealthy, draining and short-context
    workers.  Returns the dispatcher, the workers and the shared heads."""
    # Settings under which the filters and the cost terms bite differently.
    settings = rng.choice(({}, {"active_session_tokens": 0.0},
                           {"session_spread": 0, "active_session_tokens": 0.0}, {"session_spread": None},
                           {"stay_tokens": 0.0, "waiting_tokens": 100_000.0}))
    config = RoutingConfig(default=ModelSettings(policy="auto", **settings), prune_above=8)
    d = Dispatcher(Scheduler(config, clock=clock), timer=clock)
    ws = fleet(n, max_num_seqs=rng.choice((16, 64)))
    for w in ws:
        d.worker_epoch(w.id, w.epoch)
    exact = d.scheduler.exact
    for w in rng.sample(ws, n // 10):
        exact.attach(w.id, [0])
        exact.synced(w.id, 0, clock.now)
    heads = [text(500 + h, rng.choice((2000, 12_000, 30_000))) for h in range(4)]
    for j in range(rng.randrange(n // 2, 2 * n)):
        w = rng.choice(ws)
        k = key(rng.choice(heads) + text(1000 + j, rng.choice((100, 3000))),
                session=f"old{j}" if rng.random() < 0.7 else None)
        if rng.random() < 0.2:
            k = dataclasses.replace(k, token_hashes=_token_hashes(j % 3, 4), token_block=16)
        decision = d.scheduler.decide(k, [w])
        flight, _ = d.sent(k, decision, w)
        if rng.random() < 0.6:
            d.finished(flight, ok=True, prompt_tokens=k.est_prompt_tokens, cached_tokens=0)
        clock.advance(rng.choice((0.0, 0.1, 2.0, 30.0)))
    backlogged = rng.choice((0.8, 1.0))
    for i, w in enumerate(ws):  # a backlog of its own on most workers (or all), of any size
        if rng.random() < backlogged:
            k = key(text(-1 - i, rng.choice((400, 4000, 40_000))))
            d.sent(k, d.scheduler.decide(k, [w]), w)
    # Often the least busy have a queue in the engine: then a busier worker is cheaper.
    queued = rng.choice((0.05, 0.5, 0.9))
    for w in ws:
        w.healthy, w.draining = rng.random() > 0.05, rng.random() < 0.03
        if rng.random() < 0.02:
            w.max_model_len = 2000
        d.peer_load(w, rng.choice((0, 0, 1, 3, 6)))
        running = rng.choice((None, 0, 2, 6, 12))
        waiting = None if running is None else 1 if rng.random() < queued else 0
        d.scraped(w, running, waiting, None)
        w.inflight += rng.randrange(4)
        d.book.touch(w)
    return d, ws, heads


def _brute_force(s: Scheduler) -> Scheduler:
    """A copy of the scheduler (its index, sessions and learned figures) outside any dispatcher, so
    it decides over every worker it is given.  Its settings are shared, not copied: they are frozen,
    and a settings block compiled by mypyc cannot be deep-copied (docs/design.md)."""
    shared: list[object] = [s.config, *s._learning_as.values()]
    return copy.deepcopy(s, {id(b): b for b in shared})


@pytest.mark.parametrize("seed", range(8))
def test_pruned_decisions_equal_looking_at_every_worker(seed: int) -> None:
    """Each decision twice from one state: pruned (the dispatcher's path) and by brute force over
    every worker (a copy of the scheduler, no load book): the same scores, the same kind."""
    rng = random.Random(1000 + seed)
    clock = Clock()
    n = rng.choice((65, 150, 400))
    d, ws, heads = _busy_fleet(rng, n, clock)
    pruned_some = 0
    cases = 0
    for step in range(40):
        head = rng.choice(heads)
        case = rng.choice(("new", "next", "none", "exact", "cold"))
        if case == "cold":  # a new conversation that shares nothing: no worker holds any of it
            k = key(text(20_000 + step, rng.choice((3000, 40_000, 140_000))), session=f"cold{seed}-{step}")
        elif case == "next":  # a bound session's next turn
            j = rng.randrange(n // 2)
            k = key(head + text(1000 + j, 3000) + text(step, 400), session=f"old{j}")
        else:
            k = key(head + text(9000 + step, rng.choice((50, 4000))),
                    session=None if case == "none" else f"new{seed}-{step}")
        if case == "exact":
            k = dataclasses.replace(k, token_hashes=_token_hashes(step % 3, 6), token_block=16)
        exclude = {w.id for w in rng.sample(ws, 2)} if rng.random() < 0.2 else set()
        reference = _brute_force(d.scheduler).decide(k, ws, exclude)
        decision = d.route(k, ws, exclude)
        assert decision.scores == reference.scores, (step, case, decision.reason, reference.reason)
        assert decision.kind == reference.kind, (step, case)
        assert decision.considered <= reference.considered
        cases += 1
        pruned_some += decision.considered < reference.considered
        clock.advance(rng.choice((0.0, 0.5)))
    assert pruned_some > cases // 2


def _placed(policy: ModelSettings, n: int) -> tuple[Dispatcher, list[WorkerState]]:
    clock = Clock()
    d = Dispatcher(Scheduler(RoutingConfig(default=policy, prune_above=8), clock=clock), timer=clock)
    ws = fleet(n, max_num_seqs=64)
    for w in ws:
        d.worker_epoch(w.id, w.epoch)
    return d, ws


def _commit(d: Dispatcher, k: RoutingKey, w: WorkerState) -> None:
    d.scheduler.commit(k, d.scheduler.decide(k, [w]))


def _both(d: Dispatcher, k: RoutingKey, ws: list[WorkerState]) -> tuple[Decision, Decision]:
    reference = _brute_force(d.scheduler).decide(k, ws)
    return d.route(k, ws), reference


def test_a_busier_worker_holding_nothing_is_found_when_the_least_busy_are_slow() -> None:
    """The least busy carry a large backlog: a worker one request busier, with none, is cheaper,
    and only the floor's walk finds it."""
    d, ws = _placed(ModelSettings(policy="auto"), 100)
    for i, w in enumerate(ws):
        if i < 10:  # one request in flight each, with a long prompt still to prefill
            k = key(text(-1 - i, 80_000))
            d.sent(k, d.scheduler.decide(k, [w]), w)
        else:  # busier; the few at 2 hold nothing and owe nothing
            w.inflight = 2 if i < 20 else 5
            d.book.touch(w)
    decision, reference = _both(d, key(text(7, 40_000), session="new"), ws)
    assert decision.scores == reference.scores
    assert 10 <= int(decision.worker_id[1:]) < 20
    assert decision.considered <= 20


def test_a_placement_counts_active_sessions_from_the_fewest_in_the_fleet() -> None:
    """Every worker priced first has active sessions, but idle workers elsewhere have none: the
    session filter counts from those, so a holder with more sessions must not win."""
    d, ws = _placed(ModelSettings(policy="auto", session_spread=1, active_session_tokens=0.0), 100)
    head = text(3, 20_000)
    holder = ws[50]
    _commit(d, key(head + text(4, 100)), holder)
    for j in range(2):
        _commit(d, key(text(100 + j, 600), session=f"h{j}"), holder)
    for i in range(10):  # the least busy: one active session each
        _commit(d, key(text(200 + i, 600), session=f"a{i}"), ws[i])
    for w in ws[10:]:
        if w is not holder:
            w.inflight = 1
            d.book.touch(w)
    decision, reference = _both(d, key(head + text(5, 20_000), session="new"), ws)
    assert reference.worker_id != holder.id
    assert decision.scores == reference.scores


@pytest.mark.parametrize("seed", range(4))
def test_pruned_one_shots_equal_looking_at_every_worker(seed: int) -> None:
    """A one-shot (a derived session among derived sessions that never come back) is placed by
    the cost alone, beyond the slack: the pruning walks the floor as far as it takes."""
    rng = random.Random(2000 + seed)
    clock = Clock()
    n = rng.choice((65, 150))
    d, ws, heads = _busy_fleet(rng, n, clock)
    for j in range(40):  # one-shots, each asked once, on random workers
        k = key(rng.choice(heads) + text(30_000 + j, 600), session=f"conv:once{seed}-{j}")
        d.scheduler.commit(k, d.scheduler.decide(k, [rng.choice(ws)]))
    clock.advance(61.0)
    assert d.scheduler.return_share("m") == 0.0
    for step in range(30):
        k = key(rng.choice(heads) + text(40_000 + step, rng.choice((50, 4000))),
                session=f"conv:q{seed}-{step}")
        reference = _brute_force(d.scheduler).decide(k, ws)
        decision = d.route(k, ws)
        assert decision.scores == reference.scores, (step, decision.reason, reference.reason)
        assert decision.considered <= reference.considered
        clock.advance(rng.choice((0.0, 0.5)))


def test_a_one_shot_finds_a_worker_beyond_the_slack_when_those_within_are_slow() -> None:
    """The least busy carry a large backlog, and every other worker is past the prompt-size slack
    with none: a one-shot goes to one of those (the cost alone decides), found by the floor's walk
    beyond the slack; a client's session stays within it."""
    clock = Clock()
    d = Dispatcher(Scheduler(RoutingConfig(default=ModelSettings(policy="auto"), prune_above=8), clock=clock),
                   timer=clock)
    ws = fleet(100, max_num_seqs=64)
    for w in ws:
        d.worker_epoch(w.id, w.epoch)
    for j in range(20):  # derived sessions that never come back
        k = key(text(500 + j, 2000), session=f"conv:once{j}")
        d.scheduler.commit(k, d.scheduler.decide(k, [ws[99]]))
    clock.advance(61.0)
    for i, w in enumerate(ws):
        if i < 10:  # one request in flight each, with a long prompt still to prefill
            k = key(text(-1 - i, 80_000))
            d.sent(k, d.scheduler.decide(k, [w]), w)
        else:  # past the slack of 4 (a 10,000-token prompt), owing nothing
            w.inflight = 6
            d.book.touch(w)
    decision, reference = _both(d, key(text(7, 40_000), session="conv:new"), ws)
    assert decision.scores == reference.scores, (decision.reason, reference.reason)
    assert int(decision.worker_id[1:]) >= 10 and "one-shot" in decision.reason
    client = d.route(key(text(7, 40_000), session="client"), ws)
    assert int(client.worker_id[1:]) < 10
