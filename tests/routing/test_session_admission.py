"""Session admission (routing/session_admission.py): what a served session counts in the working
set, what the door learns (the size sessions reach, the pauses between turns), and the door through
the dispatcher (order among held first turns, the bounded door wait).  Pure: an injected clock."""

from __future__ import annotations

from typing import Any

import pytest
from routing_helpers import Clock
from test_flow import MODEL, dispatcher, fleet, key, send

from kvroute.routing.config import ModelSettings
from kvroute.routing.flow import Ticket, TicketState
from kvroute.routing.flow_queue import ModelQueue
from kvroute.routing.key import DERIVED_SESSION_PREFIX, RoutingKey
from kvroute.routing.session_admission import KINDS, NAMED, RULES, SessionBook, SessionDoor
from kvroute.routing.worker import WorkerState


def turn(session: str, tokens: int, max_tokens: int = 0) -> RoutingKey:
    return RoutingKey(MODEL, session.encode(), session, tokens, max_tokens)


# --- the rules ----------------------------------------------------------------------------------

def test_unique_counts_a_shared_prefix_once_footprint_per_session() -> None:
    """Two sessions whose first prompts (1000 tokens) start with a 600-token prefix the fleet
    already held: 'unique' counts what each adds (400 + 100 output), 'footprint' the whole
    request."""
    for rule, expected in (("unique", 2 * 500), ("footprint", 2 * 1100)):
        book = SessionBook()
        for sid in ("a", "b"):
            book.sent(turn(sid, 1000, max_tokens=100), prefill_tokens=400, rule=rule)
        assert book.working_set(0.0, 15.0, rule) == expected


def test_a_session_grows_by_its_turns_less_the_shared_prefix() -> None:
    book = SessionBook()
    book.sent(turn("a", 1000), prefill_tokens=400, rule="unique")  # 600 shared
    book.finished("a", 1.0)
    book.sent(turn("a", 1500), prefill_tokens=500, rule="unique")  # its own turn cached
    assert book.working_set(1.0, 15.0, "unique") == 900


def test_sessions_count_at_the_size_the_last_ones_reached() -> None:
    """Once eight sessions were forgotten at 5000 tokens, a session at its first turn (1000)
    counts 5000, and so does a new one at the door: 2 x 5000 + 5000 > 12000."""
    book = SessionBook()
    for i in range(8):
        book.sent(turn(f"old{i}", 5000), prefill_tokens=5000, rule="unique")
        book.finished(f"old{i}", 0.0)
    assert book.working_set(100.0, 15.0, "unique") == 0  # all forgotten, their sizes kept
    book.sent(turn("a", 1000), prefill_tokens=1000, rule="unique")
    book.sent(turn("b", 1000), prefill_tokens=1000, rule="unique")
    assert book.working_set(100.0, 15.0, "unique") == 10_000
    assert not book.fits(turn("c", 1000), 1000, 12_000, 1.0, "unique", 100.0, 15.0)
    assert book.fits(turn("c", 1000), 1000, 15_000, 1.0, "unique", 100.0, 15.0)
    # the first version's rule learns nothing: 3 x 1000
    for sid in ("a", "b"):
        book.finished(sid, 100.0)
    assert book.working_set(200.0, 15.0, "unique") == 0
    book.sent(turn("a", 1000), prefill_tokens=1000, rule="footprint")
    book.sent(turn("b", 1000), prefill_tokens=1000, rule="footprint")
    assert book.fits(turn("c", 1000), 1000, 3000, 1.0, "footprint", 100.0, 15.0)


def test_a_quiet_session_is_forgotten_after_the_pauses_seen() -> None:
    """After sessions paused 1-2 s between turns, one quiet for 3.5 s (> 1.5 x 2 s) has most
    likely ended: it is forgotten, not kept for flow_session_idle_s (15 s); the first version's
    rule keeps it."""
    book = SessionBook()
    t = 0.0
    for i in range(8):
        sid = f"s{i}"
        book.sent(turn(sid, 100), 100, "unique")
        book.finished(sid, t)
        t += 1.0 + (i % 2)
        book.arrived(sid, t)
        book.sent(turn(sid, 200), 100, "unique")
        book.finished(sid, t)
    assert max(book.gaps) == 2.0
    assert book.idle_after(RULES["unique"], 15.0) == 3.0
    assert book.idle_after(RULES["footprint"], 15.0) == 15.0
    book.sent(turn("a", 100), 100, "unique")
    book.finished("a", t)
    assert "a" in book and book.working_set(t + 2.9, 15.0, "unique") > 0
    book.working_set(t + 3.5, 15.0, "unique")
    assert "a" not in book


def test_a_session_waiting_at_the_gate_is_not_forgotten() -> None:
    book = SessionBook()
    book.sent(turn("a", 100), 100, "unique")
    book.finished("a", 0.0)
    book.arrived("a", 1.0)
    book.queued("a", +1)
    book.working_set(100.0, 15.0, "unique")
    assert "a" in book
    book.queued("a", -1)
    book.working_set(100.0, 15.0, "unique")
    assert "a" not in book


def test_the_rule_setting_is_validated() -> None:
    with pytest.raises(ValueError, match="flow_session_rule"):
        ModelSettings(flow_session_rule="guess")
    with pytest.raises(ValueError):
        ModelSettings(flow_session_door_s=-1.0)


# --- the door through the dispatcher ------------------------------------------------------------

def test_held_first_turns_pass_the_door_oldest_first() -> None:
    """A fleet (2 x 1000 tokens of KV) full of served sessions holds two new sessions; when one
    session goes quiet and is forgotten, room for one: the older held session goes first, even
    though the younger one's prompt is shorter (the 'cache' order would pick it otherwise)."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_session_idle_s=5.0, flow_kv_fill=10.0)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    a = send(d, key(900, session="a"), workers)
    send(d, key(900, session="b"), workers)
    old = d.admit(key(800, session="old"), workers)
    clock.now += 1.0
    young = d.admit(key(400, session="young"), workers)
    assert old.queued and young.queued
    assert d.flow.session_counts(d.now()) == {MODEL: (2, 2)}  # admitted a and b; old and young at the door
    d.finished(a, ok=True)
    clock.now += 6.0
    d.scraped(workers[0], 0, 0, 0.0)  # "a" forgotten: 900 + 800 fits, then 900 + 800 + 400 not
    assert old.state is TicketState.GRANTED
    assert young.queued
    assert d.flow.session_counts(d.now())[MODEL][1] == 1  # young still waits


def test_a_held_first_turn_is_admitted_after_the_door_wait() -> None:
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_kv_fill=10.0, flow_session_door_s=4.0)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    send(d, key(900, session="a"), workers)
    send(d, key(900, session="b"), workers)
    new = d.admit(key(300, session="c"), workers)
    assert new.queued
    clock.now += 3.0
    d.scraped(workers[0], 0, 0, 0.0)
    assert new.queued
    clock.now += 1.0
    d.scraped(workers[0], 0, 0, 0.0)
    assert new.state is TicketState.GRANTED
    assert new.waited_s == 4.0


# --- found in review: the door's bookkeeping ----------------------------------------------------

def test_the_door_shuts_in_one_step_however_many_wait_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of new sessions held at a full door: one pass over the queue asks for its next
    request a bounded number of times (it used to hold them back one ``next`` scan each, a
    quadratic pass on every answer), and a continuing session's turn behind them still goes."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_kv_fill=10.0, flow_max_queued=1000)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    a = send(d, key(900, session="a"), workers)
    send(d, key(900, session="b"), workers)
    held = [d.admit(key(500, session=f"new{i}"), workers) for i in range(400)]
    assert all(t.queued for t in held)
    d.finished(a, ok=True)
    turn_a = d.admit(key(950, session="a"), workers)  # a's next turn: served, not at the door
    calls = 0
    original = ModelQueue.next

    def counting(self: ModelQueue, *args: Any) -> Ticket | None:
        nonlocal calls
        calls += 1
        return original(self, *args)

    monkeypatch.setattr(ModelQueue, "next", counting)
    d.flow.pump(clock.now)
    assert calls <= 3
    assert turn_a.state is TicketState.GRANTED and all(t.queued for t in held)


def test_the_door_lets_in_only_a_request_a_replica_can_start() -> None:
    """The door's oldest takes the place of the request the order picked only if a replica is
    admissible for it: an 8k first turn on a 10k replica with 5k in flight waits, and so does
    the younger 500-token one behind it (none passes another at the door)."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0)
    workers = fleet(1, seqs=8, kv_tokens=10_000)
    running = send(d, key(5000), workers)  # no session: not in the working set
    big = d.admit(key(8000, session="big"), workers)
    small = d.admit(key(500, session="small"), workers)
    assert big.queued and small.queued
    d.scraped(workers[0], 1, 0, 0.5)
    assert big.queued and small.queued
    d.finished(running, ok=True)
    assert big.state is TicketState.GRANTED


def test_sessions_let_in_count_until_they_are_sent_across_passes() -> None:
    """Two new sessions of 5k wait for a 15k fleet that serves 8k: the first answer lets one in;
    a second pass before its edge sends it must count it (8 + 5 + 5 > 15) and hold the other."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0, flow_kv_fill=10.0)
    workers = fleet(1, seqs=2, kv_tokens=15_000)
    a = send(d, key(4000, session="a"), workers)
    b = send(d, key(4000, session="b"), workers)
    first = d.admit(key(5000, session="c"), workers)
    second = d.admit(key(5000, session="d"), workers)
    assert first.queued and second.queued
    d.finished(a, ok=True)
    assert first.state is TicketState.GRANTED and first.door_tokens > 0  # not claimed yet
    d.finished(b, ok=True)  # another pass while c is still on its way
    assert second.queued
    d.claim(first)
    assert d.flow._models[MODEL].door.opened == {}


def test_the_session_book_stays_bounded_where_the_door_is_never_asked() -> None:
    """KV sizes unknown: the door always opens and never sweeps; finished requests bound the book
    instead, and the admitted count on /metrics counts only the sessions not idle."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_session_idle_s=5.0)
    workers = fleet(4, seqs=8)
    for i in range(5000):
        flight = send(d, key(100, session=f"s{i}"), workers)
        d.finished(flight, ok=True)
        clock.now += 1.0
    assert len(d.flow._models[MODEL].door.book) <= 2048
    assert d.flow.session_counts(d.now())[MODEL] == (5, 0)  # the last 5 s


def test_a_request_granted_as_it_arrives_adds_no_wait_sample() -> None:
    """A request that joins a queue held at the door and is granted by the same pass did not
    wait: it is counted once, as admitted at once (no 'after_wait' count taken back), its 0 s does
    not pull the aging threshold down, and its edge routes it with no callback and no
    reservation left to claim."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0, flow_kv_fill=10.0)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    a = send(d, key(900, session="a"), workers)
    send(d, key(900, session="b"), workers)
    assert d.admit(key(500, session="new"), workers).queued
    d.finished(a, ok=True)
    told: list[Ticket] = []
    turn_a = d.admit(key(950, session="a"), workers, told.append)
    assert turn_a.state is TicketState.GRANTED and not turn_a.holds and not told
    assert list(d.flow._models[MODEL].queue.waits) == []
    assert d.flow._models[MODEL].queue.reserved == 0
    assert d.flow.admitted == {(MODEL, "at_once", "normal"): 1}  # a and b were sent past the gate


# --- the door on its own ------------------------------------------------------------------------

def door_ticket(session: str | None, tokens: int = 1000, *, resident: bool = False, arrived: float = 0.0,
                priority: int = 0, seq: int = 0) -> Ticket:
    k = RoutingKey(MODEL, b"x", session, tokens, 0, priority=priority)
    return Ticket(k, arrived, TicketState.QUEUED, prefill_tokens=tokens, resident=resident, seq=seq)


def served_door(*sessions: str, worker: str = "w0") -> SessionDoor:
    door = SessionDoor()
    for sid in sessions:
        door.book.sent(turn(sid, 1000), prefill_tokens=1000, rule="unique", worker=worker)
    return door


@pytest.mark.parametrize("session, resident, on, new, held", [
    ("new", False, KINDS, True, True),
    ("new", True, KINDS, True, False),     # its prefix is resident: not held
    ("new", False, (), False, False),      # the door is off
    ("new", False, NAMED, True, True),     # on for the sessions the client names
    (DERIVED_SESSION_PREFIX + "new", False, NAMED, False, False),  # ... not a derived identity
    ("served", False, KINDS, False, False),
    (None, False, KINDS, False, False),    # no session: nothing to admit
])
def test_what_the_door_holds(session: str | None, resident: bool, on: tuple[bool, ...], new: bool,
                             held: bool) -> None:
    door = served_door("served")
    t = door_ticket(session, resident=resident)
    assert door.is_new(t.key, on) is new
    assert door.holds(t, on) is held


def test_the_door_line_is_highest_class_then_oldest_and_counts_sessions() -> None:
    door = served_door("served")
    tickets = [door_ticket("b", arrived=2.0, seq=1), door_ticket("a", arrived=1.0, seq=2),
               door_ticket("c", arrived=3.0, priority=1, seq=3), door_ticket("served", seq=4),
               door_ticket("a", arrived=4.0, seq=5)]
    assert [t.seq for t in door.line(tickets, KINDS)] == [3, 2, 1, 5]
    assert door.waiting(tickets, KINDS) == 3
    assert not door.line(tickets, ()) and door.waiting(tickets, ()) == 0


def kv_fleet(*kv: int | None) -> list[WorkerState]:
    return [WorkerState(f"w{i}", "u", frozenset({MODEL}), kv_tokens=k) for i, k in enumerate(kv)]


@pytest.mark.parametrize("session, workers, now, door_s, opened, expected, seat", [
    # the fleet serves one session of 1000 tokens on w0; the new one needs 1000
    ("new", kv_fleet(1000, 1000), 0.0, 0.0, 0, True, "w1"),     # one kind served: always a seat
    ("new", kv_fleet(1000, 999), 0.0, 0.0, 0, True, "w1"),      # past the fleet's, w1 keeps none
    ("new", kv_fleet(1999), 0.0, 0.0, 0, False, None),          # one replica, no room on it
    ("new", kv_fleet(1000, 1000), 0.0, 0.0, 1, False, None),    # one let in, not sent, counts
    ("new", kv_fleet(1000, None), 0.0, 0.0, 0, True, None),     # a KV size unknown: it opens
    ("new", kv_fleet(1999), 15.0, 15.0, 0, True, None),         # held the bounded wait
    ("new", kv_fleet(1999), 14.0, 15.0, 0, False, None),
    ("served", kv_fleet(10), 0.0, 0.0, 0, True, None),          # a served session always fits
])
def test_the_door_fits(session: str, workers: list[WorkerState], now: float, door_s: float, opened: int,
                       expected: bool, seat: str | None) -> None:
    door = served_door("served")
    if opened:
        door.opened[("", True)] = opened  # let in by the fleet's test: no seat
    t = door_ticket(session)
    assert door.fits(t, workers, now, KINDS, fill=1.0, rule="unique", idle_s=60.0,
                     door_s=door_s) is expected
    assert t.seat == seat


def test_a_session_let_in_counts_as_opened_until_claimed() -> None:
    door = served_door("served")
    t = door_ticket("new", 800)
    door.let_in(t, "unique", 0.0)
    assert t.door_tokens == 800 and door.opened == {("", True): 800}
    door.claimed(t)
    assert t.door_tokens == 0 and door.opened == {}
