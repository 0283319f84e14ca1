"""Discovery of replicas at run time (docs/discovery.md): each source looked up on a timer, its
answer folded into the router's fleet through the admin API's own path (``Router.add_worker``,
``Registry.set_draining``, ``Router.remove_worker``).

The decisions are ``fleet.discovery.Reconciler``'s; this module does the lookups
(``fleet.discovery_lookup``), carries out each plan, logs what changed (a failing source once
when it starts failing, then at most once a minute, and when it answers again) and keeps the
metrics ``kvroute_discovery_errors_total{source}`` and ``kvroute_discovered_workers{source}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from prometheus_client import Counter, Gauge

from kvroute.event_loop import cancel_and_wait
from kvroute.fleet.discovery import DiscoverySource, Member, Plan, Reconciler, parse_source
from kvroute.fleet.discovery_lookup import DiscoveryError, lookup
from kvroute.server.context import Router

log = logging.getLogger("kvroute.discovery")

# A source that keeps failing is logged again at most this often.
ERROR_LOG_INTERVAL_S = 60.0


class DiscoveryWatch:
    """The discovery loops of one router: one per source, every ``settings.discover_interval_s``."""

    def __init__(self, router: Router, *, clock: Callable[[], float] = time.monotonic) -> None:
        s = router.settings
        self._router = router
        self._sources: tuple[DiscoverySource, ...] = tuple(parse_source(spec) for spec in s.discover)
        self._interval = s.discover_interval_s
        self._timeout = min(s.probe_timeout_s, s.discover_interval_s)
        self._clock = clock
        self.reconciler = Reconciler(tuple(src.spec for src in self._sources),
                                     empty_rounds_needed=s.discover_empty_rounds)
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._next_error_log: dict[str, float] = {}
        self._quiet_errors: dict[str, int] = {}
        registry = router.metrics.prometheus
        self.errors = Counter("kvroute_discovery_errors",
                              "Discovery rounds that got no answer (the last replicas listed are kept), "
                              "by source",
                              ["source"], registry=registry)
        self.listed = Gauge("kvroute_discovered_workers",
                            "Replicas a discovery source lists (what the router acts on), by source",
                            ["source"], registry=registry)
        for src in self._sources:
            self.errors.labels(src.spec)
            self.listed.labels(src.spec).set(0)

    async def start(self) -> None:
        """Look every source up once and register what they list (before the router accepts
        requests, like the configured workers), then keep looking on the timer."""
        await asyncio.gather(*(self._observe(src) for src in self._sources))
        await self.reconcile()
        self._tasks = [asyncio.create_task(self._loop(src), name=f"discover:{src.spec}")
                       for src in self._sources]

    async def close(self) -> None:
        """Stop every loop."""
        tasks, self._tasks = self._tasks, []
        await cancel_and_wait(tasks)

    async def _loop(self, source: DiscoverySource) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self._observe(source)
                await self.reconcile()
            except Exception:  # a bug here must not end discovery for the router's lifetime
                log.exception("discovery round of %s failed", source.spec)

    async def _observe(self, source: DiscoverySource) -> None:
        spec = source.spec
        before = self.reconciler.views.get(spec)
        try:
            answer: frozenset[str] | None = await lookup(source, timeout_s=self._timeout)
        except DiscoveryError as exc:
            answer = None
            self.errors.labels(spec).inc()
            self._log_failure(spec, str(exc))
        view = self.reconciler.observe(spec, answer)
        self.listed.labels(spec).set(len(view.urls))
        if answer is None:
            return
        if before is not None and before.failures:
            log.info("discovery %s answers again after %d failed round(s): %d replica(s)",
                     spec, before.failures, len(answer))
            self._next_error_log.pop(spec, None)
            self._quiet_errors.pop(spec, None)
        if not answer and view.urls:
            log.warning("discovery %s lists no replica (%d in a row): keeping the last %d until %d "
                        "answers in a row say so (discover_empty_rounds)", spec, view.empty_rounds,
                        len(view.urls), self.reconciler.empty_rounds_needed)

    def _log_failure(self, spec: str, message: str) -> None:
        now = self._clock()
        if now < self._next_error_log.get(spec, 0.0):
            self._quiet_errors[spec] = self._quiet_errors.get(spec, 0) + 1
            return
        quiet = self._quiet_errors.pop(spec, 0)
        more = f" ({quiet} more failed round(s) since the last message)" if quiet else ""
        kept = len(self.reconciler.views[spec].urls) if spec in self.reconciler.views else 0
        log.warning("discovery %s failed: %s; keeping the last %d replica(s)%s", spec, message, kept, more)
        self._next_error_log[spec] = now + ERROR_LOG_INTERVAL_S

    async def reconcile(self) -> Plan:
        """Make the fleet what the sources list now; returns what was done."""
        async with self._lock:
            router = self._router
            plan = self.reconciler.plan(self._members())
            for wid in plan.drain:
                log.info("discovery %s: %s is no longer listed: draining it (removed once its requests "
                         "finish)", self._source_of(wid), wid)
                router.registry.set_draining(wid)
            for wid in plan.resume:
                log.info("discovery %s: %s is listed again: taking requests again", self._source_of(wid), wid)
                router.registry.set_draining(wid, False)
            for wid in plan.remove:
                log.info("discovery %s: %s drained and idle: removed", self._source_of(wid), wid)
                router.remove_worker(wid)
            if plan.register:
                records = await asyncio.gather(*(router.add_worker(url, source=source)
                                                 for url, source in plan.register))
                for record, (_, source) in zip(records, plan.register, strict=True):
                    log.info("discovery %s: registered %s (%s)", source, record.id,
                             "healthy" if record.state.healthy else f"not healthy: {record.last_error}")
            self.reconciler.applied(plan, self._members())
            return plan

    def _source_of(self, worker_id: str) -> str:
        record = self._router.registry.get(worker_id)
        return "?" if record is None else record.source

    def _members(self) -> Sequence[Member]:
        return [Member(r.id, r.state.url, r.source, r.state.draining, r.state.inflight)
                for r in self._router.registry.records()]
