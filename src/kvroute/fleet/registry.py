"""The fleet as this router sees it: one ``WorkerState`` per replica, its epoch, health and history.

The registry is the only owner of the ``WorkerState`` objects the scheduler reads.  The server
mutates in-flight counts and failures, the probe fills the engine's own figures, the admin API adds,
removes and drains.  Everything here is synchronous and I/O-free but for one log line per change of
a worker's health or circuit breaker; the clock is injected.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvroute.fleet.breaker import Breaker, BreakerSettings, BreakerState, latency_outlier, malformed_outlier
from kvroute.fleet.vllm_metrics import EngineMetrics
from kvroute.rings import NumberRing
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

# Read on every request; a class's member read costs ~900 instructions on Python 3.11 (breaker.py).
_CLOSED = BreakerState.CLOSED

# Restart epochs must strictly increase even if the engine's clock is behind the router's.
_EPOCH_STEP = 1e-3
# Predictions below this are noise next to the event loop's own delays: latency is compared to it.
_PREDICTION_FLOOR_S = 0.05
# The fleet comparison (O(workers)) runs every few samples of a worker, not on every answer.
_OUTLIER_EVERY = 4
# Who registered a worker (``WorkerRecord.source``); discovery's workers carry their source's spec
# (``dns://NAME:PORT``, ``file://PATH``), so it drains only the workers it registered.
SOURCE_CONFIG = "config"
SOURCE_ADMIN = "admin"

log = logging.getLogger("kvroute.fleet")
# Weight of the newest stream in a worker's average gap between reads.
_GAP_ALPHA = 0.2


class RegistryListener(Protocol):
    """Told about epochs and removals; the Scheduler satisfies this protocol as it is."""

    def on_worker_epoch(self, worker_id: str, epoch: float) -> None: ...

    def on_worker_removed(self, worker_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class CounterSample:
    """One scrape of an engine's cumulative token counters (they restart from 0 with the engine:
    a decrease between two samples means a restart, not negative traffic)."""

    time: float
    prefix_hits: float
    prefix_queries: float
    prompt_tokens: float


class CounterHistory:
    """A worker's last ``size`` counter samples, oldest first, in a ring allocated up front (an
    hour of them per worker: as objects they grew a router's memory for its first hour)."""

    __slots__ = ("_ring",)

    def __init__(self, size: int) -> None:
        self._ring = NumberRing(size, 4)

    def append(self, sample: CounterSample) -> None:
        """Add a sample, forgetting the oldest once full."""
        self._ring.append(sample.time, sample.prefix_hits, sample.prefix_queries, sample.prompt_tokens)

    def __len__(self) -> int:
        return len(self._ring)

    def __iter__(self) -> Iterator[CounterSample]:
        return (CounterSample(*row) for row in self._ring)

    def first(self) -> CounterSample:
        """The oldest sample held (IndexError when empty)."""
        return CounterSample(*self._ring.first())


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one probe round learnt about a worker.

    ``reachable`` is False when the connection itself failed (nothing listening, reset, timeout);
    ``healthy`` is whether ``/health`` answered 2xx.  ``models`` is None when ``/v1/models`` was not
    asked this round; ``metrics`` None when ``/metrics`` is absent or unreadable.
    ``inflight_at_start`` is what the routers had in flight there when the round began (None: not
    known), so that a request that ended while ``/metrics`` was on its way is not load.
    """

    reachable: bool
    healthy: bool
    error: str | None = None
    metrics: EngineMetrics | None = None
    models: tuple[Mapping[str, Any], ...] | None = None
    max_num_seqs: int | None = None
    inflight_at_start: int | None = None
    # Where the engine says it publishes KV-cache events (``PUB[,REPLAY]``), from /server_info.
    kv_events: str | None = None


@dataclass(slots=True)
class WorkerRecord:
    """Everything the router keeps about one worker; ``state`` is what the scheduler reads."""

    state: WorkerState
    registered_at: float
    source: str = SOURCE_CONFIG
    declared_models: frozenset[str] = frozenset()
    declared_max_num_seqs: int | None = None
    engine_start_time: float | None = None
    metrics: EngineMetrics | None = None
    model_cards: tuple[Mapping[str, Any], ...] = ()
    last_probe: float | None = None
    last_error: str | None = None
    # Whether ``last_error`` is the probe's: a /health that answers clears only its own error,
    # never a request's failure (that one stays until a request to the worker succeeds).
    error_from_probe: bool = False
    consecutive_failures: int = 0
    restarts: int = 0
    requests: Counter[str] = field(default_factory=Counter)  # by decision kind
    history: CounterHistory = field(default_factory=lambda: CounterHistory(1))
    breaker: Breaker = field(default_factory=Breaker)
    # The breaker state last logged: transitions are logged once each (see Registry._sync).
    logged_breaker: BreakerState = BreakerState.CLOSED
    # Average seconds between two reads of a streamed answer from this worker (None: no stream
    # finished yet); the stream idle deadline is derived from it.
    read_gap_s: float | None = None

    @property
    def id(self) -> str:
        """The worker id (same as ``state.id``)."""
        return self.state.id

    @property
    def discovered(self) -> bool:
        """Registered by a discovery source (not the configuration nor the admin API)."""
        return self.source not in (SOURCE_CONFIG, SOURCE_ADMIN)

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """A JSON-ready summary (admin API, dashboard); ``now`` (wall clock) dates the breaker's
        cool-down."""
        s, m = self.state, self.metrics
        return {
            "id": s.id,
            "url": s.url,
            "source": self.source,
            "models": sorted(s.models),
            "epoch": s.epoch,
            "healthy": s.healthy,
            "draining": s.draining,
            "ejected": s.ejected,
            "guard_holds": sorted(s.guard_holds),
            "breaker": self.breaker.to_json(time.time() if now is None else now),
            "max_num_seqs": s.max_num_seqs,
            "max_model_len": s.max_model_len,
            "inflight": s.inflight,
            "rank_inflight": {str(rank): n for rank, n in sorted(s.rank_inflight.items())},
            "peer_inflight": s.peer_inflight,
            "running": s.running,
            "waiting": s.waiting,
            "kv_usage": s.kv_usage,
            "prefix_cache_hits": None if m is None else m.prefix_hits,
            "prefix_cache_queries": None if m is None else m.prefix_queries,
            "prompt_tokens": None if m is None else m.prompt_tokens,
            "cache_config": {} if m is None else dict(m.cache_config),
            "engine_start_time": self.engine_start_time,
            "registered_at": self.registered_at,
            "restarts": self.restarts,
            "last_probe": self.last_probe,
            "last_error": self.last_error,
            "requests": dict(self.requests),
            "read_gap_s": None if self.read_gap_s is None else round(self.read_gap_s, 6),
        }


def _log_breaker(worker_id: str, before: BreakerState, breaker: Breaker) -> None:
    """One line for a change of a worker's circuit breaker."""
    if breaker.state is BreakerState.OPEN:
        again = " again (its trial request failed)" if before is BreakerState.HALF_OPEN else ""
        log.warning("worker %s ejected%s for %.0f s: %s", worker_id, again, breaker.cooldown_s,
                    breaker.reason)
    elif breaker.state is BreakerState.HALF_OPEN:
        log.info("worker %s: cool-down over; one trial request decides whether it comes back", worker_id)
    else:
        log.info("worker %s back in rotation: its trial request succeeded", worker_id)


def worker_id_for(url: str) -> str:
    """The default id of a worker: ``host:port`` of its URL, identical on every router instance."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = parts.path.rstrip("/")
    return f"{parts.hostname}:{port}{path}"


class Registry:
    """The workers of one router instance, keyed by id."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        history_len: int = 3600,
        failure_threshold: int = 3,
        dispatch: Dispatcher | None = None,
        breaker: BreakerSettings | None = None,
    ) -> None:
        # Engine figures reach the workers' states through the router's dispatch path (a private
        # one for a registry used on its own, as in tests).
        self.dispatch = dispatch if dispatch is not None else Dispatcher(Scheduler())
        self._clock = clock
        self._history_len = history_len
        self._failure_threshold = failure_threshold
        self._breaker = breaker or BreakerSettings(failures=failure_threshold)
        self._records: dict[str, WorkerRecord] = {}
        self._states: tuple[WorkerState, ...] = ()
        self._listeners: list[RegistryListener] = []

    # -- membership -------------------------------------------------------------------------
    def subscribe(self, listener: RegistryListener) -> None:
        """Tell ``listener`` about every epoch change and removal from now on."""
        self._listeners.append(listener)

    def add(
        self,
        url: str,
        *,
        worker_id: str | None = None,
        models: Iterable[str] = (),
        max_num_seqs: int | None = None,
        source: str = SOURCE_CONFIG,
    ) -> WorkerRecord:
        """Register a worker, or re-register it: either way its epoch becomes now, so prefixes
        recorded under an earlier registration stop matching.  In-flight counts survive.
        ``source`` says who registered it (the last registration's wins)."""
        url = url.rstrip("/")
        wid = worker_id or worker_id_for(url)
        now = self._clock()
        declared = frozenset(models)
        old = self._records.get(wid)
        if old is None:
            epoch = now
            state = WorkerState(id=wid, url=url)
        else:
            # Keep the same WorkerState object: requests in flight hold it and decrement it.
            epoch = max(now, old.state.epoch + _EPOCH_STEP)
            state = old.state
        state.url, state.models, state.epoch = url, declared, epoch
        state.max_num_seqs = max_num_seqs
        state.healthy, state.draining, state.ejected = True, False, False
        state.running = state.waiting = state.kv_usage = state.max_model_len = None
        record = WorkerRecord(
            state=state,
            registered_at=now,
            source=source,
            declared_models=declared,
            declared_max_num_seqs=max_num_seqs,
            history=CounterHistory(self._history_len),
            breaker=Breaker(self._breaker),
        )
        self._records[wid] = record
        self._states = tuple(r.state for r in self._records.values())
        for listener in self._listeners:
            listener.on_worker_epoch(wid, epoch)
        return record

    def remove(self, worker_id: str) -> bool:
        """Forget a worker; returns whether it was registered."""
        if self._records.pop(worker_id, None) is None:
            return False
        self._states = tuple(r.state for r in self._records.values())
        for listener in self._listeners:
            listener.on_worker_removed(worker_id)
        return True

    def set_draining(self, worker_id: str, draining: bool = True) -> WorkerRecord | None:
        """Stop (or resume) sending new requests to a worker; in-flight ones finish."""
        record = self._records.get(worker_id)
        if record is not None:
            record.state.draining = draining
        return record

    def set_guard_hold(self, worker_id: str, reason: str, hold: bool = True) -> WorkerRecord | None:
        """Keep a worker out of rotation for ``reason`` (a fleet-guard check), or release that
        reason's hold; other reasons' holds and an admin drain are untouched."""
        record = self._records.get(worker_id)
        if record is not None:
            holds = record.state.guard_holds
            record.state.guard_holds = holds | {reason} if hold else holds - {reason}
        return record

    # -- reading ----------------------------------------------------------------------------
    def get(self, worker_id: str) -> WorkerRecord | None:
        """The record of ``worker_id``, or None."""
        return self._records.get(worker_id)

    def records(self) -> list[WorkerRecord]:
        """All records, in registration order."""
        return list(self._records.values())

    def states(self) -> Sequence[WorkerState]:
        """The scheduler's view: every registered worker (the scheduler filters unhealthy ones)."""
        return self._states

    def __len__(self) -> int:
        return len(self._records)

    def model_cards(self) -> dict[str, list[Mapping[str, Any]]]:
        """``/v1/models`` entries by model id, from healthy undrained workers; declared models
        without a card get a minimal one."""
        cards: dict[str, list[Mapping[str, Any]]] = {}
        for record in self._records.values():
            if not record.state.healthy or record.state.draining:
                continue
            seen = set()
            for card in record.model_cards:
                mid = card.get("id")
                if isinstance(mid, str) and (not record.declared_models or mid in record.declared_models):
                    cards.setdefault(mid, []).append(card)
                    seen.add(mid)
            for mid in record.state.models - seen:
                cards.setdefault(mid, []).append({"id": mid})
        return cards

    # -- the proxy's accounting (in-flight counts are the dispatcher's) ----------------------
    def count_request(self, worker_id: str, kind: str) -> None:
        """Count a request served by ``worker_id`` under its decision kind."""
        record = self._records.get(worker_id)
        if record is not None:
            record.requests[kind] += 1

    def sending(self, record: WorkerRecord) -> None:
        """A request is about to be sent to ``record``'s worker: if its breaker is half-open this
        is the one trial, and the worker stops being a candidate until the trial reports back."""
        breaker = record.breaker
        if breaker.state is not _CLOSED:
            breaker.sending(self._clock())
            self._sync(record)

    def mark_failure(self, worker_id: str, reason: str, *, unreachable: bool = False,
                     malformed: bool = False) -> None:
        """A request to the worker failed.  An unreachable worker is unhealthy at once (the probe
        brings it back when it answers again); every failure counts towards its circuit breaker,
        which takes it out after ``breaker.failures`` in a row (only a request brings it back).
        ``malformed``: the worker answered, but not with an answer; enough of those among its
        recent answers eject it even with good answers in between (``malformed_outlier``)."""
        record = self._records.get(worker_id)
        if record is None:
            return
        record.last_error, record.error_from_probe = reason, False
        if unreachable and record.state.healthy:
            record.state.healthy = False
            log.warning("worker %s unhealthy: unreachable (%s)", worker_id, reason)
        now = self._clock()
        breaker = record.breaker
        breaker.tick(now)
        breaker.failed(now, reason)
        if malformed:
            breaker.answered(True)
            ready = sum(1 for s in self._states if s.ready)
            detail = malformed_outlier({r.id: r.breaker for r in self._records.values()}, worker_id, ready)
            if detail is not None:
                breaker.eject(now, "malformed", detail)
                record.last_error, record.error_from_probe = f"ejected: {detail}", False
        self._sync(record)

    def mark_success(self, worker_id: str, *, ttft_s: float | None = None, predicted_s: float = 0.0,
                     read_gap_s: float | None = None) -> None:
        """A request to the worker got its whole answer (or its client left while it flowed): its
        failure streak ends, a half-open breaker closes.  ``ttft_s`` (a streamed answer's time to
        first token) and the ``predicted_s`` it was routed with feed the latency-outlier detector;
        ``read_gap_s`` (a stream's mean time between two reads) the worker's average gap."""
        record = self._records.get(worker_id)
        if record is None:
            return
        if read_gap_s is not None:
            old = record.read_gap_s
            record.read_gap_s = read_gap_s if old is None else old + (read_gap_s - old) * _GAP_ALPHA
        if not record.error_from_probe:
            record.last_error = None
        breaker = record.breaker
        was_closed = breaker.state is _CLOSED
        breaker.succeeded()
        breaker.answered(False)
        if not was_closed:
            self._sync(record)
        if ttft_s is None or ttft_s < 0:
            return
        breaker.observe(ttft_s, predicted_s, _PREDICTION_FLOOR_S)
        if breaker.samples < self._breaker.outlier_min_samples or breaker.samples % _OUTLIER_EVERY:
            return
        ready = sum(1 for s in self._states if s.ready)
        detail = latency_outlier({r.id: r.breaker for r in self._records.values()}, worker_id, ready)
        if detail is not None:
            breaker.eject(self._clock(), "latency", detail)
            record.last_error, record.error_from_probe = f"ejected: {detail}", False
            self._sync(record)

    def _sync(self, record: WorkerRecord) -> None:
        breaker = record.breaker
        record.state.ejected = not breaker.admits
        if breaker.state is not record.logged_breaker:
            before, record.logged_breaker = record.logged_breaker, breaker.state
            _log_breaker(record.id, before, breaker)

    # -- the probe's findings ---------------------------------------------------------------
    def apply_probe(self, worker_id: str, result: ProbeResult) -> None:
        """Fold one probe round into the worker's state; a changed engine start time is a
        restart, which starts a new epoch."""
        record = self._records.get(worker_id)
        if record is None:
            return
        now = self._clock()
        state = record.state
        record.last_probe = now
        # Only the clock moves the breaker here: /health answering says nothing about whether the
        # engine answers requests (a hung engine often still does), so it never closes a breaker.
        if record.breaker.tick(now):
            self._sync(record)
        if not result.reachable or not result.healthy:
            record.last_error, record.error_from_probe = result.error, True
            record.consecutive_failures += 1
            if state.healthy and (not result.reachable
                                  or record.consecutive_failures >= self._failure_threshold):
                state.healthy = False
                log.warning("worker %s unhealthy: %s", worker_id, result.error or "/health failed")
        else:
            record.consecutive_failures = 0
            if record.error_from_probe:
                record.last_error, record.error_from_probe = None, False
            if not state.healthy:
                state.healthy = True
                log.info("worker %s healthy again", worker_id)
        if result.models is not None:
            self._apply_models(record, result.models)
        if result.max_num_seqs is not None and record.declared_max_num_seqs is None:
            state.max_num_seqs = result.max_num_seqs
        m = result.metrics
        if m is None:
            return
        record.metrics = m
        self.dispatch.scraped(state, m.running, m.waiting, m.kv_usage, m.kv_tokens,
                              block_size=m.block_size, inflight_before=result.inflight_at_start)
        if m.process_start_time is not None:
            if record.engine_start_time is not None and m.process_start_time != record.engine_start_time:
                self._restarted(record, m.process_start_time)
            record.engine_start_time = m.process_start_time
        if m.prefix_hits is not None or m.prompt_tokens is not None:
            record.history.append(
                CounterSample(now, m.prefix_hits or 0.0, m.prefix_queries or 0.0, m.prompt_tokens or 0.0)
            )

    def _apply_models(self, record: WorkerRecord, cards: tuple[Mapping[str, Any], ...]) -> None:
        record.model_cards = cards
        served = frozenset(c["id"] for c in cards if isinstance(c.get("id"), str))
        if not record.declared_models and served:
            record.state.models = served
        lens: list[int] = [c["max_model_len"] for c in cards
                           if c.get("id") in record.state.models and isinstance(c.get("max_model_len"), int)]
        if lens:
            record.state.max_model_len = min(lens)

    def _restarted(self, record: WorkerRecord, start_time: float) -> None:
        """The engine restarted with an empty cache.  Its new epoch is its start time when that is
        later than the current epoch, so router instances that detect the same restart agree."""
        epoch = max(start_time, record.state.epoch + _EPOCH_STEP)
        record.state.epoch = epoch
        record.restarts += 1
        for listener in self._listeners:
            listener.on_worker_epoch(record.id, epoch)
