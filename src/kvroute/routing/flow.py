"""Flow control: hold requests at the router while no replica can start them, and admit them in a
cache- and session-aware order when one can.

The router used to forward every request the moment it arrived; past the fleet's capacity each
engine's own FCFS queue then bound the request to that replica early, and the prefills admitted
ahead of a session's next turn evicted the blocks that would have made that turn cheap.  Here a
request is *admitted* only while some replica is *admissible* for it; otherwise it waits in its
model's queue and is decided — the whole pipeline, afresh — once a replica frees up.  Past the
queue's caps, or at its deadline (``flow_queue_ttl_s`` after it arrived), it is *shed*: the edge
answers with the API's own overload error and a ``Retry-After`` from the predicted drain
(``ModelQueue.retry_after``).

This module is the gate; it composes four parts, each a rule of its own, per model:

* the queue (routing/flow_queue.py): the tickets, their caps, the order within a tenant
  (``flow_order``, aged by ``flow_aging_factor`` x the median recent wait, at least
  ``flow_aging_s``), which replicas are admissible, the reservations of grants not yet claimed,
  late binding's wait for a prefix's holder, and the drain rate behind ``Retry-After``;
* the tenants' fair share (routing/fair_share.py): start-time fair queuing between the tenants of
  a priority class, token-weighted (classes are strict: the highest waiting goes first, and a full
  queue sheds the lowest first);
* the session door (routing/session_admission.py): a new session starts only while the working
  set of the sessions already served fits the fleet's KV cache;
* the counters (routing/flow_counters.py): admitted, shed and tokens served per tenant, with their
  own label limits.

Pure: no clock (the dispatcher passes its timer's readings), no I/O.  The dispatcher
(routing/dispatch.py) owns the one ``FlowControl`` of a router and calls it from both clocks:
``admit`` on arrival, ``pump`` whenever a replica may have freed up (a response ended, a scrape,
other routers' load), ``claim`` when a woken request is about to be routed, ``withdraw`` when its
client left, ``expire`` at its deadline and ``shed_all`` at shutdown.  A ticket's ``on_decided``
callback is how the edge learns that it was granted or shed (an asyncio future over HTTP, an event
on the virtual clock in simulation); its ``deadline`` is when the edge's timer calls ``expire``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvroute.routing.fair_share import FairShare, tenant_weight, tenant_weights
from kvroute.routing.flow_counters import CLASSES, TENANT_LABELS, FlowCounters, class_name
from kvroute.routing.flow_queue import (
    DEFAULT_TENANT,
    ORDERS,
    ModelQueue,
    Prediction,
    ShedReason,
    Ticket,
    TicketState,
    by_arrival,
)
from kvroute.routing.key import RoutingKey
from kvroute.routing.saturation import check_switch, switch_on
from kvroute.routing.session_admission import KINDS, NAMED, RULES, SessionDoor, kind
from kvroute.routing.settings import PlacementSettings, check_non_negative, check_positive, setting
from kvroute.routing.worker import WorkerState

# The gate's interface as the edges and /metrics import it (the ticket types live with the queue,
# the label limit with the counters).
__all__ = ["TENANT_LABELS", "FlowControl", "FlowSettings", "ModelFlow", "ShedReason", "Ticket",
           "TicketState"]


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
    flow_session_fill_unsaturated: float = setting(
        1.25, "share of the fleet's KV cache the working set may take before a new session waits "
              "while the fleet is not saturated; with flow_session_admission 'auto', the sessions "
              "the client names pass the door from the start (0: flow_session_fill then too, and "
              "the door waits for the fleet to thrash; docs/saturation.md)")
    flow_session_idle_s: float = setting(
        15.0, "a session stops counting in the working set this long after its last request ended")
    flow_session_door_s: float = setting(
        0.0, "a new session's first turn held this long at the door is admitted anyway "
             "(0: it waits until flow_queue_ttl_s)")
    flow_session_slow_start: int = setting(
        3, "cold start of the door's seat: until 8 sessions have left (their size is not learnt "
           "yet), a replica takes a new session only while those it took and has not seen past "
           "their first request number fewer than this, or than its sessions seen past it, and "
           "each session counts at least the median one served (0: off; docs/saturation.md, "
           "'The cold start')")

    def __post_init__(self) -> None:
        check_switch(self, "flow_control", "flow_session_admission")
        check_non_negative(self, "flow_aging_s", "flow_aging_factor", "flow_max_queued",
                           "flow_max_queued_tokens", "flow_session_idle_s", "flow_session_door_s",
                           "flow_session_fill_unsaturated", "flow_session_slow_start")
        tenant_weights(self.flow_tenant_weights)  # raises ValueError when malformed
        if self.flow_session_rule not in RULES:
            raise ValueError(f"flow_session_rule must be one of {', '.join(RULES)}")
        check_positive(self, "flow_session_fill", "flow_kv_fill", what="share")
        check_positive(self, "flow_queue_ttl_s", what="number of seconds")
        if self.flow_order not in ORDERS:
            raise ValueError(f"flow_order must be one of {', '.join(ORDERS)}")


@dataclass(slots=True)
class ModelFlow:
    """One model's parts: its queue, its tenants' fair share and its session door."""

    queue: ModelQueue = field(default_factory=ModelQueue)
    fair: FairShare = field(default_factory=FairShare)
    door: SessionDoor = field(default_factory=SessionDoor)


class FlowControl:
    """Every model's gate (see the module's docstring)."""

    def __init__(self, settings: Callable[[str], FlowSettings],
                 placement: Callable[[str], PlacementSettings],
                 saturated: Callable[[str], bool] = lambda model: False,
                 thrashing: Callable[[str], bool] = lambda model: False) -> None:
        self._settings = settings
        self._placement = placement
        self._saturated = saturated
        self._thrashing = thrashing
        self._models: dict[str, ModelFlow] = {}
        self._seq = 0
        self.counters = FlowCounters()

    @property
    def admitted(self) -> dict[tuple[str, str, str], int]:
        """Requests admitted, by (model, "at_once" | "after_wait", class)."""
        return self.counters.admitted

    @property
    def shed(self) -> dict[tuple[str, str, str], int]:
        """Requests shed, by (model, reason, class)."""
        return self.counters.shed

    @property
    def tenant_tokens(self) -> dict[tuple[str, str], int]:
        """Tokens served through the gate, by (model, tenant label)."""
        return self.counters.tenant_tokens

    def _model(self, model: str) -> ModelFlow:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelFlow()
        return m

    # --- the switches -----------------------------------------------------------------------------

    @staticmethod
    def _early(s: FlowSettings) -> bool:
        """Whether the sessions the client names pass the door from the start, not only once the
        fleet thrashes: ``flow_session_admission`` "auto" with ``flow_session_fill_unsaturated``
        set (and a gate).  A step's new sessions send their first turns at once, before any
        reading of the fleet can engage; with a named session the door knows a conversation is
        coming, and a derived identity (a one-shot question) is left to the reading."""
        return s.flow_session_admission == "auto" and s.flow_session_fill_unsaturated > 0 and \
            s.flow_control is not False

    def _gate_on(self, key: RoutingKey, s: FlowSettings, m: ModelFlow | None) -> bool:
        """Whether ``key``'s request passes the gate: ``flow_control`` true, or "auto" while the
        fleet is saturated; before that, a first turn the door holds from the start (``_early``).
        A later turn passes as before: gating every turn of a named session too made no difference
        beyond the spread (docs/saturation.md, "The door from the start for every kind")."""
        if switch_on(s.flow_control, self._saturated(key.model)):
            return True
        if not (key.client_session and self._early(s)):
            return False
        return m is None or m.door.is_new(key, NAMED)

    def engaged(self, key: RoutingKey) -> bool:
        """Whether the gate is engaged for ``key``'s request now (else ``admit`` grants it at once,
        with nothing to record: the dispatcher then skips it)."""
        return self._gate_on(key, self._settings(key.model), self._models.get(key.model))

    def _door_kinds(self, model: str, s: FlowSettings) -> Container[bool]:
        """The kinds of session (session_admission.kind) the door applies to now: every kind with
        ``flow_session_admission`` true, or "auto" while the fleet thrashes; else the sessions the
        client names, from the start (``_early``)."""
        if switch_on(s.flow_session_admission, self._thrashing(model)):
            return KINDS
        return NAMED if self._early(s) else ()

    def _fits(self, t: Ticket, m: ModelFlow, now: float, s: FlowSettings, door_on: Container[bool]) -> bool:
        fill = s.flow_session_fill
        if s.flow_session_fill_unsaturated and not self._saturated(t.key.model):
            # Before the fleet saturates, sessions a little past the KV are still served warm
            # while others pause; once it is saturated, every one let in evicts a paused one.
            # A seat's count already takes the pauses in (each session at its size on the mean
            # over its life): it keeps flow_session_fill.
            fill = s.flow_session_fill_unsaturated
        return m.door.fits(t, m.queue.workers, now, door_on, fill=fill,
                           seat_fill=s.flow_session_fill, rule=s.flow_session_rule,
                           idle_s=s.flow_session_idle_s, door_s=s.flow_session_door_s,
                           slow_start=s.flow_session_slow_start)

    # --- arrival ----------------------------------------------------------------------------------

    def admit(self, key: RoutingKey, workers: Sequence[WorkerState], now: float,
              predict: Callable[[], Prediction]) -> Ticket:
        """A request arrived: grant it at once while some replica is admissible for it, nothing
        waits ahead of it and (late binding) the replica holding its prefix is among them; else
        queue it until its deadline (``predict`` says where it would go, for the order, session
        admission and late binding) or shed it past the caps."""
        model = key.model
        s = self._settings(model)
        self._seq += 1
        ticket = Ticket(key, now, seq=self._seq)
        if not self._gate_on(key, s, self._models.get(model)):
            return ticket
        m = self._model(model)
        q = m.queue
        q.workers = workers
        if key.session_id is not None:
            # Learnt only while the gate is engaged, as the door reads it: learnt before, the
            # pauses make the working set forget ended sessions sooner, and the working-set test
            # of thrashing (docs/saturation.md) fired 25 s into 24 agent sessions instead of
            # carrying over from 16 (output -22 % at 24 sessions without pauses, virtual time).
            m.door.book.arrived(key.session_id, now, key.client)
        m.door.returned(ticket, now)
        placement, fill = self._placement(model), s.flow_kv_fill
        door_on = self._door_kinds(model, s)
        # The door needs what the fleet holds of its prompt already; late binding, its holder.
        predicted = m.door.is_new(key, door_on) or self._saturated(model)
        if predicted:
            ticket.predicted(predict())
        if not q.tickets and q.room(key, placement, fill) > q.reserved and \
                self._fits(ticket, m, now, s, door_on) and q.holder_free(ticket, now, placement, fill):
            self._charge(ticket, m, s)
            m.door.granted(ticket)
            self.counters.count_admitted(model, key.priority, waited=False)
            return ticket
        reason = q.over_caps(key, s.flow_max_queued, s.flow_max_queued_tokens)
        if reason is not None:
            victims = q.displaceable(ticket, s.flow_max_queued, s.flow_max_queued_tokens)
            if victims is None:
                return self._shed(ticket, m, reason, now, s)
            for victim in victims:
                self._leave(victim, m, now)
                self._shed(victim, m, ShedReason.DISPLACED, now, s)
        if not predicted:
            ticket.predicted(predict())
        wait = self._door_wait(ticket, m, now, s, door_on)
        if wait is not None:
            return self._shed_at_door(ticket, m, wait, now, s)
        ticket.state = TicketState.QUEUED
        # The queue TTL's one rule: both edges arm their timer for this deadline (Dispatcher.expires_in).
        ticket.deadline = now + s.flow_queue_ttl_s
        q.join(ticket)
        if key.session_id is not None:
            m.door.book.queued(key.session_id, +1)
        if q.room(key, placement, fill) > q.reserved:
            # Room, but requests wait (new sessions held back): the order decides, now.
            self._pump(now, arriving=ticket)
        return ticket

    def _door_wait(self, t: Ticket, m: ModelFlow, now: float, s: FlowSettings,
                   door_on: Container[bool]) -> float | None:
        """The predicted wait at the door of ``t``, about to queue, when it passes the queue TTL
        (it would be shed there); None when it is not held at the door, the wait is not predicted
        yet, is within the TTL, or the door lets it in sooner anyway (``flow_session_door_s``)."""
        if not m.door.holds(t, door_on) or not self._door_predicts(s):
            return None
        wait = m.door.wait_s(t, m.queue.tickets, now, door_on)
        return wait if wait is not None and wait > s.flow_queue_ttl_s else None

    @staticmethod
    def _door_predicts(s: FlowSettings) -> bool:
        """Whether a first turn's predicted wait at the door can shed it: not where the door lets
        it in before its TTL anyway (``flow_session_door_s``)."""
        door_s = s.flow_session_door_s
        return not (door_s and door_s < s.flow_queue_ttl_s)

    def _recheck_door(self, model: str, m: ModelFlow, now: float) -> None:
        """The first turns still held at the door after a pass: each whose predicted wait from
        now (the sessions still ahead of it over the drain measured now) passes the queue TTL is
        shed now, as it would have been on arrival.  Not against what is left of its own TTL:
        shed then, the shared questions of a mixed fleet came back to a door no emptier and lost
        a third of their share (docs/saturation.md, "Tried and not kept")."""
        s = self._settings(model)
        if not self._door_predicts(s):
            return
        for t, wait in m.door.waits(m.queue.tickets, now, self._door_kinds(model, s)):
            if wait > s.flow_queue_ttl_s:
                self._leave(t, m, now)
                self._shed_at_door(t, m, wait, now, s)

    def _shed_at_door(self, t: Ticket, m: ModelFlow, wait: float, now: float, s: FlowSettings) -> Ticket:
        """Shed held ``t`` (out of the queue already, if it was queued), predicted to wait ``wait``
        at the door: it would be shed at the TTL anyway, so it is told now, with when to come back
        (``Retry-After``: the wait less the TTL, within [1 s, the TTL]), and its place is kept."""
        ttl = max(1, math.ceil(s.flow_queue_ttl_s))
        retry_after_s = max(1, min(ttl, math.ceil(wait - s.flow_queue_ttl_s)))
        m.door.remember(t, now, retry_after_s + s.flow_queue_ttl_s)
        return self._shed(t, m, ShedReason.DOOR_WAIT, now, s, retry_after_s)

    # --- granting ---------------------------------------------------------------------------------

    def pump(self, now: float) -> list[Ticket]:
        """Grant queued requests, in each model's order, while a replica is admissible for the next
        one; returns the granted tickets (their ``on_decided`` has been called)."""
        return self._pump(now, arriving=None)

    def _pump(self, now: float, arriving: Ticket | None) -> list[Ticket]:
        """``pump``, for every model; ``arriving`` is the request ``admit`` just queued: granted by
        this pass, it did not wait — it is counted as admitted at once, adds no wait sample, and
        its edge routes it without a callback (so its reservation ends here)."""
        granted: list[Ticket] = []
        for model, m in self._models.items():
            if not m.queue.tickets:
                continue
            passed = self._pass(model, m, now)
            self._recheck_door(model, m, now)
            for t in passed:
                waited = t is not arriving
                self.counters.count_admitted(model, t.priority, waited=waited)
                if not waited:
                    self.claim(t)
                    continue
                m.queue.waited(t.waited_s)
                if t.on_decided is not None:
                    t.on_decided(t)
                granted.append(t)
        return granted

    def _pass(self, model: str, m: ModelFlow, now: float) -> list[Ticket]:
        """One pass over ``model``'s queue: the tickets it grants, in order (each out of the queue,
        reserved and charged to its tenant's share)."""
        q = m.queue
        s = self._settings(model)
        flush: list[Ticket] = []
        if not switch_on(s.flow_control, self._saturated(model)):
            # The gate opened (the fleet is no longer saturated): whoever waits goes now, but for
            # the sessions the door holds from the start.
            flush = sorted((t for t in q.tickets if not self._gate_on(t.key, s, m)), key=by_arrival)
            for t in flush:
                self._grant(t, m, s, now)
            if not q.tickets:
                return flush
        placement, fill = self._placement(model), s.flow_kv_fill
        door_on = self._door_kinds(model, s)
        order = ORDERS[s.flow_order]
        aged_after = q.aged_after(s.flow_aging_s, s.flow_aging_factor)
        held_back: set[int] = set()
        granted = flush
        # New sessions pass the door oldest first (highest class first), none past another of
        # its kind: where the order reaches one, the longest-held one of a kind takes its place
        # (a bounded wait at the door, not the shortest prompt first forever).
        door = m.door.line(q.tickets, door_on)
        door_shut = False
        while (best := q.next(now, order, aged_after, held_back, m.fair)) is not None:
            if q.room(best.key, placement, fill) <= q.reserved:
                break
            if not q.holder_free(best, now, placement, fill):
                held_back.add(best.seq)  # it waits for its holder; others may go
                continue
            if m.door.holds(best, door_on):
                # The door's oldest of a kind goes in its place, if the fleet's KV holds its
                # session and a replica is admissible for it; else the door shuts for this pass,
                # all of it at once (a continuing session's turn behind it may still go).
                head = None if door_shut else next(
                    (h for h in m.door.heads(door) if self._fits(h, m, now, s, door_on) and
                     q.room(h.key, placement, fill) > q.reserved), None)
                if head is None:
                    door_shut = True
                    held_back.add(best.seq)
                    held_back.update(t.seq for t in door)
                    door.clear()
                    continue
                door.remove(head)
                best = head
                m.door.let_in(best, s.flow_session_rule, now)
            self._grant(best, m, s, now)
            granted.append(best)
        return granted

    def _grant(self, t: Ticket, m: ModelFlow, s: FlowSettings, now: float) -> None:
        """Queued ``t`` is granted: out of the queue, a reservation until its edge claims it, and
        its tenant charged."""
        self._leave(t, m, now)
        t.state = TicketState.GRANTED
        m.queue.reserve(t, now)
        self._charge(t, m, s)
        m.door.granted(t)

    def _charge(self, t: Ticket, m: ModelFlow, s: FlowSettings) -> None:
        """Charge a grant to its tenant's fair share: its footprint over the tenant's weight."""
        tenant, priority = t.tenant, t.priority
        tickets = m.queue.tickets
        m.fair.charge(priority, tenant, t.key.footprint, tenant_weight(s.flow_tenant_weights, tenant),
                      busy=any(other.priority == priority for other in tickets),
                      waiting=lambda: {other.tenant for other in tickets})

    # --- the edges' calls -------------------------------------------------------------------------

    def claim(self, ticket: Ticket) -> None:
        """A ticket granted from the queue is about to be routed and sent (with no pause in between,
        so its replica's load counts it from then on): its reservation ends, and a new session let
        in at the door counts in the working set from its send on, not as opened at the door."""
        if ticket.holds:
            ticket.holds = False
            m = self._models.get(ticket.key.model)
            if m is not None:
                m.queue.release(ticket)
                m.door.claimed(ticket)

    def withdraw(self, ticket: Ticket, now: float) -> list[Ticket]:
        """Its client left: the ticket leaves no trace (out of the queue, its reservation back).
        Returns the tickets this granted to others."""
        m = self._models.get(ticket.key.model)
        if ticket.state is TicketState.QUEUED and m is not None:
            self._leave(ticket, m, now)
        if ticket.state is TicketState.GRANTED and m is not None:
            m.door.take_seat(ticket.key.session_id)
        self.claim(ticket)
        if ticket.state is not TicketState.SHED:
            ticket.state = TicketState.WITHDRAWN
        return self.pump(now)

    def expire(self, ticket: Ticket, now: float) -> bool:
        """The ticket's deadline passed (its edge's timer): shed it if it still waits (True), else
        nothing (False)."""
        m = self._models.get(ticket.key.model)
        if ticket.state is not TicketState.QUEUED or m is None:
            return False
        model = ticket.key.model
        s = self._settings(model)
        door = m.door.holds(ticket, self._door_kinds(model, s))
        self._leave(ticket, m, now)
        self._shed(ticket, m, ShedReason.TTL, now, s)
        if door:  # it comes back to the place it had at the door
            m.door.remember(ticket, now, ticket.retry_after_s + s.flow_queue_ttl_s)
        return True

    def shed_all(self, now: float) -> list[Ticket]:
        """Shutdown: every queued request is shed at once."""
        out: list[Ticket] = []
        for model, m in self._models.items():
            s = self._settings(model)
            for t in list(m.queue.tickets):
                self._leave(t, m, now)
                out.append(self._shed(t, m, ShedReason.SHUTDOWN, now, s))
        return out

    # --- what happened to requests sent -----------------------------------------------------------

    def seat(self, key: RoutingKey) -> str | None:
        """The replica session admission found room on for ``key``'s new session, which its
        routing now takes (once; None for any other request)."""
        m = self._models.get(key.model)
        return None if m is None else m.door.take_seat(key.session_id)

    def session_sent(self, key: RoutingKey, prefill_tokens: int, worker: str) -> None:
        """A request of ``key``'s session was sent to ``worker`` (its id), which computes
        ``prefill_tokens`` of its prompt.  Tracked only where session admission reads it (its idle
        sessions are dropped there): otherwise every conversation ever seen would stay in this
        table."""
        s = self._settings(key.model)
        if key.session_id is None or s.flow_session_admission is False:
            return
        self._model(key.model).door.book.sent(key, prefill_tokens, s.flow_session_rule, worker)

    def session_finished(self, model: str, session_id: str, now: float) -> None:
        """A request of the session ended."""
        m = self._models.get(model)
        if m is not None:
            book = m.door.book
            book.finished(session_id, now)
            if len(book) > book.sweep_at:
                s = self._settings(model)
                book.sweep(now, s.flow_session_idle_s, s.flow_session_rule)

    def finished(self, model: str, now: float) -> None:
        """A request of ``model`` ended (the drain rate Retry-After predicts from)."""
        self._model(model).queue.ended(now)

    def served(self, model: str, tenant: str | None, priority: int, charged: int,
               used: int | None) -> None:
        """A request granted through the gate was answered: ``charged`` tokens (its footprint) were
        put on its tenant's fair share at the grant, ``used`` (prompt + output tokens, as the
        engine reported them; None when the answer carried no usage) is what it took: the share is
        settled to it, and the tenant's served tokens counted (``tenant_tokens``)."""
        s = self._settings(model)
        if s.flow_control is False:
            return
        tenant = tenant or DEFAULT_TENANT
        m = self._models.get(model)
        if used is not None and m is not None:
            m.fair.settle(priority, tenant, used - charged, tenant_weight(s.flow_tenant_weights, tenant))
        self.counters.count_served(model, tenant, charged if used is None else used)

    # --- figures ----------------------------------------------------------------------------------

    def depth(self) -> dict[str, tuple[int, int]]:
        """Queued requests and queued estimated prompt tokens, by model."""
        return {name: (len(m.queue.tickets), m.queue.tokens) for name, m in self._models.items()}

    def depth_by_class(self) -> dict[tuple[str, str], tuple[int, int]]:
        """Queued requests and queued estimated prompt tokens by (model, class), every class of
        every model the gate has seen (zeros included, so the series stay)."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for model, m in self._models.items():
            for name in CLASSES.values():
                out[(model, name)] = (0, 0)
            for t in m.queue.tickets:
                n, tokens = out[(model, class_name(t.priority))]
                out[(model, class_name(t.priority))] = (n + 1, tokens + t.key.est_prompt_tokens)
        return out

    def session_counts(self, now: float) -> dict[str, tuple[int, int]]:
        """Session admission's door by model, for a model where it is on: sessions in the working
        set (admitted, not idle past what the rule keeps) and new sessions whose first turn waits
        at the door."""
        out: dict[str, tuple[int, int]] = {}
        for model, m in self._models.items():
            s = self._settings(model)
            if s.flow_session_admission is not False:
                waiting = m.door.waiting(m.queue.tickets, self._door_kinds(model, s))
                live = m.door.book.live(now, s.flow_session_idle_s, s.flow_session_rule)
                out[model] = (live, waiting)
        return out

    def working_set(self, model: str, now: float) -> int:
        """KV tokens the sessions ``model``'s fleet serves count in session admission's working
        set (0 where it is off)."""
        m = self._models.get(model)
        s = self._settings(model)
        if m is None or s.flow_session_admission is False:
            return 0
        return m.door.book.working_set(now, s.flow_session_idle_s, s.flow_session_rule)

    def one_kind(self, key: RoutingKey, now: float) -> bool:
        """Whether ``key``'s model's fleet serves no kind of session but ``key``'s
        (``SessionBook.alone``): False for a request without a session, and where session
        admission is off (its book then tracks nothing)."""
        if key.session_id is None or self._settings(key.model).flow_session_admission is False:
            return False
        m = self._models.get(key.model)
        return m is None or m.door.book.alone(kind(key.session_id), now)

    def free_room(self, key: RoutingKey) -> int:
        """How many replicas are admissible for ``key`` now beyond the grants not yet claimed
        (read-only; 0 or less: none is free for it)."""
        m = self._models.get(key.model)
        if m is None:
            return 1
        q = m.queue
        return q.room(key, self._placement(key.model), self._settings(key.model).flow_kv_fill) - q.reserved

    def waits_for_holder(self, t: Ticket, now: float) -> bool:
        """Whether ``t`` waits for the replica holding its prefix (late binding) at ``now``."""
        m = self._models.get(t.key.model)
        return m is not None and t.holder is not None and not self._holder_free(t, m, now)

    def blocked(self, model: str, now: float) -> int:
        """How many of ``model``'s requests wait for room (at the door included), not only for the
        replica holding their prefix (late binding): those queued, and the first turns shed at the
        door whose place is kept for their return (they wait at their client meanwhile)."""
        m = self._models.get(model)
        if m is None:
            return 0
        kept = m.door.kept(now)
        return kept + sum(1 for t in m.queue.tickets if t.holder is None or self._holder_free(t, m, now))

    def at_door(self, t: Ticket) -> bool:
        """Whether session admission holds ``t`` at the door: a new session's request whose prefix
        is not resident."""
        model = t.key.model
        m = self._models.get(model)
        return m is not None and m.door.holds(t, self._door_kinds(model, self._settings(model)))

    def queued(self, model: str) -> list[Ticket]:
        """The model's queued tickets, in arrival order."""
        m = self._models.get(model)
        return list(m.queue.tickets) if m is not None else []

    # --- bookkeeping ------------------------------------------------------------------------------

    def _holder_free(self, t: Ticket, m: ModelFlow, now: float) -> bool:
        model = t.key.model
        return m.queue.holder_free(t, now, self._placement(model), self._settings(model).flow_kv_fill)

    def _leave(self, t: Ticket, m: ModelFlow, now: float) -> None:
        m.queue.leave(t, now)
        if t.key.session_id is not None:
            m.door.book.queued(t.key.session_id, -1)

    def _shed(self, t: Ticket, m: ModelFlow, reason: ShedReason, now: float, s: FlowSettings,
              retry_after_s: int | None = None) -> Ticket:
        """Shed ``t`` (out of the queue already, if it was queued) with ``retry_after_s`` (None: the
        queue's own estimate): its edge is told when it waited, with every field set first (an
        arriving request's edge reads the ticket ``admit`` returns)."""
        t.reason = reason
        t.retry_after_s = (m.queue.retry_after(now, s.flow_queue_ttl_s) if retry_after_s is None
                           else retry_after_s)
        self.counters.count_shed(t.key.model, reason.value, t.priority)
        told = t.state is TicketState.QUEUED
        t.state = TicketState.SHED
        if told and t.on_decided is not None:
            t.on_decided(t)
        return t
