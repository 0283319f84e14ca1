"""Faults a simulated replica can be told to show (``POST /admin/fault`` or ``--fault``).

Kinds:
* ``error``: answer with ``status`` (default 500) in the API's error format, before any work;
* ``hang``: accept the request and never answer (until the client goes away);
* ``drop``: close the connection abruptly after ``after_tokens`` streamed tokens (default 1; for a
  non-streamed request, before the body);
* ``slow``: every engine step takes ``factor`` times longer;
* ``corrupt``: a ``rate`` fraction of replies is empty or a run of ``!`` (like ``--corrupt-rate``);
* ``stall``: stop sending after ``after_tokens`` streamed tokens (default 1) and keep the connection
  open until the client goes away; a non-streamed answer stalls after half its body;
* ``garbage``: answer 200 with bytes that are not the API's: a non-streamed body that is not JSON; a
  stream whose whole body is not SSE (``after_tokens`` 0), or that carries one line of garbage
  after ``after_tokens`` tokens and then goes on;
* ``wrong_shape``: answer 200 with JSON that is not the API's answer (no ``choices`` or
  ``content``); a stream's first event is such an object;
* ``oversized``: a stream carries one well-formed event of ``size`` bytes (default 2 MiB, above the
  router's default ``max_event_bytes``) after ``after_tokens`` tokens; a non-streamed answer is
  unaffected;
* ``restart``: immediate, not persistent — the engine restarts (cache emptied, counters reset, new
  start time, in-flight connections dropped) and answers 503 for ``down_s`` seconds.

``rate`` (default 1.0) is the fraction of requests affected and ``count`` (default unlimited) how
many requests in total, after which the fault clears itself.  Draws come from a seeded generator,
so a replica's sequence of faults is reproducible.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

FAULT_KINDS = ("error", "hang", "drop", "slow", "corrupt", "stall", "garbage", "wrong_shape", "oversized",
               "restart")
# Faults that change what a replica answers, drawn once per request (AnswerFaults).
_ANSWER_KINDS = ("drop", "stall", "garbage", "wrong_shape", "oversized")


@dataclass(slots=True)
class Fault:
    """One active fault (see the module docstring for the fields' meaning per kind)."""

    kind: str
    rate: float = 1.0
    count: int | None = None
    status: int = 500
    after_tokens: int = 1
    factor: float = 1.0
    down_s: float = 0.0
    size: int = 2 << 20

    @classmethod
    def from_json(cls, body: Any) -> Fault:
        """Validate an admin request body; ValueError with a readable message if it is wrong."""
        if not isinstance(body, dict):
            raise ValueError("the fault must be a JSON object with a 'kind'")
        unknown = set(body) - {"kind", "rate", "count", "status", "after_tokens", "factor", "down_s", "size"}
        if unknown:
            raise ValueError(f"unknown fault field(s): {', '.join(sorted(unknown))}")
        kind = body.get("kind")
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(FAULT_KINDS)}")
        try:
            fault = cls(
                kind=kind,
                rate=float(body.get("rate", 1.0)),
                count=None if body.get("count") is None else int(body["count"]),
                status=int(body.get("status", 500)),
                after_tokens=int(body.get("after_tokens", 1)),
                factor=float(body.get("factor", 1.0)),
                down_s=float(body.get("down_s", 0.0)),
                size=int(body.get("size", 2 << 20)),
            )
        except (TypeError, ValueError):
            raise ValueError("fault fields must be numbers") from None
        if not 0.0 <= fault.rate <= 1.0:
            raise ValueError("rate must be between 0 and 1")
        if not 500 <= fault.status <= 599:
            raise ValueError("status must be a 5xx code")
        if fault.factor <= 0 or fault.down_s < 0 or fault.after_tokens < 0:
            raise ValueError("factor must be positive; down_s and after_tokens non-negative")
        if fault.size < 1:
            raise ValueError("size must be at least 1 byte")
        if fault.count is not None and fault.count < 1:
            raise ValueError("count must be at least 1 (omit it for no limit)")
        return fault

    @classmethod
    def from_flag(cls, text: str) -> Fault:
        """Parse ``KIND[:RATE]`` from the command line, e.g. ``error:0.05`` or ``slow`` (factor 2)."""
        kind, _, rate = text.partition(":")
        if kind == "restart":
            raise ValueError("restart happens once (POST /admin/fault); it cannot be a startup fault")
        body: dict[str, Any] = {"kind": kind}
        if kind == "slow":
            body["factor"] = float(rate or 2.0)
        elif rate:
            body["rate"] = float(rate)
        return cls.from_json(body)


@dataclass(frozen=True, slots=True)
class AnswerFaults:
    """The faults that change one request's answer (each None when it is not hit)."""

    drop: Fault | None = None
    stall: Fault | None = None
    garbage: Fault | None = None
    wrong_shape: Fault | None = None
    oversized: Fault | None = None


class FaultSet:
    """The persistent faults of one replica, at most one per kind."""

    __slots__ = ("_active", "_rng")

    def __init__(self, seed: int) -> None:
        self._active: dict[str, Fault] = {}
        self._rng = random.Random(seed)

    def set(self, fault: Fault) -> None:
        """Activate (or replace) a persistent fault."""
        self._active[fault.kind] = fault

    def clear(self) -> None:
        """Remove every fault."""
        self._active.clear()

    def describe(self) -> list[dict[str, Any]]:
        """The active faults as JSON-ready dicts."""
        return [asdict(f) for f in self._active.values()]

    @property
    def slow_factor(self) -> float:
        """Multiplier on step durations."""
        fault = self._active.get("slow")
        return fault.factor if fault else 1.0

    def draw(self, kind: str) -> Fault | None:
        """Whether this request is hit by the ``kind`` fault (consuming one of its ``count``)."""
        fault = self._active.get(kind)
        if fault is None or self._rng.random() >= fault.rate:
            return None
        if fault.count is not None:
            fault.count -= 1
            if fault.count <= 0:
                del self._active[kind]
        return fault

    def draw_answer(self) -> AnswerFaults:
        """Which answer-changing faults hit this request (one draw per active kind)."""
        if not any(kind in self._active for kind in _ANSWER_KINDS):
            return _UNTOUCHED
        return AnswerFaults(*(self.draw(kind) for kind in _ANSWER_KINDS))

    def uniform(self) -> float:
        """A draw from the replica's generator (for ``--corrupt-rate``)."""
        return self._rng.random()


_UNTOUCHED = AnswerFaults()
