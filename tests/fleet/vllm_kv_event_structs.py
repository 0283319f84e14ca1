"""vLLM's own KV-event structs, copied as test fixtures so that payloads are built by msgspec exactly
as a vLLM engine builds them (the wire module must read them and write the same bytes).

Three generations, each as vLLM declared it (field order, defaults and struct options are what
decide the bytes):

* ``V09``: vllm-project/vllm ``vllm/distributed/kv_events.py`` at commit
  b4e69e0af33f4698e157a262cc787fe61983cd3d (the first release with events: positional arrays,
  ``BlockStored`` of five fields, ``BlockRemoved`` of one, no ``data_parallel_rank``).
* ``ARRAY``: the last positional layout, as vLLM's documentation copies it from
  ``vllm.distributed.kv_events`` (docs.vllm.ai/en/latest/examples/features/kv_events, page of
  2026-05; ``examples/features/kv_events`` in the repository): ``lora_name``, ``extra_keys`` and
  ``group_idx`` appended, ``EventBatch`` positional with ``data_parallel_rank``.
* ``MAP``: vllm-project/vllm ``vllm/distributed/kv_events.py`` at commit
  0181ea3173e53eea8cf04a86891488e3dc89bb34: events are maps tagged ``"type"`` (``tag=True``, no
  ``array_like``), with ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``.  That commit
  also wrote the envelope as a map (``MapEnvelopeBatch``); released engines and vLLM's own example
  subscriber keep it positional (``MapBatch``).
* ``NEWEST``: later map-era additions seen in vLLM (``locality``, ``ownership``; ``event_version``
  with its default 1 omitted), to show a consumer ignores fields it does not know.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

ExternalBlockHash = bytes | int


# --- V09 (b4e69e0a) ------------------------------------------------------------------------------


class V09EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class V09KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class V09BlockStored(V09KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]  # noqa: UP045 - copied as vLLM wrote it
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]  # noqa: UP045


class V09BlockRemoved(V09KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class V09AllBlocksCleared(V09KVCacheEvent, tag="AllBlocksCleared"):
    pass


# --- ARRAY (docs, 2026-05) -----------------------------------------------------------------------


class ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


# --- MAP (0181ea31) ------------------------------------------------------------------------------


class MapEnvelopeBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class MapBlockStored(MapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class MapBlockRemoved(MapKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapKVCacheEvent, tag="AllBlocksCleared"):
    pass


# --- NEWEST (later map-era fields) ---------------------------------------------------------------


class NewestBlockStored(MapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    event_version: int = 1
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


class NewestBlockRemoved(MapKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
