"""Fixtures for the multi-instance tests: real redis-server processes on free loopback ports,
simulated replicas and real routers, all stopped at the end of each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import RunningRouter, start_router
from kvroute.sim.server import SimFleet, start_sim_fleet
from kvroute.sync.local_redis import LocalRedis

SIM_PRESET = "a4000-qwen3-4b"
# Fast: a turn of a ~4k-token conversation takes a few milliseconds of wall time.
SIM_SPEED = 50.0


@pytest.fixture
def redis_servers() -> Iterator[Callable[..., LocalRedis]]:
    """Factory of started redis-servers (``password=...``, ``extra_args=...``), killed at the end."""
    started: list[LocalRedis] = []

    def make(**kwargs: Any) -> LocalRedis:
        server = LocalRedis(**kwargs)
        started.append(server)
        server.start()
        return server

    yield make
    for server in started:
        server.close()


@pytest.fixture
def redis_server(redis_servers: Callable[..., LocalRedis]) -> LocalRedis:
    return redis_servers()


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    fleet = await start_sim_fleet(SIM_PRESET, 4, speed=SIM_SPEED, max_num_batched_tokens=8192)
    yield fleet
    await fleet.close()


@pytest.fixture
async def instances(sim: SimFleet) -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    """Factory of router instances in front of the ``sim`` fleet sharing ``redis_url``."""
    started: list[RunningRouter] = []

    async def make(redis_url: str | None, **settings: Any) -> RunningRouter:
        # The router's prior prefill rate is a real card's; the simulated cards run SIM_SPEED
        # times faster, so scale it, or the router believes workers busy long after they are done.
        routing = {"prefill_s_per_token": 1.5e-4 / SIM_SPEED, **settings.pop("routing", {})}
        s = Settings(workers=tuple(WorkerSpec(u) for u in sim.urls), redis_url=redis_url,
                     probe_interval_s=0.1, routing=routing, **settings)
        running = await start_router(s)
        started.append(running)
        return running

    yield make
    for running in started:
        await running.close()
