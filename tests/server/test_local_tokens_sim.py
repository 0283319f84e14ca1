"""Which path tokenizes a request for exact mode, against simulated replicas that publish KV
events: the engine's ``/tokenize`` by default; the router's own tokenizer where the model's
settings name one, with ``/tokenize`` still answering what it declines.

The simulator's tokenizer is a pseudo-tokenizer (four bytes a token, its own ChatML-like template:
sim/tokenizer.py), not a real one, so a real tokenizer's ids never equal its ``/tokenize``'s and
its blocks never match the simulator's events; that equality is checked against real vLLM-CPU
(tests/vllm/test_local_tokenizer_real.py).  Here: the paths, the fallback, the metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from exact_helpers import EVENTS, all_exact, until
from tiny_tokenizer import write_tokenizer

from kvroute.prometheus_text import parse_exposition
from kvroute.server.app import RunningRouter
from kvroute.sim.server import SimFleet

MakeFleet = Callable[..., Awaitable[SimFleet]]
MakeRouter = Callable[..., Awaitable[RunningRouter]]

MODEL = "qwen3-4b"


def counts(text: str) -> dict[tuple[str, str], float]:
    """kvroute_tokenize_total by (path, outcome), and kvroute_tokenize_tokens_total by ("tokens", part)."""
    found = {(s.labels["path"], s.labels["outcome"]): s.value
             for s in parse_exposition(text, ["kvroute_tokenize_total"])}
    found.update({("tokens", s.labels["part"]): s.value
                  for s in parse_exposition(text, ["kvroute_tokenize_tokens_total"])})
    return found


async def chat(http: aiohttp.ClientSession, r: RunningRouter, messages: list[dict[str, object]]) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def metrics(http: aiohttp.ClientSession, r: RunningRouter) -> dict[tuple[str, str], float]:
    async with http.get(r.url + "/metrics") as resp:
        return counts(await resp.text())


CONVERSATION: list[dict[str, object]] = [
    {"role": "system", "content": "You review pull requests for a storage engine. " * 20},
    {"role": "user", "content": "First diff?"}]
NEXT: list[dict[str, object]] = [*CONVERSATION, {"role": "assistant", "content": "Looks fine."},
                                 {"role": "user", "content": "And the next?"}]
IMAGE: list[dict[str, object]] = [
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]


async def test_the_local_tokenizer_replaces_the_round_trip_and_falls_back_for_what_it_declines(
        sim_fleet: MakeFleet, router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    fleet = await sim_fleet(2, speed=50.0, kv_events=EVENTS)
    folder = write_tokenizer(tmp_path / "model")
    local = await router(fleet.urls, models={MODEL: {"tokenizer": str(folder)}})
    engine = await router(fleet.urls)
    for r in (local, engine):
        await all_exact(r)
        # Tokens are worth computing once a worker's block size is known (its metrics say it).
        await until(lambda r=r: all(r.scheduler.block_size(w) is not None for w in r.registry.states()))
        await chat(http, r, CONVERSATION)
        await chat(http, r, NEXT)
        await chat(http, r, IMAGE)
    got = await metrics(http, local)
    # Both text turns locally, the second from its tail; the image left to the engine's /tokenize.
    assert got[("local", "ok")] == 2 and got[("local", "declined")] == 1
    assert got[("engine", "ok")] == 1
    assert got[("tokens", "reused")] > 0 and got[("tokens", "encoded")] > got[("tokens", "reused")]
    got = await metrics(http, engine)
    assert got[("engine", "ok")] == 3 and got[("local", "ok")] == 0


async def test_a_router_without_the_setting_never_loads_a_tokenizer(
        sim_fleet: MakeFleet, router: MakeRouter) -> None:
    fleet = await sim_fleet(1, speed=50.0, kv_events=EVENTS)
    r = await router(fleet.urls)
    tokens = r.router.tokens
    assert tokens is not None and tokens._local == {}


async def test_a_simulator_with_a_tokenizer_folder_tokenizes_as_the_local_tokenizer(
        sim_fleet: MakeFleet, http: aiohttp.ClientSession, tmp_path: Path) -> None:
    """``kvroute sim --tokenizer``: the replica's prompts are the folder's ids (its /tokenize, its
    usage), tool calls included; what the local tokenizer declines is a 400; /tokenize calls are
    counted in vLLM's http_requests_total."""
    from tiny_tokenizer import TOOL_TEMPLATE

    from kvroute.api.local_tokens import ChatTokenizer

    folder = write_tokenizer(tmp_path / "model", TOOL_TEMPLATE)
    fleet = await sim_fleet(1, tokenizer=str(folder))
    url = fleet.urls[0]
    tok = ChatTokenizer(folder)
    body: dict[str, object] = {"model": MODEL, "messages": [
        *CONVERSATION, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.c"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "int x;"}]}
    expected = tok.tokens(body, None)
    assert expected is not None
    async with http.post(url + "/tokenize", json=body) as resp:
        got = await resp.json()
    assert got["tokens"] == list(expected[0]) and got["count"] == len(expected[0])
    async with http.post(url + "/detokenize", json={"tokens": got["tokens"]}) as resp:
        assert (await resp.json())["prompt"] == tok.render(body)
    async with http.post(url + "/v1/chat/completions", json={**body, "max_tokens": 4}) as resp:
        assert (await resp.json())["usage"]["prompt_tokens"] == len(expected[0])
    async with http.post(url + "/tokenize", json={"model": MODEL, "messages": IMAGE}) as resp:
        assert resp.status == 400 and "--tokenizer" in await resp.text()
    async with http.get(url + "/metrics") as resp:
        calls = {(s.labels["handler"], s.labels["status"]): s.value
                 for s in parse_exposition(await resp.text(), ["http_requests_total"])}
    assert calls == {("/tokenize", "2xx"): 1, ("/tokenize", "4xx"): 1, ("/detokenize", "2xx"): 1,
                     ("/v1/chat/completions", "2xx"): 1}
