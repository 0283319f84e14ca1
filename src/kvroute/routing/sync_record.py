"""Routing facts one router instance tells the others: small, frozen, validated both ways.

``to_dict()`` gives plain JSON-ready values (ints, floats, strings, lists); ``record_from_dict``
checks every field and raises ``ValueError`` on anything malformed, so a foreign or corrupted
message can be dropped and counted rather than crash an instance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

MAX_HASHES_PER_RECORD = 65_536
_MAX_ID_LEN = 512
_U64 = 1 << 64


def _str(d: Mapping[str, Any], name: str) -> str:
    v = d.get(name)
    if not isinstance(v, str) or not v or len(v) > _MAX_ID_LEN:
        raise ValueError(f"{name} must be a non-empty string of at most {_MAX_ID_LEN} characters")
    return v


def _time(d: Mapping[str, Any], name: str) -> float:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite non-negative number")
    return float(v)


def _u64(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _U64:
        raise ValueError(f"{name} must be an unsigned 64-bit integer")
    return v


def _count(d: Mapping[str, Any], name: str) -> int:
    v = d.get(name, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative integer")
    return v


@dataclass(frozen=True, slots=True)
class PrefixRecord:
    """Worker ``worker_id`` (registration ``epoch``) owns these block hashes as of ``time``.

    ``prefill_tokens`` is the sender's estimate of the uncached tokens the request will prefill
    there, so that every instance's backlog estimate for the worker includes it.
    """

    TYPE: ClassVar[str] = "prefix"
    worker_id: str
    epoch: float
    time: float
    hashes: tuple[int, ...]
    prefill_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"type": self.TYPE, "worker_id": self.worker_id, "epoch": self.epoch, "time": self.time,
                "hashes": list(self.hashes), "prefill_tokens": self.prefill_tokens}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PrefixRecord:
        """Validate and build; raises ValueError."""
        hashes = d.get("hashes")
        if not isinstance(hashes, list | tuple) or len(hashes) > MAX_HASHES_PER_RECORD:
            raise ValueError(f"hashes must be a list of at most {MAX_HASHES_PER_RECORD} integers")
        return cls(worker_id=_str(d, "worker_id"), epoch=_time(d, "epoch"), time=_time(d, "time"),
                   hashes=tuple(_u64(h, "hashes[]") for h in hashes),
                   prefill_tokens=_count(d, "prefill_tokens"))


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """Session ``session`` (a 64-bit hash of scope and id, never the raw id) is on ``worker_id``;
    ``active`` False for a one-shot's, which is not counted among the sessions active there."""

    TYPE: ClassVar[str] = "session"
    session: int
    worker_id: str
    time: float
    active: bool = True

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``active`` only when False: an active session's record is as before)."""
        d: dict[str, Any] = {"type": self.TYPE, "session": self.session, "worker_id": self.worker_id,
                             "time": self.time}
        if not self.active:
            d["active"] = False
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SessionRecord:
        """Validate and build; raises ValueError."""
        active = d.get("active", True)
        if not isinstance(active, bool):
            raise ValueError("active must be a boolean")
        return cls(session=_u64(d.get("session"), "session"), worker_id=_str(d, "worker_id"),
                   time=_time(d, "time"), active=active)


@dataclass(frozen=True, slots=True)
class WorkerEpochRecord:
    """Worker ``worker_id`` (re)registered at ``epoch``: its older cache entries no longer match."""

    TYPE: ClassVar[str] = "epoch"
    worker_id: str
    epoch: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"type": self.TYPE, "worker_id": self.worker_id, "epoch": self.epoch}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> WorkerEpochRecord:
        """Validate and build; raises ValueError."""
        return cls(worker_id=_str(d, "worker_id"), epoch=_time(d, "epoch"))


SyncRecord = PrefixRecord | SessionRecord | WorkerEpochRecord

_TYPES: dict[str, type[PrefixRecord] | type[SessionRecord] | type[WorkerEpochRecord]] = {
    PrefixRecord.TYPE: PrefixRecord,
    SessionRecord.TYPE: SessionRecord,
    WorkerEpochRecord.TYPE: WorkerEpochRecord,
}


def record_from_dict(d: Any) -> SyncRecord:
    """Any record from its ``to_dict()`` form, dispatched on ``type``; raises ValueError."""
    if not isinstance(d, Mapping):
        raise ValueError("a sync record must be a JSON object")
    kind = d.get("type")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown sync record type {kind!r}")
    return cls.from_dict(d)
