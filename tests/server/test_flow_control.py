"""Flow control over HTTP: a real router in front of one simulated replica with a single sequence
slot, so a second request must wait at the router's gate.  The official SDKs see a shed request as
their own overload exception, with ``Retry-After``."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import anthropic
import openai
import pytest

MODEL = "qwen3-4b"


def chat(text: str, max_tokens: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": True}


async def occupy(http: aiohttp.ClientSession, url: str, max_tokens: int = 150) -> asyncio.Task[int]:
    """Start a long streamed request that holds the replica's only slot (wait for it to be in flight)."""
    async def run() -> int:
        async with http.post(url + "/v1/chat/completions", json=chat("hold the slot", max_tokens)) as resp:
            await resp.read()
            return resp.status
    return asyncio.create_task(run())


async def until(condition, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@pytest.fixture
async def one_slot(sim_fleet, router):
    async def make(**routing: object):
        fleet = await sim_fleet(1, speed=1.0, max_num_seqs=1)
        r = await router(fleet.urls, routing={"flow_control": True, **routing})  # off by default
        worker = r.router.registry.states()[0]
        await until(lambda: worker.max_num_seqs == 1 and worker.kv_tokens is not None)
        return r, worker
    return make


async def test_a_queued_request_waits_then_is_served(one_slot, http):
    r, worker = await one_slot()
    flow = r.router.dispatch.flow
    first = await occupy(http, r.url)
    await until(lambda: worker.inflight == 1)
    async with http.post(r.url + "/v1/chat/completions", json=chat("second", 5)) as resp:
        # the request waited at the gate until the first one ended, then was routed
        assert resp.status == 200
        await resp.read()
    assert first.done() and await first == 200
    assert flow.admitted[(MODEL, "after_wait", "normal")] == 1
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    assert 'kvroute_queue_wait_seconds_count{model="qwen3-4b"} 1.0' in text
    assert 'kvroute_queue_depth{class="normal",model="qwen3-4b"} 0.0' in text


async def test_session_admission_counts_its_sessions_on_metrics(one_slot, http):
    r, _ = await one_slot(flow_session_admission=True)
    async with http.post(r.url + "/v1/chat/completions", json=chat("a conversation", 5)) as resp:
        assert resp.status == 200
        await resp.read()
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    # Every conversation is a session (a derived id without a header): one admitted, none waiting.
    assert 'kvroute_flow_sessions{model="qwen3-4b",state="admitted"} 1.0' in text
    assert 'kvroute_flow_sessions{model="qwen3-4b",state="waiting"} 0.0' in text


async def test_each_tenants_tokens_are_what_the_engine_reported(sim_fleet, router, http):
    """A tenant's served tokens (its fair share's settled charge, and /metrics) are the engine's
    prompt + output tokens, read from the answer's usage as it passes: an OpenAI stream with
    include_usage and an Anthropic stream (output in message_delta), both asking for far more
    max_tokens than they use."""
    fleet = await sim_fleet(1)
    r = await router(fleet.urls, routing={"flow_control": True})
    oa = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0,
                            default_headers={"x-kvroute-tenant": "team-oa"})
    async with oa:
        stream = await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count the tokens"}], max_tokens=2000,
            stream=True, stream_options={"include_usage": True})
        usage = [chunk.usage async for chunk in stream if chunk.usage is not None][-1]
    an = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-test", max_retries=0,
                                  default_headers={"x-kvroute-tenant": "team-an"})
    async with an, an.messages.stream(model=MODEL, max_tokens=3000,
                                       messages=[{"role": "user", "content": "count these too"}]) as s:
        message = await s.get_final_message()
    tokens = r.router.dispatch.flow.tenant_tokens
    assert tokens[(MODEL, "team-oa")] == usage.prompt_tokens + usage.completion_tokens < 2000
    an_used = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) + \
        message.usage.output_tokens
    assert tokens[(MODEL, "team-an")] == an_used < 3000
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    served = float(tokens[(MODEL, "team-oa")])
    assert f'kvroute_tenant_tokens_total{{model="qwen3-4b",tenant="team-oa"}} {served}' in text


async def test_a_request_that_waited_logs_one_decision_line_with_its_wait(one_slot, http, caplog):
    r, worker = await one_slot()
    secret = "the secret words of the waiting prompt"
    first = await occupy(http, r.url)
    await until(lambda: worker.inflight == 1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvroute.decision"):
        async with http.post(r.url + "/v1/chat/completions", json=chat(secret, 5)) as resp:
            assert resp.status == 200
            await resp.read()
    assert await first == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvroute.decision"]
    # one line: the decision, with how long it waited and why; no separate [FLOW] line
    assert len(lines) == 1, lines
    line = lines[0]
    assert f"model={MODEL} worker={worker.id} waited=" in line
    waited = float(line.split("waited=")[1].split("s ")[0])
    assert waited > 0
    assert "(no replica admissible; predicted prefill " in line and "prefix cold)" in line
    assert secret not in line and "[FLOW]" not in line
    # the dashboard's activity log carries it too
    assert "waited=" in r.router.activity.requests[-1].reason


async def test_ttl_answers_each_api_with_its_overload_error(one_slot, http):
    r, worker = await one_slot(flow_queue_ttl_s=0.3)
    first = await occupy(http, r.url, max_tokens=400)
    await until(lambda: worker.inflight == 1)
    oa = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with oa:
        with pytest.raises(openai.RateLimitError) as caught:
            await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                             max_tokens=5)
    assert caught.value.status_code == 429
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert caught.value.body["code"] == "ttl"
    an = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with an:
        with pytest.raises(anthropic.APIStatusError) as err:
            await an.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 529
    assert err.value.body["error"]["type"] == "overloaded_error"
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert r.router.dispatch.flow.shed[(MODEL, "ttl", "normal")] == 2
    first.cancel()


async def test_a_full_queue_sheds_at_once(one_slot, http):
    r, worker = await one_slot(flow_max_queued=0)
    first = await occupy(http, r.url, max_tokens=400)
    await until(lambda: worker.inflight == 1)
    async with http.post(r.url + "/v1/chat/completions", json=chat("x", 5)) as resp:
        assert resp.status == 429
        assert int(resp.headers["retry-after"]) >= 1
        assert (await resp.json())["error"]["type"] == "rate_limit_error"
    first.cancel()


async def test_a_client_leaving_while_queued_leaves_no_trace(one_slot, http):
    r, worker = await one_slot()
    flow = r.router.dispatch.flow
    first = await occupy(http, r.url, max_tokens=100)
    await until(lambda: worker.inflight == 1)
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(r.url + "/v1/chat/completions", json=chat("gone", 5),
                             timeout=aiohttp.ClientTimeout(total=0.3)) as resp:
            await resp.read()
    await until(lambda: flow.depth()[MODEL] == (0, 0))
    assert await first == 200
    await until(lambda: worker.inflight == 0)
    assert worker.inflight_tokens == 0
    assert flow.admitted.get((MODEL, "after_wait", "normal"), 0) == 0  # nobody was woken for it


async def test_shutdown_answers_queued_requests_at_once(one_slot, http):
    r, worker = await one_slot()
    first = await occupy(http, r.url, max_tokens=2000)  # ~40 s at speed 1: far beyond the test
    await until(lambda: worker.inflight == 1)

    async def queued() -> tuple[int, str | None]:
        async with http.post(r.url + "/v1/chat/completions", json=chat("queued", 5)) as resp:
            await resp.read()
            return resp.status, resp.headers.get("retry-after")

    waiting = asyncio.create_task(queued())
    await until(lambda: r.router.dispatch.flow.depth().get(MODEL, (0, 0))[0] == 1)
    r.router.shut_down()
    status, retry = await asyncio.wait_for(waiting, 5.0)
    assert status == 429 and retry is not None
    assert r.router.dispatch.flow.shed[(MODEL, "shutdown", "normal")] == 1
    first.cancel()


async def test_priority_classes_over_http(one_slot, http):
    """A queued ``high`` goes before an earlier ``low``; a ``high`` arriving at a full queue pushes
    out the newest ``low`` (429, code displaced, Retry-After); the metrics carry class and tenant."""
    r, worker = await one_slot(flow_max_queued=2)
    flow = r.router.dispatch.flow
    first = await occupy(http, r.url, max_tokens=100)
    await until(lambda: worker.inflight == 1)
    done: list[str] = []

    async def send(name: str, priority: str, tenant: str) -> tuple[int, dict[str, object], str | None]:
        headers = {"x-kvroute-priority": priority, "x-kvroute-tenant": tenant}
        async with http.post(r.url + "/v1/chat/completions", json=chat(name, 5), headers=headers) as resp:
            body = await resp.json() if resp.status != 200 else {}
            if resp.status == 200:
                await resp.read()
            done.append(name)
            return resp.status, body, resp.headers.get("retry-after")

    low = asyncio.create_task(send("low", "low", "team-a"))
    await until(lambda: flow.depth()[MODEL][0] == 1)
    pushed = asyncio.create_task(send("pushed", "-1", "team-a"))
    await until(lambda: flow.depth()[MODEL][0] == 2)
    high = asyncio.create_task(send("high", "high", "team-b"))
    status, body, retry = await asyncio.wait_for(pushed, 5.0)
    assert status == 429 and body["error"]["code"] == "displaced" and int(retry) >= 1
    assert (await high)[0] == 200 and (await low)[0] == 200 and await first == 200
    assert done == ["pushed", "high", "low"]
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    for line in ('kvroute_queue_depth{class="high",model="qwen3-4b"} 0.0',
                 'kvroute_queue_tokens{class="low",model="qwen3-4b"} 0.0',
                 'kvroute_admitted_total{class="high",model="qwen3-4b",when="after_wait"} 1.0',
                 'kvroute_admitted_total{class="low",model="qwen3-4b",when="after_wait"} 1.0',
                 'kvroute_shed_total{class="low",model="qwen3-4b",reason="displaced"} 1.0',
                 'kvroute_tenant_tokens_total{model="qwen3-4b",tenant="team-b"}'):
        assert line in text, line


async def test_a_bad_priority_is_each_apis_400(one_slot, http):
    r, _ = await one_slot()
    oa = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0,
                            default_headers={"x-kvroute-priority": "urgent"})
    async with oa:
        with pytest.raises(openai.BadRequestError) as caught:
            await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                             max_tokens=5)
    assert caught.value.body["param"] == "x-kvroute-priority"
    an = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0,
                                  default_headers={"x-kvroute-priority": "urgent"})
    async with an:
        with pytest.raises(anthropic.BadRequestError) as err:
            await an.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "x-kvroute-priority" in err.value.body["error"]["message"]


async def test_the_client_header_reaches_session_admission(one_slot, http):
    """x-kvroute-client over HTTP: a client's second conversation ends its first one (quiet) in
    session admission's book at once."""
    r, _ = await one_slot(flow_session_admission=True)
    for sid in ("s1", "s2"):
        headers = {"x-claude-code-session-id": sid, "x-kvroute-client": "agent-7"}
        async with http.post(r.url + "/v1/chat/completions", json=chat(f"conversation {sid}", 5),
                             headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
    book = r.router.dispatch.flow._models[MODEL].door.book
    assert dict(book.clients) == {"agent-7": "s2"}
    assert "s1" not in book and "s2" in book and len(book.left) == 1


async def test_a_first_turn_predicted_past_the_ttl_is_shed_at_the_door_in_each_api(one_slot, http):
    """One client's three conversations, one after another, measure the door's drain (two left);
    the third stays served and the working set may hold nothing more (a tiny flow_session_fill).
    A new session's first turn would wait past the (tiny) TTL at that drain: it is shed at once
    with door_wait and Retry-After, as each API's overload error."""
    r, _ = await one_slot(flow_session_admission=True, flow_session_fill=1e-6,
                          flow_session_fill_unsaturated=0.0, flow_queue_ttl_s=0.001)
    for sid in ("s1", "s2", "s3"):
        headers = {"x-claude-code-session-id": sid, "x-kvroute-client": "agent-1"}
        async with http.post(r.url + "/v1/chat/completions", json=chat(f"conversation {sid}", 5),
                             headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    oa = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with oa:
        with pytest.raises(openai.RateLimitError) as caught:
            await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "new"}],
                                             max_tokens=5, extra_headers={"x-claude-code-session-id": "n1"})
    assert caught.value.status_code == 429
    assert caught.value.body["code"] == "door_wait"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    an = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with an:
        with pytest.raises(anthropic.APIStatusError) as err:
            await an.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "new"}],
                                     extra_headers={"x-claude-code-session-id": "n2"})
    assert err.value.status_code == 529
    assert err.value.body["error"]["type"] == "overloaded_error"
    assert int(err.value.response.headers["retry-after"]) >= 1
    assert r.router.dispatch.flow.shed[(MODEL, "door_wait", "normal")] == 2
    # a continuing turn of the served session is not held at the door
    async with http.post(r.url + "/v1/chat/completions", json=chat("conversation s3", 5),
                         headers={"x-claude-code-session-id": "s3"}) as resp:
        assert resp.status == 200
        await resp.read()
