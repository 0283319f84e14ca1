"""The admin API: token, dynamic registration (and its epoch), drain, removal."""

from __future__ import annotations

import pytest

MODEL = "qwen3-4b"
AUTH = {"Authorization": "Bearer secret"}
PROMPT = [{"role": "system", "content": "Shared context. " * 400}, {"role": "user", "content": "go"}]


async def ask(http, url: str) -> tuple[int, str | None]:
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 4}
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvroute-worker")


@pytest.mark.parametrize(("headers", "status"), [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 403),
    ({"x-admin-token": "wrong"}, 403),
    ({"Authorization": "Basic secret"}, 401),
    ({"x-admin-token": "secret"}, 200),
    (AUTH, 200),
])
async def test_admin_calls_need_the_token(echo_engines, router, http, headers, status):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    async with http.get(r.url + "/admin/workers", headers=headers) as resp:
        assert resp.status == status
        doc = await resp.json()
    if status == 200:
        assert [w["url"] for w in doc["workers"]] == [engine.url]
    else:
        assert "error" in doc
    async with http.delete(r.url + "/admin/workers/x", headers=headers) as resp:
        assert resp.status == (404 if status == 200 else status)


async def test_without_a_configured_token_the_admin_api_is_off(echo_engines, router, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url], admin_token=None)
    async with http.get(r.url + "/admin/workers", headers=AUTH) as resp:
        assert resp.status == 403
        assert "disabled" in (await resp.json())["error"]["message"]


async def test_register_drain_and_remove_workers(sim_fleet, router, http):
    fleet = await sim_fleet(2)
    r = await router([])
    assert (await ask(http, r.url))[0] == 503
    for bad in (b"{", b'{"id": "x"}', b'{"url": "ftp://x"}', b'{"url": "http://x", "colour": 1}'):
        async with http.post(r.url + "/admin/workers", data=bad, headers=AUTH) as resp:
            assert resp.status == 400
    ids = []
    for i, url in enumerate(fleet.urls):
        async with http.post(r.url + "/admin/workers", headers=AUTH,
                             json={"url": url, "id": f"gpu{i}", "max_num_seqs": 16}) as resp:
            assert resp.status == 201
            doc = await resp.json()
        assert doc["healthy"] and doc["models"] == [MODEL] and doc["max_num_seqs"] == 16
        ids.append(doc["id"])
    assert ids == ["gpu0", "gpu1"]
    status, first = await ask(http, r.url)
    assert status == 200 and first in ids
    other = next(i for i in ids if i != first)

    async with http.post(r.url + f"/admin/workers/{first}/drain", headers=AUTH) as resp:
        assert resp.status == 200 and (await resp.json())["draining"] is True
    assert await ask(http, r.url) == (200, other)  # the prefix is on `first`, but it is draining
    async with http.post(r.url + f"/admin/workers/{first}/drain", headers=AUTH,
                         json={"draining": False}) as resp:
        assert (await resp.json())["draining"] is False

    async with http.delete(r.url + f"/admin/workers/{other}", headers=AUTH) as resp:
        assert resp.status == 200
    async with http.get(r.url + "/admin/workers", headers=AUTH) as resp:
        assert [w["id"] for w in (await resp.json())["workers"]] == [first]
    assert await ask(http, r.url) == (200, first)
    async with http.post(r.url + "/admin/workers/nobody/drain", headers=AUTH) as resp:
        assert resp.status == 404


async def test_re_registering_a_worker_starts_a_new_epoch(sim_fleet, router, http):
    fleet = await sim_fleet(1)
    r = await router([], policy="prefix")
    spec = {"url": fleet.urls[0], "id": "w"}
    async with http.post(r.url + "/admin/workers", headers=AUTH, json=spec) as resp:
        epoch = (await resp.json())["epoch"]
    for _ in range(2):
        assert (await ask(http, r.url))[0] == 200
    assert list(r.router.activity.requests)[-1].matched_blocks > 0
    async with http.post(r.url + "/admin/workers", headers=AUTH, json=spec) as resp:
        assert (await resp.json())["epoch"] > epoch
    assert (await ask(http, r.url))[0] == 200
    assert list(r.router.activity.requests)[-1].matched_blocks == 0
