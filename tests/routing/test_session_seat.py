"""A seat on a replica (routing/session_admission.py, routing/dispatch.py): where the fleet's working
set is past its KV, a new session still passes the door where one replica has room for it beside
the sessions it serves, and its first turn goes to that replica.  Pure: an injected clock."""

from __future__ import annotations

import pytest
from routing_helpers import Clock
from test_flow import MODEL, dispatcher, fleet, key, send

from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.flow import TicketState
from kvroute.routing.key import DERIVED_SESSION_PREFIX, RoutingKey
from kvroute.routing.session_admission import SessionBook
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
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_kv_fill=10.0)
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
