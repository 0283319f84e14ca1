"""What the exact-mode server tests share: replicas that publish KV events, and waiting until a
router reads every worker's events."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvroute.fleet.kv_event_wire import KVEventsConfig
from kvroute.server.app import RunningRouter

# Each simulated replica publishes on ports of its own, found through its /server_info.
EVENTS = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
                        replay_endpoint="tcp://127.0.0.1:*")


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until ``cond()`` holds; fail the test after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def all_exact(r: RunningRouter) -> None:
    """Wait until ``r`` routes every worker on its engine's events (each synchronised by replay)."""
    await until(lambda: all(r.scheduler.cache_mode(w.id) == "exact" for w in r.registry.states()))
