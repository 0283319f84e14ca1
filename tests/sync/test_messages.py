"""The wire format: what one instance encodes the others decode, and anything else is refused
with the reason it is counted under."""

from __future__ import annotations

import orjson
import pytest

from kvroute.routing.sync_record import PrefixRecord, SessionRecord, WorkerEpochRecord
from kvroute.sync.messages import (
    FIELD,
    MAX_TTL_S,
    FactsMessage,
    LoadMessage,
    MessageError,
    WorkerLoad,
    decode_facts,
    decode_load,
    encode_facts,
    encode_load,
)

RECORDS = (
    PrefixRecord("w1", 100.5, 200.25, (1, 2**64 - 1), prefill_tokens=42),
    SessionRecord(7, "w2", 201.0),
    WorkerEpochRecord("w1", 150.0),
)


def test_facts_round_trip() -> None:
    msg = FactsMessage("a:1:abc", 123.5, RECORDS)
    assert decode_facts({FIELD: encode_facts(msg)}) == msg


def test_load_round_trip_and_ttl_clamped() -> None:
    msg = LoadMessage("b", 9.0, 1.0, {"w1": WorkerLoad(3, 100.5), "w2": WorkerLoad(0, 0.0)})
    assert decode_load({FIELD: encode_load(msg)}) == msg
    long = LoadMessage("b", 9.0, 1e9, {})
    assert decode_load({FIELD: encode_load(long)}).ttl_s == MAX_TTL_S


def _facts(**changes: object) -> dict[bytes, bytes]:
    doc = {"v": 1, "kind": "facts", "src": "x", "t": 1.0, "records": [r.to_dict() for r in RECORDS]}
    doc.update(changes)
    return {FIELD: orjson.dumps(doc)}


@pytest.mark.parametrize(("fields", "reason"), [
    ({FIELD: b"garbage"}, "malformed"),
    ({b"other": b"{}"}, "malformed"),
    ({FIELD: b"[1, 2]"}, "malformed"),
    (_facts(v=2), "version"),
    (_facts(v=True), "version"),
    ({FIELD: b'{"records": []}'}, "version"),
    (_facts(kind="load"), "malformed"),
    (_facts(src=""), "malformed"),
    (_facts(t=-1), "malformed"),
    (_facts(records={"type": "prefix"}), "malformed"),
    (_facts(records=[{"type": "prefix", "worker_id": "w", "epoch": 1, "time": 1, "hashes": [-1]}]),
     "malformed"),
    (_facts(records=[{"type": "teleport"}]), "malformed"),
])
def test_bad_facts_are_refused_with_their_reason(fields: dict[bytes, bytes], reason: str) -> None:
    with pytest.raises(MessageError) as err:
        decode_facts(fields)
    assert err.value.reason == reason


@pytest.mark.parametrize("workers", [
    [1, 2],
    {"w": [1]},
    {"w": [-1, 0.0]},
    {"w": [True, 0.0]},
    {"w": [1, "soon"]},
    {"w": [1, float("inf")]},
    {"": [1, 0.0]},
])
def test_bad_heartbeats_are_malformed(workers: object) -> None:
    raw = orjson.dumps({"v": 1, "kind": "load", "src": "x", "t": 1.0, "ttl": 1.0, "workers": workers})
    with pytest.raises(MessageError) as err:
        decode_load({FIELD: raw})
    assert err.value.reason == "malformed"


def test_a_facts_message_is_not_a_heartbeat() -> None:
    with pytest.raises(MessageError):
        decode_load({FIELD: encode_facts(FactsMessage("x", 1.0, ()))})
