"""Fixtures shared by every area: simulated replicas and an HTTP client, on loopback, closed at the
end of each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvroute.sim.server import SimFleet, start_sim_fleet

SIM_PRESET = "a4000-qwen3-4b"
# Fast enough for short tests, slow enough that engine figures are still visible to a probe.
SIM_SPEED = 20.0


@pytest.fixture
async def sim_fleet() -> AsyncIterator[Callable[..., Awaitable[SimFleet]]]:
    """``await sim_fleet(replicas, speed=..., **engine_overrides)``: simulated replicas."""
    fleets: list[SimFleet] = []

    async def make(replicas: int = 3, *, speed: float = SIM_SPEED, **overrides: Any) -> SimFleet:
        fleet = await start_sim_fleet(SIM_PRESET, replicas, speed=speed, **overrides)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        await fleet.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain aiohttp client session."""
    async with aiohttp.ClientSession() as session:
        yield session
