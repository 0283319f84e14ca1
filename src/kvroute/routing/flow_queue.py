"""Flow control's queue: the tickets of one model's requests waiting at the router's gate, the order
they leave in, the replicas they wait for, and the figures read from it.

A request may start while some replica is *admissible* for it (:func:`admissible`: a free sequence
slot by every count the router has, and room in its KV cache).  Until then it waits here; when one
frees up the gate (routing/flow.py) asks :meth:`ModelQueue.next` for the request to grant: of the
highest priority class waiting (strict), of the tenant whose fair share is furthest behind
(routing/fair_share.py), the first of that tenant's by the pluggable order (``flow_order``:
:data:`ORDERS`), in which a request that has waited past the aging threshold goes ahead of younger
ones.  A granted request holds a reservation until its edge claims it, so that a second pass
before it is sent does not grant its replica twice.

Pure: no clock (readings are passed in), no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvroute.routing.fair_share import FairShare
from kvroute.routing.filters import seq_slots
from kvroute.routing.key import RoutingKey
from kvroute.routing.settings import PlacementSettings
from kvroute.routing.view import Candidate
from kvroute.routing.worker import WorkerState

# The tenant of a request that names none, for the fair share.
DEFAULT_TENANT = "default"
# Recent queue waits the aging threshold is the median of.
RECENT_WAITS = 256


class TicketState(StrEnum):
    """Where a request stands at the router's gate."""

    QUEUED = "queued"
    GRANTED = "granted"  # may be routed now (``claim`` before routing, when it waited)
    SHED = "shed"  # answered with the overload error
    WITHDRAWN = "withdrawn"  # its client left while it waited


class ShedReason(StrEnum):
    """Why a request was shed; the ``reason`` metric label."""

    QUEUE_FULL = "queue_full"
    QUEUE_TOKENS = "queue_tokens"
    TTL = "ttl"
    SHUTDOWN = "shutdown"
    DISPLACED = "displaced"  # a queued request pushed out by a higher class arriving at a full queue
    DOOR_WAIT = "door_wait"  # a new session's first turn whose predicted wait at the door passes the TTL


@dataclass(frozen=True, slots=True)
class Prediction:
    """Where a request would go if it were routed now, for the queue: the prompt tokens it would
    prefill there, whether it is a continuing session's turn whose prefix is still resident, and
    (late binding, while the fleet is saturated) the replica holding most of its prompt and how
    many seconds it may wait for that replica before it may go elsewhere.  ``bound``: a session
    the client names that the shared session table already binds to a replica (another router
    instance served it): a later turn, never a new session at this instance's door."""

    prefill_tokens: int
    resident: bool
    holder: str | None = None
    bind_s: float = 0.0
    bound: bool = False


@dataclass(slots=True, eq=False)
class Ticket:
    """One request at the gate.

    ``prefill_tokens`` and ``resident`` are the queue's prediction at arrival (what the order
    reads): the prompt tokens the replica it would go to does not hold, and whether it is a
    continuing session's turn whose prefix is still there.  ``deadline`` is when a queued ticket
    is shed (its queue TTL, on the dispatcher's clock: the edges arm their timer for it);
    ``waited_s`` is set when it leaves the queue; ``retry_after_s`` when it is shed; ``why``, by
    the dispatcher, when it is queued (why it had to wait, in words, for the decision log).
    """

    key: RoutingKey
    arrived: float
    state: TicketState = TicketState.GRANTED
    prefill_tokens: int = 0
    resident: bool = False
    bound: bool = False  # Prediction.bound
    waited_s: float = 0.0
    reason: ShedReason | None = None
    retry_after_s: int = 0
    on_decided: Callable[[Ticket], None] | None = None
    seq: int = 0
    deadline: float = math.inf
    holds: bool = False  # granted from the queue and not yet claimed: counts as a reservation
    door_tokens: int = 0  # a new session let in at the door: what it adds until it is sent
    seat: str | None = None  # a new session's: the replica the door found room on (SessionDoor.fits)
    why: str = ""
    holder: str | None = None  # late binding: the replica holding its prefix, which it waits for
    bind_until: float = 0.0  # ... until then (the dispatcher's clock)
    target: str | None = None  # granted for its holder and not yet claimed
    place: float = math.nan  # its place in session admission's line (its arrival, unless it came back)

    def __post_init__(self) -> None:
        if math.isnan(self.place):
            self.place = self.arrived

    @property
    def queued(self) -> bool:
        """Still waiting for a replica."""
        return self.state is TicketState.QUEUED

    @property
    def priority(self) -> int:
        """Its priority class (1 high, 0 normal, -1 low)."""
        return self.key.priority

    @property
    def tenant(self) -> str:
        """Whose request it is, for the fair share."""
        return self.key.tenant or DEFAULT_TENANT

    def predicted(self, p: Prediction) -> None:
        """Take the queue's prediction of where it would go (late binding: its holder, for at
        most ``p.bind_s`` from its arrival)."""
        self.prefill_tokens, self.resident, self.bound = p.prefill_tokens, p.resident, p.bound
        if p.holder is not None and p.bind_s > 0:
            self.holder, self.bind_until = p.holder, self.arrived + p.bind_s


# An order maps (ticket, now, aging threshold in seconds) to a sort key; the smallest key goes
# first.  It orders one tenant's requests of one class (classes and tenants are decided before).
Order = Callable[[Ticket, float, float], tuple[float, ...]]


def cache_order(t: Ticket, now: float, aged_after_s: float) -> tuple[float, ...]:
    """Aged requests first (oldest first); then continuing sessions whose prefix is resident, then
    the shortest predicted prefill, then arrival."""
    if now - t.arrived >= aged_after_s:
        return (0.0, t.arrived, t.seq)
    return (1.0, 0.0 if t.resident else 1.0, float(t.prefill_tokens), t.arrived, t.seq)


def fifo_order(t: Ticket, now: float, aged_after_s: float) -> tuple[float, ...]:
    """Arrival order."""
    return (t.arrived, t.seq)


ORDERS: dict[str, Order] = {"cache": cache_order, "fifo": fifo_order}


def admissible(w: WorkerState, need: int, placement: PlacementSettings, kv_fill: float) -> bool:
    """Whether ``w`` can start a request needing ``need`` KV tokens without queueing it behind a full
    batch or preempting: a free sequence slot by every count the router has (its own, the other
    routers', the engine's scraped load beyond them), and — when the engine's KV size is known —
    room for the KV tokens what the routers have sent it and not seen finish add (each request's
    prompt the replica was not predicted to hold, and its output), plus ``need``.  A replica with
    nothing of the routers' in flight always has room (a prompt bigger than the cache is the
    engine's to refuse)."""
    if Candidate.of(w).busy >= seq_slots(w, placement):
        return False
    cap = w.kv_tokens
    if cap is None or w.inflight_tokens == 0:
        return True
    return w.inflight_tokens + need <= kv_fill * cap


def by_arrival(t: Ticket) -> tuple[int, float, int]:
    """Highest class first, then oldest first: the order of a flush and of the session door."""
    return (-t.priority, t.arrived, t.seq)


@dataclass(slots=True)
class ModelQueue:
    """One model's waiting requests, the grants its edges have not claimed yet, and the fleet they
    wait for."""

    workers: Sequence[WorkerState] = ()
    tickets: list[Ticket] = field(default_factory=list)
    tokens: int = 0  # estimated prompt tokens of the tickets
    reserved: int = 0  # granted from the queue, not yet claimed by their edge
    targeted: dict[str, int] = field(default_factory=dict)  # unclaimed grants for their holder
    finished: deque[float] = field(default_factory=lambda: deque(maxlen=64))  # when requests ended
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_WAITS))
    median_wait: float | None = None  # of ``waits``; None: to be computed again

    # --- joining and leaving ----------------------------------------------------------------------

    def join(self, t: Ticket) -> None:
        """``t`` starts waiting."""
        self.tickets.append(t)
        self.tokens += t.key.est_prompt_tokens

    def leave(self, t: Ticket, now: float) -> None:
        """``t`` stops waiting (granted, shed or withdrawn): how long it waited is set."""
        self.tickets.remove(t)
        self.tokens -= t.key.est_prompt_tokens
        t.waited_s = now - t.arrived

    def over_caps(self, key: RoutingKey, max_queued: int, max_tokens: int) -> ShedReason | None:
        """Why ``key`` may not join as the queue stands (``flow_max_queued``,
        ``flow_max_queued_tokens``: 0 is no limit), or None when it may."""
        if len(self.tickets) >= max_queued:
            return ShedReason.QUEUE_FULL
        if max_tokens and self.tokens + key.est_prompt_tokens > max_tokens:
            return ShedReason.QUEUE_TOKENS
        return None

    def displaceable(self, ticket: Ticket, max_queued: int, max_tokens: int) -> list[Ticket] | None:
        """The queued requests ``ticket`` pushes out of a full queue — of lower classes only, the
        lowest class first and within it the newest — or None when those cannot make room."""
        lower = sorted((t for t in self.tickets if t.priority < ticket.priority),
                       key=lambda t: (t.priority, -t.seq))
        victims: list[Ticket] = []
        count, tokens = len(self.tickets), self.tokens
        need = ticket.key.est_prompt_tokens

        def fits() -> bool:
            return count < max_queued and (not max_tokens or tokens + need <= max_tokens)

        for victim in lower:
            if fits():
                break
            victims.append(victim)
            count -= 1
            tokens -= victim.key.est_prompt_tokens
        return victims if fits() else None

    # --- the replicas it waits for ----------------------------------------------------------------

    def room(self, key: RoutingKey, placement: PlacementSettings, kv_fill: float) -> int:
        """How many replicas are admissible for ``key``, the unclaimed grants not deducted (the
        replicas able to serve its model at all, when none is: then the pipeline answers, not the
        queue)."""
        need = key.footprint
        model = key.model
        ready = 0
        room = 0
        for w in self.workers:
            if not w.ready or not w.serves(model):
                continue
            ready += 1
            if admissible(w, need, placement, kv_fill):
                room += 1
        return room if ready else 1 << 30

    def holder_free(self, t: Ticket, now: float, placement: PlacementSettings, kv_fill: float) -> bool:
        """Late binding: whether ``t`` may be granted now as far as its holder goes — it has none,
        its wait for it is over, or the holder is admissible for it and no grant for it is
        unclaimed yet (a holder that left or is not ready is nothing to wait for)."""
        holder = t.holder
        if holder is None or now >= t.bind_until:
            return True
        if self.targeted.get(holder):
            return False
        for w in self.workers:
            if w.id == holder:
                return not w.ready or admissible(w, t.key.footprint, placement, kv_fill)
        return True

    # --- granting ---------------------------------------------------------------------------------

    def next(self, now: float, order: Order, aged_after: float, held_back: set[int],
             fair: FairShare) -> Ticket | None:
        """The queued request to grant next, of those not ``held_back`` (by ``seq``): of the highest
        class waiting; within it, of the tenant whose next request has the earliest virtual start
        tag in ``fair`` (ties: the better head by ``order``); within the tenant, the first by
        ``order``."""
        top: int | None = None
        for t in self.tickets:
            if (top is None or t.priority > top) and t.seq not in held_back:
                top = t.priority
        if top is None:
            return None
        heads: dict[str, tuple[tuple[float, ...], Ticket]] = {}
        for t in self.tickets:
            if t.priority != top or t.seq in held_back:
                continue
            k = order(t, now, aged_after)
            head = heads.get(t.tenant)
            if head is None or k < head[0]:
                heads[t.tenant] = (k, t)
        if len(heads) == 1:
            return next(iter(heads.values()))[1]
        return fair.pick(top, ((tenant, k, t) for tenant, (k, t) in heads.items()))

    def reserve(self, t: Ticket, now: float) -> None:
        """``t`` was granted from the queue: it holds a reservation until its edge claims it (for
        its holder, when it waited for one and its bound has not passed)."""
        t.holds = True
        self.reserved += 1
        if t.holder is not None and now < t.bind_until:
            t.target = t.holder
            self.targeted[t.holder] = self.targeted.get(t.holder, 0) + 1

    def release(self, t: Ticket) -> None:
        """The reservation of granted ``t`` ends (claimed by its edge, or withdrawn)."""
        self.reserved -= 1
        if t.target is not None:
            left = self.targeted[t.target] - 1
            if left:
                self.targeted[t.target] = left
            else:
                del self.targeted[t.target]
        t.target = None

    # --- aging and drain --------------------------------------------------------------------------

    def waited(self, seconds: float) -> None:
        """A request granted from the queue had waited ``seconds`` (what the aging threshold is the
        median of; a request granted as it arrived did not wait and is not a sample)."""
        self.waits.append(seconds)
        self.median_wait = None

    def aged_after(self, floor_s: float, factor: float) -> float:
        """Seconds after which a queued request ages: ``factor`` (``flow_aging_factor``) x the
        median of the recent queue waits, never below ``floor_s`` (``flow_aging_s``)."""
        if not self.waits:
            return floor_s
        if self.median_wait is None:
            self.median_wait = statistics.median(self.waits)
        return max(floor_s, factor * self.median_wait)

    def ended(self, now: float) -> None:
        """A request of the model ended (the drain rate Retry-After predicts from)."""
        self.finished.append(now)

    def drain_rate(self, now: float) -> float:
        """Requests finished per second, over the last (at most 64) completions."""
        if len(self.finished) < 2:
            return 0.0
        span = max(now, self.finished[-1]) - self.finished[0]
        return (len(self.finished) - 1) / span if span > 0 else 0.0

    def retry_after(self, now: float, ttl_s: float) -> int:
        """Seconds after which a shed request may find room: the queue's length (and the request)
        over the drain rate, in whole seconds, at least 1, at most the TTL."""
        ahead = 1 + len(self.tickets)
        rate = self.drain_rate(now)
        ttl = max(1, math.ceil(ttl_s))
        if rate <= 0:
            return ttl
        return max(1, min(ttl, math.ceil(ahead / rate)))
