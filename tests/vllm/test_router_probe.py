"""The router's probe reads real vLLM: load, KV use, prefix-cache counters, block size and
max_model_len, as the engine itself reports them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from vllm_helpers import block_size, get_text

from kvroute.fleet.registry import worker_id_for
from kvroute.server.app import RunningRouter
from kvroute_dev.growing_chat import filler
from kvroute_dev.vllm_replicas import ReplicaFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]


def start_time_of(url: str) -> float:
    """``process_start_time_seconds`` straight from the replica's exposition."""
    for line in get_text(f"{url}/metrics").splitlines():
        if line.startswith("process_start_time_seconds "):
            return float(line.split()[1])
    raise AssertionError(f"{url}/metrics has no process_start_time_seconds")


async def test_probe_reads_the_real_engine_figures(
    vllm_fleet: ReplicaFleet, router: RunningRouter, served_model: str
) -> None:
    for replica in vllm_fleet.replicas:
        record = router.registry.get(worker_id_for(replica.url))
        assert record is not None and record.metrics is not None, f"{replica.url} was not probed"
        state, metrics = record.state, record.metrics
        assert state.healthy
        assert state.models == frozenset({served_model})
        assert state.max_model_len == 4096  # --max-model-len, read from /v1/models
        assert isinstance(state.running, int) and isinstance(state.waiting, int)
        assert state.kv_usage is not None and 0.0 <= state.kv_usage <= 1.0
        assert metrics.prefix_hits is not None and metrics.prefix_queries is not None
        assert metrics.cache_config["enable_prefix_caching"] == "True"
        assert metrics.cache_config["block_size"] == "128"  # vLLM's CPU default
        assert record.engine_start_time == start_time_of(replica.url)
        assert time.time() - 3600 < record.engine_start_time < time.time()


async def test_probe_sees_a_running_request_and_counts_its_hits(
    vllm_fleet: ReplicaFleet, router: RunningRouter, served_model: str
) -> None:
    replica = vllm_fleet.replicas[0]
    worker_id = worker_id_for(replica.url)
    prober, record = router.router.prober, router.registry.get(worker_id)
    assert record is not None and record.metrics is not None
    block = block_size(replica.url)
    prompt = filler(f"probe-{time.time_ns()}", 0, 300)  # ~1,400 tokens: several seconds of work on one core
    body = {"model": served_model, "prompt": prompt, "max_tokens": 48, "ignore_eos": True, "temperature": 0}

    async with aiohttp.ClientSession() as session:

        async def complete(max_tokens: int) -> dict[str, Any]:
            url = f"{replica.url}/v1/completions"
            async with session.post(url, json={**body, "max_tokens": max_tokens}) as response:
                assert response.status == 200, await response.text()
                doc: dict[str, Any] = await response.json()
                return doc

        # Bypass the router so that only the engine's own figures can show this request.
        request = asyncio.create_task(complete(48))
        seen_running, seen_kv = 0, 0.0
        while not request.done():
            await prober.probe_once(worker_id, with_models=False)
            seen_running = max(seen_running, record.state.running or 0)
            seen_kv = max(seen_kv, record.state.kv_usage or 0.0)
            await asyncio.sleep(0.1)
        first = await request
        assert seen_running >= 1, "the probe never saw the request running"
        assert seen_kv > 0.0, "the probe never saw KV blocks in use"

        hits_before = record.metrics.prefix_hits or 0.0
        again = await complete(1)
        await prober.probe_once(worker_id, with_models=False)
    reusable = first["usage"]["prompt_tokens"] // block * block
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= reusable
    assert (record.metrics.prefix_hits or 0.0) - hits_before >= reusable
