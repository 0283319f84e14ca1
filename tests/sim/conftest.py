"""Fixtures shared by the simulator's HTTP tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for the simulated replicas' HTTP API (20-s bound per request)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session
