"""The router's own API keys (``api_keys``, ``--api-key``, ``--api-key-file``), with the official
OpenAI and Anthropic SDKs: the right key passes on either header, a missing or wrong one gets 401
in the API's own format, and the router's key never reaches a worker."""

from __future__ import annotations

import anthropic
import openai
import pytest

MODEL = "qwen3-4b"
KEYS = ["sk-router-first", "sk-router-second-longer"]
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture
async def guarded(sim_fleet, router):
    fleet = await sim_fleet(1)
    return await router(fleet.urls, api_keys=KEYS)


async def test_openai_sdk_with_the_right_key_and_with_a_wrong_one(guarded):
    for key in KEYS:
        async with openai.AsyncOpenAI(base_url=guarded.url + "/v1", api_key=key, max_retries=0) as client:
            done = await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
            assert done.choices[0].message.content
            assert [m.id for m in (await client.models.list()).data] == [MODEL]
    # A prefix of a key, a longer string that starts with one, another key altogether.
    for wrong in ("sk-router-", "sk-router-first-and-more", "sk-other"):
        async with openai.AsyncOpenAI(base_url=guarded.url + "/v1", api_key=wrong, max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as caught:
                await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
            assert caught.value.status_code == 401
            assert caught.value.code == "invalid_api_key"
            assert caught.value.type == "invalid_request_error"
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
            with pytest.raises(openai.AuthenticationError):
                await client.completions.create(model=MODEL, prompt="x", max_tokens=1)


async def test_anthropic_sdk_with_x_api_key_or_a_bearer_token(guarded):
    # ANTHROPIC_API_KEY sends x-api-key; ANTHROPIC_AUTH_TOKEN (as Claude Code may use) a Bearer token.
    for client in (anthropic.AsyncAnthropic(base_url=guarded.url, api_key=KEYS[1], max_retries=0),
                   anthropic.AsyncAnthropic(base_url=guarded.url, auth_token=KEYS[0], max_retries=0)):
        async with client:
            done = await client.messages.create(model=MODEL, max_tokens=4, messages=HI)
            assert done.content[0].text
    async with anthropic.AsyncAnthropic(base_url=guarded.url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await client.messages.create(model=MODEL, max_tokens=4, messages=HI)
        assert caught.value.status_code == 401
        assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]


async def test_either_header_on_either_route_and_no_key_at_all(guarded, http):
    body = {"model": MODEL, "max_tokens": 4, "messages": HI}
    for path in ("/v1/chat/completions", "/v1/messages"):
        for headers in ({"Authorization": f"Bearer {KEYS[0]}"}, {"x-api-key": KEYS[1]},
                        {"Authorization": "Bearer wrong", "x-api-key": KEYS[0]}):
            async with http.post(guarded.url + path, json=body, headers=headers) as resp:
                assert resp.status == 200, (path, headers, await resp.text())
        async with http.post(guarded.url + path, json=body) as resp:
            assert resp.status == 401
            assert resp.headers["x-should-retry"] == "false"  # SDKs and Claude Code do not retry it
            doc = await resp.json()
        if path == "/v1/messages":
            assert doc["type"] == "error" and doc["error"]["type"] == "authentication_error"
            assert "x-api-key" in doc["error"]["message"]
        else:
            assert doc["error"]["code"] == "invalid_api_key" and "didn't provide" in doc["error"]["message"]
    async with http.get(guarded.url + "/v1/models", headers={"anthropic-version": "2023-06-01"}) as resp:
        assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
    async with http.get(guarded.url + "/health") as resp:  # the fleet endpoints keep their own rules
        assert resp.status == 200
    text = await (await http.get(guarded.url + "/metrics")).text()
    assert 'kvroute_failures_total{reason="unauthorized"} 3.0' in text  # two posts and /v1/models


async def test_the_router_never_forwards_its_own_key(echo_engines, router, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url], api_keys=KEYS)
    chat = {"model": "echo", "messages": HI}
    async with http.post(r.url + "/v1/chat/completions", json=chat,
                         headers={"Authorization": f"Bearer {KEYS[0]}", "x-api-key": KEYS[1]}) as resp:
        assert resp.status == 200
    seen = {k.lower() for k in engine.seen[-1].headers}
    assert "authorization" not in seen and "x-api-key" not in seen


async def test_the_workers_get_the_worker_key_and_the_probe_does_too(echo_engines, router, http):
    [engine] = await echo_engines(1, api_key="worker-secret")
    r = await router([engine.url], api_keys=KEYS, worker_api_key="worker-secret")
    # The probe read the engine's /v1/models with the worker key: the model is known.
    assert r.registry.records()[0].state.models == frozenset({"echo"})
    chat = {"model": "echo", "messages": HI}
    async with http.post(r.url + "/v1/chat/completions", json=chat,
                         headers={"Authorization": f"Bearer {KEYS[1]}"}) as resp:
        assert resp.status == 200
    got = {k.lower(): v for k, v in engine.seen[-1].headers.items()}
    assert got["authorization"] == "Bearer worker-secret" and "x-api-key" not in got


async def test_with_only_a_worker_key_clients_need_none(echo_engines, router, http):
    [engine] = await echo_engines(1, api_key="worker-secret")
    r = await router([engine.url], worker_api_key="worker-secret")
    async with http.post(r.url + "/v1/chat/completions", json={"model": "echo", "messages": HI},
                         headers={"Authorization": "Bearer client-key"}) as resp:
        assert resp.status == 200
    assert engine.seen[-1].headers["Authorization"] == "Bearer worker-secret"


def test_keys_from_a_file_join_the_listed_ones(tmp_path):
    from kvroute.router_settings import Settings

    path = tmp_path / "keys"
    path.write_text("# client keys\nsk-from-file\n\n  sk-two  \nsk-listed\n")
    settings = Settings.load(None, env={}, overrides={"api_keys": ["sk-listed"], "api_key_file": str(path)})
    assert settings.api_keys == ("sk-listed", "sk-from-file", "sk-two")
    env = {"KVROUTE_API_KEYS": "a, b", "KVROUTE_WORKER_API_KEY": "w"}
    from_env = Settings.load(None, env=env)
    assert from_env.api_keys == ("a", "b") and from_env.worker_api_key == "w"
