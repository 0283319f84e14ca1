"""Exact mode for Anthropic ``/v1/messages``: the router tokenizes an Anthropic request as the chat
request vLLM converts it into (api/anthropic_chat.py), so a Claude-Code-shaped conversation (system
blocks with the attribution line, tool use, tool results) is matched against the blocks the engine
published for it.  Simulated replicas publishing KV events, the official anthropic client."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
from exact_helpers import EVENTS, all_exact, until

from kvroute.prometheus_text import parse_exposition
from kvroute.server.app import RunningRouter
from kvroute.sim.server import SimFleet

MakeFleet = Callable[..., Awaitable[SimFleet]]
MakeRouter = Callable[..., Awaitable[RunningRouter]]

MODEL = "qwen3-4b"
SYSTEM: list[Any] = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=7f3a;"},
    {"type": "text", "text": "You review pull requests for a storage engine; be terse and exact. " * 40,
     "cache_control": {"type": "ephemeral"}}]
TOOLS: list[Any] = [{"name": "read_file", "description": "Read a file.",
                     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]


async def turn(client: anthropic.AsyncAnthropic, messages: list[Any], system: list[Any] = SYSTEM
               ) -> tuple[str, str, int]:
    raw = await client.messages.with_raw_response.create(model=MODEL, max_tokens=16, system=system,
                                                         tools=TOOLS, messages=messages)
    reply = await raw.parse()
    text = "".join(b.text for b in reply.content if b.type == "text")
    return text, raw.headers["x-kvroute-worker"], reply.usage.cache_read_input_tokens or 0


def last_request(r: RunningRouter, worker: str) -> Any:
    return next(req for req in reversed(r.router.activity.requests) if req.worker == worker)


async def test_an_anthropic_conversations_follow_up_is_matched_on_the_engines_blocks(
        sim_fleet: MakeFleet, router: MakeRouter) -> None:
    fleet = await sim_fleet(2, speed=50.0, kv_events=EVENTS)
    r = await router(fleet.urls)
    exact = r.scheduler.exact
    await all_exact(r)
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-test", max_retries=0)
    async with client:
        history: list[Any] = [{"role": "user", "content": "Read the diff in change.patch."}]
        reply, worker, _ = await turn(client, history)
        await until(lambda: exact.stats(worker).get("rank0_blocks", 0) > 0)
        history += [
            {"role": "assistant", "content": [
                {"type": "text", "text": reply or "Reading it."},
                {"type": "tool_use", "id": "toolu_01", "name": "read_file",
                 "input": {"path": "change.patch"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "--- a/pool.c\n+++ b/pool.c\n"},
                {"type": "text", "text": "Is it safe?"}]}]
        await asyncio.sleep(2.5)  # the first turn's speculative entries have expired: events only
        _, again, cached = await turn(client, history)
        assert again == worker
        held = last_request(r, again)
        assert "(exact)" in held.reason, held.reason
        # The router predicted exactly the blocks the engine served from its cache: the whole first
        # turn's prompt (its generation marker is where the assistant turn now begins).
        block = exact.block_size(again)
        assert block is not None and cached > 0
        assert held.matched_blocks * block == cached, (held.reason, cached)

        # Another attribution line (Claude Code's changes every request) keys the same blocks.
        changed = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=0000;"},
                   SYSTEM[1]]
        history += [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Thanks."}]
        await asyncio.sleep(2.5)
        _, third, cached = await turn(client, history, system=changed)
        held = last_request(r, third)
        assert third == worker and "(exact)" in held.reason and held.matched_blocks * block == cached > 0

        # An inline system message (Claude Code's reminders): where vLLM puts it depends on the
        # engine's template, which the router asks the engine's /tokenize about once.
        history += [{"role": "assistant", "content": "Welcome."},
                    {"role": "system", "content": "Reminder: the tests must pass."},
                    {"role": "user", "content": "Fourth?"}]
        await asyncio.sleep(2.5)
        _, fourth, cached = await turn(client, history)
        held = last_request(r, fourth)
        assert fourth == worker and "(exact)" in held.reason and held.matched_blocks * block == cached > 0
        assert r.router.tokens is not None and set(r.router.tokens._merges.values()) == {False}


def tokenize_counts(text: str) -> dict[tuple[str, str], float]:
    """kvroute_tokenize_total by (path, outcome)."""
    return {(s.labels["path"], s.labels["outcome"]): s.value
            for s in parse_exposition(text, ["kvroute_tokenize_total"])}


async def engine_tokenize_calls(http: aiohttp.ClientSession, fleet: SimFleet) -> float:
    """How many /tokenize requests the replicas answered (vLLM's http_requests_total)."""
    total = 0.0
    for url in fleet.urls:
        async with http.get(url + "/metrics") as resp:
            total += sum(s.value for s in parse_exposition(await resp.text(), ["http_requests_total"])
                         if s.labels["handler"] == "/tokenize")
    return total


async def test_a_claude_code_conversation_with_tools_is_predicted_exactly_by_the_local_tokenizer(
        sim_fleet: MakeFleet, router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    """Replicas that tokenize with a real tokenizer and a Qwen-style template that renders tools,
    tool calls and tool results (``kvroute sim --tokenizer``), a router with the same folder: every
    turn of a Claude-Code-shaped conversation (tools on every request, tool_use and tool_result
    blocks) is tokenized in the router, no /tokenize reaches an engine, and each follow-up's
    prediction is exactly what the engine serves from its cache."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tiny_tokenizer import TOOL_TEMPLATE, write_tokenizer

    folder = str(write_tokenizer(tmp_path / "model", TOOL_TEMPLATE))
    fleet = await sim_fleet(2, speed=50.0, kv_events=EVENTS, tokenizer=folder)
    r = await router(fleet.urls, models={MODEL: {"tokenizer": folder}})
    exact = r.scheduler.exact
    await all_exact(r)
    await until(lambda: all(r.scheduler.block_size(w) is not None for w in r.registry.states()))
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-test", max_retries=0)
    async with client:
        history: list[Any] = [{"role": "user", "content": "Read the diff in change.patch."}]
        reply, worker, _ = await turn(client, history)
        await until(lambda: exact.stats(worker).get("rank0_blocks", 0) > 0)
        block = exact.block_size(worker)
        assert block is not None
        files = ["change.patch", "pool.c", "pool.h"]
        for i, name in enumerate(files):
            history += [
                {"role": "assistant", "content": [
                    *([{"type": "text", "text": reply}] if reply else []),
                    {"type": "tool_use", "id": f"toolu_0{i}", "name": "read_file", "input": {"path": name}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_0{i}",
                     "content": [{"type": "text", "text": f"--- a/{name}\n+++ b/{name}\n" * 20}]},
                    *([{"type": "text", "text": "Is it safe?"}] if i == len(files) - 1 else [])]}]
            await asyncio.sleep(2.5)  # the last turn's speculative entries have expired: events only
            reply, again, cached = await turn(client, history)
            held = last_request(r, again)
            assert again == worker and "(exact)" in held.reason, held.reason
            assert cached > 0 and held.matched_blocks * block == cached, (i, held.reason, cached)
    async with http.get(r.url + "/metrics") as resp:
        done = tokenize_counts(await resp.text())
    # Every turn locally, the first too (before any event, by the block size the metrics said).
    assert done[("local", "ok")] == len(files) + 1 and done.get(("local", "declined"), 0) == 0, done
    assert done.get(("engine", "ok"), 0) == 0, done
    assert await engine_tokenize_calls(http, fleet) == 0


async def test_the_local_tokenizer_leaves_what_it_cannot_render_to_the_engine(
        sim_fleet: MakeFleet, router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tiny_tokenizer import write_tokenizer

    fleet = await sim_fleet(1, speed=50.0, kv_events=EVENTS)
    r = await router(fleet.urls, models={MODEL: {"tokenizer": str(write_tokenizer(tmp_path / "model"))}})
    await all_exact(r)

    async def send(messages: list[Any]) -> None:
        body = {"model": MODEL, "max_tokens": 4, "system": SYSTEM, "tools": TOOLS, "messages": messages}
        headers = {"anthropic-version": "2023-06-01"}
        async with http.post(r.url + "/v1/messages", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()

    await until(lambda: all(r.scheduler.block_size(w) is not None for w in r.registry.states()))
    asked: list[Any] = [{"role": "user", "content": "First diff?"},
                        {"role": "assistant",
                         "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {}}]}]
    await send([*asked, {"role": "user",
                         "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}])
    # A screenshot in a tool result: media, which the local tokenizer leaves to the engine.
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    await send([*asked, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                      "content": [image]}]}])
    async with http.get(r.url + "/metrics") as resp:
        done = tokenize_counts(await resp.text())
    # The tool turn locally; the image by /tokenize.
    assert done[("local", "ok")] == 1 and done[("local", "declined")] == 1, done
    assert done[("engine", "ok")] == 1, done
    assert await engine_tokenize_calls(http, fleet) == 1
