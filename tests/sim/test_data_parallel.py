"""A simulated replica with several data-parallel ranks (``--data-parallel-size``) over real HTTP and
ZeroMQ: the ``X-data-parallel-rank`` header pins the rank as vLLM does (an integer out of range is
refused, anything else ignored), vLLM's balancer spreads requests without it, ``/metrics`` has one
series per rank, each rank publishes its own KV events, and a restart or a prefix-cache reset
reaches every rank."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import prose

from kvroute.fleet.kv_event_wire import (
    Cleared,
    EventBatch,
    KVEventsConfig,
    Stored,
    decode_batch,
    parse_pub_frames,
)
from kvroute.sim.server import SimFleet, start_sim_fleet

MODEL = "qwen3-3b"
EVENTS = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*")


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    fleet = await start_sim_fleet("dense-3b", 1, speed=100.0, output_tokens_min=8, output_tokens_max=16,
                                  data_parallel_size=2, kv_events=EVENTS)
    try:
        yield fleet
    finally:
        await fleet.close()


def body(seed: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prose(80, seed)}], "max_tokens": 8,
            **extra}


async def chat(http: aiohttp.ClientSession, url: str, seed: int,
               rank: str | None = None, **extra: Any) -> tuple[int, bytes]:
    headers = {"X-data-parallel-rank": rank} if rank is not None else {}
    async with http.post(url + "/v1/chat/completions", json=body(seed, **extra), headers=headers) as resp:
        return resp.status, await resp.read()


async def served(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Requests finished with ``stop`` or ``length`` per ``engine`` label, from /metrics."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:request_success_total" and s.labels["finished_reason"] in ("stop", "length"):
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


async def test_the_header_pins_the_rank(fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    for i in range(3):
        status, _ = await chat(http, url, i, rank="1")
        assert status == 200
    assert await served(http, url) == {"0": 0.0, "1": 3.0}
    ranks = fleet.replicas[0].ranks
    assert ranks[0].engine.snapshot().stats.prompt_tokens == 0
    assert ranks[1].engine.snapshot().stats.prompt_tokens > 0
    # The same prompt pinned to rank 1 again is served from rank 1's cache.
    before = ranks[1].engine.snapshot().stats.prompt_tokens_cached
    assert (await chat(http, url, 0, rank="1"))[0] == 200
    assert ranks[1].engine.snapshot().stats.prompt_tokens_cached > before


async def test_a_rank_out_of_range_is_refused_as_vllm_does(fleet: SimFleet,
                                                            http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    for bad in ("2", "-1"):
        status, raw = await chat(http, url, 0, rank=bad)
        assert status == 400
        assert orjson.loads(raw)["error"]["message"] == f"data_parallel_rank {bad} is out of range [0, 2)."
    # Streaming: the refusal comes once the stream has begun, as its one event.
    status, raw = await chat(http, url, 0, rank="7", stream=True)
    assert status == 200
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    assert events[-1] == b"[DONE]" and len(events) == 2
    assert orjson.loads(events[0])["error"]["message"] == "data_parallel_rank 7 is out of range [0, 2)."
    # Not an integer: ignored (vLLM's int() fails, the balancer picks), so it is served.
    assert (await chat(http, url, 1, rank="one"))[0] == 200
    assert sum((await served(http, url)).values()) == 1


async def test_without_the_header_the_balancer_spreads_requests(fleet: SimFleet,
                                                                http: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    # One after another on idle ranks: every score ties and the scan start rotates.
    for i in range(4):
        assert (await chat(http, url, i))[0] == 200
    assert await served(http, url) == {"0": 2.0, "1": 2.0}


async def test_each_rank_publishes_its_own_events_and_a_reset_reaches_every_rank(
        fleet: SimFleet, http: aiohttp.ClientSession) -> None:
    replica = fleet.replicas[0]
    async with http.get(fleet.urls[0] + "/server_info") as resp:
        info = await resp.json()
    assert "data_parallel_size=2" in info["vllm_config"]
    endpoints = [r["kv_events"]["endpoint"] for r in info["ranks"]]
    assert [r["kv_events"]["data_parallel_rank"] for r in info["ranks"]] == [0, 1]
    assert info["kv_events"]["endpoint"] == endpoints[0] != endpoints[1]
    ctx = zmq.asyncio.Context()
    socks = []
    try:
        for endpoint in endpoints:
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
            socks.append(sock)
            assert not await sock.poll(300)   # the slow joiner
        assert (await chat(http, fleet.urls[0], 5, rank="1"))[0] == 200
        got = await _receive(socks[1], lambda bs: any(isinstance(e, Stored) for b in bs for e in b.events))
        assert {b.data_parallel_rank for b in got} == {1}
        assert not await socks[0].poll(200)    # rank 0 computed nothing
        async with http.post(fleet.urls[0] + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        for rank, sock in enumerate(socks):
            cleared = await _receive(sock, lambda bs: any(isinstance(e, Cleared)
                                                          for b in bs for e in b.events))
            assert {b.data_parallel_rank for b in cleared} == {rank}
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.destroy(linger=0)
    # A restart empties every rank.
    assert replica.restart() == 0
    assert all(r.engine.snapshot().stats.prompt_tokens == 0 for r in replica.ranks)


async def _receive(sock: zmq.asyncio.Socket, done: Any, timeout: float = 10.0) -> list[EventBatch]:
    deadline = time.monotonic() + timeout
    got: list[EventBatch] = []
    while not done(got):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; got {len(got)} batches"
        if await sock.poll(int(min(left, 0.2) * 1000)):
            _topic, _seq, payload = parse_pub_frames(await sock.recv_multipart())
            got.append(decode_batch(payload))
    return got


async def test_one_rank_is_as_before(http: aiohttp.ClientSession) -> None:
    async with await start_sim_fleet("dense-3b", 2, speed=100.0, kv_events=EVENTS) as fleet:
        info = [r.kv_publisher.describe() for r in fleet.replicas if r.kv_publisher]
        # Each one-rank replica is data-parallel rank i of the fleet, as before.
        assert [i["data_parallel_rank"] for i in info] == [0, 1]
        async with http.get(fleet.urls[0] + "/server_info") as resp:
            doc = await resp.json()
        assert "ranks" not in doc and "data_parallel_size" not in doc["vllm_config"]
        status, raw = await chat(http, fleet.urls[0], 0, rank="1")
        assert status == 400, raw
        assert (await chat(http, fleet.urls[0], 0, rank="0"))[0] == 200
        assert await served(http, fleet.urls[0]) == {"0": 1.0}
