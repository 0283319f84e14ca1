"""Reconnect delays: exponential, capped, with jitter so that instances that lost Redis together
do not all knock on it again in the same millisecond."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    """Delays ``base_s * 2**n`` capped at ``cap_s``; each one drawn from its upper half
    ("equal jitter": never shorter than half the nominal delay, never longer than it)."""

    base_s: float = 0.2
    cap_s: float = 5.0
    rng: random.Random = field(default_factory=random.Random)
    attempts: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError("backoff needs 0 < base_s <= cap_s")

    def next_delay(self) -> float:
        """The delay before the next attempt (and count the attempt)."""
        nominal = min(self.cap_s, self.base_s * 2.0 ** min(self.attempts, 62))
        self.attempts += 1
        return nominal / 2 + self.rng.uniform(0.0, nominal / 2)

    def reset(self) -> None:
        """Connected again: the next outage starts from ``base_s``."""
        self.attempts = 0
