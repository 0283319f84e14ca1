"""Routing facts shared between router instances: round trips and validation."""

from __future__ import annotations

import contextlib
import math

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.routing.sync_record import (
    PrefixRecord,
    SessionRecord,
    WorkerEpochRecord,
    record_from_dict,
)

RECORDS = [
    PrefixRecord("w0", 1.5, 1_700_000_000.25, (0, 1, (1 << 64) - 1), 1200),
    SessionRecord((1 << 64) - 2, "w1", 1_700_000_001.0),
    SessionRecord(7, "w1", 1_700_000_001.0, active=False),
    WorkerEpochRecord("w2", 1_700_000_002.0),
]


@pytest.mark.parametrize("record", RECORDS)
def test_round_trip_through_json(record: object) -> None:
    wire = orjson.dumps(record.to_dict())  # type: ignore[attr-defined]
    assert record_from_dict(orjson.loads(wire)) == record


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"type": "nope"},
        {"type": "prefix", "worker_id": "", "epoch": 1, "time": 1, "hashes": []},
        {"type": "prefix", "worker_id": "w", "epoch": 1, "time": 1, "hashes": [-1]},
        {"type": "prefix", "worker_id": "w", "epoch": 1, "time": 1, "hashes": [1 << 64]},
        {"type": "prefix", "worker_id": "w", "epoch": 1, "time": 1, "hashes": ["1"]},
        {"type": "prefix", "worker_id": "w", "epoch": 1, "time": 1, "hashes": [True]},
        {"type": "prefix", "worker_id": "w", "epoch": 1, "time": 1, "hashes": "12"},
        {"type": "prefix", "worker_id": "w", "epoch": math.nan, "time": 1, "hashes": []},
        {"type": "prefix", "worker_id": "w", "epoch": 1, "time": 1, "hashes": [], "prefill_tokens": -3},
        {"type": "prefix", "worker_id": "w", "epoch": 1, "time": 1, "hashes": [0] * 70_000},
        {"type": "session", "session": "abc", "worker_id": "w", "time": 1},
        {"type": "session", "session": 1, "worker_id": 5, "time": 1},
        {"type": "session", "session": 1, "worker_id": "w" * 600, "time": 1},
        {"type": "session", "session": 1, "worker_id": "w", "time": 1, "active": "no"},
        {"type": "epoch", "worker_id": "w", "epoch": "yesterday"},
        {"type": "epoch", "worker_id": "w", "epoch": -1},
    ],
)
def test_malformed_records_raise_value_error(bad: object) -> None:
    with pytest.raises(ValueError):
        record_from_dict(bad)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)


@given(st.dictionaries(st.sampled_from(["type", "worker_id", "epoch", "time", "hashes", "session",
                                        "prefill_tokens", "active"]), json_values)
       | json_values)
def test_garbage_never_raises_anything_but_value_error(garbage: object) -> None:
    with contextlib.suppress(ValueError):
        record_from_dict(garbage)


def test_an_active_sessions_record_is_written_as_before() -> None:
    """Only a one-shot's record carries ``active``: an instance of the previous release reads every
    other record as it did (and a one-shot's as active, as it did)."""
    assert SessionRecord(1, "w", 2.0).to_dict() == {"type": "session", "session": 1, "worker_id": "w",
                                                     "time": 2.0}
    assert SessionRecord(1, "w", 2.0, active=False).to_dict()["active"] is False
