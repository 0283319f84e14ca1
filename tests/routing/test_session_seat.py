"""A seat on a replica (routing/session_admission.py, routing/dispatch.py): where the fleet's working
set is past its KV, a new session still passes the door where one replica has room for it beside
the sessions it serves, and its first turn goes to that replica.  Pure: an injected clock."""

from __future__ import annotations

import pytest
from routing_helpers import Clock
from test_flow import MODEL, dispatcher, fleet, key, send

from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.flow import Ticket, TicketState
from kvroute.routing.key import DERIVED_SESSION_PREFIX, RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.session_admission import KINDS, RULES, SessionBook, SessionDoor
from kvroute.routing.worker import WorkerState

RULE = "unique"


def turn(session: str, tokens: int) -> RoutingKey:
    return RoutingKey(MODEL, session.encode(), session, tokens)


def placed_book(placed: dict[str, list[int]], derived: dict[str, list[int]] | None = None) -> SessionBook:
    """A book serving sessions of the sizes given on each replica (client-named ones, and those
    of identities the router derived)."""
    book = SessionBook()
    for kind_sessions, prefix in ((placed, ""), (derived or {}, DERIVED_SESSION_PREFIX)):
        for worker, sizes in kind_sessions.items():
            for i, size in enumerate(sizes):
                book.sent(turn(f"{prefix}{worker}-{i}", size), size, RULE, worker)
    return book


REPLICAS = [("w0", 1000), ("w1", 1000)]


@pytest.mark.parametrize("placed, derived, new, need, opened, expected", [
    ({"w0": [900]}, None, "new", 300, {}, "w1"),                     # the replica with room
    ({"w0": [600], "w1": [700]}, None, "new", 300, {}, "w0"),        # the most room left
    ({"w0": [800], "w1": [800]}, None, "new", 300, {}, None),        # room in the sum, on neither
    ({"w0": [900], "w1": [200]}, None, "new", 1200, {}, None),       # too big beside w1's one
    ({"w0": [900]}, None, "new", 1200, {}, "w1"),                    # ... a replica keeping none takes it
    ({"w0": [900]}, None, "new", 300, {"w1": 800}, None),            # let in for w1, not sent yet
    ({"w0": [500]}, None, "new", 300, {"w1": 600}, "w0"),            # ... w0 has more room left
    # two kinds served: a seat never takes the other kind's fair part (1000 of the fleet's 2000)
    ({"w0": [900]}, {"w1": [100]}, "new", 300, {}, None),
    ({"w0": [600]}, {"w1": [100]}, "new", 300, {}, "w1"),
    ({"w0": [900]}, {"w1": [100]}, DERIVED_SESSION_PREFIX + "new", 300, {}, "w1"),
])
def test_the_seat(placed: dict[str, list[int]], derived: dict[str, list[int]] | None, new: str,
                  need: int, opened: dict[str, int], expected: str | None) -> None:
    book = placed_book(placed, derived)
    own = sum(opened.values())
    seat = book.seat(turn(new, need), need, REPLICAS, 1.0, RULE, 0.0, 60.0,
                     lambda worker: opened.get(worker, 0), own)
    assert seat == expected


def test_a_session_counts_on_the_replica_its_last_request_went_to() -> None:
    """A session sent elsewhere moves with its last request; one forgotten counts nowhere."""
    book = SessionBook()
    book.sent(turn("a", 400), 400, RULE, "w0")
    assert (book.placed("w0", 0.0, 5.0, RULE), book.placed("w1", 0.0, 5.0, RULE)) == (400, 0)
    book.sent(turn("a", 600), 600, RULE, "w1")
    assert (book.placed("w0", 0.0, 5.0, RULE), book.placed("w1", 0.0, 5.0, RULE)) == (0, 600)
    book.sent(turn("a", 600), 600, RULE, "w0")  # the same size, moved back
    assert (book.placed("w0", 0.0, 5.0, RULE), book.placed("w1", 0.0, 5.0, RULE)) == (600, 0)
    book.finished("a", 0.0)
    book.finished("a", 0.0)
    book.finished("a", 0.0)
    assert book.placed("w1", 10.0, 5.0, RULE) == 0 and "a" not in book


def uneven(clock: Clock) -> tuple[Dispatcher, list[WorkerState]]:
    """2 x 1000 tokens of KV: w0 keeps quiet session a (1500 tokens: past its cache), w1 serves b
    (200, in flight).  A new session of 700 is past the fleet's 2000 (1500 + 200 + 700) but fits
    on w1 beside b; least-loaded would send it to idle w0, where it evicts a."""
    # No slow start: these are the seat's tests once sizes are learnt (a cold book counts b at
    # the median served, a's 1500; test_a_cold_seat_... below).
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_kv_fill=10.0, flow_session_slow_start=0)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    a = send(d, key(1500, session="a"), workers)
    assert a.state.id == "w0"
    assert send(d, key(200, session="b"), workers).state.id == "w1"
    d.finished(a, ok=True)
    return d, workers


def test_a_new_session_passes_onto_the_replica_with_room_and_goes_there() -> None:
    clock = Clock(1000.0)
    d, workers = uneven(clock)
    c = key(700, session="c")
    assert d.admit(c, workers).state is TicketState.GRANTED
    assert d.route(c, workers).worker_id == "w1"
    assert d.route(c, workers).worker_id == "w0"  # the seat is taken once


def test_the_decision_line_says_the_first_turn_was_seated() -> None:
    """Its reason (the decision line, /admin's and the dashboard's recent decisions) names the
    seat; a routing that did not go by a seat says nothing of it."""
    clock = Clock(1000.0)
    d, workers = uneven(clock)
    c = key(700, session="c")
    assert d.admit(c, workers).state is TicketState.GRANTED
    reason = d.route(c, workers).reason
    assert reason.endswith("; seated on w1 by session admission (room beside its sessions)")
    assert "seated" not in d.route(c, workers).reason


def test_a_seat_not_ready_is_not_waited_for() -> None:
    clock = Clock(1000.0)
    d, workers = uneven(clock)
    c = key(700, session="c")
    assert d.admit(c, workers).state is TicketState.GRANTED
    workers[1].healthy = False
    assert d.route(c, workers).worker_id == "w0"


def test_a_new_session_with_no_replica_room_waits() -> None:
    """The same fleet, a new session of 900: w1 has 800 left beside b, w0 none."""
    clock = Clock(1000.0)
    d, workers = uneven(clock)
    assert d.admit(key(900, session="c"), workers).queued


@pytest.mark.parametrize("shared", [True, False])
def test_a_session_another_instance_bound_is_no_new_session_here(shared: bool) -> None:
    """Two router instances sharing their session table (Redis): a session instance A placed on
    w0 is a later turn at instance B's door, which never saw it, and goes to w0 — not to the seat
    B would give a new session (w1, room beside b).  Without the shared binding it is new at B."""
    clock = Clock(1000.0)
    workers_b = fleet(2, seqs=8, kv_tokens=1000)
    settings = {"policy": "session", "flow_control": True, "flow_session_admission": True,
                "flow_session_fill_unsaturated": 0.0, "flow_kv_fill": 10.0,
                "flow_session_slow_start": 0}  # sizes as if learnt, as in ``uneven``
    a = Dispatcher(Scheduler(RoutingConfig(default=ModelSettings(**settings)), clock=clock), timer=clock)
    b = Dispatcher(Scheduler(RoutingConfig(default=ModelSettings(**settings)), clock=clock), timer=clock)
    quiet = send(b, key(1500, session="a"), workers_b)  # instance B's own sessions: w0 past its
    assert quiet.state.id == "w0"                       # cache, w1 with room for 700 beside b
    assert send(b, key(200, session="b"), workers_b).state.id == "w1"
    b.finished(quiet, ok=True)
    first = key(700, session="c")
    decision = a.route(first, fleet(2, seqs=8, kv_tokens=1000))
    assert decision.worker_id == "w0"
    if shared:
        for record in a.scheduler.commit(first, decision):
            b.scheduler.apply_remote(record)
    later = key(700, session="c")
    assert b.admit(later, workers_b).state is TicketState.GRANTED
    routed = b.route(later, workers_b)
    assert (routed.worker_id, "seated" in routed.reason) == (("w0", False) if shared else ("w1", True))


def lived_book(placed: dict[str, list[int]], left: list[int],
               derived: dict[str, list[int]] | None = None) -> SessionBook:
    """``placed_book``, after 8 client-named sessions left that each counted ``left`` at its
    requests in turn (their largest is ``expected``, their mean ``lived``)."""
    book = SessionBook()
    for i in range(8):
        for size in left:
            book.sent(turn(f"gone-{i}", size), size, RULE, "w0")
            book.finished(f"gone-{i}", 0.0)
    book.forget_idle(100.0, 1.0, RULE)
    assert not book.sessions
    for kind_sessions, prefix in ((placed, ""), (derived or {}, DERIVED_SESSION_PREFIX)):
        for worker, sizes in kind_sessions.items():
            for i, size in enumerate(sizes):
                book.sent(turn(f"{prefix}{worker}-{i}", size), size, RULE, worker)
    return book


@pytest.mark.parametrize("left, placed, need, expected", [
    # sessions that left grew 600 -> 1000 (mean 800): a replica of 3500 seats four at 800 each
    ([600, 800, 1000], {"w0": [700, 700, 700], "w1": [700] * 4}, 600, "w0"),  # 3 x 800 + 800
    ([600, 800, 1000], {"w0": [700] * 4, "w1": [700] * 4}, 600, None),        # 5 x 800 > 3500
    ([600, 800, 1000], {"w0": [1000] * 3, "w1": [700] * 4}, 600, None),       # at their size above it
    ([1000], {"w0": [700, 700, 700], "w1": [700] * 4}, 600, None),            # never grew: 4 x 1000
])
def test_the_seat_counts_sessions_at_their_size_over_their_life(
        left: list[int], placed: dict[str, list[int]], need: int, expected: str | None) -> None:
    """A replica's sessions are at different turns, so each counts at least the mean size of the
    sessions that left (``lived``), not their largest (``expected``)."""
    book = lived_book(placed, left)
    assert book.expected(RULES[RULE]) == max(left)
    seat = book.seat(turn("new", need), need, [("w0", 3500), ("w1", 3500)], 1.0, RULE, 100.0, 60.0)
    assert seat == expected


@pytest.mark.parametrize("placed, derived, need, fits, seat", [
    ({"w0": [900], "w1": [900]}, None, 150, False, None),   # the fleet's sum has room, no replica has
    ({"w0": [500], "w1": [900]}, None, 300, True, "w0"),    # one kind: let in on a seat only
    ({}, None, 300, True, "w0"),                            # nothing served
    # two kinds: its fair part of the fleet (1000 of 2000) lets it in, seated or not
    ({"w0": [600]}, {"w1": [100]}, 300, True, None),
])
def test_where_one_kind_is_served_a_new_session_passes_on_a_seat_only(
        placed: dict[str, list[int]], derived: dict[str, list[int]] | None, need: int, fits: bool,
        seat: str | None) -> None:
    door = SessionDoor(book=placed_book(placed, derived))
    k = RoutingKey(MODEL, b"x", "new", need)
    t = Ticket(k, 0.0, TicketState.QUEUED, prefill_tokens=need)
    workers = [WorkerState(f"w{i}", "u", frozenset({MODEL}), kv_tokens=1000) for i in range(2)]
    assert door.fits(t, workers, 0.0, KINDS, fill=1.0, rule=RULE, idle_s=60.0, door_s=0.0) is fits
    assert t.seat == seat


@pytest.mark.parametrize("derived, expected", [
    (None, "w0"),              # one kind: w0 seats a fourth at 800 each (3,200 of 3,500)
    ({"w2": [29000]}, "w2"),   # both kinds: at their largest w0 has no room, w2 has just enough
])
def test_while_both_kinds_are_served_the_seat_counts_sessions_at_their_largest(
        derived: dict[str, list[int]] | None, expected: str) -> None:
    book = lived_book({"w0": [700] * 3, "w1": [700] * 4}, [600, 800, 1000], derived)
    if derived is None:
        book.sent(turn("w2-0", 29000), 29000, RULE, "w2")
    seat = book.seat(turn("new", 600), 600, [("w0", 3500), ("w1", 3500), ("w2", 30000)], 1.0, RULE,
                     100.0, 60.0)
    assert seat == expected


@pytest.mark.parametrize("derived, left, left_at, now, alone", [
    (False, 0, None, 100.0, True),    # only client-named sessions ever
    (True, 0, None, 100.0, False),    # a derived identity in the book
    (False, 4, 50.0, 100.0, False),   # four left 50 s ago: their kind is still served (questions pause)
    (False, 4, 30.0, 100.0, True),    # ... 70 s ago: no longer
    (False, 3, 50.0, 100.0, True),    # three strays left (fewer than _KIND_MIN): no kind pausing
])
def test_a_kind_that_just_left_is_still_served(derived: bool, left: int, left_at: float | None,
                                               now: float, alone: bool) -> None:
    """Where questions pause, a fleet that served them does not seat its agents as if alone."""
    book = placed_book({"w0": [700]})
    others = [f"{DERIVED_SESSION_PREFIX}q{i}" for i in range(max(left, int(derived)))]
    for other in others:
        book.sent(turn(other, 300), 300, RULE, "w1")
    if left_at is not None:
        for other in others:
            book.finished(other, left_at - 2.0)
        book.forget_idle(left_at, 1.0, RULE)
        assert not any(other in book for other in others)
    assert book.alone(True, now) is alone


def cold_book(placed: dict[str, list[tuple[int, int]]]) -> SessionBook:
    """A book no session has left yet (a cold start), serving on each replica sessions of (size,
    requests sent): those sent once are fresh, not yet seen past their first request."""
    book = SessionBook()
    for worker, sessions in placed.items():
        for i, (size, sends) in enumerate(sessions):
            for _ in range(sends):
                book.sent(turn(f"{worker}-{i}", size), size, RULE, worker)
    return book


@pytest.mark.parametrize("placed, opened, window, expected", [
    # w0 has more room, but three fresh sessions fill its window of 3
    ({"w0": [(100, 1)] * 3, "w1": [(700, 2)]}, {}, 3, "w1"),
    ({"w0": [(100, 1)] * 2, "w1": [(700, 2)]}, {}, 3, "w0"),       # two fresh: room in the window
    ({"w0": [(100, 1)] * 2, "w1": [(700, 2)]}, {"w0": 100}, 3, "w1"),  # ... one let in, not sent
    # past the window, as many fresh as sessions seen past their first request
    ({"w0": [(100, 2)] * 3 + [(100, 1)] * 3, "w1": [(950, 2)]}, {}, 3, None),
    ({"w0": [(100, 2)] * 4 + [(100, 1)] * 3, "w1": [(950, 2)]}, {}, 3, "w0"),
    ({"w0": [(100, 1)] * 3, "w1": [(700, 2)]}, {}, 0, "w0"),       # slow start off
    # each counts at least the median served (the sessions at every turn of their lives):
    # w0's two of 100 count 450 each, 2 x 450 + 450 > 1000; without slow start w0 has room
    ({"w0": [(100, 2)] * 2, "w1": [(450, 2)] * 3}, {}, 3, None),
    ({"w0": [(100, 2)] * 2, "w1": [(450, 2)] * 3}, {}, 0, "w0"),
])
def test_a_cold_seat_takes_new_sessions_as_fast_as_it_sees_them_grow(
        placed: dict[str, list[tuple[int, int]]], opened: dict[str, int], window: int,
        expected: str | None) -> None:
    """Slow start (``flow_session_slow_start``): until sessions have left, first turns all look
    small, and a replica seated by their size outgrows its cache a few turns later."""
    book = cold_book(placed)
    assert book.learning(True)
    seat = book.seat(turn("new", 100), 100, REPLICAS, 1.0, RULE, 0.0, 60.0,
                     lambda worker: opened.get(worker, 0), sum(opened.values()), slow_start=window)
    assert seat == expected


def test_a_learnt_book_seats_without_slow_start() -> None:
    """Once sessions have left, the seat counts them at their size over their life (``lived``)
    and the window no longer applies."""
    book = lived_book({"w0": [700] * 4}, [600, 800, 1000])  # w0: 4 x 800 + 800 > 3500
    assert not book.learning(True)
    for i in range(3):
        book.sent(turn(f"w1-{i}", 100), 100, RULE, "w1")  # three fresh on w1: 3 x 800 + 800
    seat = book.seat(turn("new", 100), 100, [("w0", 3500), ("w1", 3500)], 1.0, RULE, 100.0, 60.0,
                     slow_start=3)
    assert seat == "w1"


def test_a_session_is_fresh_until_its_second_request() -> None:
    """Fresh: sent its first request only.  A later request, or leaving, ends it; a session back
    after the book forgot it while quiet has grown already and is not fresh again."""
    book = SessionBook()
    book.sent(turn("a", 400), 400, RULE, "w0")
    book.sent(turn("b", 400), 400, RULE, "w0")
    assert (book.fresh_on("w0", True), book.count_on("w0", True)) == (2, 2)
    book.sent(turn("a", 600), 600, RULE, "w1")  # its second request, elsewhere
    assert (book.fresh_on("w0", True), book.fresh_on("w1", True)) == (1, 0)
    book.finished("a", 0.0)
    book.finished("a", 0.0)
    book.finished("b", 0.0)
    book.forget_idle(100.0, 1.0, RULE)
    assert (book.fresh_on("w0", True), book.departed[True]) == (0, 2)
    book.sent(turn("a", 800), 800, RULE, "w1")  # back after it was forgotten
    assert book.fresh_on("w1", True) == 0
    assert book.typical(True) == 800


def test_the_window_is_a_count() -> None:
    with pytest.raises(ValueError, match="flow_session_slow_start"):
        ModelSettings(flow_session_slow_start=-1)
    assert ModelSettings().flow_session_slow_start == 3


def paused_book(on: list[tuple[int, float | None]], left: list[tuple[str, int, float]]) -> SessionBook:
    """A book whose sessions on w0 are ``on`` (size, when its last answer ended; None: in flight)
    and whose sessions in ``left`` (replica, size, when) left it: each one's client started
    another session then."""
    book = SessionBook()
    for i, (worker, size, at) in enumerate(left):
        sid, client = f"left-{i}", f"client-{i}"
        book.arrived(sid, 0.0, client)
        book.sent(turn(sid, size), size, RULE, worker)
        book.finished(sid, 0.5)
        book.arrived(f"next-{i}", at, client)
        assert sid not in book
    for i, (size, ended) in enumerate(on):
        book.sent(turn(f"on-{i}", size), size, RULE, "w0")
        if ended is not None:
            book.finished(f"on-{i}", ended)
    return book


@pytest.mark.parametrize("on, left, need, evicts", [
    ([(300, None), (300, None)], [], 500, False),                # nothing paused on w0
    ([(300, 2.0)], [], 700, False),                               # 700 ahead of its history
    ([(300, 2.0)], [], 701, True),                                # ... one token more reaches it
    ([(300, 2.0), (500, None)], [], 300, True),                   # the replica's cache is full
    ([(300, 2.0)], [("w0", 400, 3.0)], 300, False),               # what left since lies behind it
    ([(300, 2.0)], [("w0", 400, 3.0)], 301, True),
    ([(300, 2.0)], [("w0", 400, 1.0)], 700, False),               # what left before lies ahead
    ([(300, 2.0)], [("w1", 400, 3.0)], 700, False),               # another replica's
    ([(300, 4.0), (300, 2.0)], [("w0", 300, 3.0)], 101, True),    # the oldest paused one counts
])
def test_a_first_prefill_evicts_a_paused_history(on: list[tuple[int, float | None]],
                                                 left: list[tuple[str, int, float]], need: int,
                                                 evicts: bool) -> None:
    """An engine's cache is an LRU: a new prefill takes the content freed longest ago, so it evicts
    the history of a session paused before the last one left, not the history that one left."""
    assert paused_book(on, left).evicts("w0", 1000, need) is evicts


def test_where_one_kind_is_served_the_seat_waits_for_a_paused_history() -> None:
    """w0 has the most room by its count, but a new session's prefill there would evict the
    history of paused session on-0: the seat waits (w1, with room too, is not taken instead);
    once on-0's next turn is sent, w0 takes it."""
    book = paused_book([(300, 2.0), (300, None)], [("w0", 400, 3.0), ("w0", 300, 3.0)])
    replicas = [("w0", 1000), ("w1", 1000)]
    book.sent(turn("w1-0", 600), 600, RULE, "w1")
    assert book.seat(turn("new", 300), 300, replicas, 1.0, RULE, 5.0, 60.0) is None
    book.sent(turn("on-0", 300), 300, RULE, "w0")
    assert book.seat(turn("new", 300), 300, replicas, 1.0, RULE, 5.0, 60.0) == "w0"


@pytest.mark.parametrize("derived, expected", [
    (False, None),   # one kind: w0, with the most room, would evict paused on-0's history
    (True, "w0"),    # both kinds: the seat as before
])
def test_while_both_kinds_are_served_the_seat_does_not_wait_for_a_paused_history(
        derived: bool, expected: str | None) -> None:
    book = paused_book([(300, 2.0)], [("w0", 400, 3.0)])
    w1 = DERIVED_SESSION_PREFIX + "w1-0" if derived else "w1-0"
    book.sent(turn(w1, 600), 600, RULE, "w1")
    assert book.evicts("w0", 1000, 301)
    assert book.seat(turn("new", 301), 301, [("w0", 1000), ("w1", 1000)], 1.0, RULE, 5.0,
                     60.0) == expected
