"""A real replica restarted on the same address: the router notices by its
``process_start_time_seconds`` and starts a new epoch, so prefixes it had recorded stop matching."""

from __future__ import annotations

import asyncio

import pytest

from kvroute.fleet.registry import worker_id_for
from kvroute.server.app import RunningRouter
from kvroute_dev.vllm_replicas import ReplicaFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]


async def test_a_restarted_replica_gets_a_new_epoch(vllm_fleet: ReplicaFleet, router: RunningRouter) -> None:
    replica = vllm_fleet.replicas[1]
    worker_id = worker_id_for(replica.url)
    record = router.registry.get(worker_id)
    assert record is not None and record.engine_start_time is not None
    epoch, started, restarts = record.state.epoch, record.engine_start_time, record.restarts

    # In a thread: the router's probe loop keeps running while the replica is down and back.
    await asyncio.to_thread(vllm_fleet.restart, 1)
    await router.router.prober.probe_once(worker_id)

    assert record.restarts == restarts + 1
    assert record.engine_start_time is not None and record.engine_start_time > started
    assert record.state.epoch > epoch
    assert record.state.healthy
