"""Shared helpers for the doctor's tests against simulated replicas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest

from kvroute.sim.server import SimFleet, start_sim_fleet

# Fast enough that a probe of a few thousand tokens takes milliseconds of real time.
SPEED = 200.0

SimFactory = Callable[..., AbstractAsyncContextManager[SimFleet]]


@pytest.fixture
def sim() -> SimFactory:
    """``async with sim("hybrid-27b", enable_prefix_caching=True) as fleet:`` — closed afterwards."""

    @asynccontextmanager
    async def start(preset: str, replicas: int = 1, **overrides: Any) -> AsyncIterator[SimFleet]:
        fleet = await start_sim_fleet(preset, replicas, speed=SPEED, **overrides)
        try:
            yield fleet
        finally:
            await fleet.close()

    return start
