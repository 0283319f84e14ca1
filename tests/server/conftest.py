"""Fixtures for router tests: real engines (the simulator or the echo engine) and real routers on
loopback, all closed at the end of each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
from echo_engine import EchoEngine

from kvroute.router_settings import Settings, parse_worker_spec
from kvroute.server.app import RunningRouter, start_router


@pytest.fixture
async def echo_engines() -> AsyncIterator[Callable[..., Awaitable[list[EchoEngine]]]]:
    started: list[EchoEngine] = []

    async def make(n: int = 1, **kwargs: Any) -> list[EchoEngine]:
        engines = [await EchoEngine(**kwargs).start() for _ in range(n)]
        started.extend(engines)
        return engines

    yield make
    for engine in started:
        await engine.close()


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    routers: list[RunningRouter] = []

    async def make(urls: Sequence[str], **settings: Any) -> RunningRouter:
        base = {"probe_interval_s": 0.1, "probe_timeout_s": 1.0, "admin_token": "secret"}
        s = Settings.from_dict({**base, **settings}).replace(
            workers=tuple(parse_worker_spec(u) for u in urls))
        running = await start_router(s)
        routers.append(running)
        return running

    yield make
    for running in routers:
        await running.close()

