"""Runs the doctor against each worker when it registers or its epoch changes, in the background.

The registry tells this watch about every new epoch (it is a ``RegistryListener``); the check
reads the engine's ``/metrics``, ``/v1/models`` and ``/server_info`` (and runs the doctor's probe
when ``guard_doctor_probe`` asks) without ever delaying the registration or a routing decision.
The findings are kept per worker until its next epoch: one log line per new finding,
``kvroute_worker_finding{worker,code,severity}``, ``/admin/workers`` and the dashboard; with
``guard_doctor_action = "exclude"`` an error holds the worker out until a clean check at a later
epoch (``doctor_hold``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.core import GaugeMetricFamily, Metric

from kvroute.doctor.finding import Finding, Severity, worst
from kvroute.doctor.session import examine_engine
from kvroute.engine_client.http import Target
from kvroute.event_loop import cancel_and_wait
from kvroute.fleet.registry import Registry, WorkerRecord
from kvroute.guard.doctor_hold import (
    HOLD_REASON,
    DoctorGuardSettings,
    about_configuration,
    combined,
    holds_out,
    last_to_serve,
    new_findings,
    unread,
)
from kvroute.guard.worker_settings import blocks_for
from kvroute.routing.settings import Blocks

log = logging.getLogger("kvroute.guard")

# How long a check at registration waits for the worker's first probe round, and how often it looks.
_FIRST_PROBE_WAIT_S = 5.0
_POLL_S = 0.05
_LOG_LEVEL = {Severity.INFO: logging.INFO, Severity.WARNING: logging.WARNING, Severity.ERROR: logging.ERROR}


@dataclass(frozen=True, slots=True)
class DoctorCheck:
    """The doctor's findings about one worker at one epoch; ``unread`` when even the last try
    could not reach it."""

    epoch: float
    checked_at: float
    findings: tuple[Finding, ...]
    held: bool
    unread: bool = False
    spared: bool = False

    def to_json(self) -> dict[str, Any]:
        """The check as /admin/workers and the dashboard show it."""
        return {"epoch": self.epoch, "checked_at": self.checked_at, "worst": worst(self.findings).value,
                "held": self.held, "spared": self.spared, "unread": self.unread,
                "findings": [f.as_dict() for f in self.findings]}


class DoctorWatch:
    """The doctor's checks of one router's workers.  ``settings_for(model)`` gives a model's settings
    (``Scheduler.settings_for``).  A check that cannot reach the engine is tried ``tries`` times,
    ``retry_s`` apart, while the epoch lasts."""

    def __init__(self, registry: Registry, settings_for: Callable[[str], Blocks], *, timeout_s: float = 10.0,
                 retry_s: float = 2.0, tries: int = 3, clock: Callable[[], float] = time.time,
                 api_key: str | None = None) -> None:
        self._registry = registry
        self._api_key = api_key
        self._settings_for = settings_for
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._tries = tries
        self._clock = clock
        self._checks: dict[str, DoctorCheck] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    # -- RegistryListener ---------------------------------------------------------------------
    def on_worker_epoch(self, worker_id: str, epoch: float) -> None:
        """A worker registered or restarted: check it in the background (a check still running
        for an older epoch is dropped)."""
        self._cancel(worker_id)
        self._tasks[worker_id] = asyncio.create_task(self._run(worker_id, epoch), name=f"doctor:{worker_id}")

    def on_worker_removed(self, worker_id: str) -> None:
        """A worker left: forget its findings."""
        self._cancel(worker_id)
        self._checks.pop(worker_id, None)

    def _cancel(self, worker_id: str) -> None:
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()

    # -- the check ----------------------------------------------------------------------------
    async def _run(self, worker_id: str, epoch: float) -> None:
        try:
            await self.check(worker_id, epoch)
        except Exception:  # a bug in one check must not end the watch of the others
            log.exception("doctor check of %s failed", worker_id)
        finally:
            if self._tasks.get(worker_id) is asyncio.current_task():
                del self._tasks[worker_id]

    async def check(self, worker_id: str, epoch: float) -> DoctorCheck | None:
        """Run the doctor against ``worker_id`` for ``epoch`` and apply its findings; None when the
        worker left, its epoch moved on meanwhile, or no model it serves asks for the check."""
        await self._after_first_probe(worker_id)
        for attempt in range(1, self._tries + 1):
            record = self._registry.get(worker_id)
            if record is None or record.state.epoch != epoch:
                return None
            settings = self._settings(record.state.models)
            # A worker registered a moment ago may not have named its models yet: check it, and
            # let the model the engine reports decide below.
            if record.state.models and not settings.guard_doctor:
                return None
            target = Target(record.state.url, self._api_key, self._timeout_s)
            report = await examine_engine(self._client(), target, probe=settings.guard_doctor_probe)
            record = self._registry.get(worker_id)
            if record is None or record.state.epoch != epoch:
                return None
            reported = report.merged.facts.model
            settings = self._settings(record.state.models or ([reported.value] if reported else []))
            if not settings.guard_doctor:
                return None
            findings = tuple(about_configuration(report.findings))
            if unread(findings) and attempt < self._tries:
                await asyncio.sleep(self._retry_s)
                continue
            return self._apply(record, findings, settings)
        return None

    async def _after_first_probe(self, worker_id: str) -> None:
        """A worker registered a moment ago is probed at once: let that round go first (it names
        the worker's models and must not wait behind the check's requests), for up to
        ``_FIRST_PROBE_WAIT_S``."""
        deadline = self._clock() + _FIRST_PROBE_WAIT_S
        while (record := self._registry.get(worker_id)) is not None and record.last_probe is None \
                and self._clock() < deadline:
            await asyncio.sleep(_POLL_S)

    def _settings(self, models: Iterable[str]) -> DoctorGuardSettings:
        return combined(blocks_for(models, self._settings_for, DoctorGuardSettings))

    def _apply(self, record: WorkerRecord, findings: tuple[Finding, ...],
               settings: DoctorGuardSettings) -> DoctorCheck:
        worker_id, epoch = record.id, record.state.epoch
        before = self._checks.get(worker_id)
        could_not_read = unread(findings)
        if could_not_read:
            # Nothing was learnt about the configuration: whatever hold there was stays.
            held = before is not None and before.held
        else:
            held = holds_out(findings, settings.guard_doctor_action)
        was_held = HOLD_REASON in record.state.guard_holds
        spared = held and not was_held and last_to_serve(record.state, self._registry.states())
        held = held and not spared
        check = DoctorCheck(epoch, self._clock(), findings, held, could_not_read, spared)
        self._checks[worker_id] = check
        for f in new_findings(before.findings if before is not None else (), findings):
            log.log(_LOG_LEVEL.get(f.severity, logging.INFO), "doctor on %s: %s %s: %s%s", worker_id,
                    f.severity.value, f.code, f.title, f" (fix: {f.fix})" if f.fix else "")
        self._registry.set_guard_hold(worker_id, HOLD_REASON, held)
        if spared:
            log.warning("doctor would hold %s out of rotation (guard_doctor_action = exclude), but no "
                        "other ready worker serves its models: it stays in", worker_id)
        elif held and not was_held:
            log.warning("doctor holds %s out of rotation (guard_doctor_action = exclude) until a clean "
                        "check at a new epoch", worker_id)
        elif was_held and not held:
            log.warning("doctor releases %s: its check at epoch %.3f is clean", worker_id, epoch)
        return check

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    # -- reading --------------------------------------------------------------------------------
    def to_json(self, worker_id: str) -> dict[str, Any] | None:
        """The worker's latest check (None before the first one ends)."""
        check = self._checks.get(worker_id)
        return None if check is None else check.to_json()

    def summary(self, worker_id: str) -> str:
        """The worker's warnings and errors in a few words (for the drift alarm's log line)."""
        check = self._checks.get(worker_id)
        if check is None:
            return ""
        codes = [f.code for f in check.findings if f.severity in (Severity.WARNING, Severity.ERROR)]
        return "doctor: " + (", ".join(codes) if codes else "no warning")

    def families(self) -> Iterator[Metric]:
        """``kvroute_worker_finding{worker,code,severity}`` = 1 for each info, warning and error."""
        family = GaugeMetricFamily("kvroute_worker_finding",
                                   "The doctor's findings about each worker at its current epoch "
                                   "(docs/fleet-guard.md)", labels=["worker", "code", "severity"])
        for worker_id, check in self._checks.items():
            shown = {(f.code, f.severity.value) for f in check.findings if f.severity is not Severity.OK}
            for code, severity in sorted(shown):
                family.add_metric([worker_id, code, severity], 1.0)
        yield family

    async def settled(self) -> None:
        """Wait for the checks under way (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def close(self) -> None:
        """Stop the checks under way and close their connections."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        await cancel_and_wait(tasks)
        if self._session is not None:
            await self._session.close()
            self._session = None
