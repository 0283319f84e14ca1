"""The KV-event subscriber against a real ZeroMQ publisher on loopback, speaking vLLM's frames.

The publisher here is the test's own (PUB + ROUTER replay, as vllm/distributed/kv_events.py), so
each sequence case (replay on connect, a gap, a restart, garbage) can be staged exactly; the
simulator's publisher is tested end to end in tests/sim and tests/server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvroute.fleet.kv_event_sources import KvEndpoint, KvEventSettings, parse_endpoint_spec
from kvroute.fleet.kv_event_wire import (
    Cleared,
    EventBatch,
    Removed,
    Stored,
    encode_batch,
    replay_end_frames,
    replay_frames,
    seq_frame,
)
from kvroute.fleet.kv_events import KvEventMetrics, KvEventWatch, apply_batch
from kvroute.routing.exact_index import ExactIndex
from kvroute.routing.hashing import token_block_hashes

BS = 4


class Publisher:
    """vLLM's publisher in miniature: every batch numbered, buffered, replayable."""

    def __init__(self, ctx: zmq.asyncio.Context, *, replay: bool = True, encoding: str = "map") -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER) if replay else None
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1") if self.router else None
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.encoding = encoding
        self._task = asyncio.get_running_loop().create_task(self._serve()) if self.router else None

    @property
    def spec(self) -> str:
        pub = f"tcp://127.0.0.1:{self.port}"
        return f"{pub},tcp://127.0.0.1:{self.replay_port}" if self.router else pub

    def batch(self, *events: object, publish: bool = True) -> int:
        payload = encode_batch(EventBatch(1.0e9, list(events), 0), encoding=self.encoding)  # type: ignore[arg-type]
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if publish:
            self.pub.send_multipart([b"", seq_frame(seq), payload])
        return seq

    def raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            ident, _empty, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in self.buffer:
                if seq >= first:
                    frames = replay_frames(b"", seq, payload, with_topic=False)
                    await self.router.send_multipart([ident, b"", *frames])
            await self.router.send_multipart([ident, b"", *replay_end_frames(with_topic=False)])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


def stored(engine: list[int], tokens: list[int], parent: int | None = None, **kw: object) -> Stored:
    return Stored(engine, parent, tokens, BS, **kw)  # type: ignore[arg-type]


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    yield zmq.asyncio.Context.instance()


async def watching(pub: Publisher, index: ExactIndex) -> tuple[KvEventWatch, KvEventMetrics]:
    metrics = KvEventMetrics(CollectorRegistry())
    watch = KvEventWatch(index, KvEventSettings({"w": pub.spec}), lambda wid: "http://127.0.0.1:1",
                         metrics)
    watch.on_worker_epoch("w", 1.0)
    return watch, metrics


def held(index: ExactIndex, tokens: list[int]) -> int:
    return index.match(token_block_hashes(tokens, BS), ["w"], 0.0)["w"]


def count(metrics: KvEventMetrics, kind: str) -> float:
    return metrics.events.labels("w", kind)._value.get()


async def test_replay_on_connect_then_live_events(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    toks = list(range(3 * BS))
    pub.batch(stored([1, 2], toks[:2 * BS]), publish=False)  # before the router listened
    index = ExactIndex()
    watch, metrics = await watching(pub, index)
    try:
        await until(lambda: index.mode("w", 0.0) == "exact" and held(index, toks) == 2)
        await asyncio.sleep(0.3)  # the SUB socket's subscription reaches the publisher
        pub.batch(stored([3], toks[2 * BS:], parent=2))
        await until(lambda: held(index, toks) == 3)
        pub.batch(Removed([2]))
        await until(lambda: held(index, toks) == 1)
        assert count(metrics, "stored") == 2 and count(metrics, "removed") == 1
    finally:
        await watch.close()
        await pub.close()


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_a_gap_is_filled_by_replay(ctx: zmq.asyncio.Context, encoding: str) -> None:
    pub = Publisher(ctx, encoding=encoding)
    index = ExactIndex()
    watch, metrics = await watching(pub, index)
    toks = list(range(3 * BS))
    try:
        await until(lambda: index.mode("w", 0.0) == "exact")
        await asyncio.sleep(0.3)
        pub.batch(stored([1], toks[:BS]))
        await until(lambda: held(index, toks) == 1)
        pub.batch(stored([2], toks[BS:2 * BS], parent=1), publish=False)  # lost on the wire
        pub.batch(stored([3], toks[2 * BS:], parent=2))
        await until(lambda: held(index, toks) == 3)
        assert metrics.gaps.labels("w")._value.get() == 1
    finally:
        await watch.close()
        await pub.close()


async def test_an_engine_restart_clears_what_it_held(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    index = ExactIndex()
    watch, _ = await watching(pub, index)
    toks = list(range(2 * BS))
    try:
        await until(lambda: index.mode("w", 0.0) == "exact")
        await asyncio.sleep(0.3)
        for _ in range(5):
            pub.batch(Cleared())
        pub.batch(stored([1, 2], toks))
        await until(lambda: held(index, toks) == 2)
        # The engine restarts: its numbering starts over, its buffer is new.
        pub.seq, pub.buffer = 0, []
        pub.batch(stored([9], list(range(100, 100 + BS))))
        await until(lambda: held(index, toks) == 0)
        assert held(index, list(range(100, 100 + BS))) == 1
    finally:
        await watch.close()
        await pub.close()


async def test_garbage_is_counted_and_survived(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx, replay=False)
    index = ExactIndex()
    watch, metrics = await watching(pub, index)
    toks = list(range(BS))
    try:
        await asyncio.sleep(0.3)
        pub.raw([b"", b"short", b"x"])  # a sequence number that is not 8 bytes
        pub.raw([b"", seq_frame(0), b"\xc1 not msgpack"])
        pub.seq = 1
        pub.batch(stored([1], toks))
        await until(lambda: held(index, toks) == 1)
        assert count(metrics, "malformed") == 2
        # Without replay the stream is synchronised by its first event.
        assert index.mode("w", 0.0) == "exact"
    finally:
        await watch.close()
        await pub.close()


def test_only_attention_groups_on_the_gpu_make_a_prefix_resident() -> None:
    index = ExactIndex()
    index.attach("w", [0])
    toks = list(range(BS))
    batch = EventBatch(0.0, [stored([1], toks, group_idx=1, spec_kind="mamba"),
                             stored([1], toks, medium="CPU"),
                             stored([1], toks, group_idx=0, spec_kind="full_attention"),
                             Removed([1], group_idx=1)], 0)
    counts = apply_batch(index, "w", 0, batch, 0.0)
    assert counts.by_kind == {"ignored": 2, "stored": 1, "removed": 1}
    # The Mamba group's removal of the same engine hash leaves the attention group's block.
    assert held(index, toks) == 1


def test_lora_blocks_never_match_the_base_model() -> None:
    index = ExactIndex()
    index.attach("w", [0])
    toks = list(range(BS))
    apply_batch(index, "w", 0, EventBatch(0.0, [stored([1], toks, lora="adapter")], 0), 0.0)
    assert held(index, toks) == 0


def test_endpoints_named_templated_or_shared() -> None:
    assert parse_endpoint_spec("tcp://h:5557,tcp://h:5558", ranks=2).of_rank(1) == ("tcp://h:5558", "tcp://h:5559")
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        parse_endpoint_spec("h:5557")
    settings = KvEventSettings({"http://a:8000": "off"}, "tcp://{host}:5557", "tcp://{host}:5558")
    assert settings.for_worker("a", "http://a:8000") == (None, False)
    assert settings.for_worker("b", "http://[::1]:8000") == (KvEndpoint("tcp://[::1]:5557", "tcp://[::1]:5558"),
                                                              True)


async def test_workers_sharing_a_host_are_not_subscribed_by_template() -> None:
    index = ExactIndex()
    urls = {"a": "http://10.0.0.1:8001", "b": "http://10.0.0.1:8002", "c": "http://10.0.0.2:8000"}
    watch = KvEventWatch(index, KvEventSettings(), urls.get, KvEventMetrics(CollectorRegistry()),
                         known_urls=list(urls.values()))
    try:
        for wid in urls:
            watch.on_worker_epoch(wid, 1.0)
        assert watch.followed() == ["c"]
    finally:
        await watch.close()
