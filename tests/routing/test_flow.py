"""Flow control (routing/flow.py) through the dispatcher: admissibility, the queue's order and its
aging bound, caps, TTL, Retry-After, withdrawal and shutdown.  Pure: an injected clock."""

from __future__ import annotations

import math
from typing import Any

import pytest
from routing_helpers import Clock

from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.dispatch import Dispatcher, InFlight
from kvroute.routing.flow import FlowSettings, ShedReason, Ticket, TicketState
from kvroute.routing.flow_queue import admissible, cache_order, fifo_order
from kvroute.routing.key import DERIVED_SESSION_PREFIX, RoutingKey
from kvroute.routing.saturation import Saturation
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.settings import PlacementSettings
from kvroute.routing.worker import WorkerState

MODEL = "m"


def key(tokens: int = 100, session: str | None = None, max_tokens: int = 0, text: str = "") -> RoutingKey:
    prefix = (text or f"prompt-{tokens}-{session}").encode() * max(1, tokens // 8)
    return RoutingKey(MODEL, prefix, session, tokens, max_tokens)


def fleet(n: int = 1, seqs: int = 1, kv_tokens: int | None = None) -> list[WorkerState]:
    return [WorkerState(f"w{i}", f"http://w{i}", frozenset({MODEL}), max_num_seqs=seqs, kv_tokens=kv_tokens)
            for i in range(n)]


def dispatcher(clock: Clock, **policy: Any) -> Dispatcher:
    policy = {"flow_control": True, **policy}  # off by default: these tests are about it on
    cfg = RoutingConfig(default=ModelSettings(policy="least-loaded", **policy))
    return Dispatcher(Scheduler(cfg, clock=clock), timer=clock)


def send(d: Dispatcher, k: RoutingKey, workers: list[WorkerState]) -> InFlight:
    decision = d.route(k, workers)
    assert decision.worker_id is not None
    state = next(w for w in workers if w.id == decision.worker_id)
    return d.sent(k, decision, state)[0]


# --- admissibility ------------------------------------------------------------------------------

@pytest.mark.parametrize("busy, seqs, kv_tokens, inflight_tokens, need, fill, expected", [
    (0, 4, None, 0, 10_000, 1.0, True),       # nothing known but slots: free
    (4, 4, None, 0, 10, 1.0, False),          # every slot taken
    (1, 4, 1000, 600, 500, 1.0, False),       # the footprint would pass the cache
    (1, 4, 1000, 600, 500, 1.25, True),       # ... unless over-commit is allowed
    (1, 4, 1000, 600, 400, 1.0, True),        # fits exactly
    (0, 4, 1000, 0, 5000, 1.0, True),         # alone it always has room (the engine refuses it)
])
def test_admissible(busy: int, seqs: int, kv_tokens: int | None, inflight_tokens: int, need: int,
                    fill: float, expected: bool) -> None:
    w = WorkerState("w", "u", max_num_seqs=seqs, kv_tokens=kv_tokens, inflight=busy,
                    inflight_tokens=inflight_tokens)
    assert admissible(w, need, PlacementSettings(), fill) is expected


def test_engine_load_beyond_the_routers_counts() -> None:
    w = WorkerState("w", "u", max_num_seqs=2, running=2, waiting=0, scraped_inflight=0)
    assert not admissible(w, 1, PlacementSettings(), 1.0)  # two requests from elsewhere


# --- the order ----------------------------------------------------------------------------------

def ticket(arrived: float, prefill: int, resident: bool = False, seq: int = 0) -> Ticket:
    return Ticket(key(), arrived, TicketState.QUEUED, prefill_tokens=prefill, resident=resident, seq=seq)


@pytest.mark.parametrize("tickets, now, expected", [
    # resident session turns first, then the shortest predicted prefill, then arrival
    ([(0.0, 5000, False), (1.0, 3000, True), (2.0, 100, False)], 3.0, [1, 2, 0]),
    ([(0.0, 900, False), (1.0, 100, False), (2.0, 100, False)], 3.0, [1, 2, 0]),
    # aged (waited >= flow_aging_s = 10) go first, oldest first, whatever their prefill
    ([(0.0, 90_000, False), (5.0, 50_000, False), (11.0, 10, True)], 15.0, [0, 1, 2]),
    ([(0.0, 90_000, False), (8.0, 50_000, False), (11.0, 10, True)], 15.0, [0, 2, 1]),
])
def test_cache_order(tickets: list[tuple[float, int, bool]], now: float, expected: list[int]) -> None:
    ts = [ticket(a, p, r, seq=i) for i, (a, p, r) in enumerate(tickets)]
    s = FlowSettings()
    assert [t.seq for t in sorted(ts, key=lambda t: cache_order(t, now, s.flow_aging_s))] == expected
    assert [t.seq for t in sorted(ts, key=lambda t: fifo_order(t, now, s.flow_aging_s))] == sorted(expected)


def test_aging_bounds_the_wait_of_a_long_prompt() -> None:
    """A long prompt behind an endless stream of short ones is admitted once it has waited
    flow_aging_s: its wait is bounded whatever arrives after it."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_aging_s=5.0)
    workers = fleet(1, seqs=1)
    running = send(d, key(50, text="first"), workers)
    long = d.admit(key(20_000, text="long"), workers)
    assert long.queued
    admitted_at = None
    for i in range(40):  # bounded: one short request arrives and one finishes per second
        clock.now += 1.0
        short = d.admit(key(10, text=f"short{i}"), workers)
        assert short.queued
        d.finished(running, ok=True)
        granted = short if short.state is TicketState.GRANTED else long
        assert granted.state is TicketState.GRANTED
        d.claim(granted)
        running = send(d, granted.key, workers)
        if granted is long:
            admitted_at = clock.now
            break
    assert admitted_at is not None and admitted_at - long.arrived <= 5.0 + 1.0


# --- the gate through the dispatcher ------------------------------------------------------------

def test_admitted_at_once_while_a_replica_is_admissible() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock)
    workers = fleet(2, seqs=1)
    assert d.admit(key(text="a"), workers).state is TicketState.GRANTED
    send(d, key(text="a"), workers)
    assert d.admit(key(text="b"), workers).state is TicketState.GRANTED
    send(d, key(text="b"), workers)
    assert d.admit(key(text="c"), workers).queued
    assert d.flow.depth() == {MODEL: (1, 100)}


def test_finish_wakes_the_queue_and_the_woken_is_decided_afresh() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock)
    workers = fleet(1, seqs=1)
    first = send(d, key(text="a"), workers)
    woken: list[Ticket] = []
    t = d.admit(key(text="b"), workers, woken.append)
    assert t.queued and not woken
    clock.now += 2.5
    d.finished(first, ok=True)
    assert woken == [t] and t.state is TicketState.GRANTED and t.waited_s == 2.5
    # granted but not yet claimed: a newcomer cannot take its place
    assert d.admit(key(text="c"), workers).queued
    d.claim(t)
    send(d, t.key, workers)
    assert workers[0].inflight == 1 and d.flow.depth()[MODEL] == (1, 100)


def test_flow_control_off_forwards_everything() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_control=False)
    workers = fleet(1, seqs=1)
    send(d, key(text="a"), workers)
    assert d.admit(key(text="b"), workers).state is TicketState.GRANTED


def test_no_worker_serving_the_model_is_the_pipelines_answer_not_the_queues() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock)
    workers = fleet(1, seqs=1)
    workers[0].healthy = False
    assert d.admit(key(), workers).state is TicketState.GRANTED


@pytest.mark.parametrize("settings, reason", [
    ({"flow_max_queued": 1}, ShedReason.QUEUE_FULL),
    ({"flow_max_queued_tokens": 150}, ShedReason.QUEUE_TOKENS),
])
def test_caps_shed_at_once(settings: dict[str, Any], reason: ShedReason) -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock, **settings)
    workers = fleet(1, seqs=1)
    send(d, key(text="a"), workers)
    assert d.admit(key(text="b"), workers).queued
    shed = d.admit(key(text="c"), workers)
    assert shed.state is TicketState.SHED and shed.reason is reason and shed.retry_after_s >= 1
    assert d.flow.shed == {(MODEL, reason.value, "normal"): 1}


def test_ttl_expiry_sheds_and_calls_back() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock)
    workers = fleet(1, seqs=1)
    send(d, key(text="a"), workers)
    told: list[Ticket] = []
    t = d.admit(key(text="b"), workers, told.append)
    clock.now += 60.0
    assert d.expire(t) and told == [t] and t.reason is ShedReason.TTL
    assert d.flow.depth()[MODEL] == (0, 0)
    assert not d.expire(t)  # once


@pytest.mark.parametrize("ttl_s", [60.0, 2.5])
def test_the_deadline_is_flow_controls_and_the_edge_arms_it(ttl_s: float) -> None:
    """The queue TTL is one rule: flow control sets a queued ticket's deadline (``flow_queue_ttl_s``
    after it arrived, on the dispatcher's clock); an edge on another clock asks how long is left.
    A request granted at once has none."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_queue_ttl_s=ttl_s)
    workers = fleet(1, seqs=1)
    at_once = d.admit(key(text="a"), workers)
    send(d, key(text="a"), workers)
    queued = d.admit(key(text="b"), workers)
    assert at_once.deadline == math.inf and queued.deadline == 1000.0 + ttl_s
    clock.now += 1.0
    assert d.expires_in(queued) == ttl_s - 1.0
    clock.now += ttl_s
    assert d.expires_in(queued) == 0.0  # past it: the edge's timer fires at once


def test_retry_after_follows_the_drain_rate() -> None:
    """Retry-After is the queue ahead over the rate at which requests finish: never a constant."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_max_queued=3)
    workers = fleet(1, seqs=1)
    flight = send(d, key(text="warm"), workers)
    for i in range(4):  # finishing every 0.5 s: 2 per second
        clock.now += 0.5
        d.finished(flight, ok=True)
        flight = send(d, key(text=f"r{i}"), workers)
    for i in range(3):
        assert d.admit(key(text=f"q{i}"), workers).queued
    fast = d.admit(key(text="x"), workers)
    assert fast.state is TicketState.SHED and fast.retry_after_s == 2  # (3 ahead + 1) / 2 per s
    clock.now += 8.0  # nothing finished for 8 s: the rate falls, the advice grows
    slow = d.admit(key(text="y"), workers)
    assert slow.retry_after_s > fast.retry_after_s


def test_withdraw_leaves_no_trace() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock)
    workers = fleet(1, seqs=1)
    first = send(d, key(text="a"), workers)
    queued = d.admit(key(text="b"), workers)
    d.withdraw(queued)
    assert d.flow.depth()[MODEL] == (0, 0) and queued.state is TicketState.WITHDRAWN
    # a woken, unclaimed ticket gives its reservation back
    woken = d.admit(key(text="c"), workers)
    d.finished(first, ok=True)
    assert woken.state is TicketState.GRANTED
    d.withdraw(woken)
    assert d.admit(key(text="d"), workers).state is TicketState.GRANTED
    assert workers[0].inflight == 0 and workers[0].inflight_tokens == 0


def test_shed_all_answers_every_queued_request() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock)
    workers = fleet(1, seqs=1)
    send(d, key(text="a"), workers)
    told: list[Ticket] = []
    for i in range(3):
        d.admit(key(text=f"q{i}"), workers, told.append)
    assert [t.reason for t in d.shed_all()] == [ShedReason.SHUTDOWN] * 3
    assert len(told) == 3 and d.flow.depth()[MODEL] == (0, 0)


def test_kv_footprint_is_counted_while_in_flight() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_kv_fill=1.0)
    workers = fleet(1, seqs=8, kv_tokens=1000)
    first = send(d, key(600, max_tokens=100), workers)
    assert workers[0].inflight_tokens == 700
    assert d.admit(key(400, text="big"), workers).queued  # 700 + 400 > 1000
    d.finished(first, ok=True)
    assert workers[0].inflight_tokens == 0


def test_settings_are_validated() -> None:
    for bad in ({"flow_order": "random"}, {"flow_queue_ttl_s": 0}, {"flow_kv_fill": 0},
                {"flow_max_queued": -1}, {"flow_session_fill_unsaturated": -0.5}):
        with pytest.raises(ValueError):
            ModelSettings(**bad)


# --- session admission --------------------------------------------------------------------------

def test_session_admission_holds_new_sessions_not_continuing_ones() -> None:
    """With the fleet's KV (2 x 1000 tokens) held by served sessions, a new session waits while a
    continuing one is admitted past it; once a session goes idle the new one starts."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_session_idle_s=5.0, flow_kv_fill=10.0)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    a = send(d, key(900, session="a"), workers)
    b = send(d, key(900, session="b"), workers)
    new = d.admit(key(300, session="c"), workers)
    assert new.queued  # 1800 + 300 > 2000, though both replicas have slots
    d.finished(a, ok=True)
    assert new.queued  # "a" ended just now: still part of the working set
    again = d.admit(key(950, session="a", text="turn 2"), workers)
    assert again.state is TicketState.GRANTED  # a continuing session goes past the held new one
    a = send(d, again.key, workers)
    d.finished(b, ok=True)
    clock.now += 6.0
    d.scraped(workers[0], 0, 0, 0.0)  # any wake re-checks: "b" has been idle for 6 s
    assert new.state is TicketState.GRANTED


@pytest.mark.parametrize("other, fill_unsaturated, saturated, granted", [
    # both kinds served: "a" and "c"'s kind may fill half the fleet's KV, 1000 x the fill
    (DERIVED_SESSION_PREFIX + "b", 0.0, False, False),  # flow_session_fill at all times: 900 + 300 > 1000
    (DERIVED_SESSION_PREFIX + "b", 1.5, False, True),   # not saturated: 900 + 300 <= 1.5 x 1000
    (DERIVED_SESSION_PREFIX + "b", 1.5, True, False),   # saturated: flow_session_fill again
    ("b", 1.5, False, False),  # one kind: a seat only, at flow_session_fill (900 + 300 > 1000)
])
def test_the_door_fill_before_saturation(other: str, fill_unsaturated: float, saturated: bool,
                                         granted: bool) -> None:
    """``flow_session_fill_unsaturated`` stands for ``flow_session_fill`` in the fleet's test
    while the fleet is not saturated; a seat (the only test where one kind is served) keeps
    ``flow_session_fill``, its count already taking the sessions' pauses in."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill=1.0, flow_kv_fill=10.0,
                   flow_session_fill_unsaturated=fill_unsaturated)
    if saturated:
        d.saturation[MODEL] = Saturation(level=1.0, engaged=True)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    send(d, key(900, session="a"), workers)
    send(d, key(900, session=other), workers)
    new = d.admit(key(300, session="c"), workers)
    assert (new.state is TicketState.GRANTED) is granted
    assert d.saturated(MODEL) is saturated


@pytest.mark.parametrize("session, fill_unsaturated, held", [
    ("c", 1.25, True),    # the client names it: the door from the start, 1800 + 900 > 1.25 x 2000
    ("c", 0.0, False),    # 0: the door waits for the fleet to thrash, as for every session
    (DERIVED_SESSION_PREFIX + "c", 1.25, False),  # a derived identity: left to the reading
])
def test_sessions_the_client_names_pass_the_door_from_the_start(session: str, fill_unsaturated: float,
                                                               held: bool) -> None:
    """With the defaults' switches ("auto"), a first turn of a session the client names waits at
    the door before the fleet saturates, while a later turn of a served one goes at once; once a
    session goes idle the held one passes, the fleet never saturated."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_control="auto", flow_session_fill_unsaturated=fill_unsaturated,
                   flow_session_idle_s=5.0, flow_kv_fill=10.0)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    a = send(d, key(900, session="a"), workers)
    send(d, key(900, session="b"), workers)
    new = d.admit(key(900, session=session), workers)
    assert new.queued is held
    assert d.admit(key(950, session="b", text="turn 2"), workers).state is TicketState.GRANTED
    if held:
        d.finished(a, ok=True)
        clock.now += 6.0
        d.scraped(workers[0], 0, 0, 0.0)  # any wake re-checks: "a" has been idle for 6 s
        assert new.state is TicketState.GRANTED
    assert not d.saturated(MODEL)


def test_by_default_the_door_waits_for_thrashing_for_derived_ids() -> None:
    """A derived identity's first turn is not held before the fleet thrashes, past the KV too."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_kv_fill=10.0)
    workers = fleet(1, seqs=8, kv_tokens=1000)
    send(d, key(700, session=DERIVED_SESSION_PREFIX + "a"), workers)
    assert d.admit(key(700, session=DERIVED_SESSION_PREFIX + "b"), workers).state is TicketState.GRANTED


@pytest.mark.parametrize("flow_control", [False, True])
def test_sessions_are_remembered_only_for_session_admission(flow_control: bool) -> None:
    """With session admission off nothing reads the served sessions, so none may pile up: every
    conversation a router ever saw would otherwise stay in memory.  With "auto" (the default)
    they are kept, for when the fleet saturates (the book's sweep bounds them)."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_control=flow_control, flow_session_admission=False)
    ws = fleet(2, seqs=64)
    for i in range(50):
        flight = send(d, key(session=f"s{i}"), ws)
        clock.now += 1.0
        d.finished(flight, ok=True)
    assert all(not m.door.book for m in d.flow._models.values())
    for switch in (True, "auto"):
        d = dispatcher(clock, flow_control=True, flow_session_admission=switch)
        flight = send(d, key(session="kept"), ws)
        assert "kept" in d.flow._models[MODEL].door.book
