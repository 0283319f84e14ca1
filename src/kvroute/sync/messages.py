"""The wire format router instances exchange through Redis: versioned, validated both ways.

Two kinds of message, each on its own stream and each one JSON object in the stream entry's ``m``
field:

* **facts** — ``{"v": 1, "kind": "facts", "src": <instance>, "t": <sent, unix s>, "records": [...]}``:
  routing facts (``SyncRecord.to_dict()`` forms) learned by instance ``src``.
* **load** — ``{"v": 1, "kind": "load", "src": ..., "t": ..., "ttl": <s>, "workers": {id: [inflight,
  epoch]}}``: a heartbeat with what ``src`` has in flight per worker and the epoch it uses for it,
  valid for ``ttl`` seconds.

``decode_*`` raise ``MessageError`` (a ``ValueError``) whose ``reason`` is ``"version"`` for a
message of another protocol version and ``"malformed"`` for anything else, so the receiver can drop
and count it without ever trusting its content.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from kvroute.routing.sync_record import SyncRecord, record_from_dict

PROTOCOL_VERSION = 1
FIELD = b"m"
# Far above any real message (a batch of records is tens of KB); guards the JSON parser.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_RECORDS_PER_MESSAGE = 4096
MAX_WORKERS_PER_HEARTBEAT = 65_536
_MAX_ID_LEN = 512
# A heartbeat's validity is clamped so that a peer cannot pin its load in place for long.
MIN_TTL_S = 0.05
MAX_TTL_S = 60.0


class MessageError(ValueError):
    """A received message that must be dropped; ``reason`` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class FactsMessage:
    """Routing facts ``instance`` learned, sent at ``time`` (its wall clock)."""

    instance: str
    time: float
    records: tuple[SyncRecord, ...]


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One worker in a heartbeat: the sender's in-flight count there and the epoch it uses."""

    inflight: int
    epoch: float


@dataclass(frozen=True, slots=True)
class LoadMessage:
    """A heartbeat: ``instance``'s per-worker load as of ``time``, valid for ``ttl_s`` seconds."""

    instance: str
    time: float
    ttl_s: float
    workers: Mapping[str, WorkerLoad]


def encode_facts(msg: FactsMessage) -> bytes:
    """The stream-entry payload of a facts message."""
    return orjson.dumps({"v": PROTOCOL_VERSION, "kind": "facts", "src": msg.instance, "t": msg.time,
                         "records": [r.to_dict() for r in msg.records]})


def encode_load(msg: LoadMessage) -> bytes:
    """The stream-entry payload of a heartbeat."""
    return orjson.dumps({"v": PROTOCOL_VERSION, "kind": "load", "src": msg.instance, "t": msg.time,
                         "ttl": msg.ttl_s,
                         "workers": {w: [load.inflight, load.epoch] for w, load in msg.workers.items()}})


def decode_facts(fields: Mapping[Any, Any]) -> FactsMessage:
    """A facts message from a stream entry's fields; raises MessageError."""
    doc = _envelope(fields, "facts")
    records = doc.get("records")
    if not isinstance(records, list) or len(records) > MAX_RECORDS_PER_MESSAGE:
        raise MessageError("malformed", f"records must be a list of at most {MAX_RECORDS_PER_MESSAGE}")
    try:
        parsed = tuple(record_from_dict(r) for r in records)
    except ValueError as exc:
        raise MessageError("malformed", f"bad record: {exc}") from exc
    return FactsMessage(_src(doc), _time(doc, "t"), parsed)


def decode_load(fields: Mapping[Any, Any]) -> LoadMessage:
    """A heartbeat from a stream entry's fields; raises MessageError."""
    doc = _envelope(fields, "load")
    workers = doc.get("workers")
    if not isinstance(workers, dict) or len(workers) > MAX_WORKERS_PER_HEARTBEAT:
        raise MessageError("malformed", "workers must be an object of worker id -> [inflight, epoch]")
    loads: dict[str, WorkerLoad] = {}
    for wid, pair in workers.items():
        if not wid or len(wid) > _MAX_ID_LEN or not isinstance(pair, list) or len(pair) != 2:
            raise MessageError("malformed", "each worker must map to [inflight, epoch]")
        inflight, epoch = pair
        if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 0:
            raise MessageError("malformed", "inflight must be a non-negative integer")
        if not _finite_non_negative(epoch):
            raise MessageError("malformed", "epoch must be a finite non-negative number")
        loads[wid] = WorkerLoad(inflight, float(epoch))
    ttl = _time(doc, "ttl")
    return LoadMessage(_src(doc), _time(doc, "t"), min(MAX_TTL_S, max(MIN_TTL_S, ttl)), loads)


def _envelope(fields: Mapping[Any, Any], kind: str) -> dict[str, Any]:
    raw = fields.get(FIELD, fields.get(FIELD.decode()))
    if isinstance(raw, str):
        raw = raw.encode()
    if not isinstance(raw, bytes):
        raise MessageError("malformed", f"the entry has no {FIELD.decode()!r} field")
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError("malformed", f"message larger than {MAX_MESSAGE_BYTES} bytes")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MessageError("malformed", f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise MessageError("malformed", "a message must be a JSON object")
    version = doc.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise MessageError("version", f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    if doc.get("kind") != kind:
        raise MessageError("malformed", f"kind {doc.get('kind')!r} on the {kind} stream")
    return doc


def _src(doc: Mapping[str, Any]) -> str:
    src = doc.get("src")
    if not isinstance(src, str) or not src or len(src) > _MAX_ID_LEN:
        raise MessageError("malformed", "src must be a non-empty instance id")
    return src


def _finite_non_negative(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and v >= 0


def _time(doc: Mapping[str, Any], name: str) -> float:
    v: Any = doc.get(name)
    if not _finite_non_negative(v):
        raise MessageError("malformed", f"{name} must be a finite non-negative number")
    return float(v)
