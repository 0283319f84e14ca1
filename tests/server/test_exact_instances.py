"""Several router instances with no Redis, each subscribed to every engine's KV events, behind a
round-robin balancer: an instance that never saw a conversation sends its next turn to the worker
the engines say hold its history, even when the sessions it routed itself crowd that worker
(docs/routing.md, "Several instances, no Redis")."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from exact_helpers import EVENTS, all_exact, until

from kvroute.server.app import RunningRouter
from kvroute.sim.server import SimFleet

MakeFleet = Callable[..., Awaitable[SimFleet]]
MakeRouter = Callable[..., Awaitable[RunningRouter]]

MODEL = "qwen3-4b"
# A reader's pause between turns, longer than a probe interval: the engines' scraped load settles.
THINK_S = 0.3


async def turn(http: aiohttp.ClientSession, r: RunningRouter, messages: list[dict[str, str]]) -> str:
    """One turn of the conversation through router ``r``; returns the worker that served it."""
    messages.append({"role": "user", "content": f"question {len(messages)}: why? " * 20})
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 8}
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        doc = await resp.json()
        assert resp.status == 200, doc
        worker = resp.headers["x-kvroute-worker"]
    messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
    return worker


def reason_of(r: RunningRouter) -> str:
    """The decision line of the last request ``r`` routed."""
    return r.router.activity.requests[-1].reason


async def test_an_instance_that_never_saw_a_conversation_keeps_it_on_its_worker(
        sim_fleet: MakeFleet, router: MakeRouter, http: aiohttp.ClientSession) -> None:
    fleet = await sim_fleet(2, speed=50.0, kv_events=EVENTS)
    a, b = await router(fleet.urls), await router(fleet.urls)
    for r in (a, b):
        await all_exact(r)
    # Router a places six conversations: at least three share a worker.
    chats = [[{"role": "system", "content": f"You are assistant {i}. " + f"Context {i}: lorem ipsum " * 180}]
             for i in range(6)]
    homes = []
    for chat in chats:
        homes.append(await turn(http, a, chat))
        await asyncio.sleep(THINK_S)
    crowded = max(set(homes), key=homes.count)
    on_it = [chat for chat, home in zip(chats, homes, strict=True) if home == crowded]
    assert len(on_it) >= 3, homes
    await until(lambda: b.scheduler.exact.stats(crowded).get("rank0_blocks", 0) > 0)
    # Router b sees their next turns one after another; by the last ones, every session b knows is
    # on the crowded worker (its own count of sessions there would send the turn to the other).
    for chat in on_it:
        assert await turn(http, b, chat) == crowded, reason_of(b)
        line = reason_of(b)
        assert "sticky" in line and "(exact)" in line, line
        await asyncio.sleep(THINK_S)
