"""Routing to a data-parallel rank end to end: one simulated vLLM server fronting two engine ranks
(``--data-parallel-size 2``), each publishing its KV events on the ports + rank, and a real router
subscribed to both (``kv_events_ranks = 2``).  The router pins each request's rank with
``X-data-parallel-rank``: a conversation's next turn goes to the rank holding its history, and two
new conversations on the idle server go to different ranks — told by the simulator's own per-rank
``/metrics`` (label ``engine``) and its engines' cache counters (docs/routing.md, "Exact cache
state")."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from exact_helpers import all_exact, until
from prometheus_client.parser import text_string_to_metric_families

from kvroute.fleet.kv_event_wire import KVEventsConfig
from kvroute.server.app import RunningRouter
from kvroute.sim.server import SimFleet
from kvroute_dev.ports import free_ports

MakeFleet = Callable[..., Awaitable[SimFleet]]
MakeRouter = Callable[..., Awaitable[RunningRouter]]

MODEL = "qwen3-4b"


async def per_engine(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Requests each rank served (``vllm:request_success_total`` by ``engine``), from /metrics."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:request_success_total":
                out[s.labels["engine"]] = out.get(s.labels["engine"], 0.0) + s.value
    return out


async def turn(http: aiohttp.ClientSession, r: RunningRouter, sim: str,
               messages: list[dict[str, str]]) -> str:
    """One turn through the router; returns the rank that served it (by the simulator's /metrics)."""
    before = await per_engine(http, sim)
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 8}
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        reply = await resp.json()
    messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    after = await per_engine(http, sim)
    served = [engine for engine, n in after.items() if n > before.get(engine, 0.0)]
    assert len(served) == 1, (before, after)
    return served[0]


def last_decision(r: RunningRouter) -> str:
    reason: str = r.router.activity.requests[-1].reason
    return reason


async def test_a_follow_up_goes_to_the_rank_holding_its_history(sim_fleet: MakeFleet,
                                                                router: MakeRouter) -> None:
    base = free_ports(4)
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{base}",
                            replay_endpoint=f"tcp://*:{base + 2}")
    fleet = await sim_fleet(1, speed=50.0, kv_events=events, data_parallel_size=2)
    sim = fleet.urls[0]
    r = await router(fleet.urls, kv_events_ranks=2)
    await all_exact(r)
    exact = r.scheduler.exact
    worker = r.registry.states()[0].id
    assert exact.ranks(worker) == 2
    ranks = fleet.replicas[0].ranks
    a = [{"role": "system", "content": "You review pull requests for a storage engine. " * 30},
         {"role": "user", "content": "First diff?"}]
    b = [{"role": "system", "content": "You translate legal contracts into plain French. " * 30},
         {"role": "user", "content": "Clause one?"}]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
        # Before the engines' first stored block their block size is the one /metrics says: the
        # very first request is hashed, exact, and pinned to a rank.
        await until(lambda: r.scheduler.block_size(r.registry.states()[0]) is not None)
        rank_a = await turn(http, r, sim, a)
        line = last_decision(r)
        assert "(exact)" in line and f"rank={rank_a}" in line, line
        await until(lambda: exact.stats(worker).get(f"rank{rank_a}_blocks", 0) > 0)
        # A second conversation on the idle server: the other rank (its cache is the emptier).
        rank_b = await turn(http, r, sim, b)
        assert rank_b != rank_a and f"rank={rank_b}" in last_decision(r), last_decision(r)
        await until(lambda: exact.stats(worker).get(f"rank{rank_b}_blocks", 0) > 0)
        await asyncio.sleep(2.5)   # the speculative entries have expired: the engines' events only
        for history, rank in ((a, rank_a), (b, rank_b), (a, rank_a)):
            engine = ranks[int(rank)].engine
            cached = engine.snapshot().stats.prompt_tokens_cached
            history.append({"role": "user", "content": "And the next one?"})
            assert await turn(http, r, sim, history) == rank, last_decision(r)
            line = last_decision(r)
            assert "(exact)" in line and f"rank={rank}" in line, line
            # Served from that rank's cache: its history was there.
            assert engine.snapshot().stats.prompt_tokens_cached > cached
        async with http.get(r.url + "/admin/workers", headers={"authorization": "Bearer secret"}) as resp:
            listed = (await resp.json())["workers"][0]
    assert listed["rank_inflight"] == {} and listed["kv_events"]["rank1_blocks"] > 0
    # Each rank has its own sequence slots: the worker has both ranks' (/server_info names them per rank).
    assert listed["max_num_seqs"] == 2 * fleet.replicas[0].config.max_num_seqs
