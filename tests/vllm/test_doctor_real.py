"""``kvroute doctor`` on real vLLM: it reads prefix caching on and the block size from the replicas
themselves, through the router as well, and from a real startup log."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest
from vllm_helpers import ADMIN_TOKEN, FIXTURES

from kvroute.server.app import RunningRouter
from kvroute_dev.vllm_replicas import ReplicaFleet

DOCTOR = [sys.executable, "-c", "from kvroute.cli import main; main()", "doctor"]


def doctor_json(*args: str) -> dict[str, Any]:
    """Run ``kvroute doctor ARGS --json`` as a user would and return its report (blocking: a router
    in this process must be given the event loop meanwhile, see ``doctor_json_async``)."""
    command = [*DOCTOR, *args, "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"doctor exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    report: dict[str, Any] = json.loads(result.stdout)
    return report


async def doctor_json_async(*args: str) -> dict[str, Any]:
    return await asyncio.to_thread(doctor_json, *args)


def assert_caching_on(target: dict[str, Any], model: str) -> None:
    facts = target["facts"]
    assert "enable_prefix_caching" in facts, f"doctor could not read /metrics: {target}"
    assert facts["enable_prefix_caching"]["value"] is True
    assert facts["model"]["value"] == model
    assert "prefix-caching-on" in {f["code"] for f in target["findings"]}
    assert target["worst"] != "error"


@pytest.mark.vllm
@pytest.mark.timeout(420)
def test_doctor_reads_the_real_replicas(vllm_fleet: ReplicaFleet, served_model: str) -> None:
    report = doctor_json(*vllm_fleet.urls)
    assert [t["kind"] for t in report["targets"]] == ["engine", "engine"]
    for target in report["targets"]:
        assert_caching_on(target, served_model)
        assert target["facts"]["block_size"]["value"] == 128
        assert target["facts"]["max_model_len"]["value"] == 4096


@pytest.mark.vllm
@pytest.mark.timeout(420)
async def test_doctor_through_the_router_checks_every_replica(
    router: RunningRouter, served_model: str
) -> None:
    report = await doctor_json_async(router.url, "--admin-token", ADMIN_TOKEN)
    workers = [t for t in report["targets"] if t["kind"] == "worker"]
    assert len(workers) == 2
    for target in workers:
        assert_caching_on(target, served_model)
        assert target["facts"]["block_size"]["value"] == 128


def test_doctor_reads_a_real_startup_log() -> None:
    report = doctor_json("--log", str(FIXTURES / "startup.log"))
    (target,) = report["targets"]
    assert_caching_on(target, "smollm2-135m-instruct")
    assert target["facts"]["max_num_seqs"]["value"] == 4
    assert target["facts"]["kv_cache_tokens"]["value"] == 46592
