"""What a benchmark records: one row per request, one summary per load step, one run per policy."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are seconds since the step started.

    ``ttfb_s`` is the time to the first streamed token (None if none came), ``end_s`` when the
    response ended (None if it was cut off).  Token counts come from the response's ``usage``.
    """

    session_id: str | None
    round: int
    start_s: float
    ttfb_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    worker: str | None = None
    error: str | None = None
    last_round: bool = False
    queue_s: float = 0.0  # waited at the router's gate (flow control) before it was routed
    shed: bool = False  # answered with the router's overload error (429 / 529, 503 or 408)
    retry_after_s: float | None = None  # the overload answer's Retry-After, when it had one
    # Prompt tokens the router predicted its worker holds (virtual time only: HTTP cannot see it).
    predicted_cached: float | None = None


@dataclass(slots=True)
class StepResult:
    """The summary of one load step (one policy's row of the A/B table).

    A closed-loop step is ``sessions`` concurrent sessions (``rate`` None); an open-loop step is an
    arrival ``rate`` in requests/s (``sessions`` 0).  Session figures are over the sessions whose
    last round finished; None where there are none (an open loop has no sessions).
    """

    policy: str
    sessions: int
    duration_s: float
    requests: int
    errors: int
    sessions_completed: int
    sessions_per_hour: float
    output_tokens_per_min: float
    ttfb_p50_s: float | None
    ttfb_p95_s: float | None
    replicas_busy: float | None
    prefix_hit_pct: float | None
    stayed_pct: float | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    unfinished: int = 0
    preemptions: int | None = None
    ttfb_p99_s: float | None = None
    shed: int = 0  # requests answered with the overload error (not counted in ``errors``)
    # The router's own queue (kvroute's flow control, from its /metrics): the wait of the requests
    # it admitted, zero for those admitted at once, and what it shed; None where it has none.
    queue_wait_p50_s: float | None = None
    queue_wait_p95_s: float | None = None
    router_shed: int | None = None
    rate: float | None = None  # the open loop's offered requests/s
    completed_per_s: float | None = None  # requests that ended without error inside the window, per s
    # A session from its first request's start to its last answer's end (gate waits and pauses
    # included); the first round's time to first byte and its wait at the gate; later rounds' TTFB.
    session_p50_s: float | None = None
    session_p95_s: float | None = None
    first_ttfb_p50_s: float | None = None
    first_ttfb_p95_s: float | None = None
    first_queue_p50_s: float | None = None
    first_queue_p95_s: float | None = None
    continuing_ttfb_p50_s: float | None = None
    continuing_ttfb_p95_s: float | None = None

    @property
    def load(self) -> float:
        """What the step offered: its arrival rate (open loop) or its concurrent sessions."""
        return self.rate if self.rate is not None else self.sessions


@dataclass(slots=True)
class PolicyRun:
    """Every step of one policy."""

    policy: str
    steps: list[StepResult] = field(default_factory=list)


@dataclass(slots=True)
class BenchResult:
    """A whole benchmark: what ran (``meta``) and each policy's steps, in the order they ran."""

    meta: dict[str, Any]
    runs: list[PolicyRun] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """Inverse of :meth:`as_dict`."""
        runs = [PolicyRun(r["policy"], [StepResult(**s) for s in r["steps"]]) for r in data["runs"]]
        return cls(dict(data["meta"]), runs)

    def policies(self) -> list[str]:
        """Policy names in run order."""
        return [r.policy for r in self.runs]

    def step_sizes(self) -> list[float]:
        """The steps' loads (concurrent sessions, or arrival rates in an open loop), in order of
        first appearance."""
        sizes: list[float] = []
        for run in self.runs:
            for step in run.steps:
                if step.load not in sizes:
                    sizes.append(step.load)
        return sizes

    def open_loop(self) -> bool:
        """Whether the steps are arrival rates rather than session counts."""
        return any(step.rate is not None for run in self.runs for step in run.steps)

    def step(self, policy: str, load: float) -> StepResult | None:
        """The step of ``policy`` at ``load`` (concurrent sessions or arrival rate), if it ran."""
        for run in self.runs:
            if run.policy == policy:
                for step in run.steps:
                    if step.load == load:
                        return step
        return None
