"""Runs the cache-drift alarm: reads every worker's learned realisation once per interval, logs
the alarm raised and cleared, and exposes it as ``kvroute_worker_cache_drift{worker}``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from kvroute.event_loop import cancel_and_wait
from kvroute.fleet.registry import Registry
from kvroute.guard.drift import DriftAlarms, DriftChange, DriftReading, DriftSettings
from kvroute.guard.worker_settings import blocks_for
from kvroute.routing.scheduler import Scheduler

log = logging.getLogger("kvroute.guard")


class DriftWatch:
    """The drift alarms of one router's workers.  ``context(worker_id)`` names what else the guard
    knows about a worker (the doctor's findings) for the alarm's log line."""

    def __init__(self, registry: Registry, scheduler: Scheduler, *, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.time,
                 context: Callable[[str], str] = lambda _: "") -> None:
        self._registry = registry
        self._scheduler = scheduler
        self._interval = interval_s
        self._clock = clock
        self._context = context
        self.alarms = DriftAlarms()
        self._task: asyncio.Task[None] | None = None

    def tick(self) -> list[tuple[str, DriftChange]]:
        """Update every worker's alarm now; returns the changes (each one logged)."""
        now = self._clock()
        changes = []
        for record in self._registry.records():
            state = record.state
            learned = self._scheduler.learned(state.id)
            # The reports alone, not the figure routing counts on: that one fades back to 1 while no
            # report renews it, and a worker whose cache is broken gets few requests (routing
            # discounts it), so the alarm would clear for want of traffic, not for a cache that
            # delivers again.  It clears on reports at guard_drift_recover, or a new epoch.
            reading = DriftReading(state.id, state.epoch, 1.0 if learned is None else learned.realised,
                                   0.0 if learned is None else learned.predicted_cached_tokens)
            settings = blocks_for(state.models, self._scheduler.settings_for, DriftSettings)[0]
            change = self.alarms.update(reading, settings, now)
            if change is not None:
                changes.append((state.id, change))
                self._log(state.id, change, settings)
        return changes

    def _log(self, worker_id: str, change: DriftChange, s: DriftSettings) -> None:
        alarm = self.alarms.state(worker_id)
        if change is DriftChange.RAISED and alarm is not None:
            extra = self._context(worker_id)
            log.warning("cache drift on %s: realisation %.2f, below %.2f for %.0f s over %.0f predicted "
                        "cached tokens%s", worker_id, alarm.realised, s.guard_drift_below,
                        self._clock() - (alarm.low_since or self._clock()), alarm.low_tokens,
                        f"; {extra}" if extra else "")
        else:
            log.info("cache drift on %s cleared (%s)", worker_id, change.value.replace("_", " "))

    def to_json(self, worker_id: str) -> dict[str, Any] | None:
        """The worker's alarm for /admin/workers and the dashboard (None before its first tick)."""
        state = self.alarms.state(worker_id)
        return None if state is None else state.to_json(self._clock())

    def families(self) -> Iterator[Metric]:
        """``kvroute_worker_cache_drift`` and ``kvroute_worker_cache_realisation`` (the figure routing
        counts on, ``Scheduler.realisation``) per worker."""
        drift = GaugeMetricFamily("kvroute_worker_cache_drift",
                                  "1 while the worker's engine reports far fewer cached tokens than the "
                                  "prefix index predicted (docs/fleet-guard.md)", labels=["worker"])
        realised = GaugeMetricFamily("kvroute_worker_cache_realisation",
                                     "Engine-reported hit share / share the index predicted, learned "
                                     "per worker, as routing counts on it now: its deficit fades while "
                                     "no report renews it (1.0 until enough requests; the drift alarm "
                                     "reads the reports alone)", labels=["worker"])
        for record in self._registry.records():
            state = self.alarms.state(record.id)
            if state is not None:
                drift.add_metric([record.id], 1.0 if state.alarmed else 0.0)
                realised.add_metric([record.id], self._scheduler.realisation(record.id))
        yield from (drift, realised)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet."""
        self.alarms.forget(worker_id)

    def start(self) -> None:
        """Tick every interval from now on."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="guard:drift")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                self.tick()
            except Exception:  # a bug here must not silence the alarm for good
                log.exception("cache-drift tick failed")

    async def close(self) -> None:
        """Stop ticking."""
        task, self._task = self._task, None
        await cancel_and_wait([task])
