"""Flow control: hold requests at the router while no replica can start them, and admit them in a
cache- and session-aware order when one can.

The router used to forward every request the moment it arrived; past the fleet's capacity each
engine's own FCFS queue then bound the request to that replica early, and the prefills admitted
ahead of a session's next turn evicted the blocks that would have made that turn cheap.  Here a
request is *admitted* only while some replica is *admissible* for it (see :func:`admissible`);
otherwise it waits in its model's queue and is decided — the whole pipeline, afresh — once a
replica frees up.  Past the queue's caps, or after its TTL, it is *shed*: the edge answers with
the API's own overload error and a ``Retry-After`` from the predicted drain (:meth:`retry_after`).

Which queued request goes next: the highest priority class first (strict; a full queue sheds the
lowest class first); within a class the tenant with the least token-weighted service (start-time
fair queuing, each request charged its prompt + ``max_tokens`` at the grant and settled to the
prompt + output tokens the engine reports when it is answered); within the tenant the pluggable order
(``flow_order``), in which a request that has waited ``flow_aging_factor`` x the median recent
queue wait (at least ``flow_aging_s``) goes ahead of younger ones.

Pure: no clock (the dispatcher passes its timer's readings), no I/O.  The dispatcher
(routing/dispatch.py) owns the one ``FlowControl`` of a router and calls it from both clocks:
``admit`` on arrival, ``pump`` whenever a replica may have freed up (a response ended, a scrape,
other routers' load), ``claim`` when a woken request is about to be routed, ``withdraw`` when its
client left, ``expire`` at its TTL and ``shed_all`` at shutdown.  A ticket's ``on_decided``
callback is how the edge learns that it was granted or shed (an asyncio future over HTTP, an event
on the virtual clock in simulation).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from kvroute.routing.filters import seq_slots
from kvroute.routing.key import RoutingKey
from kvroute.routing.saturation import check_switch, switch_on
from kvroute.routing.session_admission import RULES, SessionBook, footprint
from kvroute.routing.settings import PlacementSettings, check_non_negative, check_positive, setting
from kvroute.routing.view import Candidate
from kvroute.routing.worker import WorkerState


@dataclass(frozen=True, slots=True)
class FlowSettings:
    """Flow control's settings (docs/flow-control.md)."""

    flow_control: bool | Literal["auto"] = setting(
        "auto", "hold requests at the router while no replica is admissible, and admit them in "
                "flow_order when one frees up: 'auto' while the fleet is saturated "
                "(docs/saturation.md), true always, false never (every request is forwarded at once)")
    flow_kv_fill: float = setting(
        1.25, "a replica is admissible while the KV tokens of what the routers sent it and have "
             "not seen finish add (the prompt each was not predicted to find cached, plus "
             "max_tokens), plus the request's whole footprint, stays within this share "
             "of its KV cache (when the engine's KV size is known)")
    flow_order: str = setting(
        "cache", "order of queued requests: 'cache' (continuing sessions' turns with a resident "
                 "prefix first, then shortest predicted prefill, aged) or 'fifo'")
    flow_aging_s: float = setting(
        10.0, "floor of the aging threshold: a queued request goes ahead of every younger one of its "
              "class and tenant (oldest first) once it has waited flow_aging_factor x the median "
              "recent queue wait, and never before this many seconds")
    # 1.0: at 24-48 agent sessions in virtual time 2 and 4 made TTFB p95 worse (and 4 shed at 48
    # sessions) for no better median (docs/flow-control.md, "Aging as a multiple of the median").
    flow_aging_factor: float = setting(
        1.0, "a queued request ages (goes ahead of younger ones, so the 'cache' order cannot starve "
             "a long prompt) once it has waited this multiple of the median recent queue wait "
             "(at least flow_aging_s)")
    flow_tenant_weights: str = setting(
        "", "weights of tenants' fair shares, 'tenant=weight,...' (a tenant not named weighs 1); "
            "tenants come from x-kvroute-tenant, x-gateway-inference-fairness-id or the API key")
    flow_max_queued: int = setting(
        1024, "most requests a model's queue holds; past it a request is shed (429 / 529)")
    flow_max_queued_tokens: int = setting(
        0, "most estimated prompt tokens a model's queue holds (0: no limit); past it a request "
           "is shed")
    flow_queue_ttl_s: float = setting(
        60.0, "a request queued this long is shed with the API's overload answer")

    flow_session_admission: bool | Literal["auto"] = setting(
        "auto", "start a new session only while the working set of the sessions the fleet already "
                "serves (flow_session_rule), plus the new one's, fits in flow_session_fill x the "
                "fleet's KV cache; a held first turn waits in the queue ('auto': while the fleet "
                "is saturated and thrashing, docs/saturation.md)")
    flow_session_rule: str = setting(
        "unique", "what a served session counts in the working set: 'unique' (its last request's "
                  "prompt + max_tokens less the prefix other sessions had cached, e.g. a shared "
                  "system prompt) or 'footprint' (prompt + max_tokens)")
    flow_session_fill: float = setting(
        1.0, "share of the fleet's KV cache the working set of active sessions may take before a new "
             "session waits (with flow_session_admission)")
    flow_session_idle_s: float = setting(
        15.0, "a session stops counting in the working set this long after its last request ended")
    flow_session_door_s: float = setting(
        0.0, "a new session's first turn held this long at the door is admitted anyway "
             "(0: it waits until flow_queue_ttl_s)")

    def __post_init__(self) -> None:
        check_switch(self, "flow_control", "flow_session_admission")
        check_non_negative(self, "flow_aging_s", "flow_aging_factor", "flow_max_queued",
                           "flow_max_queued_tokens", "flow_session_idle_s", "flow_session_door_s")
        tenant_weights(self.flow_tenant_weights)  # raises ValueError when malformed
        if self.flow_session_rule not in RULES:
            raise ValueError(f"flow_session_rule must be one of {', '.join(RULES)}")
        check_positive(self, "flow_session_fill", "flow_kv_fill", what="share")
        check_positive(self, "flow_queue_ttl_s", what="number of seconds")
        if self.flow_order not in ORDERS:
            raise ValueError(f"flow_order must be one of {', '.join(ORDERS)}")


@functools.lru_cache(maxsize=64)
def tenant_weights(text: str) -> dict[str, float]:
    """``flow_tenant_weights`` read: ``'a=2,b=0.5'`` -> ``{'a': 2.0, 'b': 0.5}`` (ValueError when
    malformed or a weight is not positive)."""
    out: dict[str, float] = {}
    if not isinstance(text, str):
        raise ValueError("flow_tenant_weights must be a string 'tenant=weight,...'")
    for part in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, weight = part.rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = 0.0
        if not sep or not tenant.strip() or not math.isfinite(value) or value <= 0:
            raise ValueError(f"flow_tenant_weights: {part!r} is not 'tenant=positive weight'")
        out[tenant.strip()] = value
    return out


# Priority classes (the ``x-kvroute-priority`` header): the metric label of each.
CLASSES: dict[int, str] = {1: "high", 0: "normal", -1: "low"}
DEFAULT_TENANT = "default"
# Tenants with a label of their own in ``tenant_tokens`` per model (the first seen keep it, so the
# counters stay monotone); the rest are counted as "other".
TENANT_LABELS = 32
# Tenants whose fair-queuing tag is remembered per model and class before idle ones are forgotten.
_MAX_TENANTS = 4096
_RECENT_WAITS = 256


def class_name(priority: int) -> str:
    """The metric label of a priority class."""
    return CLASSES.get(priority, "normal")


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


@dataclass(slots=True, eq=False)
class Ticket:
    """One request at the gate.

    ``prefill_tokens`` and ``resident`` are the queue's prediction at arrival (what the order
    reads): the prompt tokens the replica it would go to does not hold, and whether it is a
    continuing session's turn whose prefix is still there.  ``waited_s`` is set when it leaves the
    queue; ``retry_after_s`` when it is shed; ``why``, by the dispatcher, when it is queued (why it
    had to wait, in words, for the decision log).
    """

    key: RoutingKey
    arrived: float
    state: TicketState = TicketState.GRANTED
    prefill_tokens: int = 0
    resident: bool = False
    waited_s: float = 0.0
    reason: ShedReason | None = None
    retry_after_s: int = 0
    on_decided: Callable[[Ticket], None] | None = None
    seq: int = 0
    holds: bool = False  # granted from the queue and not yet claimed: counts as a reservation
    door_tokens: int = 0  # a new session let in at the door: what it adds until it is sent
    why: str = ""
    holder: str | None = None  # late binding: the replica holding its prefix, which it waits for
    bind_until: float = 0.0  # ... until then (the dispatcher's clock)
    target: str | None = None  # granted for its holder and not yet claimed

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


@dataclass(frozen=True, slots=True)
class Prediction:
    """Where a request would go if it were routed now, for the queue: the prompt tokens it would
    prefill there, whether it is a continuing session's turn whose prefix is still resident, and
    (late binding, while the fleet is saturated) the replica holding most of its prompt and how
    many seconds it may wait for that replica before it may go elsewhere."""

    prefill_tokens: int
    resident: bool
    holder: str | None = None
    bind_s: float = 0.0


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


@dataclass(slots=True)
class _Band:
    """Start-time fair queuing between the tenants of one class: ``finish`` is each tenant's
    virtual finish tag (token-weighted service so far), ``vtime`` the start tag of the last
    request granted.  A tenant's next request starts at ``max(vtime, finish)``, so a tenant that
    was idle comes back level with the others, with no credit banked."""

    vtime: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)
    sweep_at: int = 64  # forget idle tenants once this many are remembered

    def start(self, tenant: str) -> float:
        """The virtual start tag of ``tenant``'s next request."""
        return max(self.vtime, self.finish.get(tenant, 0.0))


@dataclass(slots=True)
class _Queue:
    """One model's waiting requests and the fleet they wait for."""

    workers: Sequence[WorkerState] = ()
    tickets: list[Ticket] = field(default_factory=list)
    tokens: int = 0
    reserved: int = 0  # granted from the queue, not yet claimed by their edge
    opened: int = 0  # working-set tokens of new sessions let in at the door and not yet sent
    targeted: dict[str, int] = field(default_factory=dict)  # unclaimed grants for their holder
    finished: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    sessions: SessionBook = field(default_factory=SessionBook)  # for session admission
    bands: dict[int, _Band] = field(default_factory=dict)  # by priority class
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT_WAITS))
    median_wait: float | None = None  # of ``waits``; None: to be computed again


class FlowControl:
    """Every model's gate and queue (see the module's docstring)."""

    def __init__(self, settings: Callable[[str], FlowSettings],
                 placement: Callable[[str], PlacementSettings],
                 saturated: Callable[[str], bool] = lambda model: False,
                 thrashing: Callable[[str], bool] = lambda model: False) -> None:
        self._settings = settings
        self._placement = placement
        self._saturated = saturated
        self._thrashing = thrashing
        self._queues: dict[str, _Queue] = {}
        self._seq = 0
        self.admitted: dict[tuple[str, str, str], int] = {}  # by (model, "at_once" | "after_wait", class)
        self.shed: dict[tuple[str, str, str], int] = {}  # by (model, reason, class)
        # Tokens served, by (model, tenant label): the engine's prompt + output tokens, or the
        # estimate (prompt + max_tokens) when the answer reported no usage.  TENANT_LABELS tenants
        # per model have their own label, the rest are "other".
        self.tenant_tokens: dict[tuple[str, str], int] = {}
        self._labelled: dict[str, set[str]] = {}
        self._arriving: Ticket | None = None  # the request admit() is pumping the queue for

    # --- the gate ---------------------------------------------------------------------------------

    def gate_on(self, model: str) -> bool:
        """Whether ``model``'s requests pass the gate: ``flow_control`` true, or "auto" while the
        fleet is saturated."""
        return switch_on(self._settings(model).flow_control, self._saturated(model))

    def admit(self, key: RoutingKey, workers: Sequence[WorkerState], now: float,
              predict: Callable[[], Prediction]) -> Ticket:
        """A request arrived: grant it at once while some replica is admissible for it, nothing
        waits ahead of it and (late binding) the replica holding its prefix is among them; else
        queue it (``predict`` says where it would go, for the order, session admission and late
        binding) or shed it past the caps."""
        s = self._settings(key.model)
        self._seq += 1
        ticket = Ticket(key, now, seq=self._seq)
        if not switch_on(s.flow_control, self._saturated(key.model)):
            return ticket
        q = self._queues.get(key.model)
        if q is None:
            q = self._queues[key.model] = _Queue()
        q.workers = workers
        if key.session_id is not None:
            q.sessions.arrived(key.session_id, now)
        # The door needs what the fleet holds of its prompt already; late binding, its holder.
        predicted = self._new_session(key, q, s) or self._saturated(key.model)
        if predicted:
            self._predicted(ticket, predict())
        if not q.tickets and self._room(key, q) > q.reserved and \
                self._session_fits(ticket, q, now, s) and self._holder_free(ticket, q, now):
            self._granted(ticket, q, s, waited=False)
            return ticket
        full = len(q.tickets) >= s.flow_max_queued
        if full or (s.flow_max_queued_tokens and q.tokens + key.est_prompt_tokens > s.flow_max_queued_tokens):
            reason = ShedReason.QUEUE_FULL if full else ShedReason.QUEUE_TOKENS
            victims = self._displaceable(ticket, q, s)
            if victims is None:
                return self._shed(ticket, q, reason, now, s, queued=False)
            for victim in victims:
                self._leave(victim, q, now)
                self._shed(victim, q, ShedReason.DISPLACED, now, s, queued=True)
        if not predicted:
            self._predicted(ticket, predict())
        ticket.state = TicketState.QUEUED
        q.tickets.append(ticket)
        q.tokens += key.est_prompt_tokens
        if key.session_id is not None:
            q.sessions.queued(key.session_id, +1)
        if self._room(key, q) > q.reserved:
            # Room, but requests wait (new sessions held back): the order decides, now.
            self._arriving = ticket
            try:
                self.pump(now)
            finally:
                self._arriving = None
            if ticket.holds:  # granted at once: its edge routes it without a callback (or claim)
                self.claim(ticket)
                cls = class_name(key.priority)
                self.admitted[(key.model, "after_wait", cls)] -= 1
                self._count_admitted(key.model, cls, waited=False)
        return ticket

    @staticmethod
    def _predicted(ticket: Ticket, p: Prediction) -> None:
        ticket.prefill_tokens, ticket.resident = p.prefill_tokens, p.resident
        if p.holder is not None and p.bind_s > 0:
            ticket.holder, ticket.bind_until = p.holder, ticket.arrived + p.bind_s

    def _holder_free(self, t: Ticket, q: _Queue, now: float) -> bool:
        """Late binding: whether ``t`` may be granted now as far as its holder goes — it has none,
        its wait for it is over, or the holder is admissible for it and no grant for it is
        unclaimed yet (a holder that left or is not ready is nothing to wait for)."""
        holder = t.holder
        if holder is None or now >= t.bind_until:
            return True
        if q.targeted.get(holder):
            return False
        for w in q.workers:
            if w.id == holder:
                if not w.ready:
                    return True
                model = t.key.model
                return admissible(w, footprint(t.key), self._placement(model),
                                  self._settings(model).flow_kv_fill)
        return True

    def waits_for_holder(self, t: Ticket, now: float) -> bool:
        """Whether ``t`` waits for the replica holding its prefix (late binding) at ``now``."""
        q = self._queues.get(t.key.model)
        return q is not None and t.holder is not None and not self._holder_free(t, q, now)

    def _displaceable(self, ticket: Ticket, q: _Queue, s: FlowSettings) -> list[Ticket] | None:
        """The queued requests ``ticket`` pushes out of a full queue — of lower classes only, the
        lowest class first and within it the newest — or None when those cannot make room."""
        lower = sorted((t for t in q.tickets if t.priority < ticket.priority),
                       key=lambda t: (t.priority, -t.seq))
        victims: list[Ticket] = []
        count, tokens = len(q.tickets), q.tokens
        need = ticket.key.est_prompt_tokens
        for victim in lower:
            if count < s.flow_max_queued and (
                    not s.flow_max_queued_tokens or tokens + need <= s.flow_max_queued_tokens):
                break
            victims.append(victim)
            count -= 1
            tokens -= victim.key.est_prompt_tokens
        fits = count < s.flow_max_queued and (
            not s.flow_max_queued_tokens or tokens + need <= s.flow_max_queued_tokens)
        return victims if fits else None

    def _room(self, key: RoutingKey, q: _Queue) -> int:
        """How many replicas are admissible for ``key`` (the replicas able to serve its model at
        all, when none is: then the pipeline answers, not the queue)."""
        placement = self._placement(key.model)
        fill = self._settings(key.model).flow_kv_fill
        need = footprint(key)
        model = key.model
        ready = 0
        room = 0
        for w in q.workers:
            if not w.ready or not w.serves(model):
                continue
            ready += 1
            if admissible(w, need, placement, fill):
                room += 1
        return room if ready else 1 << 30

    def _new_session(self, key: RoutingKey, q: _Queue, s: FlowSettings) -> bool:
        """Whether session admission applies to ``key``: on, and a session the fleet does not
        serve yet."""
        return key.session_id is not None and key.session_id not in q.sessions and \
            switch_on(s.flow_session_admission, self._thrashing(key.model))

    def at_door(self, t: Ticket) -> bool:
        """Whether session admission holds ``t`` at the door: a new session's request whose prefix
        is not resident."""
        q = self._queues.get(t.key.model)
        return q is not None and self._at_door(t, q, self._settings(t.key.model))

    def _at_door(self, t: Ticket, q: _Queue, s: FlowSettings) -> bool:
        """A new session's request that session admission may hold (its prefix not resident)."""
        return not t.resident and self._new_session(t.key, q, s)

    def _session_fits(self, t: Ticket, q: _Queue, now: float, s: FlowSettings) -> bool:
        """Session admission (routing/session_admission.py): a request of a session the fleet
        serves, or whose prefix is still resident (a session forgotten while quiet), always fits;
        a new session's first request fits while the working set has room for it in the fleet's
        KV cache, or once it has waited ``flow_session_door_s`` (always, when the setting is off,
        the request has no session or the KV sizes are unknown).  New sessions let in and not
        sent yet (``q.opened``) count in the working set."""
        if not self._new_session(t.key, q, s) or t.resident:
            return True
        if s.flow_session_door_s and now - t.arrived >= s.flow_session_door_s:
            return True
        fleet = 0
        for w in q.workers:
            if w.ready and w.serves(t.key.model):
                if w.kv_tokens is None:
                    return True
                fleet += w.kv_tokens
        return q.sessions.fits(t.key, t.prefill_tokens, fleet, s.flow_session_fill,
                               s.flow_session_rule, now, s.flow_session_idle_s, q.opened)

    def session_sent(self, key: RoutingKey, prefill_tokens: int) -> None:
        """A request of ``key``'s session was sent to a replica that computes ``prefill_tokens``
        of its prompt.  Tracked only where session admission reads it (its idle sessions are
        dropped there): otherwise every conversation ever seen would stay in this table."""
        s = self._settings(key.model)
        if key.session_id is None or s.flow_session_admission is False:
            return
        q = self._queues.get(key.model)
        if q is None:
            q = self._queues[key.model] = _Queue()
        q.sessions.sent(key, prefill_tokens, s.flow_session_rule)

    def session_finished(self, model: str, session_id: str, now: float) -> None:
        """A request of the session ended."""
        q = self._queues.get(model)
        if q is not None:
            q.sessions.finished(session_id, now)
            if len(q.sessions) > q.sessions.sweep_at:
                s = self._settings(model)
                q.sessions.sweep(now, s.flow_session_idle_s, s.flow_session_rule)

    def pump(self, now: float) -> list[Ticket]:
        """Grant queued requests, in each model's order, while a replica is admissible for the next
        one; returns the granted tickets (their ``on_decided`` has been called)."""
        granted: list[Ticket] = []
        for model, q in self._queues.items():
            if not q.tickets:
                continue
            s = self._settings(model)
            if not self.gate_on(model):
                # The gate opened (the fleet is no longer saturated): whoever waits goes now.
                for t in sorted(q.tickets, key=lambda t: (-t.priority, t.arrived, t.seq)):
                    self._grant(t, q, s, now)
                    granted.append(t)
                continue
            order = ORDERS[s.flow_order]
            aged_after = self._aged_after(q, s)
            held_back: set[int] = set()
            # New sessions pass the door oldest first (highest class first), none past another:
            # where the order reaches one, the longest-held one takes its place (a bounded wait
            # at the door, not the shortest prompt first forever).
            door = deque(sorted((t for t in q.tickets if self._at_door(t, q, s)),
                                key=lambda t: (-t.priority, t.arrived, t.seq)))
            door_shut = False
            while (best := self._next(q, now, order, aged_after, held_back)) is not None:
                if self._room(best.key, q) <= q.reserved:
                    break
                if not self._holder_free(best, q, now):
                    held_back.add(best.seq)  # it waits for its holder; others may go
                    continue
                if self._at_door(best, q, s):
                    # The door's oldest goes in its place, if the fleet's KV holds its session and
                    # a replica is admissible for it; else the door shuts for this pass, all of it
                    # at once (a continuing session's turn behind it may still go).
                    if door_shut or not door or not self._session_fits(door[0], q, now, s) or \
                            self._room(door[0].key, q) <= q.reserved:
                        door_shut = True
                        held_back.add(best.seq)
                        held_back.update(t.seq for t in door)
                        door.clear()
                        continue
                    best = door.popleft()
                    best.door_tokens = q.sessions.need(best.key, best.prefill_tokens, s.flow_session_rule)
                    q.opened += best.door_tokens
                self._grant(best, q, s, now)
                granted.append(best)
        return granted

    def _grant(self, t: Ticket, q: _Queue, s: FlowSettings, now: float) -> None:
        """Grant queued ``t``: out of the queue, a reservation until its edge claims it (for its
        holder, when it waited for one), and its edge told."""
        self._leave(t, q, now)
        if t is not self._arriving:  # one granted as it arrives did not wait
            q.waits.append(t.waited_s)
            q.median_wait = None
        t.state = TicketState.GRANTED
        t.holds = True
        q.reserved += 1
        if t.holder is not None and now < t.bind_until:
            t.target = t.holder
            q.targeted[t.holder] = q.targeted.get(t.holder, 0) + 1
        self._granted(t, q, s, waited=True)
        if t.on_decided is not None:
            t.on_decided(t)

    def _next(self, q: _Queue, now: float, order: Order, aged_after: float,
              held_back: set[int]) -> Ticket | None:
        """The queued request to grant next: of the highest class waiting; within it, of the
        tenant whose next request has the earliest virtual start tag (ties: the better head by
        ``order``); within the tenant, the first by ``order``."""
        top: int | None = None
        for t in q.tickets:
            if (top is None or t.priority > top) and t.seq not in held_back:
                top = t.priority
        if top is None:
            return None
        heads: dict[str, tuple[tuple[float, ...], Ticket]] = {}
        for t in q.tickets:
            if t.priority != top or t.seq in held_back:
                continue
            k = order(t, now, aged_after)
            head = heads.get(t.tenant)
            if head is None or k < head[0]:
                heads[t.tenant] = (k, t)
        if len(heads) == 1:
            return next(iter(heads.values()))[1]
        band = q.bands.get(top) or _Band()
        return min(heads.values(), key=lambda h: (band.start(h[1].tenant), h[0]))[1]

    def _aged_after(self, q: _Queue, s: FlowSettings) -> float:
        """Seconds after which a queued request ages: ``flow_aging_factor`` x the median of the
        recent queue waits, never below ``flow_aging_s``."""
        if not q.waits:
            return s.flow_aging_s
        if q.median_wait is None:
            q.median_wait = statistics.median(q.waits)
        return max(s.flow_aging_s, s.flow_aging_factor * q.median_wait)

    def claim(self, ticket: Ticket) -> None:
        """A ticket granted from the queue is about to be routed and sent (with no pause in between,
        so its replica's load counts it from then on): its reservation ends, and a new session let
        in at the door counts in the working set from its send on, not through ``q.opened``."""
        if ticket.holds:
            ticket.holds = False
            q = self._queues.get(ticket.key.model)
            if q is not None:
                q.reserved -= 1
                q.opened -= ticket.door_tokens
                if ticket.target is not None:
                    left = q.targeted[ticket.target] - 1
                    if left:
                        q.targeted[ticket.target] = left
                    else:
                        del q.targeted[ticket.target]
            ticket.door_tokens = 0
            ticket.target = None

    def withdraw(self, ticket: Ticket, now: float) -> list[Ticket]:
        """Its client left: the ticket leaves no trace (out of the queue, its reservation back).
        Returns the tickets this granted to others."""
        q = self._queues.get(ticket.key.model)
        if ticket.state is TicketState.QUEUED and q is not None:
            self._leave(ticket, q, now)
        self.claim(ticket)
        if ticket.state is not TicketState.SHED:
            ticket.state = TicketState.WITHDRAWN
        return self.pump(now)

    def expire(self, ticket: Ticket, now: float) -> bool:
        """The ticket's TTL passed: shed it if it still waits (True), else nothing (False)."""
        q = self._queues.get(ticket.key.model)
        if ticket.state is not TicketState.QUEUED or q is None:
            return False
        self._leave(ticket, q, now)
        s = self._settings(ticket.key.model)
        self._shed(ticket, q, ShedReason.TTL, now, s, queued=True)
        return True

    def shed_all(self, now: float) -> list[Ticket]:
        """Shutdown: every queued request is shed at once."""
        out: list[Ticket] = []
        for model, q in self._queues.items():
            s = self._settings(model)
            for t in list(q.tickets):
                self._leave(t, q, now)
                out.append(self._shed(t, q, ShedReason.SHUTDOWN, now, s, queued=True))
        return out

    def finished(self, model: str, now: float) -> None:
        """A request of ``model`` ended (the drain rate Retry-After predicts from)."""
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = _Queue()
        q.finished.append(now)

    # --- figures ----------------------------------------------------------------------------------

    def retry_after(self, model: str, now: float) -> int:
        """Seconds after which a shed request may find room: the queue's length over the rate at
        which the model's requests recently finished (whole seconds, at least 1, at most the TTL)."""
        s = self._settings(model)
        q = self._queues.get(model)
        ahead = 1 + (len(q.tickets) if q is not None else 0)
        rate = self.drain_rate(model, now)
        ttl = max(1, math.ceil(s.flow_queue_ttl_s))
        if rate <= 0:
            return ttl
        return max(1, min(ttl, math.ceil(ahead / rate)))

    def drain_rate(self, model: str, now: float) -> float:
        """Requests of ``model`` finished per second, over the last (at most 64) completions."""
        q = self._queues.get(model)
        if q is None or len(q.finished) < 2:
            return 0.0
        span = max(now, q.finished[-1]) - q.finished[0]
        return (len(q.finished) - 1) / span if span > 0 else 0.0

    def depth(self) -> dict[str, tuple[int, int]]:
        """Queued requests and queued estimated prompt tokens, by model."""
        return {m: (len(q.tickets), q.tokens) for m, q in self._queues.items()}

    def session_counts(self, now: float) -> dict[str, tuple[int, int]]:
        """Session admission's door by model, for a model where it is on: sessions in the working
        set (admitted, not idle past what the rule keeps) and new sessions whose first turn waits
        at the door."""
        out: dict[str, tuple[int, int]] = {}
        for model, q in self._queues.items():
            s = self._settings(model)
            if s.flow_session_admission is not False:
                waiting = {t.key.session_id for t in q.tickets if self._at_door(t, q, s)}
                live = q.sessions.live(now, s.flow_session_idle_s, s.flow_session_rule)
                out[model] = (live, len(waiting))
        return out

    def free_room(self, key: RoutingKey) -> int:
        """How many replicas are admissible for ``key`` now beyond the grants not yet claimed
        (read-only; 0 or less: none is free for it)."""
        q = self._queues.get(key.model)
        return 1 if q is None else self._room(key, q) - q.reserved

    def depth_by_class(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Queued requests and queued estimated prompt tokens by (model, class), every class of
        every model the gate has seen (zeros included, so the series stay)."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for model, q in self._queues.items():
            for name in CLASSES.values():
                out[(model, name)] = (0, 0)
            for t in q.tickets:
                n, tokens = out[(model, class_name(t.priority))]
                out[(model, class_name(t.priority))] = (n + 1, tokens + t.key.est_prompt_tokens)
        return out

    def working_set(self, model: str, now: float) -> int:
        """KV tokens the sessions ``model``'s fleet serves count in session admission's working
        set (0 where it is off)."""
        q = self._queues.get(model)
        s = self._settings(model)
        if q is None or s.flow_session_admission is False:
            return 0
        return q.sessions.working_set(now, s.flow_session_idle_s, s.flow_session_rule)

    def blocked(self, model: str, now: float) -> int:
        """How many of ``model``'s queued requests wait for room (at the door included), not only
        for the replica holding their prefix (late binding)."""
        q = self._queues.get(model)
        if q is None:
            return 0
        return sum(1 for t in q.tickets if t.holder is None or self._holder_free(t, q, now))

    def queued(self, model: str) -> list[Ticket]:
        """The model's queued tickets, in arrival order."""
        q = self._queues.get(model)
        return list(q.tickets) if q is not None else []

    # --- bookkeeping ------------------------------------------------------------------------------

    def _leave(self, t: Ticket, q: _Queue, now: float) -> None:
        q.tickets.remove(t)
        q.tokens -= t.key.est_prompt_tokens
        if t.key.session_id is not None:
            q.sessions.queued(t.key.session_id, -1)
        t.waited_s = now - t.arrived

    def _shed(self, t: Ticket, q: _Queue, reason: ShedReason, now: float, s: FlowSettings, *,
              queued: bool) -> Ticket:
        t.state = TicketState.SHED
        t.reason = reason
        t.retry_after_s = self.retry_after(t.key.model, now)
        label = (t.key.model, reason.value, class_name(t.priority))
        self.shed[label] = self.shed.get(label, 0) + 1
        if queued and t.on_decided is not None:
            t.on_decided(t)
        return t

    def _granted(self, t: Ticket, q: _Queue, s: FlowSettings, *, waited: bool) -> None:
        """Count a grant and charge its tenant's fair share: its virtual finish tag advances by the
        request's footprint over the tenant's weight."""
        model = t.key.model
        self._count_admitted(model, class_name(t.priority), waited=waited)
        cost = footprint(t.key)
        band = q.bands.get(t.priority)
        if band is None:
            band = q.bands[t.priority] = _Band()
        tenant = t.tenant
        start = band.start(tenant)
        band.finish[tenant] = start + cost / tenant_weights(s.flow_tenant_weights).get(tenant, 1.0)
        band.vtime = start
        if not any(other.priority == t.priority for other in q.tickets):
            # The class's busy period ended (SFQ): what was served without contention is nobody's
            # debt, and every tenant starts level when requests queue again.
            band.vtime = max(band.vtime, band.finish[tenant])
        if len(band.finish) > band.sweep_at:
            self._forget_idle(band, q)

    def served(self, model: str, tenant: str | None, priority: int, charged: int,
               used: int | None) -> None:
        """A request granted through the gate was answered: ``charged`` tokens (prompt estimate +
        ``max_tokens``) were put on its tenant's fair share at the grant, ``used`` (prompt +
        output tokens, as the engine reported them; None when the answer carried no usage) is
        what it took.  The tenant's finish tag moves by the difference, so a tenant whose clients
        ask for a large ``max_tokens`` and get short answers is not held back for tokens it never
        used; and its served tokens are counted (``tenant_tokens``)."""
        s = self._settings(model)
        if s.flow_control is False:
            return
        tenant = tenant or DEFAULT_TENANT
        q = self._queues.get(model)
        band = q.bands.get(priority) if q is not None else None
        if used is not None and band is not None and tenant in band.finish:
            # Below the virtual time a correction changes nothing: start() takes the larger.
            weight = tenant_weights(s.flow_tenant_weights).get(tenant, 1.0)
            band.finish[tenant] += (used - charged) / weight
        labelled = self._labelled.setdefault(model, set())
        if tenant not in labelled and len(labelled) < TENANT_LABELS:
            labelled.add(tenant)
        label = (model, tenant if tenant in labelled else "other")
        self.tenant_tokens[label] = self.tenant_tokens.get(label, 0) + (charged if used is None else used)

    @staticmethod
    def _forget_idle(band: _Band, q: _Queue) -> None:
        """Bound the tenants remembered: a tenant with nothing queued whose finish tag the virtual
        time has passed would start at ``vtime`` anyway, so forgetting it changes nothing; past
        ``_MAX_TENANTS`` idle tenants still ahead of it are forgotten too (their debt is dropped)."""
        waiting = {t.tenant for t in q.tickets}
        for tenant, tag in list(band.finish.items()):
            if tenant not in waiting and tag <= band.vtime:
                del band.finish[tenant]
        if len(band.finish) > _MAX_TENANTS:
            for tenant in list(band.finish):
                if tenant not in waiting:
                    del band.finish[tenant]
        band.sweep_at = max(64, 2 * len(band.finish))

    def _count_admitted(self, model: str, cls: str, *, waited: bool) -> None:
        label = (model, "after_wait" if waited else "at_once", cls)
        self.admitted[label] = self.admitted.get(label, 0) + 1
