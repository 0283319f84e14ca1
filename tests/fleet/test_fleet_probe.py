"""The probe against real HTTP engines: the simulator, and a bare server without vLLM metrics."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from kvroute.fleet.probe import Prober, find_max_num_seqs
from kvroute.fleet.registry import Registry
from kvroute.sim.server import start_sim_fleet


class Epochs:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def on_worker_epoch(self, worker_id: str, epoch: float) -> None:
        self.seen.append((worker_id, epoch))

    def on_worker_removed(self, worker_id: str) -> None:
        self.seen.append((worker_id, -1.0))


@pytest.fixture
async def sim():
    fleet = await start_sim_fleet("a4000-qwen3-4b", 1, speed=20.0)
    yield fleet
    await fleet.close()


@pytest.fixture
async def bare():
    """An engine with /health and /v1/models only (no /metrics), whose health can be switched."""
    state = {"health": 200}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=state["health"])

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "bare-model"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", state
    await runner.cleanup()


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_the_simulator_is_read_like_vllm(sim):
    registry = Registry()
    prober = Prober(registry, interval_s=0.05)
    try:
        record = registry.add(sim.urls[0])
        result = await prober.probe_once(record.id, with_server_info=True)
        assert result is not None and result.reachable and result.healthy
        s = record.state
        assert s.healthy and s.models == {"qwen3-4b"} and s.max_model_len == 32768
        assert s.max_num_seqs == 32  # from /server_info
        assert (s.running, s.waiting, s.kv_usage) == (0, 0, 0.0)
        assert record.metrics.cache_config["block_size"] == "16"
        assert record.engine_start_time == sim.replicas[0].process_start_time
    finally:
        await prober.close()


async def test_a_restart_is_detected_by_the_loop_and_starts_a_new_epoch(sim):
    registry = Registry()
    epochs = Epochs()
    registry.subscribe(epochs)
    prober = Prober(registry, interval_s=0.05)
    try:
        record = registry.add(sim.urls[0])
        await prober.probe_once(record.id)
        prober.watch(record.id)
        first = record.state.epoch
        await asyncio.sleep(0.01)  # the restarted engine's start time must differ
        async with aiohttp.ClientSession() as http, \
                http.post(sim.urls[0] + "/admin/fault", json={"kind": "restart"}) as resp:
            assert resp.status == 200
        await wait_for(lambda: record.restarts == 1)
        assert record.state.epoch > first
        assert epochs.seen == [(record.id, first), (record.id, record.state.epoch)]
        await wait_for(lambda: len(record.history) >= 2)
    finally:
        await prober.close()


async def test_an_engine_without_metrics_is_healthy_with_unknown_load(bare):
    url, health = bare
    registry = Registry(failure_threshold=2)
    prober = Prober(registry, interval_s=0.05)
    try:
        record = registry.add(url)
        await prober.probe_once(record.id, with_server_info=True)
        s = record.state
        assert s.healthy and s.models == {"bare-model"}
        assert s.running is None and s.kv_usage is None and s.max_num_seqs is None
        prober.watch(record.id)
        health["health"] = 503
        await wait_for(lambda: not s.healthy)
        assert record.last_error == "/health answered 503"
        health["health"] = 200
        await wait_for(lambda: s.healthy)
    finally:
        await prober.close()


async def test_nothing_listening_is_unhealthy_at_once_and_removal_ends_the_loop():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    registry = Registry()
    prober = Prober(registry, interval_s=0.02)
    try:
        record = registry.add(url)
        result = await prober.probe_once(record.id)
        assert result is not None and not result.reachable and not record.state.healthy
        assert "ClientConnectorError" in record.last_error
        prober.watch(record.id)
        registry.remove(record.id)
        prober.unwatch(record.id)
        assert await prober.probe_once(record.id) is None
    finally:
        await prober.close()


@pytest.mark.parametrize(("info", "expected"), [
    ({"max_num_seqs": 48}, 48),
    ({"engine": {"scheduler": {"max_num_seqs": 12}}}, 12),
    ({"vllm_config": "model='x', max_num_seqs=256, max_model_len=4096"}, 256),
    ({"max_num_seqs": True}, None),
    ([{"a": 1}], None),
    (None, None),
    # One API server in front of several data-parallel ranks: each rank has max_num_seqs slots.
    ({"max_num_seqs": 48, "data_parallel_size": 2}, 96),
    ({"vllm_config": "max_num_seqs=256, max_model_len=4096, tensor_parallel_size=1, "
                     "pipeline_parallel_size=1, data_parallel_size=4, decode_context_parallel_size=1"}, 1024),
    ({"vllm_config": "max_num_seqs=8, decode_context_parallel_size=2"}, 8),
    ({"max_num_seqs": 48, "data_parallel_size": 0}, 48),
])
def test_max_num_seqs_from_server_info(info, expected):
    assert find_max_num_seqs(info) == expected
