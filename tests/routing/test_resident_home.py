"""A session's next turn, where the engines' KV events say which worker holds its history, is
decided from what every router instance sees alike: the instance that placed the session and one
that never saw it (several instances behind a load balancer, no Redis) send it to the same worker.
It stays there unless that worker is really busy; then both move it, to the same place."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from routing_helpers import Clock, fleet, key, send, text

from kvroute.routing.decision import DecisionKind
from kvroute.routing.hashing import token_block_hashes
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

MakeScheduler = Callable[..., Scheduler]
BLOCK = 16
PROMPT_BLOCKS = 80  # the turn being routed: 1,280 tokens


@dataclass(frozen=True)
class Case:
    """One situation: where the engines hold the session's history (blocks of the prompt per
    worker), where the routing instance last bound the session itself (None: it never saw it),
    the other sessions it routed to each worker lately, and the engines' waiting queues."""

    name: str
    held: dict[str, int]
    bound_here: str | None
    others_here: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    expect: str | None = None  # None: any worker but the holder
    expect_kind: DecisionKind = DecisionKind.STICKY


CASES = [
    Case("unknown here, its history on w1, this instance's sessions on w1",
         {"w1": 75}, None, others_here={"w1": 2}, expect="w1"),
    Case("known here, the same sessions", {"w1": 75}, "w1", others_here={"w1": 2}, expect="w1"),
    Case("bound here to w0, since moved to w1 by another instance",
         {"w0": 40, "w1": 75}, "w0", others_here={"w0": 1}, expect="w1"),
    Case("its holder has a queue in the engine: it moves", {"w1": 75}, None,
         waiting={"w1": 2}, expect=None, expect_kind=DecisionKind.OVERFLOW),
    Case("bound here, its holder queueing: it moves as well", {"w1": 75}, "w1",
         waiting={"w1": 2}, expect=None, expect_kind=DecisionKind.OVERFLOW),
]


def _tokens(n_blocks: int) -> list[int]:
    return [1000 + i for i in range(n_blocks * BLOCK)]


def _turn(session: str) -> RoutingKey:
    k = key(text(7, PROMPT_BLOCKS * BLOCK * 4), session=session)
    return dataclasses.replace(k, token_hashes=tuple(token_block_hashes(_tokens(PROMPT_BLOCKS), BLOCK)),
                               token_block=BLOCK)


def _instance(make_scheduler: MakeScheduler, clock: Clock, case: Case,
              ws: list[WorkerState]) -> Scheduler:
    """A router instance whose engines' events say what ``case.held`` says, with its own history."""
    s = make_scheduler("auto")
    for w in ws:
        s.on_worker_epoch(w.id, w.epoch)
        s.exact.attach(w.id, [0])
        s.exact.synced(w.id, 0, clock.now)
    for wid, n in case.held.items():
        s.exact.stored(wid, 0, list(range(1, n + 1)), None, _tokens(n), BLOCK, None, clock.now)
    by_id = {w.id: w for w in ws}
    for wid, n in case.others_here.items():
        for i in range(n):
            send(s, key(text(100 + i, 4000), session=f"other-{wid}-{i}"), [by_id[wid]])
    if case.bound_here is not None:
        send(s, key(text(7, 2000), session="chat"), [by_id[case.bound_here]])
    return s


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_turn_goes_where_the_engines_hold_its_history(make_scheduler: MakeScheduler, clock: Clock,
                                                        case: Case) -> None:
    ws = fleet(4)
    for w in ws:
        w.running, w.waiting = 0, case.waiting.get(w.id, 0)
    holder = max(case.held, key=lambda w: case.held[w])
    d = _instance(make_scheduler, clock, case, ws).decide(_turn("chat"), ws)
    assert d.kind is case.expect_kind, d.reason
    if case.expect is not None:
        assert d.worker_id == case.expect, d.reason
    else:
        assert d.worker_id != holder, d.reason
        # The line says what the worker left was predicted at, and its engine's queue.
        assert f"{holder} predicted" in d.reason and "waiting=2" in d.reason, d.reason


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_instance_that_never_saw_the_session_decides_alike(make_scheduler: MakeScheduler,
                                                               clock: Clock, case: Case) -> None:
    """The same engines' state and load; one instance bound the session itself and routed other
    sessions, another did neither.  Where it moves, the workers it may move to are equal here, and
    ties go round-robin by each instance's own turn counter: both move it, not always to the same
    one of them."""
    decided = []
    for here in (case, dataclasses.replace(case, bound_here=None, others_here={})):
        ws = fleet(4)
        for w in ws:
            w.running, w.waiting = 0, case.waiting.get(w.id, 0)
        d = _instance(make_scheduler, clock, here, ws).decide(_turn("chat"), ws)
        decided.append((d.kind, d.worker_id if case.expect is not None else None))
    assert decided[0] == decided[1]


def test_a_head_two_workers_hold_alike_leaves_the_binding_to_the_table(make_scheduler: MakeScheduler,
                                                                       clock: Clock) -> None:
    """No single holder (a shared head, or the history copied): the instance's own binding stands,
    and so does the sessions term its placements use."""
    ws = fleet(4)
    case = Case("shared", {"w1": 75, "w2": 75}, "w2")
    d = _instance(make_scheduler, clock, case, ws).decide(_turn("chat"), ws)
    assert (d.worker_id, d.kind) == ("w2", DecisionKind.STICKY), d.reason


def test_less_than_half_the_prompt_is_no_history(make_scheduler: MakeScheduler, clock: Clock) -> None:
    """A worker holding a third of the prompt is not where the conversation lives: an instance
    that does not know the session places it (by its cost), and reads no binding from the cache."""
    ws = fleet(4)
    s = _instance(make_scheduler, clock, Case("short", {"w1": 25}, None), ws)
    d = s.decide(_turn("chat"), ws)
    assert d.kind is not DecisionKind.STICKY and d.kind is not DecisionKind.OVERFLOW, d.reason
