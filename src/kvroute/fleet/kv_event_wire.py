"""vLLM's KV-cache event wire format: msgpack batches over ZeroMQ, read and written, both encodings.

vLLM (``vllm/distributed/kv_events.py``) publishes one ``EventBatch`` per scheduler step that changed
the prefix cache, on a PUB socket as three frames ``(topic, seq, payload)``: ``seq`` is 8 bytes
big-endian, counting from 0 per publisher; ``payload`` is the msgpack of
``EventBatch[ts, events, data_parallel_rank]`` (a positional array).  The events inside come in two
encodings, and a consumer must accept both:

* ``"map"`` — engines since mid-2026: each event is a msgpack map tagged ``"type"``
  (``{"type": "BlockStored", "block_hashes": [...], ...}``), fields left at their default omitted;
* ``"array"`` — older engines: each event is a positional array led by its tag
  (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx]``), shorter still on the oldest ones.

A ROUTER replay socket answers a start sequence number (8 bytes big-endian) with one reply per
buffered batch from there on, then an end marker whose sequence number is -1 and whose payload is
empty.  A reply is ``(seq, payload)`` on older engines and ``(topic, seq, payload)`` on the newest
ones; :func:`parse_replay_reply` reads both.  With data parallelism each rank publishes on its own
ports, base + rank (:func:`offset_endpoint_port`).

Block hashes (``ExternalBlockHash``) are ``int`` (64 bits, vLLM's default) or ``bytes``; they are the
engine's own and only identify a block: never recompute them.

What the router consumes is the normalized form: :class:`EventBatch` of :class:`Stored`,
:class:`Removed`, :class:`Cleared` and :class:`Unknown` (an event kind this module does not know,
kept so that it can be counted while the rest of the batch is applied).  :func:`decode_batch` never
raises anything but :class:`MalformedEvents`; :func:`encode_batch` writes what vLLM's own msgspec
encoder writes, byte for byte, in either encoding.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import msgspec

ExternalBlockHash: TypeAlias = int | bytes
Encoding = Literal["map", "array"]
ENCODINGS: tuple[Encoding, ...] = ("map", "array")

MEDIUM_GPU = "GPU"
# vLLM's ``KVCacheSpecKind`` values (vllm/v1/kv_cache_interface.py) for the groups the simulator has.
SPEC_FULL_ATTENTION = "full_attention"
SPEC_MAMBA = "mamba"
# Kinds whose blocks hold a prefix's attention KV, i.e. whose events mean "this prefix is resident".
RESIDENT_SPEC_KINDS = frozenset(("full_attention", "mla_attention", "sink_full_attention"))

KNOWN_KINDS = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))


class MalformedEvents(ValueError):
    """A frame or payload that is not a vLLM event batch (the message says what is wrong)."""


# ------------------------------------------------------------------------------ normalized events


class Stored(msgspec.Struct, frozen=True, gc=False):
    """Full blocks the engine added to its prefix cache: ``engine_hashes[i]`` holds
    ``token_ids[i * block_size:(i + 1) * block_size]``, chained after ``parent`` (None: the first
    block of a sequence).  ``group_idx``/``spec_kind`` say which KV-cache group (vLLM's
    ``kv_cache_spec_kind``, e.g. ``"full_attention"``, ``"mamba"``, ``"sliding_window"``); ``None``
    where the engine does not say.  ``lora`` is vLLM's ``lora_name``, ``lora_id`` its deprecated
    number; ``extra_keys`` is passed through as decoded (per block: multimodal ids, LoRA name,
    cache salt...)."""

    engine_hashes: list[ExternalBlockHash]
    parent: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    group_idx: int | None = None
    spec_kind: str | None = None
    medium: str | None = None
    lora: str | None = None
    lora_id: int | None = None
    sliding_window: int | None = None
    extra_keys: list[Any] | None = None


class Removed(msgspec.Struct, frozen=True, gc=False):
    """Blocks the engine dropped from its prefix cache (evicted or reset)."""

    engine_hashes: list[ExternalBlockHash]
    group_idx: int | None = None
    medium: str | None = None


class Cleared(msgspec.Struct, frozen=True, gc=False):
    """The engine emptied its whole prefix cache (``/reset_prefix_cache``, a restart)."""


class Unknown(msgspec.Struct, frozen=True, gc=False):
    """An event of a kind this module does not know (a newer engine's); to be counted, not applied."""

    kind: str


KvEvent: TypeAlias = Stored | Removed | Cleared | Unknown


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One published batch: wall-clock ``ts`` (seconds since the epoch) at the engine, the events in
    order, and the publisher's data-parallel rank (None when the engine does not say)."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


# ------------------------------------------------------------------------------ wire structs
# Field order, defaults and options are vLLM's (vllm/distributed/kv_events.py): msgspec writes fields
# in declaration order and omits those left at their default, so these encode byte for byte as the
# engine's own structs do.


class _MapStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


# Decoding only: the same events with every optional field defaulted, so that a producer which leaves
# out a field vLLM always writes (another engine, a future vLLM) is still read.
class _MapStoredIn(msgspec.Struct, gc=False, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapRemovedIn(msgspec.Struct, gc=False, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


# The array encoding's layout is the last one vLLM published before it switched to maps; fields an
# engine appends after these are ignored when decoding, fields an older one lacks take the default.
class _ArrayStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _ArrayStoredSpec(_ArrayStored, tag="BlockStored"):
    # Decoding only: an array engine that also appends the group's spec.
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct, gc=False):
    # Decoding only: a batch envelope written as a map (seen on some development builds).
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_MapEvent: TypeAlias = _MapStoredIn | _MapRemovedIn | _MapCleared
_ArrayEvent: TypeAlias = _ArrayStoredSpec | _ArrayRemoved | _ArrayCleared


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_array_batch = msgspec.msgpack.Decoder(_ArrayBatch)
_raw_batch = msgspec.msgpack.Decoder(_RawBatch)
_raw_map_batch = msgspec.msgpack.Decoder(_RawMapBatch)
_map_event = msgspec.msgpack.Decoder(_MapEvent)
_array_event = msgspec.msgpack.Decoder(_ArrayEvent)
_any = msgspec.msgpack.Decoder()

# First byte of a msgpack map (fixmap, map16, map32) or array (fixarray, array16, array32).
_MAP_HEADS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))
_ARRAY_HEADS = frozenset((*range(0x90, 0xA0), 0xDC, 0xDD))


# ------------------------------------------------------------------------------ encode


def _to_wire(event: KvEvent, encoding: Encoding) -> Any:
    if isinstance(event, Stored):
        if encoding == "map":
            return _MapStored(event.engine_hashes, event.parent, event.token_ids, event.block_size,
                              event.lora_id, event.medium, event.lora, event.extra_keys, event.group_idx,
                              event.spec_kind, event.sliding_window)
        return _ArrayStored(event.engine_hashes, event.parent, event.token_ids, event.block_size,
                            event.lora_id, event.medium, event.lora, event.extra_keys, event.group_idx)
    if isinstance(event, Removed):
        if encoding == "map":
            return _MapRemoved(event.engine_hashes, event.medium, event.group_idx)
        return _ArrayRemoved(event.engine_hashes, event.medium, event.group_idx)
    if isinstance(event, Cleared):
        return _MapCleared() if encoding == "map" else _ArrayCleared()
    raise ValueError(f"cannot encode an event of unknown kind {event.kind!r}")


def encode_batch(batch: EventBatch, *, encoding: Encoding) -> bytes:
    """The msgpack payload vLLM writes for ``batch``: events as maps tagged ``"type"`` (``"map"``, the
    newest engines) or as positional arrays (``"array"``, older ones).  The array layout has no
    ``kv_cache_spec_kind``: older engines did not send it."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}")
    wire = _Batch(batch.ts, [_to_wire(e, encoding) for e in batch.events], batch.data_parallel_rank)
    return _encoder.encode(wire)


# ------------------------------------------------------------------------------ decode


def _from_wire(event: Any) -> KvEvent:
    if isinstance(event, _MapStoredIn):
        return Stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                      event.group_idx, event.kv_cache_spec_kind, event.medium, event.lora_name,
                      event.lora_id, event.kv_cache_spec_sliding_window, event.extra_keys)
    if isinstance(event, _ArrayStored):
        spec = event if isinstance(event, _ArrayStoredSpec) else None
        return Stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                      event.group_idx, spec.kv_cache_spec_kind if spec else None, event.medium,
                      event.lora_name, event.lora_id, spec.kv_cache_spec_sliding_window if spec else None,
                      event.extra_keys)
    if isinstance(event, _MapRemovedIn | _ArrayRemoved):
        return Removed(event.block_hashes, event.group_idx, event.medium)
    return Cleared()


def _unknown_kind(raw: msgspec.Raw, is_map: bool) -> str | None:
    """The tag of an event whose kind is not one we know, or None if the event is just malformed."""
    try:
        value = _any.decode(raw)
    except msgspec.DecodeError:
        return None
    if is_map and isinstance(value, dict):
        tag = value.get("type")
    elif not is_map and isinstance(value, list) and value:
        tag = value[0]
    else:
        return None
    return tag if isinstance(tag, str) and tag not in KNOWN_KINDS else None


def _decode_event(raw: msgspec.Raw, index: int) -> KvEvent:
    data = memoryview(raw)
    head = data[0] if len(data) else -1
    is_map = head in _MAP_HEADS
    if not is_map and head not in _ARRAY_HEADS:
        raise MalformedEvents(f"event {index} is neither a map nor an array")
    try:
        return _from_wire((_map_event if is_map else _array_event).decode(raw))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        kind = _unknown_kind(raw, is_map)
        if kind is not None:
            return Unknown(kind)
        raise MalformedEvents(f"event {index}: {exc}") from None


def decode_batch(payload: bytes) -> EventBatch:
    """Read a published payload in either encoding (and either batch envelope).

    Fields an engine adds that this module does not know are ignored; an event of an unknown kind
    becomes :class:`Unknown`; anything else that does not fit — not msgpack, a wrong type, a missing
    field — raises :class:`MalformedEvents` for the whole batch, so a batch is applied whole or not at
    all.
    """
    # The common case in one typed pass per encoding; the event-by-event pass below only runs for a
    # batch that has an unknown or malformed event, or an unusual envelope.
    for fast in (_map_batch, _array_batch):
        try:
            typed = fast.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
        return EventBatch(typed.ts, [_from_wire(e) for e in typed.events], typed.data_parallel_rank)
    try:
        raw: _RawBatch | _RawMapBatch = _raw_batch.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        try:
            raw = _raw_map_batch.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise MalformedEvents(f"not a KV event batch: {exc}") from None
    events = [_decode_event(e, i) for i, e in enumerate(raw.events)]
    return EventBatch(raw.ts, events, raw.data_parallel_rank)


# ------------------------------------------------------------------------------ frames

END_SEQ = -1
_END_SEQ_FRAME = END_SEQ.to_bytes(8, "big", signed=True)


def seq_frame(seq: int) -> bytes:
    """A sequence number as vLLM frames it: 8 bytes big-endian (-1, the replay end, as all ones)."""
    return seq.to_bytes(8, "big", signed=True)


def parse_seq(frame: bytes) -> int:
    """Read an 8-byte big-endian sequence number (``-1`` for the replay end marker)."""
    if len(frame) != 8:
        raise MalformedEvents(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def parse_pub_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one message from the PUB socket."""
    if len(frames) != 3:
        raise MalformedEvents(f"a published message has 3 frames, got {len(frames)}")
    return frames[0], parse_seq(frames[1]), frames[2]


def replay_frames(topic: bytes, seq: int, payload: bytes, *, with_topic: bool) -> list[bytes]:
    """One replay reply after the ROUTER's identity and empty delimiter: ``(seq, payload)`` as older
    engines send it, ``(topic, seq, payload)`` as the newest do."""
    return [topic, seq_frame(seq), payload] if with_topic else [seq_frame(seq), payload]


def replay_end_frames(*, with_topic: bool) -> list[bytes]:
    """The end-of-replay marker: sequence number -1 and an empty payload (and an empty topic)."""
    return [b"", _END_SEQ_FRAME, b""] if with_topic else [_END_SEQ_FRAME, b""]


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of one replay reply as a REQ or DEALER socket receives it, in either shape
    (a DEALER also gets the empty delimiter first); ``seq`` is -1 at the end."""
    if len(frames) == 4 and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 2:
        seq_bytes, payload = frames
    elif len(frames) == 3:
        # (topic, seq, payload), or a DEALER's (b"", seq, payload): the same two frames either way.
        _first, seq_bytes, payload = frames
    else:
        raise MalformedEvents(f"a replay reply has 2 or 3 frames, got {len(frames)}")
    return parse_seq(seq_bytes), payload


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of data-parallel rank ``data_parallel_rank``, as vLLM derives it: the TCP port
    plus the rank (``inproc://name`` gets ``_dp<rank>``); rank 0 and None are unchanged."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


# ------------------------------------------------------------------------------ configuration


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's ``--kv-events-config`` (vllm/config/kv_events.py), same names and defaults; ``publisher``
    defaults to ``"zmq"`` when events are enabled, else ``"null"``."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def resolved_publisher(self) -> str:
        """``publisher`` with vLLM's default applied."""
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"

    @property
    def publishes(self) -> bool:
        """Whether this configuration publishes events over ZeroMQ."""
        return self.enable_kv_cache_events and self.resolved_publisher == "zmq"


def parse_kv_events_config(text: str | bytes) -> KVEventsConfig:
    """Read ``--kv-events-config`` JSON; ValueError naming the problem for anything vLLM would refuse."""
    try:
        config = msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 0:
            raise ValueError(f"--kv-events-config: {name} must not be negative")
    return config
