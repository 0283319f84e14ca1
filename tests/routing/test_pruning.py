"""Large fleets are decided over the few workers that can win (``Pruning``, routing/loadbook.py):
the choice must be as good as looking at every worker — the same scores, whatever the loads,
sessions, cached prefixes, backlogs, health and soft-filter states."""

from __future__ import annotations

import dataclasses
import random

import pytest
from routing_helpers import Clock, fleet, key, text

from kvroute.routing.config import ModelPolicy, RoutingConfig
from kvroute.routing.decision import Decision
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState


def _pair(policy: str, clock: Clock) -> tuple[Dispatcher, Dispatcher]:
    """Two dispatch paths with the same settings: one prunes above 8 workers, one never does."""
    def make(prune_above: int) -> Dispatcher:
        config = RoutingConfig(default=ModelPolicy(policy=policy), prune_above=prune_above)
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
