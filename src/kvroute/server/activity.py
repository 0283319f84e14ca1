"""The router's recent activity, bounded: the last decisions and the last times to first byte.

Prometheus keeps totals; this keeps the recent detail a dashboard or an operator wants to read
("why did that request go there?") without scraping logs.  No prompt text is ever stored here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
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
    """Two bounded rings: recent requests (with their decision) and (time, ttfb) samples."""

    def __init__(self, *, max_requests: int = 200, max_ttfb_samples: int = 20_000) -> None:
        self.requests: deque[RoutedRequest] = deque(maxlen=max_requests)
        self.ttfb: deque[tuple[float, float]] = deque(maxlen=max_ttfb_samples)

    def record(self, request: RoutedRequest) -> None:
        """Remember a finished request and its time to first byte."""
        self.requests.append(request)
        if request.ttfb_s is not None:
            self.ttfb.append((request.time, request.ttfb_s))
