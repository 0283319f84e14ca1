"""Flow control's queue on its own (routing/flow_queue.py): caps and displacement, the replicas it
waits for, late binding's holder, reservations, which request goes next, aging and Retry-After.
Pure: no dispatcher, readings passed in."""

from __future__ import annotations

import math

import pytest

from kvroute.routing.fair_share import FairShare
from kvroute.routing.flow_queue import (
    ModelQueue,
    Prediction,
    ShedReason,
    Ticket,
    TicketState,
    by_arrival,
    cache_order,
    fifo_order,
)
from kvroute.routing.key import RoutingKey
from kvroute.routing.settings import PlacementSettings
from kvroute.routing.worker import WorkerState

MODEL = "m"
PLACEMENT = PlacementSettings()


def ticket(seq: int, tokens: int = 100, *, priority: int = 0, tenant: str | None = None,
           arrived: float = 0.0, prefill: int = 0, resident: bool = False, max_tokens: int = 0) -> Ticket:
    key = RoutingKey(MODEL, b"p%d" % seq, None, tokens, max_tokens, priority=priority, tenant=tenant)
    return Ticket(key, arrived, TicketState.QUEUED, prefill_tokens=prefill, resident=resident, seq=seq)


def queue(*tickets: Ticket, workers: list[WorkerState] | None = None) -> ModelQueue:
    q = ModelQueue(workers=workers or [])
    for t in tickets:
        q.join(t)
    return q


def worker(wid: str = "w0", *, inflight: int = 0, seqs: int = 1, kv_tokens: int | None = None,
           inflight_tokens: int = 0, ready: bool = True,
           models: frozenset[str] = frozenset({MODEL})) -> WorkerState:
    w = WorkerState(wid, f"http://{wid}", models, max_num_seqs=seqs, kv_tokens=kv_tokens,
                    inflight=inflight, inflight_tokens=inflight_tokens)
    w.healthy = ready
    return w


# --- joining, leaving, caps ---------------------------------------------------------------------

def test_join_and_leave_keep_the_token_count_and_set_the_wait() -> None:
    a, b = ticket(1, 100, arrived=1.0), ticket(2, 300, arrived=2.0)
    q = queue(a, b)
    assert (len(q.tickets), q.tokens) == (2, 400)
    q.leave(a, now=4.5)
    assert (q.tickets, q.tokens, a.waited_s) == ([b], 300, 3.5)


@pytest.mark.parametrize("queued, max_queued, max_tokens, arriving, expected", [
    (0, 4, 0, 100, None),
    (3, 4, 0, 100, None),
    (4, 4, 0, 100, ShedReason.QUEUE_FULL),
    (2, 4, 300, 100, None),                     # 200 + 100 fits exactly
    (2, 4, 299, 100, ShedReason.QUEUE_TOKENS),
    (4, 4, 299, 100, ShedReason.QUEUE_FULL),    # the count is asked first
])
def test_over_caps(queued: int, max_queued: int, max_tokens: int, arriving: int,
                   expected: ShedReason | None) -> None:
    q = queue(*(ticket(i) for i in range(queued)))
    assert q.over_caps(ticket(99, arriving).key, max_queued, max_tokens) is expected


@pytest.mark.parametrize("queued, arriving, max_queued, max_tokens, expected", [
    # (seq, priority) queued; the arriving request's priority; the victims' seqs (None: no room)
    ([(1, 0), (2, -1), (3, -1)], 1, 3, 0, [3]),          # lowest class, newest first
    ([(1, 0), (2, -1), (3, 0)], 0, 3, 0, [2]),           # only lower classes
    ([(1, 0), (2, 0), (3, 0)], 0, 3, 0, None),           # nothing below it
    ([(1, -1), (2, 0), (3, -1)], 1, 3, 250, [3, 1]),     # tokens: two must go
    ([(1, 1), (2, -1)], 0, 2, 150, None),                # the one below is not enough
])
def test_displaceable(queued: list[tuple[int, int]], arriving: int, max_queued: int, max_tokens: int,
                      expected: list[int] | None) -> None:
    q = queue(*(ticket(seq, 100, priority=p) for seq, p in queued))
    victims = q.displaceable(ticket(99, 100, priority=arriving), max_queued, max_tokens)
    assert (None if victims is None else [v.seq for v in victims]) == expected


# --- the replicas it waits for ------------------------------------------------------------------

@pytest.mark.parametrize("workers, expected", [
    ([worker("a"), worker("b")], 2),
    ([worker("a", inflight=1), worker("b")], 1),
    ([worker("a", inflight=1), worker("b", inflight=1)], 0),
    ([worker("a", kv_tokens=1000, inflight_tokens=900), worker("b", inflight=1)], 0),  # KV full, slot full
    ([worker("a", ready=False), worker("b", inflight=1)], 0),
    ([worker("a", ready=False), worker("b", models=frozenset({"other"}))], 1 << 30),  # nobody serves it
])
def test_room(workers: list[WorkerState], expected: int) -> None:
    q = queue(workers=workers)
    assert q.room(ticket(1, 100, max_tokens=100).key, PLACEMENT, 1.0) == expected


@pytest.mark.parametrize("holder, bind_until, targeted, holder_state, expected", [
    (None, 0.0, 0, None, True),                        # no holder: nothing to wait for
    ("h", 5.0, 0, None, True),                         # its wait is over (now = 10)
    ("h", 20.0, 1, worker("h"), False),                # a grant for it is not claimed yet
    ("h", 20.0, 0, worker("h"), True),                 # the holder is admissible
    ("h", 20.0, 0, worker("h", inflight=1), False),    # the holder is busy: wait for it
    ("h", 20.0, 0, worker("h", inflight=1, ready=False), True),  # not ready: nothing to wait for
    ("gone", 20.0, 0, None, True),                     # the holder left the fleet
])
def test_holder_free(holder: str | None, bind_until: float, targeted: int,
                     holder_state: WorkerState | None, expected: bool) -> None:
    t = ticket(1)
    t.holder, t.bind_until = holder, bind_until
    q = queue(t, workers=[holder_state] if holder_state is not None else [worker("other")])
    if targeted:
        q.targeted[str(holder)] = targeted
    assert q.holder_free(t, 10.0, PLACEMENT, 1.0) is expected


def test_a_reservation_for_a_holder_ends_when_claimed() -> None:
    q = queue()
    bound, late, plain = ticket(1), ticket(2), ticket(3)
    bound.predicted(Prediction(0, False, "h", 5.0))
    late.predicted(Prediction(0, False, "h", 5.0))
    q.reserve(bound, now=1.0)
    q.reserve(late, now=6.0)  # its bound passed: not for the holder any more
    q.reserve(plain, now=1.0)
    assert (q.reserved, q.targeted, bound.target, late.target) == (3, {"h": 1}, "h", None)
    for t in (bound, late, plain):
        q.release(t)
    assert (q.reserved, q.targeted, bound.target) == (0, {}, None)


# --- which goes next ----------------------------------------------------------------------------

@pytest.mark.parametrize("tickets, held_back, expected", [
    # (seq, priority, tenant, prefill); cache order within a tenant, strict classes
    ([(1, 0, None, 500), (2, 0, None, 100)], set(), 2),
    ([(1, 0, None, 500), (2, 1, None, 900)], set(), 2),      # the higher class first
    ([(1, 0, None, 500), (2, 1, None, 900)], {2}, 1),        # unless held back
    ([(1, -1, None, 500)], {1}, None),
])
def test_next(tickets: list[tuple[int, int, str | None, int]], held_back: set[int],
              expected: int | None) -> None:
    q = queue(*(ticket(seq, priority=p, tenant=tn, prefill=pf) for seq, p, tn, pf in tickets))
    best = q.next(1.0, cache_order, 10.0, held_back, FairShare())
    assert (None if best is None else best.seq) == expected


def test_next_asks_the_fair_share_between_tenants() -> None:
    """Two tenants: the one served more goes second, whatever its head's order."""
    fair = FairShare()
    fair.charge(0, "a", 1000, 1.0, busy=True, waiting=lambda: ())
    q = queue(ticket(1, tenant="a", prefill=10), ticket(2, tenant="b", prefill=900))
    best = q.next(1.0, cache_order, 10.0, set(), fair)
    assert best is not None and best.seq == 2
    q = queue(ticket(1, tenant="a", prefill=10), ticket(2, tenant="b", prefill=900))
    best = q.next(1.0, cache_order, 10.0, set(), FairShare())  # level: the better head
    assert best is not None and best.seq == 1


def test_orders_and_the_flush_order() -> None:
    old, young_short = ticket(1, arrived=0.0, prefill=900), ticket(2, arrived=5.0, prefill=10)
    high = ticket(3, arrived=9.0, priority=1)
    assert min((old, young_short), key=lambda t: cache_order(t, 8.0, 10.0)) is young_short
    assert min((old, young_short), key=lambda t: cache_order(t, 10.0, 10.0)) is old  # aged
    assert min((old, young_short), key=lambda t: fifo_order(t, 8.0, 10.0)) is old
    assert sorted((young_short, old, high), key=by_arrival) == [high, old, young_short]


# --- aging and Retry-After ----------------------------------------------------------------------

@pytest.mark.parametrize("waits, floor_s, factor, expected", [
    ([], 10.0, 1.0, 10.0),
    ([4.0, 20.0, 30.0], 10.0, 1.0, 20.0),
    ([4.0, 20.0, 30.0], 10.0, 0.25, 10.0),  # never below the floor
    ([4.0, 6.0], 1.0, 2.0, 10.0),
])
def test_aged_after(waits: list[float], floor_s: float, factor: float, expected: float) -> None:
    q = queue()
    for w in waits:
        q.waited(w)
    assert q.aged_after(floor_s, factor) == expected


def test_a_new_wait_sample_moves_the_cached_median() -> None:
    q = queue()
    q.waited(2.0)
    assert q.aged_after(0.0, 1.0) == 2.0
    q.waited(4.0)
    assert q.aged_after(0.0, 1.0) == 3.0


@pytest.mark.parametrize("ends, queued, now, ttl_s, rate, expected", [
    ([], 0, 10.0, 60.0, 0.0, 60),                  # no drain known: the TTL
    ([1.0], 5, 10.0, 60.0, 0.0, 60),
    ([0.0, 1.0, 2.0], 3, 2.0, 60.0, 1.0, 4),       # 4 ahead at 1/s
    ([0.0, 1.0, 2.0], 3, 4.0, 60.0, 0.5, 8),       # the drain slowed since
    ([0.0, 0.1, 0.2], 0, 0.2, 60.0, 10.0, 1),      # at least 1 s
    ([0.0, 10.0], 99, 10.0, 20.5, 0.1, 21),        # at most the TTL, rounded up
])
def test_retry_after_from_the_drain(ends: list[float], queued: int, now: float, ttl_s: float,
                                    rate: float, expected: int) -> None:
    q = queue(*(ticket(i) for i in range(queued)))
    for end in ends:
        q.ended(end)
    assert q.drain_rate(now) == pytest.approx(rate)
    assert q.retry_after(now, ttl_s) == expected


def test_a_ticket_has_no_deadline_until_it_is_queued() -> None:
    assert Ticket(ticket(1).key, 0.0).deadline == math.inf
