"""The router's recent activity, bounded: the last decisions, the last times to first byte, and
flow control's queue (its depth over time and the waits of the requests it held).

Prometheus keeps totals; this keeps the recent detail a dashboard or an operator wants to read
("why did that request go there?", "how long was the queue a minute ago?") without scraping logs.
No prompt text is ever stored here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from kvroute.rings import PairRing


# Not frozen: every request makes one, and a frozen dataclass pays an ``object.__setattr__`` per
# field (~15,000 instructions for these 12, docs/benchmarks.md, "2026-12-08: more instructions per
# request").  Treat it as a value: nothing assigns to it once recorded.
@dataclass(slots=True)
class RoutedRequest:
    """One finished (or failed) request as the router saw it."""

    time: float
    route: str
    model: str
    worker: str | None
    kind: str
    reason: str
    matched_blocks: int
    total_blocks: int
    attempts: int
    status: int
    ttfb_s: float | None
    duration_s: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


class Activity:
    """Bounded rings: recent requests (with their decision), (time, ttfb) samples, and the queue's
    history (``queue``)."""

    def __init__(self, *, max_requests: int = 200, max_ttfb_samples: int = 20_000) -> None:
        self.requests: deque[RoutedRequest] = deque(maxlen=max_requests)
        self.ttfb = PairRing(max_ttfb_samples)  # (time, ttfb)
        self.queue = QueueActivity()

    def record(self, request: RoutedRequest) -> None:
        """Remember a finished request and its time to first byte."""
        self.requests.append(request)
        if request.ttfb_s is not None:
            self.ttfb.append(request.time, request.ttfb_s)


@dataclass(slots=True)
class QueueSample:
    """One model's queue during one second: its peak and its last depth (requests, estimated prompt
    tokens); a second without a change has no sample, its depth being the last one before it."""

    second: int
    peak: int
    peak_tokens: int
    depth: int
    tokens: int

    def to_json(self) -> list[int]:
        """A compact JSON form: ``[second, peak, peak_tokens, depth, tokens]``."""
        return [self.second, self.peak, self.peak_tokens, self.depth, self.tokens]


class QueueActivity:
    """Flow control's recent history, per model: the queue's depth by the second (an hour of it,
    whatever the load, since changes within a second share one sample) and the times the requests
    that waited spent in the queue (``(time, model, seconds)``)."""

    def __init__(self, *, seconds: int = 3600, max_waits: int = 20_000) -> None:
        self._seconds = seconds
        self.history: dict[str, deque[QueueSample]] = {}
        self.waits: deque[tuple[float, str, float]] = deque(maxlen=max_waits)

    def changed(self, model: str, now: float, depth: int, tokens: int) -> None:
        """The model's queue holds ``depth`` requests of ``tokens`` estimated prompt tokens now."""
        samples = self.history.get(model)
        if samples is None:
            samples = self.history[model] = deque(maxlen=self._seconds)
        second = int(now)
        last = samples[-1] if samples else None
        if last is not None and last.second == second:
            last.peak = max(last.peak, depth)
            last.peak_tokens = max(last.peak_tokens, tokens)
            last.depth, last.tokens = depth, tokens
        else:
            samples.append(QueueSample(second, depth, tokens, depth, tokens))

    def waited(self, model: str, now: float, wait_s: float) -> None:
        """A request of ``model`` left the queue for a replica after ``wait_s`` seconds."""
        self.waits.append((now, model, wait_s))
