"""Model time of one simulated replica served in (scaled) real time.  Pure: the caller passes the wall clock.

Model time runs ``speed`` times faster than the wall clock: ``model = origin_model + (wall -
origin_wall) * speed``.  While the engine is busy its steps follow each other in model time — a
step starts exactly where the previous one ended, whatever the wall clock says — and each step's
events are due at the wall-clock *deadline* of its end.  The server sleeps until that deadline, so
event-loop wake-up lag and the CPU time of a step are absorbed instead of being added to model time
(sleeping ``duration / speed`` after each step would lose them on every step).  When the engine
goes idle the clock resynchronises: the next step starts at the wall clock's model time.

If the wall clock gets ahead of the schedule (a starved CPU, a long pause), late steps run back to
back until the engine has caught up, but only while it is at most ``max_lag_s`` wall seconds
behind: beyond that the lag is *dropped* — the mapping moves forward so the late step is on time —
and counted in ``dropped_s``.  Model time still advances by exactly the step durations, so every
duration and throughput measured in model time by the engine stays right; a client measuring wall
time × speed sees the dropped seconds as extra latency of the requests in flight then, and can
read them from ``/server_info`` (``clock``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Wall seconds a replica may fall behind its schedule before the lag is dropped rather than caught
# up: long enough to absorb scheduler hiccups of a busy machine, short enough that a catch-up burst
# cannot reorder much against the requests that arrive meanwhile.
MAX_LAG_S = 0.25


@dataclass(slots=True)
class ModelClock:
    """Maps wall time (``time.monotonic()`` seconds) to one replica's model time."""

    speed: float
    origin_model: float
    origin_wall: float
    max_lag_s: float = MAX_LAG_S
    busy_until: float | None = None   # model time the step in progress ends; None while idle
    late_s: float = 0.0               # how late (wall seconds) the last step started
    dropped_s: float = 0.0            # wall seconds of lag dropped so far
    drops: int = 0
    # Where the last step ended: mapping the wall clock forth and back can land one rounding step
    # before it, and model time must never go back.
    last_end: float = float("-inf")

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError("speed must be positive")
        if self.max_lag_s < 0:
            raise ValueError("max_lag_s must not be negative")

    def mapped(self, wall: float) -> float:
        """The wall clock's model time."""
        return self.origin_model + (wall - self.origin_wall) * self.speed

    def deadline(self, model: float) -> float:
        """The wall time at which model time ``model`` is due."""
        return self.origin_wall + (model - self.origin_model) / self.speed

    def now(self, wall: float) -> float:
        """Model time for something happening at ``wall`` (an arrival, an abort, a restart).

        While a step runs it is at most the step's end: a request that arrives while the engine is
        late still arrives before the step that will schedule it.
        """
        mapped = self.mapped(wall)
        return mapped if self.busy_until is None else min(mapped, self.busy_until)

    def start_step(self, wall: float) -> float:
        """Model time at which the next step starts: the previous step's end while busy, else now."""
        if self.busy_until is None:
            self.late_s = 0.0
            return max(self.mapped(wall), self.last_end)
        start = self.busy_until
        late = wall - self.deadline(start)
        if late > self.max_lag_s:
            self.origin_wall += late
            self.dropped_s += late
            self.drops += 1
            late = 0.0
        self.late_s = max(late, 0.0)
        return start

    def end_step(self, start: float, duration: float) -> float:
        """Record the step that started at ``start``; returns the wall deadline of its events."""
        self.busy_until = self.last_end = start + duration
        return self.deadline(self.busy_until)

    def idle(self) -> None:
        """Nothing left to do: the next step starts at the wall clock's model time."""
        self.busy_until = None

    def describe(self) -> dict[str, Any]:
        """What ``/server_info`` shows under ``clock``."""
        return {"speed": self.speed, "max_lag_s": self.max_lag_s, "late_s": self.late_s,
                "dropped_lag_s": self.dropped_s, "lag_drops": self.drops}
