"""The HTTP load driver meets a router that sheds: a real kvroute router with flow control and no
queue room in front of one simulated replica with a single sequence slot, so that while one
request runs every other is answered with the API's overload error at once.  The driver must
treat that as a client does (wait Retry-After, give up the task, count it as shed), not as an
error, and read the router's own queue figures from its /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
import pytest

from kvroute.bench.http_ab import discover_model
from kvroute.bench.results import RequestRecord
from kvroute.bench.runner import ApiKind, HttpTarget, StepPlan, retry_after, run_step
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig
from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import start_router
from kvroute.sim.server import start_sim_fleet

SPEED = 20.0
TINY = AgentWorkloadConfig(system_tokens=300, first_tokens=600, rounds=3, round_tokens=60,
                           max_output_tokens=40, min_output_tokens=30, think_time_s=0.0)


@pytest.mark.parametrize(("api", "status"), [("openai", "429"), ("anthropic", "529")])
async def test_sheds_are_waited_out_counted_and_not_errors(api: ApiKind, status: str) -> None:
    fleet = await start_sim_fleet("a4000-qwen3-4b", 1, speed=SPEED, max_num_seqs=1)
    settings = Settings(workers=(WorkerSpec(url=fleet.urls[0]),), policy="auto", port=0,
                        probe_interval_s=0.05,
                        routing={"flow_control": True, "flow_max_queued": 0})
    router = await start_router(settings, host="127.0.0.1", port=0)
    try:
        worker = router.router.registry.states()[0]
        for _ in range(500):
            if worker.max_num_seqs == 1:
                break
            await asyncio.sleep(0.01)
        assert worker.max_num_seqs == 1
        model = await discover_model(fleet.urls[0])
        target = HttpTarget(router.url, model, (fleet.urls[0] + "/metrics",), api, SPEED,
                            router_metrics_url=router.url + "/metrics")
        plan = StepPlan((4,), duration_s=40.0, drain_timeout_s=40.0, poll_interval_s=0.2)
        records: list[RequestRecord] = []

        def keep(sessions: int, elapsed: float, recs: Sequence[RequestRecord]) -> None:
            records[:] = recs

        async with aiohttp.ClientSession() as http:
            step, _ = await run_step(http, target, AgentWorkload(TINY, 3), api, 4, 0, plan, keep)
    finally:
        await router.close()
        await fleet.close()
    assert step.shed > 0          # four sessions, one slot: some were turned away
    assert step.errors == 0       # ... and none of that is an error
    assert step.requests > step.shed
    assert step.router_shed is not None and step.router_shed >= step.shed
    assert step.queue_wait_p50_s == 0.0   # no queue room: whoever got in, got in at once
    shed = [r for r in records if r.shed]
    assert len(shed) == step.shed
    for rec in shed:
        assert rec.error is not None and rec.error.startswith(f"HTTP {status}")
        assert rec.retry_after_s is not None and rec.retry_after_s >= 1
        # The agent gave up that task: its session sent nothing after the shed round.
        assert not any(r.session_id == rec.session_id and r.round > rec.round for r in records)


def test_retry_after_reads_seconds_only() -> None:
    assert retry_after("3") == 3.0
    assert retry_after(" 1.5 ") == 1.5
    assert retry_after(None) is None
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after("-1") is None
    assert retry_after("inf") is None
