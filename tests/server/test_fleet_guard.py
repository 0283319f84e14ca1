"""The fleet guard in a running router: the doctor's checks at registration and at a restart with
other flags (same port), what they show (/admin/workers, /metrics), what ``exclude`` does with
them, and the cache-drift alarm under shared-prefix traffic.  Simulated replicas are real HTTP
servers on loopback; a "restart with other flags" closes one and starts another on its port
(``SimFleet.restart_with``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.server.app import RunningRouter
from kvroute.sim.server import SimFleet, start_sim_fleet

ADMIN = {"x-admin-token": "secret"}
SPEED = 20.0
# Dense replicas with prefix caching on; a hybrid one needs both flags for its cache to hit.
DENSE = ("a4000-qwen3-4b", "qwen3-4b", {})
HYBRID = ("hybrid-27b", "qwen3.8-27b", {"enable_prefix_caching": True, "mamba_cache_mode": "align"})


@pytest.fixture
async def replicas() -> AsyncIterator[Callable[..., Awaitable[SimFleet]]]:
    """``await replicas(preset, n, **flags)``: closed at the end."""
    fleets: list[SimFleet] = []

    async def start(preset: str, n: int = 1, **flags: Any) -> SimFleet:
        fleet = await start_sim_fleet(preset, n, speed=SPEED, **flags)
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in fleets:
        await fleet.close()


async def workers(http: aiohttp.ClientSession, r: RunningRouter) -> dict[str, dict[str, Any]]:
    async with http.get(r.url + "/admin/workers", headers=ADMIN) as resp:
        assert resp.status == 200
        return {w["id"]: w for w in (await resp.json())["workers"]}


async def metric_samples(http: aiohttp.ClientSession, r: RunningRouter,
                         name: str) -> dict[tuple[str, ...], float]:
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    return {tuple(sorted(s.labels.items())): s.value  # type: ignore[misc]
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


async def checked_at_epoch(r: RunningRouter, worker_id: str, restarts: int) -> dict[str, Any]:
    """Wait until the worker's restart was seen and the doctor checked its new epoch."""
    record = r.registry.get(worker_id)
    assert record is not None
    watch = r.router.doctor_watch
    assert watch is not None
    for _ in range(300):
        check = watch.to_json(worker_id)
        if record.restarts >= restarts and check is not None and check["epoch"] == record.state.epoch:
            return check
        await asyncio.sleep(0.02)
    raise AssertionError(f"no doctor check at the new epoch of {worker_id}: {watch.to_json(worker_id)}")


def codes(check: dict[str, Any]) -> dict[str, str]:
    return {f["code"]: f["severity"] for f in check["findings"]}


async def ask(http: aiohttp.ClientSession, r: RunningRouter, model: str,
              messages: list[dict[str, str]]) -> str:
    body = {"model": model, "messages": messages, "max_tokens": 4}
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-kvroute-worker"]


def shared_prefix(i: int) -> list[dict[str, str]]:
    """Requests that share a ~2k-token system prompt and differ after it."""
    return [{"role": "system", "content": "You are the support desk. " + "Answer from the manual. " * 350},
            {"role": "user", "content": f"Ticket {i}: the printer on floor {i % 7} says error {1000 + i}."}]


@pytest.mark.parametrize(("preset", "model", "healthy", "broken", "code"), [
    (*DENSE, {"enable_prefix_caching": False}, "prefix-caching-off"),
    (*HYBRID, {"enable_prefix_caching": True, "mamba_cache_mode": "none"}, "mamba-mode-none"),
], ids=["dense-caching-off", "hybrid-without-align"])
async def test_a_restart_with_other_flags_gets_a_finding_at_its_new_epoch(
        replicas, router, http, preset: str, model: str, healthy: dict[str, Any], broken: dict[str, Any],
        code: str) -> None:
    fleet = await replicas(preset, 3, **healthy)
    r = await router(fleet.urls)
    assert r.router.doctor_watch is not None
    await r.router.doctor_watch.settled()
    listed = await workers(http, r)
    for w in listed.values():  # checked at registration, and clean
        assert w["doctor"]["worst"] != "error", w["doctor"]
        assert codes(w["doctor"])["prefix-caching-on"] == "ok"
    target = r.registry.records()[0].id
    epoch = listed[target]["epoch"]

    await fleet.restart_with(0, **broken)
    check = await checked_at_epoch(r, target, 1)
    assert check["epoch"] > epoch and codes(check)[code] == "error"
    listed = await workers(http, r)
    assert codes(listed[target]["doctor"])[code] == "error"
    assert all(code not in codes(w["doctor"]) for wid, w in listed.items() if wid != target)
    findings = await metric_samples(http, r, "kvroute_worker_finding")
    assert findings[(("code", code), ("severity", "error"), ("worker", target))] == 1.0
    assert not [k for k in findings if dict(k)["worker"] != target and dict(k)["severity"] == "error"]
    # warn (the default) keeps it in rotation
    assert r.registry.get(target).state.ready  # type: ignore[union-attr]
    assert listed[target]["guard_holds"] == []


async def test_exclude_takes_the_replica_out_until_a_clean_restart(replicas, router, http) -> None:
    fleet = await replicas("a4000-qwen3-4b", 3)
    r = await router(fleet.urls, policy="round-robin", routing={"guard_doctor_action": "exclude"})
    target = r.registry.records()[0].id
    await fleet.restart_with(0, enable_prefix_caching=False)
    check = await checked_at_epoch(r, target, 1)
    assert check["held"] and codes(check)["prefix-caching-off"] == "error"
    state = r.registry.get(target).state  # type: ignore[union-attr]
    assert state.guard_holds == {"doctor"} and not state.ready
    assert (await workers(http, r))[target]["guard_holds"] == ["doctor"]
    served = {await ask(http, r, "qwen3-4b", shared_prefix(i)) for i in range(9)}
    assert target not in served and len(served) == 2

    await fleet.restart_with(0, enable_prefix_caching=True)
    check = await checked_at_epoch(r, target, 2)
    assert not check["held"] and "prefix-caching-off" not in codes(check)
    assert state.guard_holds == frozenset() and state.ready
    served = {await ask(http, r, "qwen3-4b", shared_prefix(i)) for i in range(9)}
    assert target in served
    findings = await metric_samples(http, r, "kvroute_worker_finding")
    assert not [k for k in findings if dict(k)["code"] == "prefix-caching-off"]


@pytest.mark.parametrize("policy", ["round-robin", "auto"])
async def test_the_drift_alarm_fires_on_the_replica_that_lost_its_cache_and_only_there(
        replicas, router, http, policy: str) -> None:
    fleet = await replicas("a4000-qwen3-4b", 3)
    r = await router(fleet.urls, policy=policy,
                     routing={"guard_drift_for_s": 0.3, "guard_drift_min_tokens": 8000})
    target = r.registry.records()[0].id
    await fleet.restart_with(0, enable_prefix_caching=False)
    await checked_at_epoch(r, target, 1)
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> str:
        async with sem:
            return await ask(http, r, "qwen3-4b", shared_prefix(i))

    served = await asyncio.gather(*(one(i) for i in range(90)))
    # The broken replica had a share (auto discounts its cached prefixes, but spreads the load).
    assert served.count(target) >= 10
    drift: dict[tuple[str, ...], float] = {}
    for _ in range(200):
        drift = await metric_samples(http, r, "kvroute_worker_cache_drift")
        if drift.get((("worker", target),)) == 1.0:
            break
        await asyncio.sleep(0.02)
    assert drift[(("worker", target),)] == 1.0, drift
    others = [wid for wid in (rec.id for rec in r.registry.records()) if wid != target]
    assert all(drift[(("worker", wid),)] == 0.0 for wid in others), drift
    listed = await workers(http, r)
    alarm = listed[target]["cache_drift"]
    assert alarm["alarm"] and alarm["realisation"] < 0.3 and alarm["low_predicted_tokens"] >= 8000
    for wid in others:
        assert not listed[wid]["cache_drift"]["alarm"] and listed[wid]["cache_drift"]["realisation"] > 0.6
    # the doctor's findings stand beside it
    assert codes(listed[target]["doctor"])["prefix-caching-off"] == "error"
    # healthy again at a new epoch: the alarm clears with it
    await fleet.restart_with(0, enable_prefix_caching=True)
    await checked_at_epoch(r, target, 2)
    for _ in range(200):
        drift = await metric_samples(http, r, "kvroute_worker_cache_drift")
        if drift.get((("worker", target),)) == 0.0:
            break
        await asyncio.sleep(0.02)
    assert drift[(("worker", target),)] == 0.0


async def test_each_part_turns_off_and_a_bad_action_is_refused(replicas, router, http) -> None:
    from kvroute.router_settings import Settings, SettingsError

    with pytest.raises(SettingsError, match="guard_doctor_action"):
        Settings.from_dict({"routing": {"guard_doctor_action": "drain"}}).routing_config()
    fleet = await replicas("a4000-qwen3-4b", 3)
    r = await router(fleet.urls, policy="round-robin",
                     routing={"guard_doctor": False, "guard_drift": False, "guard_doctor_action": "exclude",
                              "guard_drift_for_s": 0.3, "guard_drift_min_tokens": 8000})
    target = r.registry.records()[0].id
    await fleet.restart_with(0, enable_prefix_caching=False)
    for _ in range(200):
        if r.registry.get(target).restarts:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.02)
    served = [await ask(http, r, "qwen3-4b", shared_prefix(i)) for i in range(36)]
    assert served.count(target) == 12  # never held out
    await asyncio.sleep(0.5)  # ticks of the drift watch
    listed = await workers(http, r)
    assert all(w["doctor"] is None for w in listed.values())
    assert not listed[target]["cache_drift"]["alarm"] and listed[target]["cache_drift"]["realisation"] == 0.0
    assert not await metric_samples(http, r, "kvroute_worker_finding")
    assert set((await metric_samples(http, r, "kvroute_worker_cache_drift")).values()) == {0.0}


async def test_exclude_spares_the_only_replica_and_says_so_at_registration(replicas, router, http) -> None:
    fleet = await replicas("a4000-qwen3-4b", 1, enable_prefix_caching=False)
    r = await router(fleet.urls, routing={"guard_doctor_action": "exclude"})
    assert r.router.doctor_watch is not None
    await r.router.doctor_watch.settled()
    [worker] = (await workers(http, r)).values()
    assert codes(worker["doctor"])["prefix-caching-off"] == "error"
    assert worker["doctor"]["spared"] and not worker["doctor"]["held"] and worker["guard_holds"] == []
    await ask(http, r, "qwen3-4b", shared_prefix(0))  # still served


async def test_the_action_is_the_served_models_own_setting(replicas, router, http) -> None:
    healthy = await replicas("a4000-qwen3-4b", 1)
    broken = await replicas("a4000-qwen3-4b", 1, enable_prefix_caching=False)
    r = await router([*healthy.urls, *broken.urls], models={"qwen3-4b": {"guard_doctor_action": "exclude"}})
    assert r.router.doctor_watch is not None
    await r.router.doctor_watch.settled()
    listed = await workers(http, r)
    good, bad = (listed[rec.id] for rec in r.registry.records())
    assert bad["doctor"]["held"] and bad["guard_holds"] == ["doctor"]  # exclude, from [models.qwen3-4b]
    assert not good["doctor"]["held"] and good["guard_holds"] == []
    assert r.scheduler.settings_for("").guard_doctor_action == "warn"  # the default stays warn
