"""Why a queued request waits, in words, as its decision line says it (``Ticket.why``, set by the
dispatcher when the request joins the queue).  Pure: an injected clock."""

from __future__ import annotations

from typing import Any

from routing_helpers import Clock

from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.flow import TicketState
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

MODEL = "m"


def key(tokens: int, session: str | None = None, text: str = "") -> RoutingKey:
    prefix = (text or f"prompt-{tokens}-{session}").encode() * max(1, tokens // 8)
    return RoutingKey(MODEL, prefix, session, tokens, 0)


def fleet(n: int, seqs: int, kv_tokens: int | None = None) -> list[WorkerState]:
    return [WorkerState(f"w{i}", f"http://w{i}", frozenset({MODEL}), max_num_seqs=seqs, kv_tokens=kv_tokens)
            for i in range(n)]


def dispatcher(clock: Clock, **policy: Any) -> Dispatcher:
    cfg = RoutingConfig(default=ModelSettings(policy="least-loaded", flow_control=True, **policy))
    return Dispatcher(Scheduler(cfg, clock=clock), timer=clock)


def send(d: Dispatcher, k: RoutingKey, workers: list[WorkerState]) -> None:
    decision = d.route(k, workers)
    state = next(w for w in workers if w.id == decision.worker_id)
    d.sent(k, decision, state)


def test_a_full_fleet_and_the_requests_ahead() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock)
    workers = fleet(1, seqs=1)
    send(d, key(100), workers)
    first = d.admit(key(200, text="first"), workers)
    second = d.admit(key(300, text="second"), workers)
    assert first.why == "no replica admissible; predicted prefill 200 tokens, prefix cold"
    assert second.why == "no replica admissible, 1 queued ahead; predicted prefill 300 tokens, prefix cold"


def test_a_new_session_held_by_session_admission() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0, flow_kv_fill=10.0)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    send(d, key(900, session="a"), workers)
    send(d, key(900, session="b"), workers)
    new = d.admit(key(300, session="c"), workers)
    assert new.queued
    assert new.why.startswith("a replica is free but its session is new (session admission);")


def test_a_request_admitted_at_once_has_no_why() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock)
    t = d.admit(key(100), fleet(1, seqs=1))
    assert t.state is TicketState.GRANTED and t.why == ""


def test_a_request_behind_one_that_does_not_fit_yet_is_not_blamed_on_session_admission() -> None:
    """A free replica, but the request ahead (fifo) needs more KV than it has free: the request
    behind waits for it, and session admission (off here) is not named."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_order="fifo")
    workers = fleet(1, seqs=8, kv_tokens=1000)
    send(d, key(700), workers)
    big = d.admit(key(600, text="big"), workers)
    small = d.admit(key(100, text="small"), workers)
    assert big.queued and small.queued
    assert small.why.startswith("a replica is free but the request ahead of it is not admissible yet, "
                                "1 queued ahead;")


def test_an_ejected_replica_is_no_room() -> None:
    """Ready means not ejected by the circuit breaker either: an ejected idle replica beside a
    full one leaves no room, so the request waits instead of going to the full one."""
    clock = Clock(1000.0)
    d = dispatcher(clock)
    workers = fleet(2, seqs=1)
    workers[1].ejected = True
    send(d, key(100), workers)
    assert d.admit(key(200), workers).queued
