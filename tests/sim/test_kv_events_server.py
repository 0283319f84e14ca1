"""The simulator publishing vLLM's KV-cache events over real ZeroMQ sockets on loopback, read by a
pyzmq subscriber as a router would: stored blocks are the /tokenize tokens, eviction, reset,
replay from the start and from the middle, a gap past the buffer, both encodings, one port per rank,
a restart's new sequence."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from sim_helpers import prose

from kvroute.fleet.kv_event_wire import (
    END_SEQ,
    Cleared,
    EventBatch,
    KVEventsConfig,
    Removed,
    Stored,
    decode_batch,
    parse_pub_frames,
    parse_replay_reply,
    seq_frame,
)
from kvroute.sim.server import SimFleet, SimReplica, start_sim_fleet

MODEL = "qwen3-3b"
BLOCK = 16
TOPIC = "kv@sim"
WAIT_S = 10.0


def events_config(**kw: Any) -> KVEventsConfig:
    values: dict[str, Any] = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*",
                              "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC}
    values.update(kw)
    return KVEventsConfig(**values)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def sim(encoding: str = "map", replicas: int = 1, **kw: Any) -> AsyncIterator[SimFleet]:
    config = kw.pop("kv_events", None) or events_config()
    fleet = await start_sim_fleet("dense-3b", replicas, speed=200.0, output_tokens_min=8,
                                  output_tokens_max=24, kv_events=config, kv_events_encoding=encoding, **kw)
    try:
        yield fleet
    finally:
        await fleet.close()


class Subscriber:
    """A SUB socket on one rank: every (topic, seq, raw payload, decoded batch) received."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, bind: bool = False) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)
        self.got: list[tuple[bytes, int, bytes, EventBatch]] = []

    async def ready(self) -> None:
        """Let the subscription reach the publisher (ZeroMQ's slow joiner): a socket handles its
        connections only while it is used, so poll rather than sleep."""
        assert not await self.sock.poll(300)

    async def until(self, done: Callable[[list[EventBatch]], bool],
                    timeout: float = WAIT_S) -> list[EventBatch]:
        deadline = time.monotonic() + timeout
        while not done(self.batches):
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; got {len(self.got)} batches"
            if await self.sock.poll(int(min(left, 0.2) * 1000)):
                topic, seq, payload = parse_pub_frames(await self.sock.recv_multipart())
                self.got.append((topic, seq, payload, decode_batch(payload)))
        return self.batches

    async def settle(self, quiet: float = 0.3) -> list[EventBatch]:
        """Receive until nothing has come for ``quiet`` seconds."""
        while await self.sock.poll(int(quiet * 1000)):
            topic, seq, payload = parse_pub_frames(await self.sock.recv_multipart())
            self.got.append((topic, seq, payload, decode_batch(payload)))
        return self.batches

    @property
    def batches(self) -> list[EventBatch]:
        return [b for *_rest, b in self.got]

    @property
    def seqs(self) -> list[int]:
        return [s for _t, s, _p, _b in self.got]


def stored(batches: list[EventBatch]) -> list[Stored]:
    return [e for b in batches for e in b.events if isinstance(e, Stored)]


def stored_tokens(batches: list[EventBatch]) -> list[int]:
    return [t for e in stored(batches) for t in e.token_ids]


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[tuple[int, bytes, int]]:
    """Ask the ROUTER for everything from ``start``: (seq, payload, frames per reply) until the end."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", seq_frame(start)])
        out: list[tuple[int, bytes, int]] = []
        while True:
            assert await dealer.poll(int(WAIT_S * 1000)), "replay did not answer"
            frames = await dealer.recv_multipart()
            seq, payload = parse_replay_reply(frames)
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((seq, payload, len(frames) - 1))
    finally:
        dealer.close(linger=0)


async def post(http: aiohttp.ClientSession, url: str, path: str, body: Any) -> Any:
    async with http.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def chat_body(words: int, seed: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": "You help."},
                                         {"role": "user", "content": prose(words, seed)}],
            "max_tokens": 8, **extra}


def publisher(replica: SimReplica) -> dict[str, Any]:
    assert replica.kv_publisher is not None
    return replica.kv_publisher.describe()


# ------------------------------------------------------------------------------ stored = /tokenize


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_stored_events_of_a_chat_request_are_the_tokens_tokenize_returns(
        encoding: str, zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    async with sim(encoding) as fleet:
        replica = fleet.replicas[0]
        sub = Subscriber(zctx, publisher(replica)["endpoint"])
        await sub.ready()
        body = chat_body(300, 1)
        tokens = (await post(http, replica.url, "/tokenize", body))["tokens"]
        full = len(tokens) // BLOCK * BLOCK
        await post(http, replica.url, "/v1/chat/completions", body)
        await sub.until(lambda b: len(stored_tokens(b)) >= full)
        assert stored_tokens(sub.batches)[:full] == tokens[:full]
        # frames and batches as vLLM writes them
        assert sub.seqs == list(range(len(sub.got)))
        assert all(t == TOPIC.encode() for t, *_ in sub.got)
        assert all(b.data_parallel_rank == 0 and abs(b.ts - time.time()) < 60 for b in sub.batches)
        first = stored(sub.batches)[0]
        assert (first.parent, first.block_size, first.group_idx, first.spec_kind, first.medium) == (
            None, BLOCK, 0, "full_attention" if encoding == "map" else None, "GPU")
        raw_event = msgspec.msgpack.decode(sub.got[0][2])[1][0]
        assert (raw_event["type"] if encoding == "map" else raw_event[0]) == "BlockStored"
        # The same request again stores nothing; the next turn stores only its new blocks, chained to
        # the old ones.
        await sub.settle()
        seen = len(sub.got)
        again = await post(http, replica.url, "/v1/chat/completions", body)
        reply = again["choices"][0]["message"]["content"]
        assert not stored(await sub.settle())[len(stored(sub.batches[:seen])):]
        old_hashes = {h for e in stored(sub.batches) for h in e.engine_hashes}
        turn2 = {**body, "messages": [*body["messages"], {"role": "assistant", "content": reply},
                                      {"role": "user", "content": prose(100, 2)}]}
        tokens2 = (await post(http, replica.url, "/tokenize", turn2))["tokens"]
        assert tokens2[:full] == tokens[:full]
        await post(http, replica.url, "/v1/chat/completions", turn2)
        full2 = len(tokens2) // BLOCK * BLOCK
        await sub.until(lambda b: len(stored_tokens(b)) >= full2)
        assert stored_tokens(sub.batches)[:full2] == tokens2[:full2]
        new = stored(sub.batches)[len(stored(sub.batches[:seen])):]
        assert new and new[0].parent in old_hashes


async def test_anthropic_messages_store_the_tokens_tokenize_returns_for_the_same_body(
        zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    body = {"model": MODEL, "max_tokens": 8, "system": [{"type": "text", "text": "Be brief. " * 20}],
            "messages": [
                {"role": "user", "content": prose(120, 3)},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                  {"type": "tool_use", "id": "t1", "name": "grep",
                                                   "input": {"q": "x"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": prose(80, 4)}]}]}
    async with sim() as fleet:
        replica = fleet.replicas[0]
        sub = Subscriber(zctx, publisher(replica)["endpoint"])
        await sub.ready()
        tokens = (await post(http, replica.url, "/tokenize", body))["tokens"]
        # without a system prompt the tool blocks alone say it is an Anthropic body
        no_system = {k: v for k, v in body.items() if k != "system"}
        assert (await post(http, replica.url, "/tokenize", no_system))["count"] < len(tokens)
        await post(http, replica.url, "/v1/messages", body)
        full = len(tokens) // BLOCK * BLOCK
        await sub.until(lambda b: len(stored_tokens(b)) >= full)
        assert stored_tokens(sub.batches)[:full] == tokens[:full]


async def test_tokenize_and_render_follow_the_chat_template_flags(http: aiohttp.ClientSession) -> None:
    async with sim() as fleet:
        url = fleet.replicas[0].url
        body = chat_body(20, 5)
        with_gen = await post(http, url, "/tokenize", body)
        without = await post(http, url, "/tokenize", {**body, "add_generation_prompt": False})
        n = without["count"] - 1                 # its last token may be a zero-padded part of one
        assert without["tokens"][:n] == with_gen["tokens"][:n] and without["count"] < with_gen["count"]
        rendered = await post(http, url, "/v1/chat/completions/render", body)
        assert rendered["token_ids"] == with_gen["tokens"] and with_gen["max_model_len"] == 32768
        strs = await post(http, url, "/tokenize", {**body, "return_token_strs": True})
        assert len(strs["token_strs"]) == strs["count"] and with_gen["token_strs"] is None
        cont = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Sure, the"}],
                "add_generation_prompt": False, "continue_final_message": True}
        open_ended = await post(http, url, "/tokenize", cont)
        closed = await post(http, url, "/tokenize", {**cont, "continue_final_message": False})
        assert open_ended["count"] < closed["count"]
        async with http.post(url + "/tokenize", json={**body, "continue_final_message": True}) as resp:
            assert resp.status == 400
            assert "continue_final_message" in (await resp.json())["error"]["message"]


# ------------------------------------------------------------------------------ removed, cleared


async def test_eviction_is_published_as_removed_blocks_that_were_stored(
        zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    async with sim(num_gpu_blocks_override=96, max_model_len=1536) as fleet:
        replica = fleet.replicas[0]
        sub = Subscriber(zctx, publisher(replica)["endpoint"])
        await sub.ready()
        for i in range(4):                       # 4 x ~650 tokens through a 1536-token cache
            await post(http, replica.url, "/v1/chat/completions", chat_body(600, 10 + i))
        await sub.until(lambda b: any(isinstance(e, Removed) for x in b for e in x.events))
        await sub.settle()
        live: set[int | bytes] = set()
        for batch in sub.batches:
            for e in batch.events:
                if isinstance(e, Stored):
                    live.update(e.engine_hashes)
                elif isinstance(e, Removed):
                    assert set(e.engine_hashes) <= live and e.group_idx == 0 and e.medium == "GPU"
                    live.difference_update(e.engine_hashes)
        assert 0 < len(live) <= 96


async def test_reset_prefix_cache_is_published_as_cleared_and_empties_the_cache(
        zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    async with sim() as fleet:
        replica = fleet.replicas[0]
        sub = Subscriber(zctx, publisher(replica)["endpoint"])
        await sub.ready()
        body = chat_body(200, 20)
        await post(http, replica.url, "/v1/chat/completions", body)
        again = await post(http, replica.url, "/v1/chat/completions", body)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        await sub.until(lambda b: bool(stored(b)))
        async with http.post(replica.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200 and await resp.read() == b""
        await sub.until(lambda b: any(isinstance(e, Cleared) for x in b for e in x.events))
        after = await post(http, replica.url, "/v1/chat/completions", body)
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        async with http.post(replica.url + "/reset_prefix_cache?reset_running_requests=maybe") as resp:
            assert resp.status == 400


# ------------------------------------------------------------------------------ replay


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_replay_from_the_start_and_from_the_middle(
        encoding: str, zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    async with sim(encoding) as fleet:
        replica = fleet.replicas[0]
        sub = Subscriber(zctx, publisher(replica)["endpoint"])
        await sub.ready()
        for i in range(3):
            await post(http, replica.url, "/v1/chat/completions", chat_body(150, 30 + i))
        await sub.until(lambda b: len(b) >= 4)
        await sub.settle()
        endpoint = publisher(replica)["replay_endpoint"]
        everything = await replay(zctx, endpoint, 0)
        assert [s for s, _p, _n in everything] == sub.seqs == list(range(len(sub.got)))
        assert [p for _s, p, _n in everything] == [p for _t, _s, p, _b in sub.got]
        assert {n for _s, _p, n in everything} == {3 if encoding == "map" else 2}   # topic in replies
        middle = len(sub.got) // 2
        assert [s for s, _p, _n in await replay(zctx, endpoint, middle)] == list(range(middle, len(sub.got)))
        assert await replay(zctx, endpoint, len(sub.got) + 5) == []


async def test_a_gap_past_the_replay_buffer_is_visible(zctx: zmq.asyncio.Context,
                                                       http: aiohttp.ClientSession) -> None:
    async with sim(kv_events=events_config(buffer_steps=3)) as fleet:
        replica = fleet.replicas[0]
        for i in range(4):                       # nobody listening: every batch is missed live
            await post(http, replica.url, "/v1/chat/completions", chat_body(150, 40 + i))
        published = publisher(replica)["next_seq"]
        assert published > 3
        got = await replay(zctx, publisher(replica)["replay_endpoint"], 0)
        seqs = [s for s, _p, _n in got]
        assert seqs == list(range(published - 3, published))     # 0 .. published-4 are gone: a gap
        assert all(isinstance(decode_batch(p), EventBatch) for _s, p, _n in got)


# ------------------------------------------------------------------------------ ranks, restart


def _free_pairs(count: int) -> list[int]:
    """``count`` base ports whose next port is free too (checked by binding, then released)."""
    rng = random.Random()
    out: list[int] = []
    while len(out) < count:
        base = rng.randrange(20000, 60000)
        socks = []
        try:
            for p in (base, base + 1):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            if not any(abs(base - o) < 2 for o in out):
                out.append(base)
        except OSError:
            pass
        finally:
            for s in socks:
                s.close()
    return out


async def test_each_replica_is_a_rank_on_its_own_ports(zctx: zmq.asyncio.Context,
                                                       http: aiohttp.ClientSession) -> None:
    pub_base, replay_base = _free_pairs(2)
    # A host address is connected to, as vLLM does, so the subscribers bind (on loopback here).
    subs = [Subscriber(zctx, f"tcp://127.0.0.1:{pub_base + i}", bind=True) for i in range(2)]
    config = events_config(endpoint=f"tcp://127.0.0.1:{pub_base}", replay_endpoint=f"tcp://127.0.0.1:{replay_base}")
    async with sim(replicas=2, kv_events=config) as fleet:
        assert [publisher(r)["replay_endpoint"] for r in fleet.replicas] == [
            f"tcp://127.0.0.1:{replay_base}", f"tcp://127.0.0.1:{replay_base + 1}"]
        assert [publisher(r)["binds"] for r in fleet.replicas] == [False, False]
        for sub in subs:
            await sub.ready()
        for i, replica in enumerate(fleet.replicas):
            await post(http, replica.url, "/v1/chat/completions", chat_body(100 + 50 * i, 50 + i))
        for i, sub in enumerate(subs):
            batches = await sub.until(lambda b: bool(stored(b)))
            assert {b.data_parallel_rank for b in batches} == {i}
            replayed = await replay(zctx, f"tcp://127.0.0.1:{replay_base + i}", 0)
            assert {decode_batch(p).data_parallel_rank for _s, p, _n in replayed} == {i}
        async with http.get(fleet.replicas[1].url + "/server_info") as resp:
            info = await resp.json()
        assert info["kv_events"]["data_parallel_rank"] == 1
        assert info["kv_events_config"]["endpoint"] == f"tcp://127.0.0.1:{pub_base}"
        assert info["enable_kv_cache_events"] is True


async def test_a_restart_starts_the_sequence_again_with_nothing_to_replay(
        zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    async with sim() as fleet:
        replica = fleet.replicas[0]
        sub = Subscriber(zctx, publisher(replica)["endpoint"])
        await sub.ready()
        body = chat_body(150, 60)
        await post(http, replica.url, "/v1/chat/completions", body)
        await sub.until(lambda b: bool(stored(b)))
        await sub.settle()
        before = len(sub.got)
        await post(http, replica.url, "/admin/fault", {"kind": "restart"})
        assert await replay(zctx, publisher(replica)["replay_endpoint"], 0) == []
        await post(http, replica.url, "/v1/chat/completions", body)
        await sub.until(lambda b: len(b) > before)
        assert sub.seqs[before] == 0
        assert stored(sub.batches[before:])[0].parent is None   # the same blocks, stored afresh


async def test_no_sockets_when_events_are_off(http: aiohttp.ClientSession) -> None:
    async with sim(kv_events=KVEventsConfig()) as fleet:
        replica = fleet.replicas[0]
        assert replica.kv_publisher is None and not replica.config.enable_kv_cache_events
        async with http.get(replica.url + "/server_info") as resp:
            assert (await resp.json())["kv_events"] is None
