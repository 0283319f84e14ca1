"""The KV-event wire module against payloads built with vLLM's own struct definitions (see
vllm_kv_event_structs.py): byte-for-byte encoding in both encodings, decoding every generation,
round trips, unknown kinds, malformed input that never crashes, frames, ports and the config."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import pytest
import vllm_kv_event_structs as v
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.fleet.kv_event_wire import (
    END_SEQ,
    Cleared,
    EventBatch,
    KVEventsConfig,
    MalformedEvents,
    Removed,
    Stored,
    Unknown,
    decode_batch,
    encode_batch,
    offset_endpoint_port,
    parse_kv_events_config,
    parse_pub_frames,
    parse_replay_reply,
    parse_seq,
    replay_end_frames,
    replay_frames,
    seq_frame,
)

enc = msgspec.msgpack.encode
TOKENS = list(range(100, 132))


def stored(**kw: Any) -> Stored:
    base: dict[str, Any] = {"engine_hashes": [11, 12], "parent": None, "token_ids": TOKENS, "block_size": 16,
                            "medium": "GPU"}
    return Stored(**{**base, **kw})


# ------------------------------------------------------------------------------ byte for byte

MAP_CASES: list[tuple[Any, EventBatch]] = [
    (v.MapBatch(1.25, [v.MapBlockStored([11, 12], None, TOKENS, 16, None, "GPU", None)]),
     EventBatch(1.25, [stored()])),
    (v.MapBatch(2.0, [v.MapBlockStored([b"\xab" * 32], b"\x01" * 32, TOKENS[:16], 16, 7, "GPU", "ad",
                                        extra_keys=[("salt",)], group_idx=0,
                                        kv_cache_spec_kind="full_attention")], data_parallel_rank=3),
     EventBatch(2.0, [stored(engine_hashes=[b"\xab" * 32], parent=b"\x01" * 32, token_ids=TOKENS[:16],
                             lora_id=7, lora="ad", extra_keys=[("salt",)], group_idx=0,
                             spec_kind="full_attention")], 3)),
    (v.MapBatch(3.5, [v.MapBlockStored([5], 4, TOKENS[:16], 16, None, "GPU", None, group_idx=1,
                                        kv_cache_spec_kind="mamba", kv_cache_spec_sliding_window=None),
                      v.MapBlockRemoved([1, 2], "GPU", group_idx=1), v.MapAllBlocksCleared()], 0),
     EventBatch(3.5, [stored(engine_hashes=[5], parent=4, token_ids=TOKENS[:16], group_idx=1,
                             spec_kind="mamba"), Removed([1, 2], 1, "GPU"), Cleared()], 0)),
    (v.MapBatch(4.0, [v.MapBlockStored([9], None, TOKENS[:16], 16, None, "GPU", None, group_idx=2,
                                        kv_cache_spec_kind="sliding_window",
                                        kv_cache_spec_sliding_window=4096)]),
     EventBatch(4.0, [stored(engine_hashes=[9], token_ids=TOKENS[:16], group_idx=2,
                             spec_kind="sliding_window", sliding_window=4096)])),
    (v.MapBatch(5.0, []), EventBatch(5.0, [])),
]

ARRAY_CASES: list[tuple[Any, EventBatch]] = [
    (v.ArrayEventBatch(1.25, [v.ArrayBlockStored([11, 12], None, TOKENS, 16, None, "GPU", None)]),
     EventBatch(1.25, [stored()])),
    (v.ArrayEventBatch(2.0, [v.ArrayBlockStored([2**64 - 1], 2**63, TOKENS[:16], 16, 3, "GPU", "ad",
                                                extra_keys=[("salt",)], group_idx=0),
                             v.ArrayBlockRemoved([2**64 - 1], "GPU", 0), v.ArrayAllBlocksCleared()], 1),
     EventBatch(2.0, [stored(engine_hashes=[2**64 - 1], parent=2**63, token_ids=TOKENS[:16], lora_id=3,
                             lora="ad", extra_keys=[("salt",)], group_idx=0),
                      Removed([2**64 - 1], 0, "GPU"), Cleared()], 1)),
]


def _tuples_to_lists(value: Any) -> Any:
    """msgpack has no tuples: what vLLM sends as a tuple comes back a list."""
    if isinstance(value, list | tuple):
        return [_tuples_to_lists(x) for x in value]
    return value


def _as_received(batch: EventBatch) -> EventBatch:
    events = [msgspec.structs.replace(e, extra_keys=_tuples_to_lists(e.extra_keys))
              if isinstance(e, Stored) and e.extra_keys is not None else e for e in batch.events]
    return EventBatch(batch.ts, events, batch.data_parallel_rank)


@pytest.mark.parametrize(("vllm_batch", "ours"), MAP_CASES)
def test_map_encoding_is_vllms_bytes_and_decodes(vllm_batch: Any, ours: EventBatch) -> None:
    payload = enc(vllm_batch)
    assert encode_batch(ours, encoding="map") == payload
    assert decode_batch(payload) == _as_received(ours)


@pytest.mark.parametrize(("vllm_batch", "ours"), ARRAY_CASES)
def test_array_encoding_is_vllms_bytes_and_decodes(vllm_batch: Any, ours: EventBatch) -> None:
    payload = enc(vllm_batch)
    assert encode_batch(ours, encoding="array") == payload
    assert decode_batch(payload) == _as_received(ours)


def test_the_array_layout_has_no_spec_kind_as_older_engines_sent_none() -> None:
    batch = EventBatch(1.0, [stored(group_idx=1, spec_kind="mamba", sliding_window=8)])
    back = decode_batch(encode_batch(batch, encoding="array"))
    assert back.events == [stored(group_idx=1)]


def test_the_tag_is_the_type_key_of_each_map_event() -> None:
    raw = msgspec.msgpack.decode(encode_batch(EventBatch(1.0, [stored(), Cleared()]), encoding="map"))
    assert raw[1][0]["type"] == "BlockStored" and raw[1][1] == {"type": "AllBlocksCleared"}
    raw = msgspec.msgpack.decode(encode_batch(EventBatch(1.0, [stored(), Cleared()]), encoding="array"))
    assert raw[1][0][0] == "BlockStored" and raw[1][1] == ["AllBlocksCleared"]


# ------------------------------------------------------------------------------ other generations


def test_decodes_the_first_release_short_arrays_without_rank() -> None:
    payload = enc(v.V09EventBatch(9.0, [v.V09BlockStored([1, 2], None, TOKENS, 16, None),
                                        v.V09BlockRemoved([1]), v.V09AllBlocksCleared()]))
    assert decode_batch(payload) == EventBatch(9.0, [
        Stored([1, 2], None, TOKENS, 16), Removed([1]), Cleared()], None)


def test_decodes_a_map_envelope() -> None:
    payload = enc(v.MapEnvelopeBatch(1.0, [v.MapBlockRemoved([3], "GPU")], 2))
    assert decode_batch(payload) == EventBatch(1.0, [Removed([3], None, "GPU")], 2)


def test_ignores_fields_newer_engines_add() -> None:
    extra = [({"type": "cache_salt", "salt": "s"},), None]
    payload = enc(v.MapBatch(1.0, [
        v.NewestBlockStored([1, 2], None, TOKENS, 16, None, "GPU", None, event_version=2, extra_keys=extra,
                            group_idx=0, kv_cache_spec_kind="full_attention", locality="LOCAL",
                            ownership="tier-1"),
        v.NewestBlockRemoved([1], "GPU", 0, locality="REMOTE")], 0))
    assert decode_batch(payload) == EventBatch(1.0, [
        stored(engine_hashes=[1, 2], group_idx=0, spec_kind="full_attention",
               extra_keys=[[{"type": "cache_salt", "salt": "s"}], None]),
        Removed([1], 0, "GPU")], 0)


def test_ignores_values_appended_to_arrays() -> None:
    payload = enc([1.0, [["BlockStored", [1], None, TOKENS[:16], 16, None, "GPU", None, None, 0,
                          "full_attention", None, "LOCAL", "future"],
                         ["BlockRemoved", [1], "GPU", 0, "LOCAL"]], 0, "future-envelope-field"])
    assert decode_batch(payload) == EventBatch(1.0, [
        stored(engine_hashes=[1], token_ids=TOKENS[:16], group_idx=0, spec_kind="full_attention"),
        Removed([1], 0, "GPU")], 0)


def test_reads_a_map_event_without_the_fields_vllm_always_writes() -> None:
    payload = enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                          "token_ids": TOKENS[:16], "block_size": 16}]])
    assert decode_batch(payload).events == [Stored([1], None, TOKENS[:16], 16)]


# ------------------------------------------------------------------------------ unknown, malformed


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_an_unknown_kind_is_kept_as_unknown_and_the_rest_applies(encoding: str) -> None:
    good = enc(v.MapBlockRemoved([1], "GPU")) if encoding == "map" else enc(v.ArrayBlockRemoved([1], "GPU"))
    odd = {"type": "BlockTransferred", "block_hashes": [1], "from_medium": "GPU"} if encoding == "map" \
        else ["BlockTransferred", [1], "GPU", "CPU"]
    payload = enc([1.0, [msgspec.Raw(good), odd, msgspec.Raw(good)], 0])
    assert decode_batch(payload).events == [Removed([1], None, "GPU"), Unknown("BlockTransferred"),
                                            Removed([1], None, "GPU")]


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"not msgpack at all", enc({"hello": 1}), enc([1.0]), enc(["ts", []]), enc([1.0, 5]),
    enc([1.0, [5]]), enc([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
    enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                "token_ids": [1], "block_size": "16"}]]),
    enc([1.0, [["BlockRemoved"]]]), enc([1.0, [[]]]), enc([1.0, [{"no": "type"}]]),
    enc([1.0, [{"type": 7}]]), enc([1.0, [[7, [1]]]]), enc([1.0, [{"type": "BlockStored"}]]),
    enc([1.0, [["BlockStored", [1.5], None, [1], 16]]]),
    enc(v.MapBatch(1.0, [v.MapBlockStored([1], None, TOKENS, 16, None, "GPU", None)]))[:-3],
])
def test_malformed_payloads_raise_malformed_events(payload: bytes) -> None:
    with pytest.raises(MalformedEvents):
        decode_batch(payload)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(payload: bytes) -> None:
    with contextlib.suppress(MalformedEvents):
        decode_batch(payload)


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.binary(max_size=8)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"]),
        inner, max_size=6),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(st.floats(allow_nan=False), st.lists(_msgpack_values, max_size=5))
def test_arbitrary_msgpack_shapes_never_crash(ts: float, events: list[Any]) -> None:
    try:
        batch = decode_batch(enc([ts, events]))
    except MalformedEvents:
        return
    assert len(batch.events) == len(events)


# ------------------------------------------------------------------------------ round trips

_hash = st.integers(0, 2**64 - 1) | st.binary(min_size=1, max_size=32)
_opt_str = st.none() | st.text(max_size=12)
_opt_int = st.none() | st.integers(0, 2**31)
_stored = st.builds(
    Stored,
    engine_hashes=st.lists(_hash, min_size=1, max_size=4), parent=st.none() | _hash,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=64), block_size=st.integers(1, 4096),
    group_idx=_opt_int, spec_kind=st.none() | st.sampled_from(["full_attention", "mamba", "sliding_window"]),
    medium=_opt_str, lora=_opt_str, lora_id=_opt_int, sliding_window=_opt_int,
    extra_keys=st.none() | st.lists(
        st.none() | st.lists(st.text(max_size=4) | st.integers(0, 99), max_size=2), max_size=3),
)
_removed = st.builds(Removed, engine_hashes=st.lists(_hash, max_size=4), group_idx=_opt_int, medium=_opt_str)
_batches = st.builds(EventBatch, ts=st.floats(allow_nan=False, allow_infinity=False),
                     events=st.lists(_stored | _removed | st.just(Cleared()), max_size=6),
                     data_parallel_rank=_opt_int)


@settings(max_examples=150, deadline=None)
@given(_batches)
def test_map_round_trip(batch: EventBatch) -> None:
    assert decode_batch(encode_batch(batch, encoding="map")) == batch


@settings(max_examples=150, deadline=None)
@given(_batches)
def test_array_round_trip_keeps_all_but_the_spec(batch: EventBatch) -> None:
    expected = [msgspec.structs.replace(e, spec_kind=None, sliding_window=None)
                if isinstance(e, Stored) else e for e in batch.events]
    assert decode_batch(encode_batch(batch, encoding="array")).events == expected


class VllmTypedBatch(v.MapBatch):
    events: list[v.MapBlockStored | v.MapBlockRemoved | v.MapAllBlocksCleared]


@settings(max_examples=200, deadline=None)
@given(_batches)
def test_vllm_structs_read_our_map_payload(batch: EventBatch) -> None:
    """The other direction: a vLLM consumer decodes what we write into vLLM's own types."""
    got = msgspec.msgpack.decode(encode_batch(batch, encoding="map"), type=VllmTypedBatch)
    assert len(got.events) == len(batch.events)
    for theirs, ours in zip(got.events, batch.events, strict=True):
        if isinstance(ours, Stored):
            assert (theirs.block_hashes, theirs.parent_block_hash, theirs.token_ids,
                    theirs.kv_cache_spec_kind, theirs.group_idx) == (
                ours.engine_hashes, ours.parent, ours.token_ids, ours.spec_kind, ours.group_idx)
        else:
            assert type(theirs).__name__.removeprefix("Map") == {
                Removed: "BlockRemoved", Cleared: "AllBlocksCleared"}[type(ours)]


def test_an_unknown_event_cannot_be_encoded() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        encode_batch(EventBatch(1.0, [Unknown("X")]), encoding="map")
    with pytest.raises(ValueError, match="encoding"):
        encode_batch(EventBatch(1.0, []), encoding="json")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ frames and ports


@given(st.integers(-1, 2**63 - 1))
def test_seq_frames_round_trip(seq: int) -> None:
    frame = seq_frame(seq)
    assert len(frame) == 8 and parse_seq(frame) == seq


def test_seq_frames_are_vllms() -> None:
    assert seq_frame(5) == (5).to_bytes(8, "big")
    assert seq_frame(END_SEQ) == (-1).to_bytes(8, "big", signed=True) == b"\xff" * 8
    for bad in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(MalformedEvents):
            parse_seq(bad)


def test_pub_and_replay_frames() -> None:
    assert parse_pub_frames([b"kv", seq_frame(3), b"p"]) == (b"kv", 3, b"p")
    with pytest.raises(MalformedEvents):
        parse_pub_frames([seq_frame(3), b"p"])
    for with_topic in (False, True):
        reply = replay_frames(b"kv", 7, b"payload", with_topic=with_topic)
        assert len(reply) == (3 if with_topic else 2)
        assert parse_replay_reply(reply) == (7, b"payload")
        assert parse_replay_reply([b"", *reply]) == (7, b"payload")   # as a DEALER receives it
        assert parse_replay_reply(replay_end_frames(with_topic=with_topic)) == (END_SEQ, b"")
        assert parse_replay_reply([b"", *replay_end_frames(with_topic=with_topic)]) == (END_SEQ, b"")
    with pytest.raises(MalformedEvents):
        parse_replay_reply([b"a"])


@pytest.mark.parametrize(("endpoint", "rank", "expected"), [
    ("tcp://*:5557", 0, "tcp://*:5557"), ("tcp://*:5557", 3, "tcp://*:5560"),
    ("tcp://127.0.0.1:5558", 1, "tcp://127.0.0.1:5559"), ("tcp://[::1]:6000", 2, "tcp://[::1]:6002"),
    ("inproc://cache", 2, "inproc://cache_dp2"), (None, 4, None), ("", 4, ""),
])
def test_offset_endpoint_port_as_vllm(endpoint: str | None, rank: int, expected: str | None) -> None:
    assert offset_endpoint_port(endpoint, rank) == expected


def test_offset_endpoint_port_refuses_other_transports() -> None:
    with pytest.raises(ValueError, match="inproc"):
        offset_endpoint_port("ipc:///tmp/x", 1)


# ------------------------------------------------------------------------------ config


def test_config_defaults_are_vllms() -> None:
    config = parse_kv_events_config("{}")
    assert config == KVEventsConfig()
    assert (config.enable_kv_cache_events, config.endpoint, config.replay_endpoint, config.buffer_steps,
            config.hwm, config.max_queue_size, config.topic) == (False, "tcp://*:5557", None, 10_000, 100_000,
                                                                 100_000, "")
    assert config.resolved_publisher == "null" and not config.publishes
    on = parse_kv_events_config('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}')
    assert on.resolved_publisher == "zmq" and on.publishes
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishes


@pytest.mark.parametrize(("text", "message"), [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
    ('{"endpoint": 5}', "endpoint"), ('{"bogus": 1}', "bogus"), ("[1]", "object"), ("{", "JSON"),
    ('{"buffer_steps": -1}', "buffer_steps"),
])
def test_config_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_kv_events_config(text)
