"""Sick replicas behind the router: first-byte deadline, circuit breaker, outlier ejection, a killed
replica under load.  Simulated replicas over real HTTP, faults set the way an operator would."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.router_settings import Settings, SettingsError
from kvroute.routing.key import RoutingKey
from kvroute.server.app import RunningRouter
from kvroute.server.proxy import first_byte_deadline

MODEL = "qwen3-4b"
FLOOR_S = 0.5


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"question {i}: " + "why is the sky blue? " * 40}]


async def chat(http: aiohttp.ClientSession, r: RunningRouter, i: int, *, stream: bool,
               max_tokens: int = 8) -> tuple[int, str, bytes, float]:
    """One chat request: status, worker, body and seconds it took."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages(i), "max_tokens": max_tokens,
                            "stream": stream}
    t0 = time.perf_counter()
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        data = await resp.read()
        return resp.status, resp.headers.get("x-kvroute-worker", ""), data, time.perf_counter() - t0


async def metrics(http: aiohttp.ClientSession, r: RunningRouter) -> dict[tuple[str, tuple[Any, ...]], float]:
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def set_fault(http: aiohttp.ClientSession, url: str, **fault: Any) -> None:
    async with http.post(url + "/admin/fault", json=fault) as resp:
        assert resp.status == 200, await resp.text()


def test_first_byte_deadline_scales_the_prediction_within_floor_and_ceiling():
    s = Settings(first_byte_factor=4.0, first_byte_floor_s=2.0, first_byte_ceiling_s=60.0,
                 first_byte_decode_s_per_token=0.05)
    stream = RoutingKey(model="m", prefix=b"", stream=True, max_tokens=100)
    assert first_byte_deadline(s, 0.1, stream) == 2.0  # floor
    assert first_byte_deadline(s, 3.0, stream) == 12.0
    assert first_byte_deadline(s, 100.0, stream) == 60.0  # ceiling
    plain = RoutingKey(model="m", prefix=b"", stream=False, max_tokens=100)
    assert first_byte_deadline(s, 3.0, plain) == pytest.approx(12.0 + 5.0)  # its first byte is its last
    assert first_byte_deadline(s, 3.0, RoutingKey(model="m", prefix=b"")) is None  # length unknown
    assert first_byte_deadline(s.replace(first_byte_factor=0.0), 3.0, stream) is None  # off


@pytest.mark.parametrize(("raw", "message"), [
    ({"first_byte_factor": -1}, "first_byte_factor and first_byte_decode_s_per_token must not be negative"),
    ({"first_byte_floor_s": 0}, "first_byte_floor_s must be positive and at most first_byte_ceiling_s"),
    ({"first_byte_floor_s": 20, "first_byte_ceiling_s": 10}, "first_byte_floor_s must be positive"),
    ({"breaker_failures": 0}, "breaker_failures must be at least 1"),
    ({"breaker_cooldown_s": 500}, "breaker_cooldown_s must be positive and at most breaker_max_cooldown_s"),
    ({"outlier_max_ejected_fraction": 2}, "outlier_max_ejected_fraction must be between 0 and 1"),
    ({"outlier_min_samples": 0}, "outlier_min_samples >= 1"),
])
def test_bad_sick_replica_settings_are_named(raw, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        Settings.from_dict(raw)


async def test_a_hung_replica_is_retried_past_and_its_breaker_opens_within_three_failures(
        sim_fleet, router, http):
    fleet = await sim_fleet(3)
    r = await router(fleet.urls, policy="round-robin", first_byte_floor_s=FLOOR_S, breaker_cooldown_s=60.0)
    victim = fleet.replicas[1]
    hung = next(rec.id for rec in r.registry.records() if rec.state.url == victim.url)
    await set_fault(http, victim.url, kind="hang")
    results = [await chat(http, r, i, stream=i % 2 == 0) for i in range(15)]
    for status, worker, _, took in results:
        assert status == 200 and worker != hung
        # The deadline (0.5 s, 0.9 s for a plain answer of 8 tokens) plus one retry; generous.
        assert took < 10.0
    assert all(b"[DONE]" in body for _, _, body, _ in results[::2])
    record = r.registry.get(hung)
    assert record.breaker.state.value == "open" and not record.state.ready and record.state.healthy
    m = await metrics(http, r)
    # Exactly three attempts failed there: the breaker opened on the third and nothing went since.
    assert m[("kvroute_failures_total", (("reason", "first_byte_timeout"),))] == 3
    assert m[("kvroute_retries_total", (("reason", "first_byte_timeout"),))] == 3
    assert m[("kvroute_breaker_state", (("worker", hung),))] == 2
    assert m[("kvroute_ejections_total", (("reason", "failures"), ("worker", hung)))] == 1
    assert record.state.inflight == 0  # abandoned attempts were accounted for
    async with http.get(r.url + "/admin/workers", headers={"authorization": "Bearer secret"}) as resp:
        doc = {w["id"]: w for w in (await resp.json())["workers"]}
    assert doc[hung]["ejected"] and doc[hung]["breaker"]["state"] == "open"
    assert doc[hung]["breaker"]["reason"].startswith("failures: first_byte_timeout")


async def test_the_last_chance_is_not_cut_at_the_deadline(sim_fleet, router, http):
    """A slow but healthy replica that is the only one left: its first byte comes after the
    first-byte deadline, and the request is served (the deadline exists to move a request; with
    nowhere to move it, cutting it would only turn a slow answer into a 502).  With somewhere
    else to go, the same slow first byte is cut and retried there."""
    fleet = await sim_fleet(1, speed=20.0)
    r = await router(fleet.urls, first_byte_factor=0.01, first_byte_floor_s=0.05,
                     first_byte_ceiling_s=30.0, routing={"canary": False})
    await set_fault(http, fleet.urls[0], kind="slow", factor=100.0)
    status, _, body, took = await chat(http, r, 0, stream=True)
    assert status == 200 and b"[DONE]" in body and took > 0.05
    m = await metrics(http, r)
    assert m.get(("kvroute_failures_total", (("reason", "first_byte_timeout"),)), 0.0) == 0.0

    two = await sim_fleet(2, speed=20.0)
    r2 = await router(two.urls, policy="round-robin", first_byte_factor=0.01, first_byte_floor_s=0.05,
                      first_byte_ceiling_s=30.0, routing={"canary": False})
    slow = next(rec.id for rec in r2.registry.records() if rec.state.url == two.urls[0])
    await set_fault(http, two.urls[0], kind="slow", factor=100.0)
    results = [await chat(http, r2, i, stream=True) for i in range(2)]  # round robin: one lands there
    assert all(status == 200 for status, *_ in results)
    assert all(worker != slow for _, worker, _, _ in results)
    m = await metrics(http, r2)
    assert m[("kvroute_failures_total", (("reason", "first_byte_timeout"),))] >= 1  # cut, moved


async def test_a_hung_last_chance_fails_at_the_ceiling(sim_fleet, router, http):
    fleet = await sim_fleet(1)
    r = await router(fleet.urls, first_byte_floor_s=0.2, first_byte_ceiling_s=1.0, routing={"canary": False})
    await set_fault(http, fleet.urls[0], kind="hang")
    status, _, body, took = await chat(http, r, 0, stream=True)
    assert status == 502 and b"first_byte_timeout" in body
    assert 1.0 <= took < 10.0  # the ceiling, not the 0.2 s floor
    assert r.registry.states()[0].inflight == 0


async def test_an_open_breaker_lets_one_trial_through_after_its_cool_down(sim_fleet, router, http):
    fleet = await sim_fleet(3)
    r = await router(fleet.urls, policy="round-robin", first_byte_floor_s=FLOOR_S, breaker_cooldown_s=1.0)
    victim = fleet.replicas[0]
    wid = next(rec.id for rec in r.registry.records() if rec.state.url == victim.url)
    await set_fault(http, victim.url, kind="hang", count=3)  # hangs three requests, then recovers
    for i in range(9):
        status, worker, _, _ = await chat(http, r, i, stream=True)
        assert status == 200 and worker != wid
    breaker = r.registry.get(wid).breaker
    assert breaker.state.value == "open"
    for _ in range(100):  # the probe (every 0.1 s) moves it to half-open once the cool-down is over
        if breaker.state.value == "half_open":
            break
        await asyncio.sleep(0.05)
    served = {(await chat(http, r, 100 + i, stream=True))[1] for i in range(6)}
    assert wid in served  # the trial succeeded and closed it
    assert breaker.state.value == "closed"
    assert dict(breaker.transitions) == {"open": 1, "half_open": 1, "closed": 1}


async def test_a_killed_replica_under_twenty_concurrent_requests_fails_none_that_had_not_started(
        sim_fleet, router, http):
    fleet = await sim_fleet(3, speed=5.0)
    # The canary off: its questions count in the victim's in-flight figure, which this test reads
    # as the user requests waiting there.
    r = await router(fleet.urls, first_byte_floor_s=30.0, routing={"canary": False})
    victim = fleet.replicas[2]
    wid = next(rec.id for rec in r.registry.records() if rec.state.url == victim.url)
    # The victim's requests never start: they are all waiting for a first byte when it dies (the
    # other replicas' streams are under way meanwhile).
    await set_fault(http, victim.url, kind="hang")
    body = {"model": MODEL, "max_tokens": 64, "stream": True}

    async def one(i: int) -> tuple[bool, bool]:
        """(whether it completed, whether the client had received bytes)."""
        got = False
        try:
            async with http.post(r.url + "/v1/chat/completions",
                                 json={**body, "messages": messages(1000 + i)}) as resp:
                if resp.status != 200:
                    return False, False
                async for chunk in resp.content.iter_any():
                    got = got or bool(chunk)
                    if b"event: error" in chunk or b'"error"' in chunk:
                        return False, got
                return True, got
        except aiohttp.ClientError:
            return False, got

    tasks = [asyncio.create_task(one(i)) for i in range(20)]
    for _ in range(200):
        if r.registry.get(wid).state.inflight >= 4:
            break
        await asyncio.sleep(0.01)
    assert r.registry.get(wid).state.inflight >= 4
    await victim.close()
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    not_started_failed = sum(1 for ok, got in results if not ok and not got)
    assert not_started_failed == 0
    m = await metrics(http, r)
    # Retried elsewhere: as "disconnect" when the dying engine closed their connections (every
    # local run); once in CI, on a loaded machine, under another reason that run did not print.
    retries = {labels: v for (name, labels), v in m.items() if name == "kvroute_retries_total"}
    assert sum(retries.values()) >= 4, retries
    assert sum(ok for ok, _ in results) == 20


async def _one_slow_replica(sim_fleet, router, http):
    """A router over three simulated replicas, the first 50x slower: the router and its id."""
    fleet = await sim_fleet(3)
    r = await router(fleet.urls, policy="round-robin", outlier_min_samples=5, outlier_min_excess_s=0.02,
                     breaker_cooldown_s=60.0)
    victim = fleet.replicas[0]
    wid = next(rec.id for rec in r.registry.records() if rec.state.url == victim.url)
    await set_fault(http, victim.url, kind="slow", factor=50.0)
    return r, wid


async def test_a_slow_replica_is_ejected_as_a_latency_outlier(sim_fleet, router, http):
    r, wid = await _one_slow_replica(sim_fleet, router, http)
    for i in range(60):
        status, _, _, _ = await chat(http, r, i, stream=True)
        assert status == 200
        if r.registry.get(wid).state.ejected:
            break
    record = r.registry.get(wid)
    assert record.state.ejected and record.breaker.reason.startswith("latency")
    m = await metrics(http, r)
    assert m[("kvroute_ejections_total", (("reason", "latency"), ("worker", wid)))] == 1
    served = {(await chat(http, r, 200 + i, stream=True))[1] for i in range(6)}
    assert wid not in served and len(served) == 2


async def test_a_slow_replica_is_not_ejected_for_latency_while_the_fleet_is_saturated(sim_fleet, router, http,
                                                                                        monkeypatch):
    # Saturated, every replica queues and the slowest holds the hottest prefixes: the same slow
    # replica as above stays (the reading itself is tested in tests/routing/test_saturation.py).
    r, wid = await _one_slow_replica(sim_fleet, router, http)
    monkeypatch.setattr(r.router.dispatch, "saturated", lambda model: True)
    for i in range(30):
        status, _, _, _ = await chat(http, r, i, stream=True)
        assert status == 200
    assert not r.registry.get(wid).state.ejected and r.registry.get(wid).breaker.samples == 0


async def test_a_stream_whose_head_came_but_no_event_is_still_retried(echo_engines, router, http):
    ok, stalled = await echo_engines(2)
    stalled.mode = "stall"
    r = await router([ok.url, stalled.url], policy="round-robin", first_byte_floor_s=FLOOR_S)
    for i in range(4):
        body = {"model": "echo", "messages": messages(i), "stream": True}
        async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
            # The stalled engine's head never reached the client: the answer is the other one's.
            assert resp.status == 200 and resp.headers["x-engine"] == "echo"
            assert resp.headers["x-kvroute-worker"] == r.registry.records()[0].id
            assert b"[DONE]" in await resp.read()
    m = await metrics(http, r)
    assert m[("kvroute_failures_total", (("reason", "first_byte_timeout"),))] >= 1
