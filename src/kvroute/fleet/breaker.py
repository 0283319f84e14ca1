"""Per-replica circuit breaker and latency-outlier ejection: pure, the clock passed in.

A replica can be healthy by ``/health`` and still fail every request (a hung engine often answers
``/health``).  The breaker takes it out of rotation on what real requests see:

* **closed** (normal): ``failures`` consecutive failed attempts (5xx, reset, timeout, no first byte
  in time, a stream silent past its idle deadline, a 2xx that is not an answer) open it; an attempt
  succeeds when its answer ended well;
* **open**: not a candidate for ``cooldown`` seconds (``cooldown_s`` the first time, doubled after
  each failed trial, at most ``max_cooldown_s``);
* **half-open**: one trial request is let through; its success closes the breaker, its failure
  opens it again with the longer cool-down.  Only a real request closes it: the probe never does.

**Latency outliers** are ejected the same way (open for a cool-down, then a half-open trial): a
replica whose recent streamed time to first token, relative to the router's own prediction for
each request, is ``outlier_factor`` times the median of the other replicas' for ``min_samples``
answers, and slower than their median by at least ``outlier_min_excess_s``.  At most
``max_ejected_fraction`` of the fleet is ejected for latency, never the last replica that admits
requests (a slow replica beats none).

**Answers that are not answers** (a 2xx that is not the API's: bad JSON, not SSE, garbage
mid-stream) eject the same way once a replica has sent ``failures`` of them among its last
``ANSWER_WINDOW`` answers while at least half the other replicas sent none: good answers between
do not save it (a replica that answers every stream with garbage and every plain request well
would never fail three times in a row), and a fault the whole fleet shares ejects nobody.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from enum import StrEnum


class BreakerState(StrEnum):
    """Where a replica's breaker stands (the value is the metric and JSON spelling)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# The gauge value of each state (kvroute_breaker_state).
STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}

# Python 3.11's EnumType defines __getattr__, so reading a member from its class (``BreakerState.CLOSED``)
# takes CPython's slow attribute path (~900 instructions, a small function call's worth); the
# members read on every request are bound once (docs/benchmarks.md, "2026-12-07: instructions
# per request").
_CLOSED, _HALF_OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN
# Answers per replica among which malformed ones are counted.
ANSWER_WINDOW = 50


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """How the breaker and the outlier detector react (docs/server.md, "Sick replicas")."""

    failures: int = 3
    cooldown_s: float = 10.0
    max_cooldown_s: float = 160.0
    outlier_factor: float = 3.0  # 0 turns latency ejection off
    outlier_min_samples: int = 20
    outlier_min_excess_s: float = 1.0
    max_ejected_fraction: float = 1 / 3
    outlier_alpha: float = 0.2

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError("breaker_failures must be at least 1")
        if not 0 < self.cooldown_s <= self.max_cooldown_s:
            raise ValueError("breaker_cooldown_s must be positive and at most breaker_max_cooldown_s")
        if self.outlier_factor < 0 or self.outlier_min_excess_s < 0 or self.outlier_min_samples < 1:
            raise ValueError("outlier_factor and outlier_min_excess_s must be >= 0, "
                             "outlier_min_samples >= 1")
        if not 0 <= self.max_ejected_fraction <= 1:
            raise ValueError("outlier_max_ejected_fraction must be between 0 and 1")


@dataclass(slots=True)
class Breaker:
    """One replica's breaker, with the latency figures the outlier detector compares.

    ``transitions`` counts entries into each state, ``ejections`` openings by reason
    (``failures``, ``latency``, ``malformed``, ``trial``: a half-open trial failed).
    """

    settings: BreakerSettings = field(default_factory=BreakerSettings)
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    until: float = 0.0
    cooldown_s: float = 0.0
    trial_since: float | None = None
    reason: str | None = None
    transitions: Counter[str] = field(default_factory=Counter)
    ejections: Counter[str] = field(default_factory=Counter)
    # Latency: EWMA of ttft / max(predicted, floor) ("slowness") and of ttft, and how many samples.
    slowness: float = 0.0
    ttft_s: float = 0.0
    samples: int = 0
    # The last ANSWER_WINDOW answers, True for one that was not an answer, and how many were not.
    answers: deque[bool] = field(default_factory=deque)
    malformed: int = 0

    @property
    def admits(self) -> bool:
        """Whether a new request may be sent: closed, or half-open with no trial under way."""
        return self.state is _CLOSED or (self.state is _HALF_OPEN and self.trial_since is None)

    def tick(self, now: float) -> bool:
        """Let time pass: an open breaker whose cool-down is over turns half-open; a trial that
        never reported back (its client went away) is forgotten after ``max_cooldown_s``.
        Returns whether anything changed."""
        if self.state is BreakerState.OPEN and now >= self.until:
            self._enter(BreakerState.HALF_OPEN)
            self.trial_since = None
            return True
        if self.trial_since is not None and now - self.trial_since >= self.settings.max_cooldown_s:
            self.trial_since = None
            return True
        return False

    def sending(self, now: float) -> None:
        """A request is being sent: in half-open it is the trial, and nothing else goes."""
        if self.state is _HALF_OPEN:
            self.trial_since = now

    def succeeded(self) -> None:
        """An attempt got an answer: the failure streak ends and a half-open breaker closes."""
        self.failures = 0
        if self.state is _HALF_OPEN:
            self._enter(BreakerState.CLOSED)
            self.cooldown_s = 0.0
            self.trial_since = None
            self.reason = None

    def failed(self, now: float, reason: str) -> bool:
        """An attempt failed; returns whether the breaker opened because of it."""
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self._open(now, min(2 * self.cooldown_s, self.settings.max_cooldown_s), "trial", reason)
            return True
        if self.state is BreakerState.CLOSED and self.failures >= self.settings.failures:
            self._open(now, self.settings.cooldown_s, "failures", reason)
            return True
        return False

    def answered(self, malformed: bool) -> None:
        """An answer came back; ``malformed``: it was not the API's answer."""
        self.answers.append(malformed)
        self.malformed += malformed
        if len(self.answers) > ANSWER_WINDOW:
            self.malformed -= self.answers.popleft()

    def eject(self, now: float, reason: str, detail: str) -> None:
        """Take a closed replica out for the base cool-down (a latency or malformed-answer outlier)."""
        if self.state is BreakerState.CLOSED:
            self._open(now, self.settings.cooldown_s, reason, detail)

    def observe(self, ttft_s: float, predicted_s: float, floor_s: float) -> None:
        """One streamed answer's time to first token and what the router predicted for it."""
        ratio = ttft_s / max(predicted_s, floor_s)
        self.samples += 1
        alpha = max(self.settings.outlier_alpha, 1.0 / self.samples)
        self.slowness += (ratio - self.slowness) * alpha
        self.ttft_s += (ttft_s - self.ttft_s) * alpha

    def _open(self, now: float, cooldown_s: float, why: str, detail: str) -> None:
        self._enter(BreakerState.OPEN)
        self.cooldown_s = cooldown_s
        self.until = now + cooldown_s
        self.trial_since = None
        self.reason = f"{why}: {detail}"
        self.ejections[why] += 1
        # A replica comes back with a clean slate: its old latency would eject it again at once.
        self.slowness = self.ttft_s = 0.0
        self.samples = 0
        self.answers.clear()
        self.malformed = 0

    def _enter(self, state: BreakerState) -> None:
        self.state = state
        self.transitions[state.value] += 1

    def to_json(self, now: float) -> dict[str, object]:
        """JSON-ready summary (admin API, dashboard)."""
        return {
            "state": self.state.value,
            "consecutive_failures": self.failures,
            "reason": self.reason,
            "reopens_in_s": round(max(0.0, self.until - now), 3) if self.state is BreakerState.OPEN else None,
            "ejections": dict(self.ejections),
            "ttft_ratio": round(self.slowness, 3) if self.samples else None,
            "latency_samples": self.samples,
            "malformed_answers": self.malformed,
        }


def latency_outlier(breakers: dict[str, Breaker], worker_id: str, ready: int) -> str | None:
    """Whether ``worker_id`` should be ejected as a latency outlier now; the detail if so.

    ``breakers`` holds every replica's breaker, ``ready`` how many replicas admit requests now.
    Pure: reads the figures, decides nothing else."""
    me = breakers[worker_id]
    s = me.settings
    if not s.outlier_factor or me.state is not BreakerState.CLOSED or me.samples < s.outlier_min_samples:
        return None
    others = [b for wid, b in breakers.items()
              if wid != worker_id and b.state is BreakerState.CLOSED and b.samples >= s.outlier_min_samples]
    if len(others) < 2:  # a median of one is that replica's own noise
        return None
    ejected = sum(1 for b in breakers.values() if b.state is not BreakerState.CLOSED and b.reason
                  and b.reason.startswith("latency"))
    if ejected + 1 > int(len(breakers) * s.max_ejected_fraction) or ready <= 1:
        return None
    slowness = _median([b.slowness for b in others])
    ttft = _median([b.ttft_s for b in others])
    if me.slowness > s.outlier_factor * slowness and me.ttft_s - ttft >= s.outlier_min_excess_s:
        return (f"time to first token {me.ttft_s:.3f}s, {me.slowness / max(slowness, 1e-9):.1f}x the "
                f"fleet's relative to prediction (median {ttft:.3f}s)")
    return None


def malformed_outlier(breakers: dict[str, Breaker], worker_id: str, ready: int) -> str | None:
    """Whether ``worker_id`` should be ejected for answers that were not answers; the detail if so.

    ``breakers`` holds every replica's breaker, ``ready`` how many replicas admit requests now.
    Pure: reads the figures, decides nothing else."""
    me = breakers[worker_id]
    if me.state is not BreakerState.CLOSED or me.malformed < me.settings.failures or ready <= 1:
        return None
    others = [b.malformed for wid, b in breakers.items() if wid != worker_id]
    if 2 * sum(1 for n in others if n == 0) < len(others):
        return None  # the fleet shares it: ejecting one replica for it would only shrink the fleet
    return (f"{me.malformed} of its last {len(me.answers)} answers were not answers "
            f"(most other replicas': none)")


def _median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
