"""The canary against simulated replicas: passes when healthy, catches silent corruption."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import orjson
import pytest

from kvroute.canary.questions import Verdict
from kvroute.canary.run import CanaryError, CanaryOptions, run_canary
from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import start_router
from kvroute.sim.faults import Fault
from kvroute.sim.server import SimFleet, start_sim_fleet

SPEED = 1000.0
HEALTHY = {"enable_prefix_caching": True, "mamba_cache_mode": "align", "prefix_match_unit": 32,
           "answer_mode": True}


@pytest.fixture
async def healthy() -> AsyncIterator[SimFleet]:
    fleet = await start_sim_fleet("hybrid-27b", 1, speed=SPEED, **HEALTHY)
    yield fleet
    await fleet.close()


async def test_healthy_replica_passes_the_seed_sized_run(healthy: SimFleet) -> None:
    summary = await run_canary(CanaryOptions(healthy.urls[0], concurrency=16))
    assert (summary.total, summary.failures) == (150, 0)
    assert summary.passed
    assert summary.bound == pytest.approx(1 - 0.05 ** (1 / 150))
    assert summary.rule_of_three == pytest.approx(0.02)
    assert all(r.prompt_tokens and r.prompt_tokens > 13_000 for r in summary.replies)
    # After the first request the shared prefix is served from the cache.
    assert summary.hit_rate is not None and summary.hit_rate.rate is not None
    assert summary.hit_rate.rate > 0.5
    assert all((r.cached_tokens or 0) > (r.prompt_tokens or 0) / 2 for r in summary.replies[1:])
    assert set(summary.latency) == {"p50", "p90", "p99", "max"}


async def test_one_percent_corruption_is_caught() -> None:
    fleet = await start_sim_fleet("hybrid-27b", 1, speed=SPEED, corrupt_rate=0.01, seed=3, **HEALTHY)
    try:
        summary = await run_canary(CanaryOptions(fleet.urls[0], requests=800, prefix_tokens=2000,
                                                 concurrency=16))
    finally:
        await fleet.close()
    counts = summary.counts
    assert summary.failures >= 1
    assert counts["empty"] + counts["malformed"] == summary.failures, "only the injected faults fail"
    assert counts["empty"] >= 1 and counts["malformed"] >= 1
    assert summary.bound > summary.failures / summary.total
    shown = summary.failed_examples()
    assert shown and all(r.verdict in (Verdict.EMPTY, Verdict.MALFORMED) for r in shown)
    assert any(r.excerpt.startswith("!!!") for r in summary.replies if r.verdict is Verdict.MALFORMED)


async def test_a_replica_that_does_not_answer_fails_as_wrong() -> None:
    fleet = await start_sim_fleet("dense-3b", 1, speed=SPEED)  # no answer mode: filler text
    try:
        summary = await run_canary(CanaryOptions(fleet.urls[0], requests=20, prefix_tokens=500))
    finally:
        await fleet.close()
    assert summary.counts["wrong"] + summary.counts["truncated"] == 20
    assert not summary.passed


@pytest.mark.parametrize("kind", ["wrong_shape", "garbage"])
async def test_a_replica_that_answers_200_with_no_chat_completion_fails_as_malformed(kind: str) -> None:
    fleet = await start_sim_fleet("hybrid-27b", 1, speed=SPEED, **HEALTHY)
    fleet.replicas[0].faults.set(Fault(kind, rate=0.5))
    try:
        summary = await run_canary(CanaryOptions(fleet.urls[0], requests=40, prefix_tokens=500))
    finally:
        await fleet.close()
    assert summary.counts["malformed"] > 0 and summary.counts["error"] == 0
    assert summary.counts["malformed"] + summary.counts["correct"] == 40
    assert not summary.passed
    assert all(r.excerpt.startswith("not a chat completion") for r in summary.replies
               if r.verdict is Verdict.MALFORMED)


async def test_through_the_router_the_hit_rate_comes_from_its_re_export() -> None:
    fleet = await start_sim_fleet("hybrid-27b", 2, speed=SPEED, **HEALTHY)
    router = await start_router(Settings(workers=tuple(WorkerSpec(u) for u in fleet.urls),
                                         probe_interval_s=0.05))
    try:
        summary = await run_canary(CanaryOptions(router.url, requests=60, prefix_tokens=3000))
    finally:
        await router.close()
        await fleet.close()
    assert summary.passed
    assert summary.hit_rate is not None
    assert summary.hit_rate.after.source.startswith("kvroute_worker_prefix_cache_hits_total")


async def test_unreachable_target_cannot_start() -> None:
    with pytest.raises(CanaryError, match="pass --model"):
        await run_canary(CanaryOptions("http://127.0.0.1:9", requests=1, timeout_s=2))


async def run_cli(*args: str) -> tuple[int, bytes]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from kvroute.cli import main; main()", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out


async def test_cli_exit_status_and_json(healthy: SimFleet) -> None:
    code, out = await run_cli("canary", "--target", healthy.urls[0], "-n", "30", "--prefix-tokens", "1000",
                              "--json")
    assert code == 0, out.decode()
    doc = orjson.loads(out)
    assert doc["passed"] is True and doc["requests"] == 30 and doc["counts"]["correct"] == 30
    assert doc["failure_rate_upper_bound"] == pytest.approx(1 - 0.05 ** (1 / 30))

    code, out = await run_cli("canary", "--target", "http://127.0.0.1:9", "--timeout", "2")
    assert code == 2 and b"pass --model" in out


async def test_cli_fails_on_corruption() -> None:
    fleet = await start_sim_fleet("hybrid-27b", 1, speed=SPEED, corrupt_rate=1.0, **HEALTHY)
    try:
        code, out = await run_cli("canary", "--target", fleet.urls[0], "-n", "10", "--prefix-tokens", "200")
    finally:
        await fleet.close()
    assert code == 1
    text = out.decode()
    assert "FAIL" in text and "10 requests: 0 correct" in text
