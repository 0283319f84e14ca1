"""Fixtures for the routing core tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from routing_helpers import Clock

from kvroute.routing.config import ModelSettings, RoutingConfig, setting_infos
from kvroute.routing.scheduler import Scheduler


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make_scheduler(clock: Clock) -> Callable[..., Scheduler]:
    """Scheduler factory: ``make_scheduler("prefix", index_max_blocks=10, overflow=4)``; keyword
    arguments that are ModelSettings fields go to the policy, the rest to RoutingConfig."""
    policy_fields = {i.name for i in setting_infos()}

    def make(policy: str = "auto", **kwargs: object) -> Scheduler:
        pol = {k: v for k, v in kwargs.items() if k in policy_fields}
        rest = {k: v for k, v in kwargs.items() if k not in policy_fields}
        config = RoutingConfig(default=ModelSettings(policy=policy, **pol), **rest)  # type: ignore[arg-type]
        return Scheduler(config, clock=clock)

    return make
