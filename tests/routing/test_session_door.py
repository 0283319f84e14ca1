"""Session admission that engages itself (routing/session_admission.py, routing/flow.py): a session
forgotten after its own pauses, a later turn never held at the door, a client's new conversation
freeing its old one, a first turn shed early when its predicted wait at the door passes the queue
TTL, and a shed first turn keeping its place when it comes back.  Pure: an injected clock."""

from __future__ import annotations

import dataclasses
import random

import pytest
from routing_helpers import Clock
from test_flow import MODEL, dispatcher, fleet, key, send

from kvroute.routing import session_admission
from kvroute.routing.dispatch import Dispatcher, InFlight
from kvroute.routing.flow import ShedReason, Ticket, TicketState
from kvroute.routing.key import DERIVED_SESSION_PREFIX, RoutingKey
from kvroute.routing.session_admission import KINDS, SessionBook, SessionDoor
from kvroute.routing.worker import WorkerState


def turn(session: str, tokens: int = 100, client: str | None = None) -> RoutingKey:
    return RoutingKey(MODEL, session.encode(), session, tokens, client=client)


def go(d: Dispatcher, k: RoutingKey, workers: list[WorkerState]) -> InFlight:
    """``k`` arrives, passes the gate at once and is sent."""
    assert d.admit(k, workers).state is TicketState.GRANTED
    return send(d, k, workers)


def of(k: RoutingKey, client: str) -> RoutingKey:
    return dataclasses.replace(k, client=client)


# --- a session's own pauses ---------------------------------------------------------------------

@pytest.mark.parametrize("pauses, others, rule, quiet_for, kept", [
    ((0.5, 0.5, 0.5), 0, "unique", 1.4, True),     # 3 x 0.5 s: kept 1.5 s
    ((0.5, 0.5, 0.5), 0, "unique", 1.6, False),    # ... not the fleet's 15 s (too few samples)
    ((0.5, 0.5), 0, "unique", 1.6, True),          # two pauses are not trusted yet
    ((2.0, 1.0, 1.0), 0, "unique", 5.9, True),     # 3 x its longest, 2 s
    ((2.0, 1.0, 1.0), 0, "unique", 6.1, False),
    ((0.1, 0.1, 0.1), 0, "unique", 0.9, True),     # never less than 1 s
    ((2.0, 1.0, 1.0), 8, "unique", 3.1, False),    # bounded by the fleet's: 1.5 x 2 s
    ((0.5, 0.5, 0.5), 0, "footprint", 1.6, True),  # the first version's rule learns nothing
])
def test_a_quiet_session_is_forgotten_after_its_own_pauses(pauses: tuple[float, ...], others: int,
                                                           rule: str, quiet_for: float,
                                                           kept: bool) -> None:
    book = SessionBook()
    for i in range(others):  # other sessions pausing 2 s: the fleet keeps a quiet one 3 s
        book.sent(turn(f"o{i}"), 100, rule)
        book.finished(f"o{i}", 0.0)
        book.arrived(f"o{i}", 2.0)
        book.sent(turn(f"o{i}"), 100, rule)
    t = 0.0
    book.sent(turn("a"), 100, rule)
    for pause in pauses:
        book.finished("a", t)
        t += pause
        book.arrived("a", t)
        book.sent(turn("a"), 100, rule)
    book.finished("a", t)
    assert book.live(t + quiet_for, 15.0, rule) == others + kept
    book.working_set(t + quiet_for, 15.0, rule)
    assert ("a" in book) is kept


# --- later turns --------------------------------------------------------------------------------

def full_door(clock: Clock, **policy: object) -> tuple[Dispatcher, list[WorkerState]]:
    """A fleet of 2 x 1000 KV tokens whose served sessions b and c (900 each) leave room for no
    new session of 300, after session a was served and forgotten while quiet."""
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_kv_fill=10.0, **policy)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    d.finished(go(d, key(900, session="a"), workers), ok=True)
    clock.now += 20.0  # past flow_session_idle_s: a is forgotten
    go(d, key(900, session="b"), workers)
    go(d, key(900, session="c"), workers)
    assert "a" not in d.flow._models[MODEL].door.book
    return d, workers


def test_a_later_turn_of_an_admitted_session_is_never_held_at_the_door() -> None:
    clock = Clock(1000.0)
    d, workers = full_door(clock)
    new = d.admit(key(300, session="new"), workers)
    assert new.queued and d.flow.at_door(new)
    later = d.admit(key(950, session="a"), workers)  # a's next turn, after the book forgot a
    assert later.state is TicketState.GRANTED


def test_a_derived_identity_asked_again_is_a_new_session_and_a_longer_prompt_its_later_turn() -> None:
    """A question under a shared system prompt derives the same identity each time it is asked: the
    same prompt again is not a later turn (it waits at the door as a new session would), a longer
    one is; a session the client names passes with any prompt."""
    book = SessionBook()
    derived = f"{DERIVED_SESSION_PREFIX}q"
    for sid in (derived, "named"):
        book.sent(turn(sid, 6000), 6000, "unique")
        book.finished(sid, 0.0)
    book.working_set(100.0, 15.0, "unique")  # both forgotten, both still seen
    assert derived not in book and "named" not in book
    assert book.is_new(derived, 6000)
    assert not book.is_new(derived, 6400)
    assert not book.is_new("named", 6000)
    book.sent(turn(derived, 6000), 6000, "unique")  # asked again: served again, its first prompt kept
    assert not book.is_new(derived, 6000)  # in the book: its repeat counts there already
    assert book.seen[derived] == 6000


# --- two kinds at the door ----------------------------------------------------------------------

def test_each_kind_may_fill_its_fair_part_of_the_cache() -> None:
    """Client-named sessions hold 9,000 of a 10,000-token cache: the first derived identity may
    still take up to half of it (its kind's part, with two kinds served), a named one may not
    (its kind is past its half and the whole cache has no room)."""
    book = SessionBook()
    book.sent(turn("agent", 9000), 9000, "unique")
    p = DERIVED_SESSION_PREFIX

    def fits(sid: str, tokens: int, opened: int = 0, opened_own: int = 0) -> bool:
        return book.fits(turn(sid, tokens), tokens, 10_000, 1.0, "unique", 0.0, 15.0, opened, opened_own)

    assert fits(f"{p}q", 5000) and not fits(f"{p}q", 5001)
    assert not fits("agent2", 1001) and fits("agent2", 1000)  # the whole cache's room
    book.sent(turn(f"{p}q", 4000), 4000, "unique")
    assert fits(f"{p}r", 1000) and not fits(f"{p}r", 1001)
    assert not fits(f"{p}r", 1000, opened=1, opened_own=1)  # one of its kind let in, not sent
    assert fits(f"{p}r", 1000, opened=1, opened_own=0)  # ... of the other kind: its part is its own
    assert not fits("agent2", 100)  # 13,100 > 10,000, and 9,100 > its half
    assert book.working_set(0.0, 15.0, "unique", of=False) == 4000
    assert book.working_set(0.0, 15.0, "unique", of=True) == 9000


def test_a_kind_does_not_take_the_part_the_other_leaves_unused() -> None:
    """Client-named sessions hold 3,000 and one-shot questions 1,000 of a 10,000-token cache: a new
    named session of 2,000 fits its kind's half, one of 2,001 waits although the whole cache has
    room for it (the questions' shared prompt, resident once, counts in none of their sessions:
    their part is kept for them); so does a derived identity past its own half.  A kind served
    alone may fill the whole cache."""
    book = SessionBook()
    p = DERIVED_SESSION_PREFIX

    def fits(sid: str, tokens: int) -> bool:
        return book.fits(turn(sid, tokens), tokens, 10_000, 1.0, "unique", 0.0, 15.0)

    book.sent(turn("agent", 3000), 3000, "unique")
    assert fits("agent2", 7000) and not fits("agent2", 7001)  # one kind: the whole cache
    book.sent(turn(f"{p}q", 1000), 1000, "unique")
    assert fits("agent2", 2000) and not fits("agent2", 2001)
    assert fits(f"{p}r", 4000) and not fits(f"{p}r", 4001)


def test_a_named_session_waits_at_the_door_while_its_kind_fills_its_part() -> None:
    """Through the gate: a fleet of 2 x 1,000 KV tokens serves a named session of 500 and four
    questions of 25; a new named session of 600 would fit the fleet's cache (1,200 of 2,000) but
    not its kind's half (1,100 of 1,000): it waits at the door while the questions' kind is
    served, its last sessions forgotten included (``SessionBook.kinds``), and goes once that kind
    has been gone from the book for a minute."""
    clock = Clock(1000.0)
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_kv_fill=10.0)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    go(d, key(500, session="b"), workers)
    questions = [f"{DERIVED_SESSION_PREFIX}q{i}" for i in range(4)]
    for q in questions:
        d.finished(go(d, key(25, session=q, text=q), workers), ok=True)
    new = d.admit(key(600, session="new"), workers)
    assert new.queued and d.flow.at_door(new)
    clock.now += 20.0  # past flow_session_idle_s: the questions are forgotten ...
    d.flow.pump(clock.now)
    assert not any(q in d.flow._models[MODEL].door.book for q in questions)
    assert new.queued  # ... but its kind keeps its part a while
    clock.now += 61.0  # the questions' kind gone for longer than _KIND_GONE_S: one kind is served
    d.flow.pump(clock.now)
    assert new.state is TicketState.GRANTED


@pytest.mark.parametrize("questions, gone_for, fits", [
    (4, 0.0, False),    # the questions' last sessions left just now: their kind keeps its half
    (4, 59.0, False),
    (4, 61.0, True),    # gone for longer than _KIND_GONE_S: the named kind is served alone
    (3, 0.0, True),     # fewer than _KIND_MIN left: strays (a readiness probe), no kind to keep
])
def test_a_kind_keeps_its_part_a_while_after_its_last_session_left(questions: int, gone_for: float,
                                                                   fits: bool) -> None:
    """Named sessions hold 3,000 and the questions 1,000 of a 10,000-token cache; the questions
    are forgotten.  A new named session of 2,500 passes the whole cache's test but not its kind's
    half (5,500 > 5,000): it waits while the questions' kind was served within the last minute (a
    step of new agents arriving at a pause of the questions took the whole cache, and the
    questions then waited at the door behind them), and fits once that kind has been gone longer,
    or where only a few questions came (a benchmark's readiness request halved an agent fleet's
    door for a minute); the seat and ``alone`` read the same kinds."""
    book = SessionBook()
    book.sent(turn("agent", 3000), 3000, "unique")
    names = [f"{DERIVED_SESSION_PREFIX}q{i}" for i in range(questions)]
    for q in names:
        book.sent(turn(q, 1000 // questions), 1000 // questions, "unique")
        book.finished(q, 0.0)
    book.working_set(20.0, 15.0, "unique")
    assert not any(q in book for q in names)
    now = 20.0 + gone_for
    assert book.kinds(True, now) == (1 if fits else 2)
    assert book.alone(True, now) is fits
    assert book.fits(turn("agent2", 2500), 2500, 10_000, 1.0, "unique", now, 15.0) is fits
    seat = book.seat(turn("agent2", 2500), 2500, [("w0", 5000), ("w1", 5000)], 1.0, "unique", now, 15.0)
    assert (seat is not None) is fits


def test_a_kinds_part_counts_its_sessions_at_their_size_over_their_life() -> None:
    """Eight named sessions left, each 1,000 tokens at its first request and 3,000 at its second:
    their kind's largest is 3,000, its size on the mean over a session's life 2,000.  With a
    question served beside them, the named kind's half of a 10,000-token cache (5,000) counts each
    of its sessions at 2,000, as the door of the same kind alone on half of the fleet does (its
    seat, ``SessionBook.lived``): a second one fits (4,000), a third does not (6,000); counted at
    their largest (3,000) a second one would not have fitted."""
    book = SessionBook()
    for i in range(8):
        sid = f"old{i}"
        book.sent(turn(sid, 1000), 1000, "unique")
        book.finished(sid, 0.0)
        book.sent(turn(sid, 3000), 2000, "unique")
        book.finished(sid, 1.0)
    book.working_set(100.0, 15.0, "unique")  # all forgotten
    rule = session_admission.RULES["unique"]
    assert book.expected(rule) == 3000 and book.lived(rule) == 2000
    book.sent(turn(f"{DERIVED_SESSION_PREFIX}q", 100), 100, "unique")
    book.sent(turn("a1", 100), 100, "unique")

    def fits(sid: str) -> bool:
        return book.fits(turn(sid, 100), 100, 10_000, 1.0, "unique", 100.0, 15.0)

    assert fits("a2")
    book.sent(turn("a2", 100), 100, "unique")
    assert not fits("a3")


def test_each_kind_counts_at_least_what_its_own_sessions_reached() -> None:
    """One-shot questions (derived ids that never came back longer, 6,000 tokens each when cold)
    set no floor: a new one is expected at its own size; conversations the client names reached
    2,000 tokens, and a new one of theirs is expected at that, not at a median with the one-shots
    (4,000).  Derived ids that came back longer are conversations: they set their kind's floor."""
    book = SessionBook()
    p = DERIVED_SESSION_PREFIX
    for i in range(8):
        for sid, tokens in ((f"{p}q{i}", 6000), (f"a{i}", 2000)):
            book.sent(turn(sid, tokens), tokens, "unique")
            book.finished(sid, 0.0)
    book.working_set(100.0, 15.0, "unique")  # all forgotten
    assert book.need(turn("b", 100), 100, "unique") == 2000
    assert book.need(turn(f"{p}r", 100), 100, "unique") == 100
    book.sent(turn("b", 100), 100, "unique")
    assert book.working_set(100.0, 15.0, "unique") == 2000
    for i in range(8):  # derived conversations: each back with a longer prompt
        sid = f"{p}c{i}"
        book.sent(turn(sid, 1000), 1000, "unique")
        book.finished(sid, 100.0)
        book.sent(turn(sid, 3000), 2000, "unique")
        book.finished(sid, 101.0)
    book.working_set(200.0, 15.0, "unique")
    assert book.need(turn(f"{p}r", 100), 100, "unique") == 3000


def test_each_kind_has_its_own_line_at_the_door() -> None:
    """The oldest of each kind may pass next, and a first turn's predicted wait counts only the
    sessions of its kind ahead of it (held, or shed with their place kept)."""
    p = DERIVED_SESSION_PREFIX
    door = SessionDoor()
    a1, a2, q1, q2 = queued("a1", 1.0), queued("a2", 2.0), queued(f"{p}q1", 3.0), queued(f"{p}q2", 4.0)
    line = door.line([q2, a2, q1, a1], KINDS)
    assert list(line) == [a1, a2, q1, q2]
    assert door.heads(line) == [a1, q1]
    assert door.ahead(q2, line, 0.0, KINDS) == 1 and door.ahead(a2, line, 0.0, KINDS) == 1
    door.remember(queued("a0", 0.5), now=0.0, keep_s=100.0)
    assert door.ahead(q2, line, 0.0, KINDS) == 1 and door.ahead(a2, line, 0.0, KINDS) == 2


def test_a_derived_identity_passes_the_door_within_its_kinds_part() -> None:
    """The fleet's cache is full of client-named sessions: a new one of theirs waits at the door,
    the first derived identity goes past it at once (its kind holds nothing of the cache)."""
    clock = Clock(1000.0)
    d, workers = full_door(clock)
    named = d.admit(key(300, session="new"), workers)
    assert named.queued and d.flow.at_door(named)
    derived = d.admit(key(300, session=f"{DERIVED_SESSION_PREFIX}q"), workers)
    assert derived.state is TicketState.GRANTED


# --- a client's new conversation ----------------------------------------------------------------

@pytest.mark.parametrize("old_busy, client, next_session, freed", [
    (False, "c1", "s2", True),    # its client started another session: s1 ended
    (True, "c1", "s2", False),    # s1 still has a request in flight: not ended
    (False, "c1", "s1", False),   # the same session's next turn
    (False, "c2", "s2", False),   # another client's session
    (False, None, "s2", False),   # no x-kvroute-client: nothing is known
])
def test_a_clients_new_conversation_frees_its_quiet_old_one(old_busy: bool, client: str | None,
                                                            next_session: str, freed: bool) -> None:
    book = SessionBook()
    book.arrived("s1", 0.0, "c1")
    book.sent(turn("s1"), 100, "unique")
    if not old_busy:
        book.finished("s1", 1.0)
    book.arrived(next_session, 2.0, client)
    assert ("s1" not in book) is freed
    assert len(book.left) == freed


def test_the_clients_remembered_are_bounded() -> None:
    book = SessionBook()
    for i in range(session_admission._CLIENTS + 10):
        book.arrived(f"s{i}", 0.0, f"c{i}")
    assert len(book.clients) == session_admission._CLIENTS and "c0" not in book.clients


def test_a_clients_new_session_passes_the_door_its_old_one_held() -> None:
    """The door is full with b and c; c's client starts a new session: c (quiet) is freed at once,
    so the new one fits (without the header it waits for c to be forgotten)."""
    for client, passes in (("agent-1", True), (None, False)):
        clock = Clock(1000.0)
        d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                       flow_kv_fill=10.0)
        workers = fleet(2, seqs=8, kv_tokens=1000)
        go(d, key(900, session="b"), workers)
        d.finished(go(d, of(key(900, session="c"), "agent-1"), workers), ok=True)
        nxt = key(900, session="c2")
        ticket = d.admit(nxt if client is None else of(nxt, client), workers)
        assert (ticket.state is TicketState.GRANTED) is passes


# --- the door's bound from its measured drain ---------------------------------------------------

def draining(clock: Clock, ttl_s: float) -> tuple[Dispatcher, list[WorkerState]]:
    """Served session b (900 of 2 x 1000 KV tokens) and one client's sessions one after another
    (900 each): at t + 10 and t + 20 the client's next session frees the last, so by t + 20
    sessions leave at 1 every 10 s, and a new session of 300 does not fit."""
    d = dispatcher(clock, flow_session_admission=True, flow_session_fill_unsaturated=0.0,
                   flow_kv_fill=10.0, flow_queue_ttl_s=ttl_s)
    workers = fleet(2, seqs=8, kv_tokens=1000)
    go(d, key(900, session="b"), workers)
    for i in range(3):
        if i:
            clock.now += 10.0
        d.finished(go(d, of(key(900, session=f"s{i}"), "agent"), workers), ok=True)
    assert d.flow._models[MODEL].door.book.leave_rate(clock.now) == pytest.approx(0.1)
    return d, workers


@pytest.mark.parametrize("ttl_s, first_shed, second_shed, retry_after", [
    (5.0, True, True, 5),      # first: 1 / 0.1 = 10 s > 5; Retry-After the 5 s past the TTL
    (15.0, False, True, 5),    # first waits (10 s); the second, behind it, would wait 20 s
    (60.0, False, False, 0),   # both within the TTL: they wait
])
def test_a_first_turn_whose_predicted_door_wait_passes_the_ttl_is_shed_at_once(
        ttl_s: float, first_shed: bool, second_shed: bool, retry_after: int) -> None:
    clock = Clock(1000.0)
    d, workers = draining(clock, ttl_s)
    first = d.admit(key(300, session="x"), workers)
    second = d.admit(key(300, session="y"), workers)
    for t, shed in ((first, first_shed), (second, second_shed)):
        assert (t.state is TicketState.SHED) is shed
        assert t.queued is not shed
        if shed:
            assert t.reason is ShedReason.DOOR_WAIT
            assert t.retry_after_s == retry_after
    sheds = sum(n for (_, reason, _), n in d.flow.shed.items() if reason == "door_wait")
    assert sheds == first_shed + second_shed


@pytest.mark.parametrize("later_s, shed, retry_after", [
    (0.0, False, 0),   # as on arrival: 1 / 0.1 = 10 s within the 15 s TTL
    (3.0, False, 0),   # no session left since: the drain 1 / 23 s, 13 s predicted (12 s left)
    (5.5, True, 1),    # 15.5 s predicted: past the TTL, as it would have been on arrival
    (8.0, True, 3),    # 18 s: Retry-After the 3 s past the TTL
])
def test_a_held_first_turn_is_shed_once_its_predicted_wait_passes_the_ttl(
        later_s: float, shed: bool, retry_after: int) -> None:
    clock = Clock(1000.0)
    d, workers = draining(clock, 15.0)
    x = d.admit(key(300, session="x"), workers)
    assert x.queued
    told: list[tuple[Ticket, ShedReason | None, int]] = []
    # What the edge reads when it is told (it answers at once): the door's Retry-After already.
    x.on_decided = lambda t: told.append((t, t.reason, t.retry_after_s))
    clock.now += later_s
    d.flow.pump(clock.now)
    assert (x.state is TicketState.SHED) is shed
    assert told == ([(x, ShedReason.DOOR_WAIT, retry_after)] if shed else [])
    if shed:
        assert d.flow.queued(MODEL) == [] and d.flow._models[MODEL].door.places["x"][0] == x.place


def test_the_recheck_never_sheds_a_continuing_turn() -> None:
    """Only the first turns the door holds have a predicted wait there."""
    clock = Clock(1000.0)
    d, _ = draining(clock, 15.0)
    door = d.flow._models[MODEL].door
    later, first = queued("b", clock.now), queued("x", clock.now)
    assert [t for t, _ in door.waits([later, first], clock.now + 100.0, KINDS)] == [first]


def brute_ahead(door: SessionDoor, t: Ticket, tickets: list[Ticket], now: float) -> int:
    """The door's line before ``t``, counted one by one (the rule as first written)."""
    own = session_admission.kind(t.key.session_id or "")
    held = {u.key.session_id for u in tickets if u is not t and door.holds(u, KINDS) and
            session_admission.kind(u.key.session_id or "") == own and
            session_admission.door_order(u) < session_admission.door_order(t)}
    kept = sum(1 for sid, (place, until) in door.places.items()
               if until >= now and sid not in held and sid != t.key.session_id and place < t.place and
               session_admission.kind(sid) == own)
    return len(held) + kept


@pytest.mark.parametrize("seed", range(20))
def test_every_ahead_in_one_pass_is_each_counted_alone(seed: int) -> None:
    rng = random.Random(seed)
    door = SessionDoor()
    names = [f"{DERIVED_SESSION_PREFIX if rng.random() < 0.3 else ''}s{i}" for i in range(12)]
    for sid in rng.sample(names, 5):
        door.remember(queued(sid, rng.uniform(0.0, 10.0)), now=0.0, keep_s=rng.uniform(1.0, 20.0))
    tickets = []
    for i in range(rng.randint(1, 15)):
        t = Ticket(dataclasses.replace(turn(rng.choice(names)), priority=rng.choice((0, 0, 1))),
                   rng.uniform(0.0, 10.0), seq=i)
        t.state = TicketState.QUEUED
        tickets.append(t)
    now = 5.0
    expected = sorted((session_admission.door_order(t), brute_ahead(door, t, tickets, now)) for t in tickets)
    got = [(session_admission.door_order(t), n) for t, n in door.aheads(tickets, now, KINDS)]
    assert got == expected


def test_a_continuing_turn_is_never_shed_at_the_door() -> None:
    clock = Clock(1000.0)
    d, workers = draining(clock, 5.0)
    assert d.admit(key(950, session="b"), workers).state is not TicketState.SHED


def test_no_early_shed_until_the_drain_is_measured() -> None:
    clock = Clock(1000.0)
    d, workers = full_door(clock, flow_queue_ttl_s=0.001)
    assert d.flow._models[MODEL].door.book.leave_rate(clock.now) == 0.0
    assert d.admit(key(300, session="new"), workers).queued


# --- a shed first turn keeps its place ----------------------------------------------------------

def test_a_shed_first_turn_that_comes_back_keeps_its_place() -> None:
    """y is shed at t (15 s TTL, predicted 20 s); until it comes back it counts as waiting (for the
    saturation reading, and ahead of z, which arrives after it); when it comes back it takes its
    old place again, and keeps it if it is shed once more (the drain slowed meanwhile)."""
    clock = Clock(1000.0)
    d, workers = draining(clock, 15.0)
    x = d.admit(key(300, session="x"), workers)
    y = d.admit(key(300, session="y"), workers)
    assert x.queued and y.state is TicketState.SHED and y.retry_after_s == 5
    shed_at = clock.now
    door = d.flow._models[MODEL].door
    assert door.kept(clock.now) == 1 and d.flow.blocked(MODEL, clock.now) == 2
    clock.now += 1.0
    z = d.admit(key(300, session="z"), workers)
    assert door.ahead(z, d.flow.queued(MODEL), clock.now, KINDS) == 2  # x, and y coming back
    assert z.state is TicketState.SHED
    clock.now += y.retry_after_s
    back = d.admit(key(300, session="y"), workers)
    assert back.place == shed_at and back.place < z.place
    assert back.state is TicketState.SHED and door.places["y"][0] == shed_at


def queued(session: str, arrived: float) -> Ticket:
    t = Ticket(turn(session), arrived)
    t.state = TicketState.QUEUED
    return t


def test_kept_places_are_bounded_and_expire() -> None:
    door = SessionDoor()
    for i in range(session_admission._PLACES + 100):
        door.remember(queued(f"s{i}", float(i)), now=0.0, keep_s=10.0 + i)
    assert len(door.places) == session_admission._PLACES and "s0" not in door.places
    assert door.kept(0.0) == session_admission._PLACES
    assert door.kept(10.0 + 150.5) == session_admission._PLACES + 100 - 151  # s0-s150 passed
    late = queued("s120", 500.0)
    door.returned(late, 500.0)  # came back after its place was dropped: a new place
    assert late.place == 500.0
    back = queued("s900", 905.0)  # within its time (910): its place, 900
    door.returned(back, 905.0)
    assert back.place == 900.0 and "s900" not in door.places


def test_the_door_line_is_by_place() -> None:
    door = SessionDoor()
    young, old, back = queued("young", 5.0), queued("old", 3.0), queued("back", 9.0)
    back.place = 1.0
    assert list(door.line([young, old, back], KINDS)) == [back, old, young]


def test_the_sessions_remembered_as_served_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound the session served longest ago is no longer known (its next turn would be a
    new session's); one that came back after the book forgot it counts as recent again."""
    monkeypatch.setattr(session_admission, "_SEEN", 3)
    book = SessionBook()
    for sid in ("a", "b", "c"):
        book.sent(turn(sid), 100, "unique")
        book.finished(sid, 0.0)
    book.working_set(100.0, 15.0, "unique")  # all forgotten, all still seen
    book.sent(turn("a"), 100, "unique")  # a is back
    book.sent(turn("d"), 100, "unique")
    assert list(book.seen) == ["c", "a", "d"]
    assert book.is_new("b", 100) and not book.is_new("c", 100)
