"""Conversations that send no session id, through a real router to simulated replicas: the
identity derived from the prompt places new conversations by the sessions living on each replica
and keeps every follow-up at home (`api/requests.py`, docs/routing.md)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import openai
import pytest

from kvroute.server.app import RunningRouter
from kvroute.sim.server import SimFleet

MakeFleet = Callable[..., Awaitable[SimFleet]]
MakeRouter = Callable[..., Awaitable[RunningRouter]]

MODEL = "qwen3-4b"
SYSTEM = "You are a careful assistant for a team of engineers. Follow the house style. " * 30
# ~82 KB of tool definitions: with SYSTEM * 12, a Claude-Code-sized shared head (docs/routing.md).
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does one thing. " * 320,
                                           "parameters": {"type": "object", "properties": {}}}}
         for i in range(16)]


async def ask(client: openai.AsyncOpenAI, messages: list[dict[str, str]], **extra: object) -> tuple[str, str]:
    """One chat turn; the reply and the replica that served it (``x-kvroute-worker``)."""
    raw = await client.chat.completions.with_raw_response.create(  # type: ignore[call-overload]
        model=MODEL, messages=messages, max_tokens=8, **extra)
    return raw.parse().choices[0].message.content or "", raw.headers["x-kvroute-worker"]


async def conversations(r: RunningRouter, n: int, *, system: str, **extra: object) -> list[tuple[str, str]]:
    """``n`` conversations sharing ``system`` (and ``extra``), one after another, no session id;
    then each one's follow-up.  The replica of each first turn and of its follow-up."""
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    firsts: list[tuple[list[dict[str, str]], str]] = []
    async with client:
        for i in range(n):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Question {i}: how do I fix bug #{1000 + i}?"}]
            reply, worker = await ask(client, messages, **extra)
            firsts.append(([*messages, {"role": "assistant", "content": reply}], worker))
        out = []
        for history, worker in firsts:
            _, again = await ask(client, [*history, {"role": "user", "content": "And then?"}], **extra)
            out.append((worker, again))
    return out


@pytest.mark.parametrize(("n", "tools"), [(4, False), (8, True)])
async def test_new_conversations_without_ids_spread_and_follow_ups_stay(
        sim_fleet: MakeFleet, router: MakeRouter, n: int, tools: bool) -> None:
    fleet = await sim_fleet(4, speed=50.0)
    r = await router(fleet.urls)
    # With tools, a Claude-Code-sized head: ~28 KB of system prompt and ~82 KB of tools.
    system, extra = (SYSTEM * 12, {"tools": TOOLS}) if tools else (SYSTEM, {})
    placed = await conversations(r, n, system=system, **extra)
    assert len({first for first, _ in placed}) >= 3, placed
    assert all(first == again for first, again in placed), placed
    # The dashboard's and the metrics' session counts see them too.
    assert r.scheduler.stats()["sessions"] == n


async def test_the_derived_identity_can_be_switched_off(sim_fleet: MakeFleet, router: MakeRouter) -> None:
    """``[requests] derive_conversation_id = false``: requests without an id are placements again
    (before this switch existed, these four all landed on the first replica)."""
    fleet = await sim_fleet(4, speed=50.0)
    r = await router(fleet.urls, requests={"derive_conversation_id": False})
    placed = await conversations(r, 4, system=SYSTEM)
    assert len(placed) == 4 and r.scheduler.stats()["sessions"] == 0


@pytest.mark.parametrize("header", ["session_id", "session-id", "x-session-id"])
async def test_agent_session_headers_pass_the_listening_side(sim_fleet: MakeFleet, router: MakeRouter,
                                                             header: str) -> None:
    """Codex's ``session_id`` (an underscore: some proxies drop such headers, the router must not),
    its ``session-id`` spelling and OpenCode's ``x-session-id`` bind prompts that share nothing."""
    fleet = await sim_fleet(4, speed=50.0)
    r = await router(fleet.urls, policy="session")
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0,
                                default_headers={header: "codex-0f4c2b1e"})
    async with client:
        homes = {(await ask(client, [{"role": "user", "content": f"unrelated prompt {i} " * 50}]))[1]
                 for i in range(4)}
    assert len(homes) == 1 and r.scheduler.stats()["sessions"] == 1
