"""The cache-drift alarm: a replica whose engine reports far fewer cached tokens than the prefix
index predicted, for long enough and under enough traffic (pure; the clock is the caller's).

The signal is the router's learned cache realisation (``routing/learning.py``): the engine's
reported hit share divided by the share the index predicted, which a new epoch resets.  Prefix
caching turned off by a restart with other flags, a changed block size or an eviction storm all
drive it down.  Alone it is noisy on an idle replica (eight requests make a figure), so the alarm
also needs ``guard_drift_min_tokens`` predicted cached tokens while it stays low.  It is the figure
of the reports alone (``WorkerLearning.realised``), not the one routing counts on, whose deficit
fades while no report renews it: an alarm clears on reports that the cache delivers again, not
because a worker got no traffic (``drift_watch.py`` reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvroute.routing.settings import check_non_negative, setting


@dataclass(frozen=True, slots=True)
class DriftSettings:
    """When the cache-drift alarm fires and clears (docs/fleet-guard.md)."""

    guard_drift: bool = setting(True, "raise the cache-drift alarm (metric, log, dashboard); it never "
                                      "changes routing")
    guard_drift_below: float = setting(
        0.3, "alarm when a worker's cache realisation (engine-reported hit share / the share the index "
             "predicted) stays below this")
    guard_drift_recover: float = setting(
        0.6, "the alarm clears once realisation is back at this (or at the worker's next epoch)")
    guard_drift_for_s: float = setting(60.0, "how long realisation must stay below guard_drift_below")
    guard_drift_min_tokens: int = setting(
        50_000, "cached tokens the index must have predicted on the worker meanwhile (an idle worker "
                "never alarms)")

    def __post_init__(self) -> None:
        check_non_negative(self, "guard_drift_for_s", "guard_drift_min_tokens")
        if not 0.0 <= self.guard_drift_below <= self.guard_drift_recover <= 1.0:
            raise ValueError("need 0 <= guard_drift_below <= guard_drift_recover <= 1")


@dataclass(frozen=True, slots=True)
class DriftReading:
    """One worker's figures at one moment: its epoch, learned realisation, and the cached tokens
    the index has predicted there so far (a running total)."""

    worker_id: str
    epoch: float
    realised: float
    predicted_tokens: float


class DriftChange(StrEnum):
    """What an update did to a worker's alarm."""

    RAISED = "raised"
    RECOVERED = "recovered"  # realisation came back
    NEW_EPOCH = "new_epoch"  # the engine restarted or re-registered
    TURNED_OFF = "turned_off"  # guard_drift is off for the worker's model


@dataclass(slots=True)
class DriftState:
    """One worker's alarm: ``low_since`` is when realisation was first seen below the threshold
    (None while it is not), ``low_tokens`` the tokens predicted since the last reading before that
    (the traffic that brought it down counts), ``raised_at`` when the alarm fired."""

    epoch: float
    last_tokens: float
    realised: float = 1.0
    low_since: float | None = None
    low_from_tokens: float = 0.0
    low_tokens: float = 0.0
    raised_at: float | None = None

    @property
    def alarmed(self) -> bool:
        """Whether the alarm is up."""
        return self.raised_at is not None

    def to_json(self, now: float) -> dict[str, object]:
        """The alarm as /admin/workers and the dashboard show it."""
        return {
            "alarm": self.alarmed,
            "realisation": round(self.realised, 4),
            "low_for_s": None if self.low_since is None else round(now - self.low_since, 1),
            "low_predicted_tokens": round(self.low_tokens),
            "raised_at": self.raised_at,
        }


class DriftAlarms:
    """Every worker's drift alarm, updated from readings."""

    def __init__(self) -> None:
        self._states: dict[str, DriftState] = {}

    def update(self, reading: DriftReading, settings: DriftSettings, now: float) -> DriftChange | None:
        """Fold one reading in; returns what changed about the alarm, if anything."""
        state = self._states.get(reading.worker_id)
        change = None
        if state is None or reading.epoch != state.epoch:
            if state is not None and state.alarmed:
                change = DriftChange.NEW_EPOCH
            state = self._states[reading.worker_id] = DriftState(reading.epoch, reading.predicted_tokens)
        state.realised = reading.realised
        previous_tokens, state.last_tokens = state.last_tokens, reading.predicted_tokens
        if not settings.guard_drift:
            was = state.alarmed
            self._states[reading.worker_id] = DriftState(reading.epoch, reading.predicted_tokens,
                                                         reading.realised)
            return DriftChange.TURNED_OFF if was else change
        if reading.realised < settings.guard_drift_below:
            if state.low_since is None:
                state.low_since, state.low_from_tokens = now, previous_tokens
            state.low_tokens = reading.predicted_tokens - state.low_from_tokens
            if (not state.alarmed and now - state.low_since >= settings.guard_drift_for_s
                    and state.low_tokens >= settings.guard_drift_min_tokens):
                state.raised_at = now
                return DriftChange.RAISED
        elif reading.realised >= settings.guard_drift_recover:
            state.low_since, state.low_tokens = None, 0.0
            if state.alarmed:
                state.raised_at = None
                return DriftChange.RECOVERED
        elif not state.alarmed:
            # Between the two thresholds: not low enough to start (or keep) the clock, not
            # recovered enough to clear a raised alarm.
            state.low_since, state.low_tokens = None, 0.0
        return change

    def state(self, worker_id: str) -> DriftState | None:
        """The worker's alarm state (None before its first reading)."""
        return self._states.get(worker_id)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet."""
        self._states.pop(worker_id, None)
