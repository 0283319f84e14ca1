"""The one dispatch path both clocks use: the HTTP proxy and the virtual-time cluster.

Everything the router computes about a request's life goes through here, in this order:

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
from kvroute.routing.key import RoutingKey
from kvroute.routing.loadbook import LoadBook
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.sync_record import SyncRecord
from kvroute.routing.worker import WorkerState


@dataclass(slots=True)
class InFlight:
    """One attempt of one request, from ``sent`` to ``finished``."""

    state: WorkerState
    decision: Decision
    sent_at: float
    first_byte_at: float | None = None
    done: bool = False

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending to the first byte of the answer (None before it)."""
        return None if self.first_byte_at is None else self.first_byte_at - self.sent_at


class Dispatcher:
    """Routes requests and keeps the router's account of them (see the module's docstring)."""

    def __init__(self, scheduler: Scheduler, timer: Callable[[], float] = time.perf_counter) -> None:
        self.scheduler = scheduler
        self._timer = timer
        self.book = LoadBook()

    def route(self, key: RoutingKey, workers: Sequence[WorkerState],
              exclude: Collection[str] = ()) -> Decision:
        """Where ``key`` should go (a decision with no worker when none can serve it)."""
        return self.scheduler.decide(key, workers, exclude, self.book)

    def sent(self, key: RoutingKey, decision: Decision,
             state: WorkerState) -> tuple[InFlight, list[SyncRecord]]:
        """``key`` leaves for ``state`` as ``decision`` said; returns its handle and the facts to
        publish to other router instances."""
        state.inflight += 1
        self.book.touch(state)
        records = self.scheduler.commit(key, decision)
        return InFlight(state, decision, self._timer()), records

    def first_byte(self, flight: InFlight) -> None:
        """The worker's first byte of the answer arrived."""
        if flight.first_byte_at is None:
            flight.first_byte_at = self._timer()

    def finished(self, flight: InFlight, *, ok: bool, prompt_tokens: int | None = None,
                 cached_tokens: int | None = None, streamed: bool = True) -> None:
        """The attempt ended.  With ``ok`` the engine's usage (any may be None) is learnt from,
        and, for a streamed answer, the time to its first byte (a plain answer's first byte is its
        last).  Idempotent: a second call does nothing."""
        if flight.done:
            return
        flight.done = True
        flight.state.inflight -= 1
        self.book.touch(flight.state)
        if ok:
            ttft = flight.ttft_s if streamed else None
            self.scheduler.on_finished(flight.state.id, prompt_tokens=prompt_tokens,
                                       cached_tokens=cached_tokens, ttft_s=ttft)

    def scraped(self, state: WorkerState, running: int | None, waiting: int | None,
                kv_usage: float | None) -> None:
        """The engine's own figures, as just read from it.  What the routers had in flight at this
        moment is stamped beside them: only load beyond it is load the routers cannot see."""
        state.running, state.waiting, state.kv_usage = running, waiting, kv_usage
        state.scraped_inflight = state.inflight + state.peer_inflight
        self.book.touch(state)

    def peer_load(self, state: WorkerState, inflight: int) -> None:
        """Other router instances have ``inflight`` requests on ``state`` in total."""
        if state.peer_inflight != inflight:
            state.peer_inflight = inflight
            self.book.touch(state)

    def worker_epoch(self, worker_id: str, epoch: float) -> list[SyncRecord]:
        """A worker (re)registered or restarted at ``epoch``; returns the fact to publish if news."""
        return self.scheduler.on_worker_epoch(worker_id, epoch)

    def worker_removed(self, worker_id: str) -> None:
        """A worker left the fleet."""
        self.scheduler.on_worker_removed(worker_id)

    def remote(self, record: SyncRecord) -> None:
        """A fact another router instance published."""
        self.scheduler.apply_remote(record)
