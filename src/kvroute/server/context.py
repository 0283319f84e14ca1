"""The parts of one running router, shared by its request handlers, admin API and add-ons."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from kvroute.api.model_aliases import ModelAliases
from kvroute.api.requests import RequestOptions
from kvroute.fleet.kv_events import KvEventWatch
from kvroute.fleet.probe import Prober
from kvroute.fleet.registry import SOURCE_CONFIG, Registry, WorkerRecord
from kvroute.guard.canary_runner import CanaryRunner
from kvroute.guard.doctor_watch import DoctorWatch
from kvroute.guard.drift_watch import DriftWatch
from kvroute.router_settings import Settings
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.sync_record import SyncRecord
from kvroute.server.activity import Activity
from kvroute.server.api_keys import KeyCheck
from kvroute.server.engine_tokens import EngineTokens
from kvroute.server.metrics import RouterMetrics
from kvroute.server.trail import Trails
from kvroute.server.upstream import UpstreamPool


class RouteSync(Protocol):
    """Shares routing facts with other router instances (the Redis bus implements it).

    ``start`` is awaited once before the router accepts requests, with the function to call for
    each fact received from another instance (``Dispatcher.remote``); ``publish`` is called on
    the hot path and must not block (queue and send in the background); ``stop`` is awaited once
    at shutdown.  Losing a fact must only ever cost a cache miss.
    """

    async def start(self, apply: Callable[[SyncRecord], None]) -> None: ...

    def publish(self, records: Sequence[SyncRecord]) -> None: ...

    async def stop(self) -> None: ...


@dataclass(slots=True)
class Router:
    """Everything one router instance holds.  ``app[ROUTER]`` is this object, so add-ons mounted
    on the app (the dashboard) read the registry, scheduler, metrics and activity from it."""

    settings: Settings
    registry: Registry
    dispatch: Dispatcher
    metrics: RouterMetrics
    activity: Activity
    prober: Prober
    request_options: RequestOptions = field(default_factory=RequestOptions)
    model_aliases: ModelAliases = field(default_factory=ModelAliases)
    sync: RouteSync | None = None
    upstream: UpstreamPool | None = None
    doctor_watch: DoctorWatch | None = None
    drift_watch: DriftWatch | None = None
    canary: CanaryRunner | None = None
    kv_events: KvEventWatch | None = None
    tokens: EngineTokens | None = None
    # This process's part of the canary budget (``1 / processes`` in a multi-process router).
    canary_share: float = 1.0
    # The access log and trace spans (None: both off), and the router's own API keys (None: none).
    trails: Trails | None = None
    keys: KeyCheck | None = None
    _closing: bool = False

    @property
    def closing(self) -> bool:
        """The router is shutting down (``shut_down``): inference requests get 503, ``/ready`` too."""
        return self._closing

    def shut_down(self) -> None:
        """Begin the shutdown: new inference requests are refused from now on, and every request
        waiting at flow control's gate is shed at once (each gets the API's overload answer),
        since no replica will free up for it.  Requests already routed finish."""
        self._closing = True
        self.dispatch.shed_all()

    @property
    def scheduler(self) -> Scheduler:
        """The routing scheduler behind the dispatch path."""
        return self.dispatch.scheduler

    def publish(self, records: Sequence[SyncRecord]) -> None:
        """Hand facts to the sync bus, if there is one."""
        if records and self.sync is not None:
            self.sync.publish(records)

    def on_worker_epoch(self, worker_id: str, epoch: float) -> None:
        """Registry listener: a worker's epoch changed; tell the scheduler and the other instances."""
        self.publish(self.dispatch.worker_epoch(worker_id, epoch))

    def on_worker_removed(self, worker_id: str) -> None:
        """Registry listener: a worker left."""
        self.dispatch.worker_removed(worker_id)
        if self.drift_watch is not None:
            self.drift_watch.forget(worker_id)

    def cache_json(self, worker_id: str) -> dict[str, Any]:
        """How the router knows what a worker's cache holds: ``exact`` (its KV events) or
        ``approximate`` (the prefix index of what was sent there), and the exact index's blocks."""
        exact = self.scheduler.exact
        return {"cache_mode": self.scheduler.cache_mode(worker_id),
                "kv_events": exact.stats(worker_id) if exact.publishes(worker_id) else None}

    def guard_json(self, worker_id: str) -> dict[str, Any]:
        """What the fleet guard knows about a worker: the doctor's latest check, the cache-drift
        alarm and the canary's state (None where that part has not looked yet or is off)."""
        doctor, drift = self.doctor_watch, self.drift_watch
        return {"doctor": None if doctor is None else doctor.to_json(worker_id),
                "cache_drift": None if drift is None else drift.to_json(worker_id),
                "canary": self.canary_state(worker_id)}

    async def add_worker(self, url: str, *, worker_id: str | None = None, models: Sequence[str] = (),
                         max_num_seqs: int | None = None, source: str = SOURCE_CONFIG) -> WorkerRecord:
        """Register (or re-register) a worker, probe it once and keep probing it; ``source``: who
        registered it (``WorkerRecord.source``)."""
        record = self.registry.add(url, worker_id=worker_id, models=models, max_num_seqs=max_num_seqs,
                                   source=source)
        await self.first_probe(record.id)
        self.prober.watch(record.id)
        return record

    async def first_probe(self, worker_id: str) -> None:
        """Probe a just-registered worker once, ``/server_info`` included; where the engine says it
        publishes KV-cache events, subscribe there."""
        result = await self.prober.probe_once(worker_id, with_server_info=True)
        if result is not None and result.kv_events and self.kv_events is not None:
            await self.kv_events.advertised(worker_id, result.kv_events)

    def remove_worker(self, worker_id: str) -> bool:
        """Stop probing and forget a worker; its in-flight requests finish."""
        self.prober.unwatch(worker_id)
        if self.canary is not None:
            self.canary.watch.forget(worker_id)
        return self.registry.remove(worker_id)

    def canary_state(self, worker_id: str) -> dict[str, Any] | None:
        """The fleet guard canary's view of ``worker_id`` (admin API, dashboard), if it has one."""
        if self.canary is None:
            return None
        record = self.registry.get(worker_id)
        models = sorted(record.state.models) if record is not None else []
        return self.canary.watch.replica_json(worker_id, models[0] if models else None)


ROUTER: web.AppKey[Router] = web.AppKey("kvroute.router", Router)
