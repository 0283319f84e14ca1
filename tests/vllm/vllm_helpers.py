"""Small helpers shared by the real-engine tests: recorded answers and short synchronous GETs."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from kvroute.fleet.registry import worker_id_for
from kvroute.fleet.vllm_metrics import EngineMetrics, parse_vllm_metrics
from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import RunningRouter, start_router
from kvroute_dev.vllm_replicas import Replica, ReplicaFleet

FIXTURES = Path(__file__).parent / "fixtures"
ADMIN_TOKEN = "vllm-tests"


@asynccontextmanager
async def serving(settings: Settings) -> AsyncIterator[RunningRouter]:
    """A router on loopback with ``settings`` (validated first), closed on exit."""
    settings.validate()
    running = await start_router(settings, host="127.0.0.1", port=0)
    try:
        yield running
    finally:
        await running.close()


@asynccontextmanager
async def exact_router_for(fleet: ReplicaFleet, **routing: Any) -> AsyncIterator[RunningRouter]:
    """A router on loopback in front of ``fleet``, told where each replica publishes its KV events
    (they share a host, so it must be told), with ``routing`` settings added; closed on exit."""
    assert all(r.kv_events for r in fleet.replicas), "the directory's replicas publish KV events"
    settings = Settings(
        workers=tuple(WorkerSpec(url=r.url) for r in fleet.replicas), admin_token=ADMIN_TOKEN,
        probe_interval_s=0.5, first_byte_floor_s=120.0, routing={"canary": False, **routing},
        kv_events={r.url: r.kv_events or "" for r in fleet.replicas})
    async with serving(settings) as running:
        yield running


def get_text(url: str) -> str:
    """GET ``url`` and return the body (a probe of a local replica: short, so blocking is fine)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode("utf-8"))


def get_json(url: str) -> object:
    """GET ``url`` and parse its JSON body."""
    return json.loads(get_text(url))


def engine_metrics(url: str) -> EngineMetrics:
    """A replica's ``/metrics``, read now."""
    return parse_vllm_metrics(get_text(f"{url}/metrics"))


def block_size(url: str) -> int:
    """The replica's KV block size, as its ``vllm:cache_config_info`` states it."""
    return int(engine_metrics(url).cache_config["block_size"])


def replica_serving(fleet: ReplicaFleet, worker_id: str | None) -> Replica:
    """The replica behind a router worker id (``127.0.0.1:PORT``, the ``x-kvroute-worker`` header)."""
    for replica in fleet.replicas:
        if worker_id == worker_id_for(replica.url):
            return replica
    raise AssertionError(f"worker {worker_id!r} is none of {fleet.urls}")
