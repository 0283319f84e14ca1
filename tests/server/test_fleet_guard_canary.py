"""The fleet guard's canary on a schedule, end to end: simulated replicas over real HTTP behind a
real router; a replica that corrupts answers is held out within the rounds the bound predicts, its
sessions move at their next turn, and it comes back once it answers right again.  Canary traffic
stays out of every user-facing figure, and its budget holds under load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.guard.canary_watch import CanarySettings, drain_threshold, release_rounds, rounds_to_drain
from kvroute.router_settings import Settings, parse_worker_spec
from kvroute.server.app import RunningRouter, start_router
from kvroute.server.dashboard import setup_dashboard
from kvroute.sim.server import start_sim_fleet

MODEL = "qwen3-4b"
# Fast rounds, a short window, a quick release: the same logic as the defaults, on a test's clock.
FAST = {"canary_interval_s": 0.05, "canary_budget": 1.0, "canary_prefix_tokens": 512, "canary_window": 50,
        "canary_release_rate": 0.1}
CERTAINTY = 1 - 1e-6


async def wait_for(what: Callable[[], bool], timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.01)


async def chat(http: aiohttp.ClientSession, r: RunningRouter, session: str, turns: int) -> str:
    """One turn of a conversation (``turns`` user messages so far); the worker that served it."""
    messages: list[dict[str, str]] = []
    for t in range(turns):
        text = f"conversation {session}, turn {t}: " + "tell me more. " * 60
        messages.append({"role": "user", "content": text})
        messages.append({"role": "assistant", "content": "more."})
    body = {"model": MODEL, "messages": messages[:-1], "max_tokens": 4}
    headers = {"x-session-id": session}
    async with http.post(r.url + "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-kvroute-worker"]


async def metrics(http: aiohttp.ClientSession, r: RunningRouter) -> dict[tuple[str, tuple[Any, ...]], float]:
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def admin_workers(http: aiohttp.ClientSession, r: RunningRouter) -> dict[str, dict[str, Any]]:
    async with http.get(r.url + "/admin/workers", headers={"x-admin-token": "secret"}) as resp:
        assert resp.status == 200
        return {w["id"]: w for w in (await resp.json())["workers"]}


def settings_of(r: RunningRouter) -> CanarySettings:
    return r.scheduler.settings_for(MODEL).block(CanarySettings)


async def test_a_corrupting_replica_is_drained_its_sessions_move_and_it_comes_back(
        sim_fleet: Callable[..., Awaitable[Any]], router: Callable[..., Awaitable[RunningRouter]],
        http: aiohttp.ClientSession) -> None:
    fleet = await sim_fleet(4, answer_mode=True)
    r = await router(fleet.urls, routing=FAST)
    watch = r.router.canary.watch  # type: ignore[union-attr]
    s = settings_of(r)
    ids = [rec.id for rec in r.registry.records()]
    placed = {f"s{i}": await chat(http, r, f"s{i}", 1) for i in range(12)}
    bad = max(ids, key=lambda wid: list(placed.values()).count(wid))
    moved = [sid for sid, wid in placed.items() if wid == bad]
    assert moved
    # Healthy answers everywhere: everyone is asked, nobody is held.
    await wait_for(lambda: all((rec := watch.replica(w)) is not None and rec.questions >= 5 for w in ids), 20,
                   "the canary did not ask every replica")
    assert not any(watch.replica(w).held for w in ids)  # type: ignore[union-attr]

    bad_url = r.registry.get(bad).state.url  # type: ignore[union-attr]
    before = watch.replica(bad)
    assert before is not None
    onset = before.questions
    async with http.post(bad_url + "/admin/fault", json={"kind": "corrupt", "rate": 0.5}) as resp:
        assert resp.status == 200
    predicted = rounds_to_drain(0.5, s, CERTAINTY)
    assert predicted is not None
    await wait_for(lambda: bool(r.registry.get(bad).state.guard_holds), 30,  # type: ignore[union-attr]
                   "the corrupting replica was not held")
    record = watch.replica(bad)
    assert record is not None and record.held_after is not None
    # A round or two may have been under way when the fault was set: counted from the onset.
    assert record.held_after - onset <= predicted + 1, (record.held_after - onset, predicted)
    assert r.registry.get(bad).state.guard_holds == frozenset({"canary"})  # type: ignore[union-attr]
    assert not any(watch.replica(w).held for w in ids if w != bad)  # type: ignore[union-attr]

    # Its sessions move at their next turn; it gets no new ones.
    for sid in moved:
        assert await chat(http, r, sid, 2) != bad
    assert bad not in {await chat(http, r, f"new{i}", 1) for i in range(8)}
    listed = await admin_workers(http, r)
    assert listed[bad]["guard_holds"] == ["canary"] and listed[bad]["canary"]["held"] is True
    assert listed[ids[0] if ids[0] != bad else ids[1]]["canary"]["held"] is False
    m = await metrics(http, r)
    assert m[("kvroute_canary_holds_total", (("worker", bad),))] == 1
    assert m[("kvroute_canary_held", (("worker", bad),))] == 1
    assert m[("kvroute_canary_wrong_total", (("worker", bad),))] > drain_threshold(s.canary_window, s)

    # Held, it keeps being asked; once the fault is gone a clean run brings it back.
    async with http.delete(bad_url + "/admin/fault") as resp:
        assert resp.status == 200
    await wait_for(lambda: not r.registry.get(bad).state.guard_holds,  # type: ignore[union-attr]
                   30 + release_rounds(s) * s.canary_interval_s * 4, "the repaired replica did not come back")
    record = watch.replica(bad)
    assert record is not None and not record.held and record.questions > record.held_after  # type: ignore[operator]
    m = await metrics(http, r)
    assert m[("kvroute_canary_held", (("worker", bad),))] == 0


async def test_a_replica_started_with_corrupt_rate_is_held_and_returns_after_a_restart_without_it(
        sim_fleet: Callable[..., Awaitable[Any]], router: Callable[..., Awaitable[RunningRouter]]) -> None:
    healthy = await sim_fleet(2, answer_mode=True)
    sick = await start_sim_fleet("a4000-qwen3-4b", 1, speed=20.0, answer_mode=True, corrupt_rate=1.0)
    port = int(sick.urls[0].rsplit(":", 1)[1])
    restarted = None
    try:
        r = await router([*healthy.urls, sick.urls[0]], routing=FAST)
        watch = r.router.canary.watch  # type: ignore[union-attr]
        s = settings_of(r)
        bad = r.registry.records()[2].id
        await wait_for(lambda: bool(r.registry.get(bad).state.guard_holds), 20,  # type: ignore[union-attr]
                       "the replica started with --corrupt-rate 1 was not held")
        record = watch.replica(bad)
        # Every answer corrupt from the first round: drained at exactly the round the bound says.
        assert record is not None and record.held_after == rounds_to_drain(1.0, s, CERTAINTY)
        await sick.close()
        restarted = await start_sim_fleet("a4000-qwen3-4b", 1, base_port=port, speed=20.0, answer_mode=True)
        await wait_for(lambda: not r.registry.get(bad).state.guard_holds,  # type: ignore[union-attr]
                       30 + release_rounds(s) * s.canary_interval_s * 4,
                       "the restarted replica did not come back")
        assert r.registry.get(bad).restarts >= 1  # type: ignore[union-attr]
    finally:
        await sick.close()
        if restarted is not None:
            await restarted.close()


async def test_a_replica_that_answers_what_is_not_a_chat_completion_is_held_not_left_unjudged(
        sim_fleet: Callable[..., Awaitable[Any]], router: Callable[..., Awaitable[RunningRouter]],
        http: aiohttp.ClientSession) -> None:
    fleet = await sim_fleet(3, answer_mode=True)
    async with http.post(fleet.urls[2] + "/admin/fault", json={"kind": "wrong_shape"}) as resp:
        assert resp.status == 200
    r = await router(fleet.urls, routing=FAST)
    watch = r.router.canary.watch  # type: ignore[union-attr]
    bad = r.registry.records()[2].id
    await wait_for(lambda: bool(r.registry.get(bad).state.guard_holds), 20,  # type: ignore[union-attr]
                   "the replica answering no chat completion was not held")
    record = watch.replica(bad)
    # "not a chat completion" is a wrong answer from the first round, never an unjudged one.
    assert record is not None and record.unjudged == 0 and record.last_verdict == "malformed"
    assert record.held_after == rounds_to_drain(1.0, settings_of(r), CERTAINTY)


async def test_canary_traffic_stays_out_of_user_figures(
        sim_fleet: Callable[..., Awaitable[Any]], http: aiohttp.ClientSession) -> None:
    fleet = await sim_fleet(2, answer_mode=True)
    settings = Settings(workers=tuple(parse_worker_spec(u) for u in fleet.urls), probe_interval_s=0.1,
                        routing=FAST)
    r = await start_router(settings, setup=(setup_dashboard,))
    try:
        await _canary_stays_out(fleet.urls, r, http)
    finally:
        await r.close()


async def _canary_stays_out(urls: list[str], r: RunningRouter, http: aiohttp.ClientSession) -> None:
    watch = r.router.canary.watch  # type: ignore[union-attr]
    ids = [rec.id for rec in r.registry.records()]
    await wait_for(lambda: all((rec := watch.replica(w)) is not None and rec.questions >= 10 for w in ids),
                   20, "the canary did not run")
    # The replicas did serve it (so what follows is not vacuous) ...
    for url in urls:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
        engine = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert engine["vllm:prompt_tokens_total"] >= 10 * 512
    # ... and the router's user-facing figures never saw it.
    stats = r.scheduler.stats()
    assert stats["index_blocks"] == 0 and stats["sessions"] == 0
    assert all("learned_s_per_token" not in w for w in stats["workers"].values())
    assert all(not rec.requests for rec in r.registry.records())
    m = await metrics(http, r)
    assert not any(name == "kvroute_requests_total" for name, _ in m)
    assert m[("kvroute_ttfb_seconds_count", ())] == 0
    assert all(m[("kvroute_canary_questions_total", (("worker", w),))] >= 10 for w in ids)
    async with http.get(r.url + "/dashboard/data.json") as resp:
        snapshot = await resp.json()
    replicas = snapshot["models"][0]["replicas"]
    assert all(rep["requests_total"] == 0 for rep in replicas)
    assert snapshot["models"][0]["totals"]["requests_total"] == 0
    assert snapshot["decisions"] == []
    assert all(rep["canary"]["questions"] >= 10 and rep["canary"]["held"] is False for rep in replicas)


async def test_the_budget_holds_under_load(
        sim_fleet: Callable[..., Awaitable[Any]], router: Callable[..., Awaitable[RunningRouter]],
        http: aiohttp.ClientSession) -> None:
    fleet = await sim_fleet(2, answer_mode=True)
    # Rounds every 20 ms would cost far more than 5 % of the fleet: the budget, not the interval, binds.
    r = await router(fleet.urls, routing={**FAST, "canary_interval_s": 0.02, "canary_budget": 0.05,
                                          "canary_prefix_tokens": 256})
    watch = r.router.canary.watch  # type: ignore[union-attr]
    sent = 0

    async def user(i: int) -> None:
        nonlocal sent
        for turn in range(1, 6):
            await chat(http, r, f"load{i}", turn)
            sent += 1

    await asyncio.gather(*(user(i) for i in range(6)))
    await wait_for(lambda: bool(watch.budgets()) and watch.budgets()[MODEL]["spent_tokens"] > 0, 20,
                   "no canary round went out")
    await asyncio.sleep(1.0)
    budget = watch.budgets()[MODEL]
    # Spent (as the replicas' usage reports it) never runs ahead of what the budget granted.
    assert budget["spent_tokens"] <= budget["allowed_tokens"], budget
    assert budget["skipped_rounds"] > 0
    # Under load, the user figures count exactly the user's requests.
    m = await metrics(http, r)
    assert sum(v for (name, _), v in m.items() if name == "kvroute_requests_total") == sent == 30
    assert sum(rec.requests.total() for rec in r.registry.records()) == sent
