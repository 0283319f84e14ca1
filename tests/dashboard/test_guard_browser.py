"""The fleet guard on the dashboard, in headless chromium: a replica restarted with prefix caching
off (guard_doctor_action = exclude) shows as guarded with the doctor's error beside its status, and
once its cache drift is raised a warning line names it with the doctor's findings; the healthy
replicas show neither."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import aiohttp
import pytest
from dashboard_browser import chromium_available, open_dashboard
from dashboard_setup import SIM_MODEL
from playwright.async_api import Page

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not chromium_available(), reason="needs Debian's chromium (/usr/bin/chromium)"),
]

TEST_OUTPUT = Path(__file__).resolve().parents[2] / "test-output"


def ticket(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are the support desk. " + "Answer from the manual. " * 350},
            {"role": "user", "content": f"Ticket {i}: error {1000 + i}."}]


async def test_guarded_replica_and_drift_warning(sim_fleet, dashboard_router, tmp_path: Path) -> None:
    fleet = await sim_fleet(3)
    router = await dashboard_router(fleet.urls, policy="round-robin",
                                    routing={"guard_drift_for_s": 0.2, "guard_drift_min_tokens": 4000})
    target = router.registry.records()[0]
    await fleet.restart_with(0, enable_prefix_caching=False)
    for _ in range(200):  # the probe sees the new engine: a new epoch
        if target.restarts:
            break
        await asyncio.sleep(0.02)
    async with aiohttp.ClientSession() as http:
        # Traffic while it is still in rotation (warn), so its cache drift shows.
        for i in range(36):
            body = {"model": SIM_MODEL, "messages": ticket(i), "max_tokens": 4}
            async with http.post(router.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
    drift = router.router.drift_watch
    assert drift is not None
    for _ in range(200):
        alarm = drift.to_json(target.id)
        if alarm is not None and alarm["alarm"]:
            break
        await asyncio.sleep(0.02)
    assert alarm is not None and alarm["alarm"], alarm
    assert target.restarts == 1
    # Now keep it out, as guard_doctor_action = exclude would: the dashboard shows the hold.
    router.registry.set_guard_hold(target.id, "doctor", True)

    async def check(page: Page) -> None:
        row = page.locator(f"section.model tbody tr[data-replica='{target.id}']")
        assert await row.locator(".badge").inner_text() == "guarded"
        flag = row.locator("[data-flag=doctor]")
        assert await flag.inner_text() == "doctor: 1 error"
        assert "prefix-caching-off" in (await flag.get_attribute("title") or "")
        assert await row.locator("[data-flag=drift]").inner_text() == "cache drift"
        warning = page.locator(f".guard-warning[data-replica='{target.id}']")
        text = await warning.inner_text()
        assert text.startswith(f"Cache drift on {target.id}") and "error prefix-caching-off" in text
        assert await page.locator(".guard-warning").count() == 1
        for other in router.registry.records()[1:]:
            other_row = page.locator(f"section.model tbody tr[data-replica='{other.id}']")
            assert await other_row.locator(".badge").inner_text() == "healthy"
            assert await other_row.locator("[data-flag]").count() == 0

    shot = tmp_path / "dashboard-guard.png"
    await open_dashboard(router.url, shot, check=check)
    TEST_OUTPUT.mkdir(exist_ok=True)
    shutil.copyfile(shot, TEST_OUTPUT / "dashboard-guard.png")
