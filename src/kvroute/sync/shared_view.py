"""One instance's side of the shared view: applying the others' facts and agreeing on epochs.

Why epochs need agreeing.  A worker's epoch is its registration time (or its engine's start time
after a restart), and prefix entries only match under the epoch they were recorded with.  Every
instance registers its configured workers when it starts, so two instances started a minute apart
would hold two different epochs for the same engine: each would refuse the other's older facts, or
jump to the other's newer epoch and forget its own.  Registering a worker does not empty its cache;
only a restart does.  So:

* A worker this instance registers is *settled* against the cluster before its facts count: if a
  live peer's heartbeat (or else the newest fact held for it) names an epoch, this instance adopts
  that epoch, even an older one, because both name the same running engine.  Otherwise its own
  epoch becomes the cluster's.
* After that the newest epoch wins: a re-registration or restart seen by any instance reaches the
  others as an epoch record, in facts carrying it, or in heartbeats, and they follow.
* Facts about a worker this instance has not (yet) registered are held, bounded, and applied when
  it registers the worker, so a catch-up read before the configured workers are registered is not
  lost.  Facts queued under the local epoch an instance gave up are sent under the adopted one.

Pure: no I/O; the clock is injected.  Not thread-safe: one per event loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvroute.fleet.registry import Registry
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.sync_record import PrefixRecord, SyncRecord, WorkerEpochRecord
from kvroute.routing.worker import WorkerState
from kvroute.sync.metrics import SyncMetrics
from kvroute.sync.peer_load import PeerLoads


def record_epoch(record: SyncRecord) -> float | None:
    """The worker epoch a record speaks of (None for session bindings)."""
    if isinstance(record, PrefixRecord | WorkerEpochRecord):
        return record.epoch
    return None


@dataclass(slots=True)
class _Agreement:
    """The epoch this instance shares with the cluster for one registered worker.

    ``state`` is the registry's object for that registration (a removed and re-added worker gets a
    new one, and is settled again); ``replaced`` the local epoch given up for the cluster's."""

    state: WorkerState
    epoch: float
    replaced: float | None = None


class SharedView:
    """Applies remote facts to the scheduler and keeps worker epochs agreed with the other instances."""

    def __init__(self, registry: Registry, scheduler: Scheduler, peers: PeerLoads, metrics: SyncMetrics,
                 *, max_pending: int = 20_000, clock: Callable[[], float] = time.time) -> None:
        self._registry = registry
        self._scheduler = scheduler
        self._peers = peers
        self._metrics = metrics
        self._clock = clock
        self._settled: dict[str, _Agreement] = {}
        self._pending: deque[SyncRecord] = deque()
        self._max_pending = max_pending
        self.apply: Callable[[SyncRecord], None] = scheduler.apply_remote
        self.caught_up = False

    # --- facts this instance produced ----------------------------------------------------------

    def local(self, record: SyncRecord) -> bool:
        """Whether a fact produced here is news to send.  The epoch announcement of a worker this
        instance merely registered is settled against the cluster first (and not sent if adopted)."""
        if not isinstance(record, WorkerEpochRecord):
            return True
        agreement = self._current(record.worker_id)
        if agreement is not None:
            if record.epoch <= agreement.epoch:
                return False
            agreement.epoch = record.epoch
            return True
        if not self.caught_up or self._registry.get(record.worker_id) is None:
            return True  # filtered when sent, once catch-up has settled the worker
        return self._settle(record.worker_id)

    def outgoing(self, record: SyncRecord) -> SyncRecord | None:
        """The form in which a queued local fact is sent: facts stamped with a local epoch this
        instance gave up are restamped with the adopted one; the given-up announcement is dropped."""
        epoch = record_epoch(record)
        if epoch is None:
            return record
        agreement = self._settled.get(record.worker_id)
        if agreement is None or agreement.replaced is None or epoch != agreement.replaced:
            return record
        if isinstance(record, PrefixRecord):
            return dataclasses.replace(record, epoch=agreement.epoch)
        return None

    # --- facts from other instances ------------------------------------------------------------

    def receive(self, record: SyncRecord) -> bool:
        """Apply a fact from another instance now (True), or hold it until its worker is
        registered and settled here (False)."""
        agreement = self._current(record.worker_id)
        if agreement is None:
            self._hold(record)
            return False
        epoch = record_epoch(record)
        if epoch is not None and epoch > agreement.epoch:
            self._follow(record.worker_id, agreement, epoch)
        self._apply(record)
        return True

    def peer_epochs(self, epochs: Mapping[str, float]) -> None:
        """Follow any newer epoch a peer's heartbeat uses for a worker settled here."""
        for wid, epoch in epochs.items():
            agreement = self._current(wid)
            if agreement is not None and epoch > agreement.epoch:
                self._follow(wid, agreement, epoch)

    def finish_catch_up(self) -> None:
        """The recent history has been read: from now on workers are settled as they register."""
        self.caught_up = True
        self.refresh()

    def refresh(self) -> None:
        """Forget agreements of workers that left the registry, and settle newly registered ones
        (once caught up)."""
        for wid in [w for w in self._settled if self._current(w) is None]:
            del self._settled[wid]
        if self.caught_up:
            for state in self._registry.states():
                if state.id not in self._settled:
                    self._settle(state.id)

    def agreed_epoch(self, worker_id: str) -> float | None:
        """The epoch shared with the cluster for a settled worker (None if not settled)."""
        agreement = self._current(worker_id)
        return None if agreement is None else agreement.epoch

    @property
    def pending(self) -> int:
        """Facts held for workers not registered here."""
        return len(self._pending)

    # --- internals -----------------------------------------------------------------------------

    def _current(self, worker_id: str) -> _Agreement | None:
        agreement = self._settled.get(worker_id)
        if agreement is None:
            return None
        record = self._registry.get(worker_id)
        if record is None or record.state is not agreement.state:
            return None
        return agreement

    def _settle(self, worker_id: str) -> bool:
        """Agree on ``worker_id``'s epoch; True when the local one was kept (and is news)."""
        record = self._registry.get(worker_id)
        assert record is not None
        state = record.state
        local = state.epoch
        held = [r for r in self._pending if r.worker_id == worker_id]
        if held:
            self._pending = deque(r for r in self._pending if r.worker_id != worker_id)
        cluster = self._peers.epochs().get(worker_id)
        if cluster is None:
            cluster = max((e for r in held if (e := record_epoch(r)) is not None), default=None)
        if cluster is None or cluster == local:
            self._settled[worker_id] = _Agreement(state, local)
            kept = True
        else:
            if cluster < local:
                # The scheduler only ever moves an epoch forward; going back to the cluster's (same
                # engine, registered earlier elsewhere) means forgetting this registration first.
                self._scheduler.on_worker_removed(worker_id)
            self._scheduler.on_worker_epoch(worker_id, cluster)
            state.epoch = cluster
            self._settled[worker_id] = _Agreement(state, cluster, replaced=local)
            kept = False
        for r in held:
            self.receive(r)
        return kept

    def _follow(self, worker_id: str, agreement: _Agreement, epoch: float) -> None:
        # A restart or re-registration seen elsewhere: the scheduler drops the older entries.
        self._scheduler.on_worker_epoch(worker_id, epoch)
        agreement.state.epoch = epoch
        agreement.epoch = epoch

    def _hold(self, record: SyncRecord) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self._metrics.dropped.labels("pending_full").inc()
        self._pending.append(record)

    def _apply(self, record: SyncRecord) -> None:
        # The scheduler discounts a replayed record's backlog by its age (Scheduler.apply_remote).
        self.apply(record)
        self._metrics.applied.labels(record.TYPE).inc()
