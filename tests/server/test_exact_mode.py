"""Exact mode end to end: simulated replicas publishing vLLM's KV events over ZeroMQ, a real router
reading where they publish from /server_info, the official openai client (docs/routing.md, "Exact
cache state").  The router's prediction is checked against what the engine reported."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import openai
from exact_helpers import EVENTS, all_exact, until

from kvroute.prometheus_text import parse_exposition, total, where
from kvroute.server.app import RunningRouter
from kvroute.sim.server import SimFleet

MakeFleet = Callable[..., Awaitable[SimFleet]]
MakeRouter = Callable[..., Awaitable[RunningRouter]]

MODEL = "qwen3-4b"
SYSTEM = "You review pull requests for a storage engine; be terse and exact. " * 40


def decision_of(r: RunningRouter, worker: str) -> str:
    """The last decision line logged for a request that went to ``worker``."""
    return next(req.reason for req in reversed(r.router.activity.requests) if req.worker == worker)


async def turn(client: openai.AsyncOpenAI, messages: list[dict[str, str]]) -> tuple[str, str, int]:
    raw = await client.chat.completions.with_raw_response.create(  # type: ignore[call-overload]
        model=MODEL, messages=messages, max_tokens=16)
    reply = raw.parse()
    details = reply.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens is not None else 0
    return reply.choices[0].message.content or "", raw.headers["x-kvroute-worker"], cached


async def test_a_conversation_is_routed_on_the_engines_own_cache_state(
        sim_fleet: MakeFleet, router: MakeRouter) -> None:
    fleet = await sim_fleet(2, speed=50.0, kv_events=EVENTS)
    r = await router(fleet.urls)
    exact = r.scheduler.exact
    # Where each replica publishes came from its /server_info; both are synchronised by replay.
    await all_exact(r)
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First diff?"}]
        reply, worker, _ = await turn(client, history)
        await until(lambda: exact.stats(worker).get("rank0_blocks", 0) > 0)
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the next?"}]
        await asyncio.sleep(2.5)  # the first turn's speculative entries have expired: events only
        _, again, cached = await turn(client, history)
        assert again == worker
        line = decision_of(r, again)
        assert "(exact)" in line, line
        # The router predicted exactly what the engine served from its cache.
        held = next(req for req in reversed(r.router.activity.requests) if req.worker == again)
        block = exact.block_size(again)
        assert block is not None and held.matched_blocks * block == cached, (line, cached)

        # A prefix-cache reset is seen (AllBlocksCleared): the next turn knows nothing is held.
        replica = fleet.urls[[w.id for w in r.registry.states()].index(worker)]
        async with aiohttp.ClientSession() as http, http.post(replica + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        await until(lambda: exact.stats(worker).get("rank0_blocks", 1) == 0)
        history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Third?"}]
        await asyncio.sleep(2.5)
        _, third, cached = await turn(client, history)
        line = decision_of(r, third)
        assert "(exact)" in line and cached == 0, line
    async with aiohttp.ClientSession() as http:
        async with http.get(r.url + "/metrics") as resp:
            text = await resp.text()
        async with http.get(r.url + "/admin/workers", headers={"authorization": "Bearer secret"}) as resp:
            workers = (await resp.json())["workers"]
    stored = total(where(parse_exposition(text, ["kvroute_kv_events_total"]), "kind", "stored"),
                   "kvroute_kv_events_total")
    assert stored is not None and stored > 0
    assert {w["cache_mode"] for w in workers} == {"exact"}


async def test_a_first_turn_is_routed_exactly_before_any_event(
        sim_fleet: MakeFleet, router: MakeRouter) -> None:
    """Before an engine's first KV event its block size comes from its scraped cache_config_info,
    so the very first turn is hashed and routed on the exact state too."""
    fleet = await sim_fleet(2, speed=50.0, kv_events=EVENTS)
    r = await router(fleet.urls)
    await all_exact(r)
    states = r.registry.states()
    await until(lambda: all(r.scheduler.block_size(w) is not None for w in states))
    assert all(r.scheduler.exact.block_size(w.id) is None for w in states)  # no event told it
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "First diff?"}]
        _, worker, cached = await turn(client, history)
    line = decision_of(r, worker)
    assert "(exact)" in line and cached == 0, line
    await until(lambda: r.scheduler.exact.block_size(worker) is not None)
    scraped = next(w.block_size for w in states if w.id == worker)
    assert r.scheduler.exact.block_size(worker) == scraped  # the events agree with the metrics
