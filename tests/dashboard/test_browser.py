"""The dashboard in a real headless browser (Debian's chromium via Playwright): after real traffic
through the router to simulated replicas, the cards list the right replicas with the router's own
counts, and the charts drew.  Screenshots go to the test's folder and to test-output/."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from dashboard_browser import chromium_available, open_dashboard
from dashboard_setup import SIM_MODEL, TOKEN
from dashboard_traffic import run_sessions
from playwright.async_api import Page

from kvroute.fleet.registry import worker_id_for

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not chromium_available(), reason="needs Debian's chromium (/usr/bin/chromium)"),
]

TEST_OUTPUT = Path(__file__).resolve().parents[2] / "test-output"

# Pixels of a series' colour (see dashboard.css): the cached area is green, the p50 line blue.
_COLOUR_PIXELS = """([c, r, g, b]) => {
    const canvas = document.querySelector(c);
    const d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    let n = 0;
    for (let i = 0; i < d.length; i += 4)
        if (d[i + 3] > 100 && Math.abs(d[i] - r) < 40 && Math.abs(d[i + 1] - g) < 40
            && Math.abs(d[i + 2] - b) < 40) n++;
    return n;
}"""
CACHED_GREEN = (43, 182, 115)
P50_BLUE = (47, 111, 222)


async def colour_pixels(page: Page, selector: str, rgb: tuple[int, int, int]) -> int:
    return int(await page.evaluate(_COLOUR_PIXELS, [selector, *rgb]))


async def test_cards_and_charts_after_traffic(sim_fleet, dashboard_router, tmp_path: Path) -> None:
    fleet = await sim_fleet(3)
    router = await dashboard_router(fleet.urls)
    sent = await run_sessions(router.url, SIM_MODEL, sessions=6, turns=4)
    assert sent == 24
    await asyncio.sleep(0.5)  # two probe rounds: the engines' counters are scraped
    expected = {r.id: sum(r.requests.values()) for r in router.registry.records()}
    assert set(expected) == {worker_id_for(u) for u in fleet.urls}

    async def check(page: Page) -> None:
        rows = page.locator("section.model tbody tr")
        assert await rows.count() == 3
        shown = {}
        for i in range(3):
            row = rows.nth(i)
            wid = await row.get_attribute("data-replica")
            shown[wid] = int(await row.locator("[data-field=requests]").inner_text())
            assert "%" in await row.locator("[data-field=hits]").inner_text()
            assert await row.locator(".badge").inner_text() == "healthy"
        assert shown == expected
        assert sum(shown.values()) == sent
        assert sum(1 for n in shown.values() if n > 0) >= 2
        assert await page.locator("section.model h2").inner_text() == SIM_MODEL
        assert "from cache over the last" in await page.locator("section.model .share").inner_text()
        assert await page.locator("#empty").is_hidden()
        assert await page.locator("#live").get_attribute("data-state") == "live"
        assert await page.locator("#decisions tr").count() == sent
        # The charts drew data, not just their axes.
        assert int(await page.get_attribute("section.model canvas.tokens-chart", "data-points") or 0) > 0
        assert await colour_pixels(page, "section.model canvas.tokens-chart", CACHED_GREEN) > 200
        assert int(await page.get_attribute("#ttfb-chart", "data-points") or 0) > 0
        assert await colour_pixels(page, "#ttfb-chart", P50_BLUE) > 8  # a dot at least
        # Flow control is "auto" by default: the queue panel shows, and a fleet with room says so.
        assert await page.locator("section.model .flow-off").is_hidden()
        fleet_chip = page.locator('section.model .queue-figures .chip[data-field="saturation"]')
        assert "has room" in await fleet_chip.inner_text()

    shot = tmp_path / "dashboard.png"
    await open_dashboard(router.url, shot, check=check)
    assert shot.stat().st_size > 10_000
    TEST_OUTPUT.mkdir(exist_ok=True)
    shutil.copyfile(shot, TEST_OUTPUT / "dashboard.png")


async def test_protected_empty_dashboard_with_token_in_the_address(dashboard_router, tmp_path: Path) -> None:
    router = await dashboard_router(dashboard_requires_token=True)

    async def check(page: Page) -> None:
        assert await page.locator("#empty").is_visible()
        assert await page.locator("section.model").count() == 0
        assert await page.locator("#live").get_attribute("data-state") == "live"
        assert await page.locator("#t-replicas").inner_text() == "0"
        assert await page.get_attribute("#ttfb-chart", "data-points") == "0"
        assert "token=" in (await page.get_attribute("#data-link", "href") or "")

    shot = tmp_path / "dashboard-empty.png"
    await open_dashboard(router.url, shot, query=f"?token={TOKEN}", check=check)
    TEST_OUTPUT.mkdir(exist_ok=True)
    shutil.copyfile(shot, TEST_OUTPUT / "dashboard-empty.png")


QUEUED_AMBER = (217, 139, 0)


async def one_slot_known(router: Any) -> Any:
    """The router's only worker, once its probe has read its one sequence slot and KV size (what
    flow control's room needs)."""
    [worker] = router.registry.states()
    for _ in range(500):
        if worker.max_num_seqs == 1 and worker.kv_tokens is not None:
            break
        await asyncio.sleep(0.01)
    return worker


async def test_the_queue_with_flow_control_on(sim_fleet, dashboard_router, tmp_path: Path) -> None:
    """One replica with one sequence slot, six requests at once, room for three in the queue: one
    runs, three wait and are served, two are shed (429).  The model's queue shows it all."""
    fleet = await sim_fleet(1, max_num_seqs=1)
    router = await dashboard_router(fleet.urls, routing={"flow_control": True, "flow_max_queued": 3,
                                                                 "policy": "least-loaded"})
    worker = await one_slot_known(router)
    flow = router.router.dispatch.flow

    async def one(client: aiohttp.ClientSession, i: int) -> int:
        body: dict[str, Any] = {"model": SIM_MODEL, "max_tokens": 60, "stream": True,
                                "messages": [{"role": "user", "content": f"request {i} " * 50}]}
        async with client.post(router.url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            return resp.status

    async with aiohttp.ClientSession() as client:
        first = asyncio.create_task(one(client, 0))
        while worker.inflight == 0:
            await asyncio.sleep(0.005)
        rest = []
        for i in range(1, 6):  # one at a time, so that the first three queue and the last two are shed
            rest.append(asyncio.create_task(one(client, i)))
            while (sum(flow.depth()[SIM_MODEL]) == 0 and i <= 3) or \
                    (i > 3 and sum(flow.shed.values()) < i - 3):
                await asyncio.sleep(0.005)
        statuses = [await first, *[await t for t in rest]]
    assert sorted(statuses) == [200, 200, 200, 200, 429, 429]

    async def check(page: Page) -> None:
        queue = page.locator("section.model .queue")
        assert await queue.get_attribute("data-flow") == "on"
        # Not `auto`: its absent chip once rendered as the text "null".
        policy = await page.locator("section.model .policy").inner_text()
        assert "least-loaded" in policy and "null" not in policy
        assert await page.locator("section.model .flow-off").is_hidden()
        figure = lambda name: queue.locator(f".queue-figures [data-field={name}] b").inner_text()  # noqa: E731
        assert await figure("queued") == "0 requests · 0 tokens"
        assert await figure("at-once") == "1"
        assert await figure("after-wait") == "3"
        assert await figure("shed") == "2 (queue_full 2)"
        # No tenant header, no API key: every token served is the default tenant's.
        assert await figure("tenants") == "default 100.0 %"
        p50, _, p95 = (await figure("wait")).partition(" / ")
        assert p50 != "–" and p95 != "–"
        # The depth reached three: the chart has a bin with it, drawn in the queue's colour.
        assert int(await page.get_attribute("section.model canvas.queue-chart", "data-points") or 0) >= 1
        assert await colour_pixels(page, "section.model canvas.queue-chart", QUEUED_AMBER) > 8
        tokens_chart = "section.model canvas.queue-tokens-chart"
        assert int(await page.get_attribute(tokens_chart, "data-points") or 0) >= 1
        # The shed requests are in the activity log, as such.
        shed_rows = page.locator("#decisions tr", has=page.locator(".kind.shed"))
        assert await shed_rows.count() == 2
        row = await shed_rows.first.inner_text()
        assert "shed" in row and "429" in row and "queue_full" in row
        waited_rows = page.locator("#decisions tr", has_text="waited=")
        assert await waited_rows.count() == 3

    shot = tmp_path / "dashboard-queue.png"
    await open_dashboard(router.url, shot, check=check)
    TEST_OUTPUT.mkdir(exist_ok=True)
    shutil.copyfile(shot, TEST_OUTPUT / "dashboard-queue.png")


async def test_the_queue_by_class_and_session_admissions_door(sim_fleet, dashboard_router,
                                                              tmp_path: Path) -> None:
    """One slot busy with a long answer (real-time simulator), three requests held behind it — one
    of class high, two normal — with session admission on: the queue chip names the classes, and
    the door's chip says how many sessions are admitted and how many wait, as flow control counts
    them.  The held clients then hang up (which leaves no trace)."""
    fleet = await sim_fleet(1, speed=1.0, max_num_seqs=1)
    router = await dashboard_router(fleet.urls, routing={"flow_control": True, "policy": "least-loaded",
                                                         "flow_session_admission": True})
    worker = await one_slot_known(router)
    flow = router.router.dispatch.flow

    async def one(client: aiohttp.ClientSession, i: int, priority: str, max_tokens: int) -> None:
        body: dict[str, Any] = {"model": SIM_MODEL, "max_tokens": max_tokens, "stream": True,
                                "ignore_eos": True,  # the simulator answers to max_tokens, as vLLM does
                                "messages": [{"role": "user", "content": f"request {i} " * 50}]}
        async with client.post(router.url + "/v1/chat/completions", json=body,
                               headers={"x-kvroute-priority": priority}) as resp:
            await resp.read()

    async with aiohttp.ClientSession() as client:
        tasks = [asyncio.create_task(one(client, 0, "normal", 4000))]
        while worker.inflight == 0:
            await asyncio.sleep(0.005)
        for i, priority in enumerate(("normal", "high", "normal"), start=1):
            tasks.append(asyncio.create_task(one(client, i, priority, 8)))
            while flow.depth().get(SIM_MODEL, (0, 0))[0] < i:
                await asyncio.sleep(0.005)

        async def check(page: Page) -> None:
            assert worker.inflight == 1 and flow.depth()[SIM_MODEL][0] == 3  # still held
            queue = page.locator("section.model .queue")
            figure = lambda name: queue.locator(f".queue-figures [data-field={name}] b").inner_text()  # noqa: E731
            queued = await figure("queued")
            assert queued.startswith("3 requests · ") and queued.endswith(" tokens (high 1, normal 2)")
            # The running request's session is admitted; the three new ones wait at the door.
            assert flow.session_counts(router.router.dispatch.now())[SIM_MODEL] == (1, 3)
            assert await figure("sessions") == "1 / 3"

        await open_dashboard(router.url, tmp_path / "dashboard-classes.png", check=check)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(500):  # the held requests left no trace
        if flow.depth()[SIM_MODEL][0] == 0:
            break
        await asyncio.sleep(0.01)
    assert flow.depth()[SIM_MODEL] == (0, 0)


async def test_the_canary_tag_shows_held_and_healthy_replicas(sim_fleet, dashboard_router,
                                                              tmp_path: Path) -> None:
    fleet = await sim_fleet(3, answer_mode=True)
    router = await dashboard_router(fleet.urls, routing={"canary_interval_s": 0.05, "canary_budget": 1.0,
                                                         "canary_prefix_tokens": 256})
    async with aiohttp.ClientSession() as http, \
            http.post(fleet.urls[0] + "/admin/fault", json={"kind": "corrupt", "rate": 1.0}) as resp:
        assert resp.status == 200
    bad, good = worker_id_for(fleet.urls[0]), worker_id_for(fleet.urls[1])
    for _ in range(2000):
        if router.registry.get(bad).state.guard_holds:
            break
        await asyncio.sleep(0.01)
    assert router.registry.get(bad).state.guard_holds == frozenset({"canary"})

    async def check(page: Page) -> None:
        held = page.locator(f"tr[data-replica='{bad}']")
        assert await held.locator(".badge").inner_text() == "guarded"
        assert await held.locator("[data-field=canary]").inner_text() == "canary: held"
        tag = await page.locator(f"tr[data-replica='{good}'] [data-field=canary]").inner_text()
        match = re.fullmatch(r"canary 0/(\d+)", tag)
        assert match is not None and int(match.group(1)) > 0, tag

    await open_dashboard(router.url, tmp_path / "canary.png", check=check)
