"""The proxy against engines that answer exactly as scripted: passthrough, headers, failover."""

from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello there " * 50}]}


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as resp:
        return await resp.text()


def closed_port_url() -> str:
    """A loopback URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_stream_is_passed_through_byte_for_byte(echo_engines, router, http):
    [engine] = await echo_engines(1, events=5)
    r = await router([engine.url])
    body = {**CHAT, "stream": True}
    async with http.post(engine.url + "/v1/chat/completions", json=body) as resp:
        direct = await resp.read()
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["x-kvroute-worker"] == r.registry.records()[0].id
        assert resp.headers["x-engine"] == "echo"
        assert resp.content_type == "text/event-stream"
        routed = await resp.read()
    assert routed == direct
    assert routed.endswith(b"data: [DONE]\n\n")


async def test_original_body_bytes_and_headers_reach_the_engine(echo_engines, router, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    raw = b'{  "messages":[{"content":"hi \\u00e9","role":"user"}],\n "model" : "echo", "zz": 1.50}'
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-1", "x-api-key": "k-2",
               "anthropic-version": "2023-06-01", "anthropic-beta": "tools-1", "x-custom": "yes",
               "Keep-Alive": "timeout=5", "Proxy-Authorization": "Basic abc"}
    async with http.post(r.url + "/v1/chat/completions?trace=1", data=raw, headers=headers) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "hello"
    seen = engine.seen[-1]
    assert seen.body == raw
    assert seen.path == "/v1/chat/completions"
    got = {k.lower(): v for k, v in seen.headers.items()}
    for name in ("authorization", "x-api-key", "anthropic-version", "anthropic-beta", "x-custom",
                 "content-type"):
        assert got[name] == headers[next(h for h in headers if h.lower() == name)]
    assert "keep-alive" not in got and "proxy-authorization" not in got


async def test_worker_header_can_be_switched_off(echo_engines, router, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url], worker_header=False)
    async with http.post(r.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
        assert "x-kvroute-worker" not in resp.headers


async def test_5xx_before_the_first_byte_is_retried_on_another_worker(echo_engines, router, http):
    bad, good = await echo_engines(2)
    bad.mode = "error"
    r = await router([bad.url, good.url], policy="round-robin")
    good_id = r.registry.records()[1].id
    for i in range(4):
        body = {**CHAT, "messages": [{"role": "user", "content": f"question {i}"}]}
        async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-worker"] == good_id
    text = await scrape(http, r.url)
    assert metric(text, "kvroute_retries_total", reason="http_500") >= 1
    assert metric(text, "kvroute_failures_total", reason="http_5xx") >= 1


async def test_when_every_worker_fails_the_last_5xx_is_returned(echo_engines, router, http):
    engines = await echo_engines(2, mode="error")
    r = await router([e.url for e in engines])
    async with http.post(r.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == "engine exploded"
        assert resp.headers["x-kvroute-worker"] in {rec.id for rec in r.registry.records()}
    assert sum(len(e.seen) for e in engines) == 2  # each worker tried once, then no candidate left


async def test_refused_connection_is_retried_and_the_worker_leaves(echo_engines, router, http):
    [good] = await echo_engines(1)
    dead = closed_port_url()
    r = await router([dead, good.url], policy="round-robin", probe_interval_s=30.0)
    dead_id = r.registry.records()[0].id
    r.registry.get(dead_id).state.healthy = True  # as if it died after the last probe
    for i in range(3):
        body = {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]}
        async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
    assert not r.registry.get(dead_id).state.healthy
    assert metric(await scrape(http, r.url), "kvroute_retries_total", reason="connect") == 1


async def test_a_hung_worker_is_retried_after_the_read_timeout(echo_engines, router, http):
    hung, good = await echo_engines(2)
    hung.mode = "hang"
    r = await router([hung.url, good.url], policy="round-robin", upstream_read_timeout_s=0.3)
    for i in range(2):
        body = {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]}
        async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
    assert metric(await scrape(http, r.url), "kvroute_retries_total", reason="timeout") >= 1
    for _ in range(50):  # the router closed the hung connection: the engine sees it go
        if hung.running == 0:
            break
        await asyncio.sleep(0.05)
    assert hung.running == 0


def sse_events(raw: bytes) -> list[tuple[str | None, bytes]]:
    """(event name, data) of each complete event; asserts nothing is left half-written."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        name, data = None, b""
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                data = line[6:]
        out.append((name, data))
    return out


async def test_a_stream_broken_midway_ends_with_an_openai_error_event(echo_engines, router, http):
    [engine] = await echo_engines(1, mode="drop")
    r = await router([engine.url])
    async with http.post(r.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status == 200
        events = sse_events(await resp.read())
    assert orjson.loads(events[0][1])["choices"][0]["delta"]["content"] == "w0 "
    last = orjson.loads(events[-1][1])
    assert last["error"]["code"] == 502 and "mid-stream" in last["error"]["message"]
    assert all(orjson.loads(data) for _, data in events)  # the half-written event never went out
    assert metric(await scrape(http, r.url), "kvroute_failures_total", reason="midstream") == 1


async def test_a_stream_broken_midway_ends_with_an_anthropic_error_event(echo_engines, router, http):
    [engine] = await echo_engines(1, mode="drop")
    r = await router([engine.url])
    body = {"model": "echo", "max_tokens": 10, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(r.url + "/v1/messages", json=body) as resp:
        events = sse_events(await resp.read())
    assert events[0][0] == "message_start"
    name, data = events[-1]
    assert name == "error"
    error = orjson.loads(data)
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "mid-stream" in error["error"]["message"]


async def test_a_plain_body_broken_midway_is_not_passed_off_as_complete(echo_engines, router, http):
    [engine] = await echo_engines(1, mode="drop")
    r = await router([engine.url])
    # A body is held until it is whole (up to 1 MiB): nothing went out, so the client gets a 502 in
    # its API's format rather than half an answer.
    async with http.post(r.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 502
        assert "disconnect" in (await resp.json())["error"]["message"]
    # A larger one is relayed as it comes: cut, never passed off as complete.
    engine.reply = "x" * (2 << 20)
    async with http.post(r.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    async with http.post(r.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status == 200  # the router is still serving


async def test_a_client_that_leaves_cancels_the_upstream_request(echo_engines, router, http):
    [engine] = await echo_engines(1, events=200, delay_s=0.02)
    r = await router([engine.url])
    resp = await http.post(r.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    await resp.content.readany()
    assert engine.running == 1 and r.registry.states()[0].inflight == 1
    resp.close()
    for _ in range(100):
        if engine.running == 0 and r.registry.states()[0].inflight == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.running == 0
    assert r.registry.states()[0].inflight == 0
    assert engine.served == 0


BAD_INPUTS = [
    # (path, body, status, style)
    ("/v1/chat/completions", b"{not json", 400, "openai"),
    ("/v1/messages", b"{not json", 400, "anthropic"),
    ("/v1/chat/completions", b"[1, 2]", 400, "openai"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}', 400, "openai"),
    ("/v1/chat/completions", b'{"model": "echo"}', 400, "openai"),
    ("/v1/messages", b'{"model": "echo", "max_tokens": 5}', 400, "anthropic"),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404,
     "openai"),
    ("/v1/messages", b'{"model": "nope", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}',
     404, "anthropic"),
    ("/v1/chat/completions", b'{"model": "echo", "messages": [{"role": "user", "content": "' + b"x" * 5000
     + b'"}]}', 413, "openai"),
    ("/v1/messages", b'{"model": "echo", "max_tokens": 5, "messages": [{"role": "user", "content": "'
     + b"x" * 5000 + b'"}]}', 413, "anthropic"),
    ("/v1/nothing/here", b"{}", 404, "openai"),
]


@pytest.mark.parametrize(("path", "body", "status", "style"), BAD_INPUTS)
async def test_bad_input_gets_the_documented_error_and_the_router_keeps_serving(
        echo_engines, router, http, path, body, status, style):
    [engine] = await echo_engines(1)
    r = await router([engine.url], max_body_bytes=4096)
    async with http.post(r.url + path, data=body, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        doc = await resp.json()
    if style == "anthropic":
        assert doc["type"] == "error" and set(doc["error"]) == {"type", "message"}
    else:
        assert set(doc["error"]) == {"message", "type", "param", "code"}
    assert engine.seen == []
    async with http.post(r.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200


async def test_wrong_method_and_chunked_oversized_bodies(echo_engines, router, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url], max_body_bytes=4096)
    async with http.get(r.url + "/v1/chat/completions") as resp:
        assert resp.status == 405
        assert "POST" in (await resp.json())["error"]["message"]

    async def chunks():
        for _ in range(10):
            yield b"x" * 1000

    async with http.post(r.url + "/v1/messages", data=chunks()) as resp:  # no Content-Length
        assert resp.status == 413
        assert (await resp.json())["error"]["type"] == "request_too_large"


async def test_no_healthy_worker_is_503_with_retry_after(echo_engines, router, http):
    [engine] = await echo_engines(1, mode="unhealthy")
    r = await router([engine.url], failure_threshold=1)
    assert not r.registry.states()[0].healthy
    async with http.post(r.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["type"] == "service_unavailable"
    body = {"model": "echo", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    async with http.post(r.url + "/v1/messages", json=body) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["type"] == "overloaded_error"
    async with http.get(r.url + "/ready") as resp:
        assert resp.status == 503
    engine.mode = "ok"
    for _ in range(50):
        async with http.get(r.url + "/ready") as resp:
            if resp.status == 200:
                break
        await asyncio.sleep(0.05)
    async with http.post(r.url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200


async def test_models_is_the_union_of_healthy_workers(echo_engines, router, http):
    a, b = await echo_engines(2)
    b.model = "other"
    r = await router([a.url, b.url])
    async with http.get(r.url + "/v1/models") as resp:
        doc = await resp.json()
    assert [m["id"] for m in doc["data"]] == ["echo", "other"]
    assert all(m["max_model_len"] == 8192 for m in doc["data"])
    async with http.get(r.url + "/v1/models", headers={"anthropic-version": "2023-06-01"}) as resp:
        doc = await resp.json()
    assert [m["id"] for m in doc["data"]] == ["echo", "other"] and doc["has_more"] is False
    body = {"model": "other", "messages": [{"role": "user", "content": "x"}]}
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        assert resp.headers["x-kvroute-worker"] == r.registry.records()[1].id


DOCUMENTED_METRICS = [
    "kvroute_requests_total", "kvroute_prefix_blocks_matched_bucket", "kvroute_ttfb_seconds_bucket",
    "kvroute_inflight", "kvroute_index_blocks", "kvroute_sessions", "kvroute_worker_running",
    "kvroute_worker_waiting", "kvroute_worker_kv_cache_usage", "kvroute_worker_prefix_cache_hits_total",
    "kvroute_worker_prefix_cache_queries_total", "kvroute_worker_healthy", "kvroute_worker_draining",
    "kvroute_worker_epoch",
]


async def test_metrics_carry_requests_and_engine_figures(echo_engines, router, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    wid = r.registry.records()[0].id
    async with http.post(r.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        await resp.read()
    engine.served = 7
    await asyncio.sleep(0.3)  # a few probe rounds
    text = await scrape(http, r.url)
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert set(DOCUMENTED_METRICS) <= names
    assert metric(text, "kvroute_requests_total", worker=wid, model="echo", kind="cold") == 1
    assert metric(text, "kvroute_ttfb_seconds_count") == 1
    assert metric(text, "kvroute_worker_kv_cache_usage", worker=wid) == 0.25
    assert metric(text, "kvroute_worker_prefix_cache_hits_total", worker=wid) == 350.0
    assert metric(text, "kvroute_worker_healthy", worker=wid) == 1
    assert metric(text, "kvroute_inflight", worker=wid) == 0


async def test_one_decision_line_per_request_without_prompt_text(echo_engines, router, http, caplog):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    secret = "the secret prompt words"
    body = {"model": "echo", "messages": [{"role": "user", "content": secret}]}
    with caplog.at_level(logging.INFO, logger="kvroute.decision"):
        for _ in range(2):
            async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvroute.decision"]
    assert len(lines) == 2
    assert all("model=echo" in line and secret not in line for line in lines)

    r2 = await router([engine.url], log_prompts=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvroute.decision"):
        async with http.post(r2.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
    assert any(secret in rec.getMessage() for rec in caplog.records if rec.name == "kvroute.decision")


async def test_graceful_shutdown_finishes_streams_in_flight(echo_engines, router, http):
    [engine] = await echo_engines(1, events=10, delay_s=0.05)
    r = await router([engine.url], shutdown_timeout_s=10)
    resp = await http.post(r.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    first = await resp.content.readany()
    closing = asyncio.create_task(r.close())
    await asyncio.sleep(0.05)
    with pytest.raises(aiohttp.ClientConnectionError):  # no new connections once closing
        async with aiohttp.ClientSession() as fresh:
            await fresh.get(r.url + "/health")
    rest = await resp.read()
    await closing
    events = sse_events(first + rest)
    assert events[-1] == (None, b"[DONE]")
    assert len(events) == 12
