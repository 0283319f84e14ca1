"""The one dispatch path both clocks use: the HTTP proxy and the virtual-time cluster.

Everything the router computes about a request's life goes through here, in this order:

* ``admit``: flow control's gate (routing/flow.py) — go now, or wait in the model's queue until a
  replica frees up (``claim`` when woken, just before routing), or be shed past its limits;
  ``withdraw`` when the client left while waiting, ``expire`` when the edge's timer for the
  ticket's ``deadline`` fires (``expires_in``: the queue TTL is flow control's, the edges only arm
  a timer for it), ``shed_all`` at shutdown;
* ``route``: the scheduler's decision;
* ``sent``: the request leaves for its worker — ownership and session binding are recorded
  (``Scheduler.commit``), the worker's in-flight count goes up, and the facts for other router
  instances come back;
* ``first_byte``: the worker's first byte of the answer (the time to first token, for a stream);
* ``finished``: the answer ended (or the attempt failed) — in flight goes down, and the engine's
  usage and the time to first token teach the scheduler;
* ``scraped``: the engine's own figures arrived (running, waiting, KV usage), stamped with what
  the routers had in flight at that moment;
* ``peer_load``: other router instances' in flight on a worker;

``sent``, ``finished``, ``scraped`` and ``peer_load`` also wake the queues: whatever may have freed
a replica grants the next queued requests (their edge is called back).
* ``worker_epoch`` / ``worker_removed`` / ``remote``: the fleet changed, or another instance
  reported a fact.

Pure: the timer is injected (``time.perf_counter`` over HTTP, the virtual clock in simulation);
nothing here does I/O.  The owner of the ``WorkerState`` objects (the registry, or the cluster)
passes them in; nothing else changes their load figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvroute.routing.decision import Decision
from kvroute.routing.flow import FlowControl, FlowSettings
from kvroute.routing.flow_queue import Prediction, Ticket
from kvroute.routing.key import RoutingKey
from kvroute.routing.loadbook import LoadBook
from kvroute.routing.saturation import Saturation, SaturationSettings, read_fleet
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.sync_record import SyncRecord
from kvroute.routing.worker import WorkerState

# How often (dispatcher clock seconds) the fleet is read for saturation: a read looks at every
# worker, and the level it feeds moves on a scale of seconds.
READ_EVERY_S = 0.25


@dataclass(slots=True)
class InFlight:
    """One attempt of one request, from ``sent`` to ``finished``."""

    state: WorkerState
    decision: Decision
    sent_at: float
    first_byte_at: float | None = None
    done: bool = False
    model: str = ""
    tokens: int = 0  # KV tokens it adds, counted in the worker's inflight_tokens
    charged: int = 0  # its fair-share charge at the grant: prompt + max_tokens
    session_id: str | None = None
    tenant: str | None = None
    priority: int = 0

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending to the first byte of the answer (None before it)."""
        return None if self.first_byte_at is None else self.first_byte_at - self.sent_at


class _OpenGate(Ticket):
    """The ticket of a request whose model's gate is not engaged: granted at once, with nothing
    to remember about it, so one read-only instance serves them all (no ticket per request)."""

    __slots__ = ()

    def __init__(self) -> None:
        model = Ticket(RoutingKey("", b""), 0.0)
        for name in Ticket.__slots__:
            object.__setattr__(self, name, getattr(model, name))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"the shared ticket of an open gate is read-only (setting {name})")


# What ``Dispatcher.admit`` returns while the gate is not engaged.  Its key is no request's: the
# edges read only its state (granted) and its empty wait.
GRANTED_AT_ONCE: Ticket = _OpenGate()


def seated_note(seat: str) -> str:
    """What a decision line adds when session admission let a new session's first turn in on a
    seat (room beside its own sessions on one replica) and the turn went there."""
    return f"; seated on {seat} by session admission (room beside its sessions)"


class Dispatcher:
    """Routes requests and keeps the router's account of them (see the module's docstring)."""

    def __init__(self, scheduler: Scheduler, timer: Callable[[], float] = time.perf_counter) -> None:
        self.scheduler = scheduler
        self._timer = timer
        self.book = LoadBook()
        # Per model: whether its fleet is saturated (routing/saturation.py), and the workers it
        # was last routed over (what the saturation reading looks at).
        self.saturation: dict[str, Saturation] = {}
        self._fleets: dict[str, Sequence[WorkerState]] = {}
        self._read_at = -float("inf")
        self.flow = FlowControl(lambda m: scheduler.settings_for(m).block(FlowSettings),
                                lambda m: scheduler.settings_for(m).placement, self.saturated,
                                self.thrashing)

    def saturated(self, model: str) -> bool:
        """Whether ``model``'s fleet is saturated (engaged, with hysteresis): placement then routes
        for the fleet's throughput and flow control's "auto" switches engage."""
        sat = self.saturation.get(model)
        return sat is not None and sat.engaged

    def thrashing(self, model: str) -> bool:
        """Whether ``model``'s saturated fleet holds more conversations than its caches keep
        (session admission's "auto" then engages, until the fleet is released)."""
        sat = self.saturation.get(model)
        return sat is not None and sat.thrashing

    def _observe(self, now: float) -> None:
        """Read every model's fleet for saturation, at most every ``READ_EVERY_S``; when a model
        engages or is released, its queue is pumped (the gate's switch changed)."""
        if now - self._read_at < READ_EVERY_S:
            return
        self._read_at = now
        changed = False
        for model, workers in self._fleets.items():
            policy = self.scheduler.settings_for(model)
            s = policy.block(SaturationSettings)
            reading = read_fleet(model, workers, policy.placement, s, policy.block(FlowSettings).flow_kv_fill,
                                 self.flow.blocked(model, now), self.scheduler.realisation,
                                 self.flow.working_set(model, now))
            sat = self.saturation.get(model)
            if sat is None:
                sat = self.saturation[model] = Saturation()
            changed |= sat.observe(now, reading, s)
        if changed:
            self.flow.pump(now)

    def admit(self, key: RoutingKey, workers: Sequence[WorkerState],
              on_decided: Callable[[Ticket], None] | None = None) -> Ticket:
        """Flow control's gate for a request that just arrived: the ticket is granted (route it now),
        queued (``on_decided`` is called once it is granted or shed; ``claim`` it before routing)
        or shed (answer with the overload error, ``Retry-After: ticket.retry_after_s``).  While the
        gate is not engaged, the one shared ``GRANTED_AT_ONCE`` (read-only, ``on_decided`` never
        called)."""
        model = key.model
        self._fleets[model] = workers
        now = self._timer()
        self._observe(now)
        if not self.flow.engaged(key):
            return GRANTED_AT_ONCE

        def predict() -> Prediction:
            # Where it would go now, for the order only: it is decided afresh when granted.
            full = self.saturated(model)
            d = self.scheduler.foresee(key, workers, self.book, fleet_full=full,
                                       one_kind=full and self.flow.one_kind(key, now))
            resident = key.session_id is not None and d.matched_blocks > 0 and \
                2 * d.prefill_tokens < d.est_tokens
            # Another router instance may have admitted the session: its door knows it, this
            # one's only through the shared session table (a derived identity's repeat stays a
            # new session: SessionBook.is_new).
            bound = key.client_session and self.scheduler.bound_worker(key) is not None
            if not full:
                return Prediction(d.prefill_tokens, resident, bound=bound)
            factor = self.scheduler.settings_for(model).block(SaturationSettings).fleet_late_bind
            holder, held = self.scheduler.holder(key, workers)
            if holder is None or factor <= 0 or 2 * held < key.est_prompt_tokens:
                return Prediction(d.prefill_tokens, resident, bound=bound)
            # Waiting for the holder costs this request time; going elsewhere costs the fleet a
            # cold prefill of the whole prompt (and the prefix it evicts): wait up to a multiple
            # of that prefill.
            bind_s = factor * key.est_prompt_tokens * self.scheduler.prefill_s_per_token(holder)
            return Prediction(d.prefill_tokens, resident, holder, bind_s, bound)

        ticket = self.flow.admit(key, workers, now, predict)
        ticket.on_decided = on_decided
        if ticket.queued:
            ticket.why = self._why(ticket)
        return ticket

    def _why(self, ticket: Ticket) -> str:
        """Why a request just queued has to wait, in words (no prompt text): for its decision line."""
        if self.flow.waits_for_holder(ticket, self._timer()):
            held = f"waits for {ticket.holder}, which holds its prefix (late binding, fleet saturated)"
        elif self.flow.free_room(ticket.key) <= 0:
            held = "no replica admissible"
        elif self.flow.at_door(ticket):
            held = "a replica is free but its session is new (session admission)"
        else:
            held = "a replica is free but the request ahead of it is not admissible yet"
        ahead = len(self.flow.queued(ticket.key.model)) - 1
        if ahead:
            held += f", {ahead} queued ahead"
        prefix = "resident" if ticket.resident else "cold"
        return f"{held}; predicted prefill {ticket.prefill_tokens} tokens, prefix {prefix}"

    def now(self) -> float:
        """The dispatcher's clock (for readers of time-dependent figures, such as
        ``flow.session_counts``)."""
        return self._timer()

    def claim(self, ticket: Ticket) -> None:
        """A ticket woken from the queue is being routed now (call it, then ``route`` and ``sent``
        with no pause in between)."""
        self.flow.claim(ticket)

    def withdraw(self, ticket: Ticket) -> None:
        """The client of a queued (or woken, unclaimed) ticket went away: no trace of it remains."""
        if ticket is GRANTED_AT_ONCE:  # nothing of it was recorded (and it is read-only)
            self.flow.pump(self._timer())
            return
        self.flow.withdraw(ticket, self._timer())

    def expires_in(self, ticket: Ticket) -> float:
        """Seconds from now until a queued ticket's deadline (its queue TTL, which flow control
        set when it queued it): how long an edge whose timer runs on another clock than the
        dispatcher's arms it for, to call ``expire`` then.  An edge on the dispatcher's clock
        arms it at ``ticket.deadline`` itself."""
        return max(0.0, ticket.deadline - self._timer())

    def expire(self, ticket: Ticket) -> bool:
        """The ticket's deadline passed (the edge's timer fired): shed it if it still waits (True)."""
        return self.flow.expire(ticket, self._timer())

    def shed_all(self) -> list[Ticket]:
        """Shutdown: shed every queued request at once (their ``on_decided`` is called)."""
        return self.flow.shed_all(self._timer())

    def route(self, key: RoutingKey, workers: Sequence[WorkerState],
              exclude: Collection[str] = ()) -> Decision:
        """Where ``key`` should go (a decision with no worker when none can serve it); while its
        model's fleet is saturated, placed for the fleet (``fleet_full``).  A new session that
        session admission let in goes to the replica it found room on (its seat), unless that one
        is excluded, not ready or refused by the policy's filters: placed elsewhere, it would
        evict the sessions the door counted there."""
        self._fleets[key.model] = workers
        seat = self.flow.seat(key)
        full = self.saturated(key.model)
        one = full and self.flow.one_kind(key, self._timer())
        if seat is not None and seat not in exclude and any(w.id == seat and w.ready for w in workers):
            others = {w.id for w in workers if w.id != seat}
            decision = self.scheduler.decide(key, workers, others, self.book, fleet_full=full, one_kind=one)
            if decision.worker_id is not None:
                decision.reason += seated_note(seat)
                return decision
        return self.scheduler.decide(key, workers, exclude, self.book, fleet_full=full, one_kind=one)

    def sent(self, key: RoutingKey, decision: Decision,
             state: WorkerState) -> tuple[InFlight, list[SyncRecord]]:
        """``key`` leaves for ``state`` as ``decision`` said; returns its handle and the facts to
        publish to other router instances."""
        state.inflight += 1
        rank = decision.rank
        if rank is not None:
            state.rank_inflight[rank] = state.rank_inflight.get(rank, 0) + 1
        # What it adds to the worker's KV: the prompt the worker does not hold and the output.  A
        # prefix it holds is there once, however many requests share it (a system prompt of many
        # clients, a session's history).
        tokens = decision.prefill_tokens + key.max_tokens
        state.inflight_tokens += tokens
        self.book.touch(state)
        records = self.scheduler.commit(key, decision)
        self.flow.session_sent(key, decision.prefill_tokens, state.id)
        now = self._timer()
        self._observe(now)
        self.flow.pump(now)
        return InFlight(state, decision, now, model=key.model, tokens=tokens, charged=key.footprint,
                        session_id=key.session_id, tenant=key.tenant, priority=key.priority), records

    def side_sent(self, state: WorkerState) -> None:
        """A request the router sends on its own account (the fleet guard's canary) leaves for
        ``state``: it counts in the worker's in-flight load like any other, and nothing else —
        no decision, no index or session entry, no backlog, no flow-control slot, no learning.
        Call ``side_finished`` exactly once when it ends."""
        state.inflight += 1
        self.book.touch(state)

    def side_finished(self, state: WorkerState) -> None:
        """The ``side_sent`` request to ``state`` ended: its load is given back."""
        state.inflight -= 1
        self.book.touch(state)
        now = self._timer()
        self._observe(now)
        self.flow.pump(now)

    def first_byte(self, flight: InFlight) -> None:
        """The worker's first byte of the answer arrived."""
        if flight.first_byte_at is None:
            flight.first_byte_at = self._timer()
            self.scheduler.on_first_byte(flight.decision)

    def finished(self, flight: InFlight, *, ok: bool, prompt_tokens: int | None = None,
                 cached_tokens: int | None = None, output_tokens: int | None = None,
                 streamed: bool = True) -> None:
        """The attempt ended.  With ``ok`` the engine's usage (any may be None) is learnt from and
        settles the tenant's fair-share charge, and, for a streamed answer, the time to its first
        byte is learnt (a plain answer's first byte is its last).  Idempotent: a second call does
        nothing."""
        if flight.done:
            return
        flight.done = True
        flight.state.inflight -= 1
        flight.state.inflight_tokens -= flight.tokens
        rank = flight.decision.rank
        if rank is not None:
            pinned = flight.state.rank_inflight
            if pinned.get(rank, 0) > 1:
                pinned[rank] -= 1
            else:
                pinned.pop(rank, None)
        self.book.touch(flight.state)
        self.scheduler.released(flight.decision, answered=flight.first_byte_at is not None)
        if ok:
            ttft = flight.ttft_s if streamed else None
            self.scheduler.on_finished(flight.state.id, prompt_tokens=prompt_tokens,
                                       cached_tokens=cached_tokens, ttft_s=ttft,
                                       output_tokens=output_tokens, decision=flight.decision)
            used = None if prompt_tokens is None or output_tokens is None else prompt_tokens + output_tokens
            self.flow.served(flight.model, flight.tenant, flight.priority, flight.charged, used)
        now = self._timer()
        self._observe(now)
        self.flow.finished(flight.model, now)
        if flight.session_id is not None:
            self.flow.session_finished(flight.model, flight.session_id, now)
        self.flow.pump(now)

    def scraped(self, state: WorkerState, running: int | None, waiting: int | None,
                kv_usage: float | None, kv_tokens: int | None = None, *,
                block_size: int | None = None, inflight_before: int | None = None) -> None:
        """The engine's own figures, as just read from it (``kv_tokens``: its KV cache size, and
        ``block_size``: its prefix cache's block, when known).  What the routers had in flight at
        this moment is stamped beside them: only load beyond it is load the routers cannot see.
        ``inflight_before`` is what they had in flight when the read began (over HTTP it takes a
        while): the larger of the two is stamped, so a request that ended meanwhile, still counted
        by the engine, is not taken for foreign load until the next read (the virtual clock reads
        in no time and never sees such a request)."""
        state.running, state.waiting, state.kv_usage = running, waiting, kv_usage
        if kv_tokens is not None:
            state.kv_tokens = kv_tokens
        if block_size is not None:
            state.block_size = block_size
        seen = state.total_inflight
        state.scraped_inflight = seen if inflight_before is None else max(seen, inflight_before)
        self.book.touch(state)
        now = self._timer()
        self._observe(now)
        self.flow.pump(now)

    def peer_load(self, state: WorkerState, inflight: int) -> None:
        """Other router instances have ``inflight`` requests on ``state`` in total."""
        if state.peer_inflight != inflight:
            state.peer_inflight = inflight
            self.book.touch(state)
            now = self._timer()
            self._observe(now)
            self.flow.pump(now)

    def worker_epoch(self, worker_id: str, epoch: float) -> list[SyncRecord]:
        """A worker (re)registered or restarted at ``epoch``; returns the fact to publish if news."""
        return self.scheduler.on_worker_epoch(worker_id, epoch)

    def worker_removed(self, worker_id: str) -> None:
        """A worker left the fleet."""
        self.scheduler.on_worker_removed(worker_id)

    def remote(self, record: SyncRecord) -> None:
        """A fact another router instance published."""
        self.scheduler.apply_remote(record)
