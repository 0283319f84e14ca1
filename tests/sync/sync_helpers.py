"""Helpers for the multi-instance tests: conversations, waiting, reading metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from kvroute.server.app import RunningRouter
from kvroute.sync.redis_bus import RedisBus

MODEL = "qwen3-4b"


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail after a generous ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.02)


def bus(running: RunningRouter) -> RedisBus:
    """The Redis bus of a router instance."""
    sync = running.router.sync
    assert isinstance(sync, RedisBus)
    return sync


def metric(running: RunningRouter, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of the router's own metrics (0 when absent)."""
    return running.router.metrics.prometheus.get_sample_value(name, labels or {}) or 0.0


def total(running: RunningRouter, name: str) -> float:
    """Sum of a labelled counter over its record kinds."""
    return sum(metric(running, name, {"kind": k}) for k in ("prefix", "session", "epoch"))


async def synced(routers: Sequence[RunningRouter], redis_url: str, timeout_s: float = 20.0) -> None:
    """Wait until every fact published so far has been sent and read by every instance."""
    await wait_until(lambda: all(bus(r).unsent == 0 for r in routers), timeout_s, "facts sent")
    client = aioredis.from_url(redis_url)
    try:
        newest = await client.xrevrange(bus(routers[0]).facts_key, "+", "-", count=1)
    finally:
        await client.aclose()
    if not newest:
        return
    last = _id(newest[0][0])
    await wait_until(lambda: all(_id(bus(r).read_id) >= last for r in routers), timeout_s, "facts read")


def _id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.decode().partition("-")
    return int(ms), int(seq or 0)


@dataclass
class Conversation:
    """A chat that grows one turn at a time; ``workers`` is where each turn was served."""

    index: int
    session: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        system = f"You are assistant number {self.index}. " + f"Context {self.index}: lorem ipsum " * 250
        self.messages.append({"role": "system", "content": system})

    async def turn(self, http: aiohttp.ClientSession, url: str) -> str:
        """Send the next turn to the router at ``url``; returns the worker that served it."""
        self.messages.append({"role": "user", "content": f"question {len(self.workers)}: " + "why? " * 30})
        headers = {"x-session-id": self.session} if self.session else {}
        body: dict[str, Any] = {"model": MODEL, "messages": self.messages, "max_tokens": 8}
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            doc = await resp.json()
            assert resp.status == 200, doc
            worker = resp.headers["x-kvroute-worker"]
        self.messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
        self.workers.append(worker)
        return worker

    @property
    def home(self) -> str:
        return self.workers[0]

    def follow_ups_home(self) -> tuple[int, int]:
        """(follow-ups served by the first turn's worker, follow-ups)."""
        rest = self.workers[1:]
        return sum(w == self.home for w in rest), len(rest)
