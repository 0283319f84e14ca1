"""The dashboard's routes on a real router over simulated replicas: the JSON after real traffic, the
empty state, the page's files, and the optional admin-token protection."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from dashboard_setup import SIM_MODEL, TOKEN
from dashboard_traffic import run_sessions

from kvroute.fleet.registry import worker_id_for
from kvroute.router_settings import Settings, SettingsError


async def get_json(http: aiohttp.ClientSession, url: str, **kwargs: object) -> tuple[int, dict]:
    async with http.get(url, **kwargs) as resp:  # type: ignore[arg-type]
        return resp.status, await resp.json(content_type=None)


async def wait_for_counters(http: aiohttp.ClientSession, url: str, prompt_tokens: int) -> dict:
    """Poll the JSON until the probe has scraped the traffic (bounded)."""
    data: dict = {}
    for _ in range(50):
        _, data = await get_json(http, f"{url}/dashboard/data.json")
        if data["models"] and data["models"][0]["tokens"]["prompt_tokens"] >= prompt_tokens:
            break
        await asyncio.sleep(0.2)
    return data


async def test_data_after_traffic(sim_fleet, dashboard_router, http) -> None:
    fleet = await sim_fleet(3)
    router = await dashboard_router(fleet.urls)
    sent = await run_sessions(router.url, SIM_MODEL, sessions=4, turns=4)
    assert sent == 16
    engine_prompt = sum(r.engine.stats.prompt_tokens for r in fleet.replicas)
    data = await wait_for_counters(http, router.url, engine_prompt)

    (model,) = data["models"]
    assert model["name"] == SIM_MODEL
    assert {r["id"] for r in model["replicas"]} == {worker_id_for(u) for u in fleet.urls}
    assert model["totals"]["requests_total"] == sent
    assert sum(r["requests_total"] for r in model["replicas"]) == sent
    assert model["totals"]["requests"]["sticky"] >= 4 * 3 - 4  # every turn after the first stays
    assert all(r["status"] == "healthy" for r in model["replicas"])
    assert model["totals"]["hit_share"] > 0.3  # growing chats with a shared system prompt
    tokens = model["tokens"]
    # The chart counts exactly what the engines counted: every scrape's delta lands in the window.
    assert tokens["prompt_tokens"] == engine_prompt
    assert tokens["cached_tokens"] == sum(r.engine.stats.prefix_cache_hits for r in fleet.replicas)
    assert sum(tokens["cached"]) > 0 and sum(tokens["computed"]) > 0
    assert len(tokens["cached"]) == data["window"]["bins"]
    assert model["policy"]["name"] == "auto" and model["policy"]["sticky"] is True
    assert data["ttfb"]["count"] == sent and data["ttfb"]["window_p50"] > 0
    assert len(data["decisions"]) == sent
    assert all(d["worker"] in {r["id"] for r in model["replicas"]} and d["reason"] for d in data["decisions"])
    assert data["router"]["sessions"] == 4


async def test_empty_state(dashboard_router, http) -> None:
    router = await dashboard_router()
    status, data = await get_json(http, f"{router.url}/dashboard/data.json")
    assert status == 200
    assert data["models"] == [] and data["decisions"] == []
    assert data["router"]["workers"] == 0 and data["ttfb"]["count"] == 0
    async with http.get(f"{router.url}/dashboard") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        page = await resp.text()
    assert "No replicas registered" in page and 'src="dashboard/dashboard.js"' in page


async def test_page_files_and_paths(dashboard_router, http) -> None:
    router = await dashboard_router()
    for name, kind in (("dashboard.js", "application/javascript"), ("dashboard.css", "text/css")):
        async with http.get(f"{router.url}/dashboard/{name}") as resp:
            assert resp.status == 200 and resp.content_type == kind
            assert len(await resp.read()) > 1000
    status, body = await get_json(http, f"{router.url}/dashboard/nope.js")
    assert status == 404 and "nope.js" in body["error"]["message"]
    async with http.get(f"{router.url}/dashboard/?token=x", allow_redirects=False) as resp:
        assert resp.status == 302 and resp.headers["Location"] == "/dashboard?token=x"
    async with http.post(f"{router.url}/dashboard/data.json") as resp:
        assert resp.status == 405  # read-only


async def test_token_protection(dashboard_router, http) -> None:
    router = await dashboard_router(dashboard_requires_token=True)
    data_url = f"{router.url}/dashboard/data.json"
    status, body = await get_json(http, data_url)
    assert status == 401 and "?token=" in body["error"]["message"]
    status, _ = await get_json(http, data_url, params={"token": "wrong"})
    assert status == 403
    status, _ = await get_json(http, data_url, params={"token": TOKEN})
    assert status == 200
    status, _ = await get_json(http, data_url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    async with http.get(f"{router.url}/dashboard") as resp:
        assert resp.status == 401
    async with http.get(f"{router.url}/dashboard", params={"token": TOKEN}) as resp:
        assert resp.status == 200
    async with http.get(f"{router.url}/dashboard/dashboard.js") as resp:
        assert resp.status == 200  # the same file for every router, no fleet data in it


async def test_open_by_default_even_with_an_admin_token(dashboard_router, http) -> None:
    router = await dashboard_router()  # admin_token is set by the fixture
    status, _ = await get_json(http, f"{router.url}/dashboard/data.json")
    assert status == 200


def test_protection_without_a_token_is_a_configuration_error() -> None:
    with pytest.raises(SettingsError, match="dashboard_requires_token"):
        Settings.from_dict({"dashboard_requires_token": True})
