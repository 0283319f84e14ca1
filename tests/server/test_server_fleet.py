"""The router in front of simulated vLLM replicas: stickiness, placement, overflow, failures."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.server.app import RunningRouter

MODEL = "qwen3-4b"


def conversation(tag: str, turns: int) -> list[list[dict[str, str]]]:
    """The message lists of ``turns`` successive turns of one conversation (~2k tokens and up)."""
    messages = [{"role": "system", "content": f"You are assistant {tag}. " + "Be precise and brief. " * 300}]
    out = []
    for turn in range(turns):
        messages = [*messages, {"role": "user", "content": f"[{tag}] question {turn}: " + "why? " * 120}]
        out.append(messages)
        messages = [*messages, {"role": "assistant", "content": f"answer {turn} " * 30}]
    return out


async def ask(http: aiohttp.ClientSession, r: RunningRouter, messages: list[dict[str, str]],
              headers: dict[str, str] | None = None, **extra: Any) -> tuple[str, dict[str, Any]]:
    """Send one chat request; the worker that served it and the JSON answer."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}
    async with http.post(r.url + "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-kvroute-worker"], await resp.json()


async def open_stream(http: aiohttp.ClientSession, r: RunningRouter, messages: list[dict[str, str]],
                      headers: dict[str, str] | None = None) -> tuple[aiohttp.ClientResponse, str]:
    """Start a long stream and wait for its first bytes: it is then in flight on its worker."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 20000, "ignore_eos": True, "stream": True}
    resp = await http.post(r.url + "/v1/chat/completions", json=body, headers=headers or {})
    assert resp.status == 200
    await resp.content.readany()
    return resp, resp.headers["x-kvroute-worker"]


def last_kinds(r: RunningRouter, n: int) -> list[str]:
    """Decision kinds of the last ``n`` finished requests."""
    return [rec.kind for rec in list(r.router.activity.requests)[-n:]]


def sent_by_kind(r: RunningRouter) -> dict[str, int]:
    """Requests sent so far (finished or not) by decision kind, over every worker."""
    out: dict[str, int] = {}
    for record in r.registry.records():
        for kind, n in record.requests.items():
            out[kind] = out.get(kind, 0) + n
    return out


async def retries(http: aiohttp.ClientSession, r: RunningRouter) -> float:
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvroute_retries_total")


async def test_a_five_turn_conversation_stays_on_one_worker(sim_fleet, router, http):
    fleet = await sim_fleet(3)
    r = await router(fleet.urls)
    for headers in ({}, {"x-session-id": "conv-b"}):
        tag = "b" if headers else "a"
        served = []
        for messages in conversation(tag, 5):
            worker, answer = await ask(http, r, messages, headers)
            served.append((worker, answer["usage"]["prompt_tokens_details"]["cached_tokens"]))
        assert len({w for w, _ in served}) == 1, served
        assert served[0][1] == 0 and all(cached > 1000 for _, cached in served[1:]), served
        assert all(kind in ("prefix_hit", "sticky") for kind in last_kinds(r, 4))


async def test_a_new_conversation_goes_to_the_least_loaded_worker(sim_fleet, router, http):
    fleet = await sim_fleet(3)
    r = await router(fleet.urls)
    streams = [await open_stream(http, r, conversation(f"load{i}", 1)[0]) for i in range(5)]
    try:
        load = {s.id: s.inflight for s in r.registry.states()}
        assert sorted(load.values()) == [1, 2, 2]  # placement so far spread the load
        worker, _ = await ask(http, r, conversation("fresh", 1)[0])
        assert load[worker] == min(load.values())
    finally:
        for resp, _ in streams:
            resp.close()


async def test_a_session_overflows_its_hot_worker_as_configured(sim_fleet, router, http):
    fleet = await sim_fleet(3)
    r = await router(fleet.urls, models={MODEL: {"policy": "session", "overflow": 2}})
    session = {"X-Claude-Code-Session-Id": "agent-7"}
    turns = conversation("s", 5)
    home, _ = await ask(http, r, turns[0], session)
    streams = []
    try:
        for i in range(3):  # in flight on home at decision time: 0, 1, 2 -> not over 2: stays
            resp, worker = await open_stream(http, r, turns[1 + i], session)
            streams.append(resp)
            assert worker == home
        assert sent_by_kind(r) == {"cold": 1, "sticky": 3}
        worker, _ = await ask(http, r, turns[4], session)  # 3 in flight > 2: overflow
        assert worker != home
        assert sent_by_kind(r) == {"cold": 1, "sticky": 3, "overflow": 1}
    finally:
        for resp in streams:
            resp.close()


async def test_requests_on_a_killed_worker_are_retried_elsewhere(sim_fleet, router, http):
    fleet = await sim_fleet(3)
    # The probe will not notice in time.  ``session`` keeps all three turns on the victim (``auto``
    # may send a concurrent turn of the same session to an idle worker instead).
    r = await router(fleet.urls, probe_interval_s=30.0, policy="session")
    session = {"x-session-id": "doomed"}
    turns = conversation("k", 5)
    home, _ = await ask(http, r, turns[0], session)
    victim = next(rep for rep in fleet.replicas if rep.url == r.registry.get(home).state.url)
    async with http.post(victim.url + "/admin/fault", json={"kind": "hang"}) as resp:
        assert resp.status == 200
    # Three requests accepted by the victim but not answered yet (no byte sent) when it dies...
    pending = [asyncio.create_task(ask(http, r, turns[1 + i], session)) for i in range(3)]
    for _ in range(100):
        if r.registry.get(home).state.inflight == 3:
            break
        await asyncio.sleep(0.02)
    assert r.registry.get(home).state.inflight == 3
    await victim.close()
    # ...and one sent after it died: all four are served by the survivors.
    results = await asyncio.gather(*pending, ask(http, r, turns[4], session))
    assert all(worker != home for worker, _ in results)
    assert await retries(http, r) >= 3
    assert not r.registry.get(home).state.ready  # the breaker took it out


async def test_a_restarted_worker_stops_matching_its_old_prefixes(sim_fleet, router, http):
    fleet = await sim_fleet(2)
    r = await router(fleet.urls, policy="prefix")
    turns = conversation("r", 3)
    home, _ = await ask(http, r, turns[0])
    worker, _ = await ask(http, r, turns[1])
    before = list(r.router.activity.requests)[-1]
    assert worker == home and before.kind == "prefix_hit" and before.matched_blocks > 0
    record = r.registry.get(home)
    epoch = record.state.epoch
    async with http.post(record.state.url + "/admin/fault", json={"kind": "restart"}) as resp:
        assert resp.status == 200
    for _ in range(100):
        if record.restarts:
            break
        await asyncio.sleep(0.02)
    assert record.restarts == 1 and record.state.epoch > epoch
    await ask(http, r, turns[2])
    after = list(r.router.activity.requests)[-1]
    assert after.matched_blocks == 0 and after.kind != "prefix_hit"


async def sim_running(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running")


async def test_a_client_that_disconnects_aborts_the_engine_request(sim_fleet, router, http):
    fleet = await sim_fleet(1)
    r = await router(fleet.urls)
    resp, _ = await open_stream(http, r, conversation("gone", 1)[0])
    assert await sim_running(http, fleet.urls[0]) == 1
    resp.close()
    for _ in range(100):
        if await sim_running(http, fleet.urls[0]) == 0:
            break
        await asyncio.sleep(0.02)
    assert await sim_running(http, fleet.urls[0]) == 0
    assert r.registry.states()[0].inflight == 0


async def test_a_drop_before_the_body_is_retried_and_a_drop_mid_stream_is_reported(sim_fleet, router, http):
    fleet = await sim_fleet(2)
    r = await router(fleet.urls, policy="round-robin")
    first = fleet.urls[0]
    assert r.registry.records()[0].state.url == first  # round-robin starts with it
    async with http.post(first + "/admin/fault", json={"kind": "drop", "count": 1}) as resp:
        assert resp.status == 200
    # Non-streamed: the sim drops the connection before the body; the other replica answers.
    worker, answer = await ask(http, r, conversation("d", 1)[0])
    assert r.registry.get(worker).state.url != first
    assert answer["choices"][0]["message"]["content"]
    assert await retries(http, r) == 1
    # Streamed: bytes went out already, so the client gets an error event instead of a retry.
    for url in fleet.urls:
        async with http.post(url + "/admin/fault", json={"kind": "drop", "count": 1}) as resp:
            assert resp.status == 200
    body = {"model": MODEL, "messages": conversation("e", 1)[0], "max_tokens": 50, "stream": True}
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert raw.endswith(b"\n\n") and raw.rsplit(b"\n\n", 2)[-2].startswith(b'data: {"error"')
    assert await retries(http, r) == 1
