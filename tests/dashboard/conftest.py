"""Fixtures for the dashboard tests: simulated replicas and routers with the dashboard mounted, on
loopback, all closed at the end of each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
from dashboard_setup import TOKEN

from kvroute.router_settings import Settings
from kvroute.server.app import RunningRouter, start_router
from kvroute.server.dashboard import setup_dashboard


@pytest.fixture
async def dashboard_router() -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    """``await dashboard_router(urls, **settings)``: a router over ``urls`` with the dashboard."""
    routers: list[RunningRouter] = []

    async def make(urls: Sequence[str] = (), **settings: Any) -> RunningRouter:
        base = {"probe_interval_s": 0.2, "probe_timeout_s": 1.0, "admin_token": TOKEN}
        running = await start_router(Settings.from_dict({**base, **settings, "workers": list(urls)}),
                                     setup=[setup_dashboard])
        routers.append(running)
        return running

    yield make
    for running in routers:
        await running.close()
