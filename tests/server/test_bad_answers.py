"""Replicas that stall mid-stream or answer 200 with something that is not an answer: the client
gets an error in its API's format within the stream idle deadline, a retry where nothing had gone
out yet, and the replica's breaker hears of every one.  Simulated replicas over loopback HTTP with
their fault API (one `kvroute sim` process stopped with SIGSTOP), the official SDKs where the
client's view matters."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_process import wait_ready

from kvroute.router_settings import Settings, SettingsError
from kvroute.server.answer_shape import body_answer, body_start_problem, first_event_problem, sse_problem
from kvroute.server.app import RunningRouter
from kvroute.server.proxy import stream_idle_deadline
from kvroute.server.routes import HTTP_ROUTES

MODEL = "qwen3-4b"
ROUTES = {r.name: r for r in HTTP_ROUTES}
# Short deadlines: simulated replicas send a token every few milliseconds.
IDLE = {"stream_idle_floor_s": 0.3, "stream_idle_timeout_s": 1.0}
PROMPT = "Tell me about prefix caching. " * 20
SIM = [sys.executable, "-c", "from kvroute.cli import main; main()", "sim"]


async def metrics(http: aiohttp.ClientSession, r: RunningRouter) -> dict[tuple[str, tuple[Any, ...]], float]:
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def failures(m: dict[tuple[str, tuple[Any, ...]], float], reason: str) -> float:
    return m.get(("kvroute_failures_total", (("reason", reason),)), 0.0)


async def set_fault(http: aiohttp.ClientSession, url: str, **fault: Any) -> None:
    async with http.post(url + "/admin/fault", json=fault) as resp:
        assert resp.status == 200, await resp.text()


def worker_at(r: RunningRouter, url: str) -> str:
    return next(rec.id for rec in r.registry.records() if rec.state.url == url)


async def raw_chat(http: aiohttp.ClientSession, r: RunningRouter, i: int, *, stream: bool,
                   path: str = "/v1/chat/completions", max_tokens: int = 12) -> tuple[int, str, bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"{i}: {PROMPT}"}],
            "max_tokens": max_tokens, "stream": stream}
    async with http.post(r.url + path, json=body) as resp:
        return resp.status, resp.headers.get("x-kvroute-worker", ""), await resp.read()


# --- the pure parts ------------------------------------------------------------------------------

def test_the_stream_idle_deadline_follows_the_workers_gap_within_floor_and_ceiling() -> None:
    s = Settings(stream_idle_factor=50.0, stream_idle_floor_s=30.0, stream_idle_timeout_s=120.0)
    assert stream_idle_deadline(s, None) == 120.0  # no stream finished yet: the ceiling
    assert stream_idle_deadline(s, 0.02) == 30.0  # 1 s derived: the floor
    assert stream_idle_deadline(s, 1.0) == 50.0
    assert stream_idle_deadline(s, 10.0) == 120.0  # the ceiling
    assert stream_idle_deadline(s.replace(stream_idle_factor=0.0), 1.0) == 120.0  # fixed
    # Never longer than the read timeout that bounds every silence anyway (the pool takes the min).
    assert Settings().stream_idle_timeout_s < Settings().upstream_read_timeout_s


@pytest.mark.parametrize(("raw", "message"), [
    ({"stream_idle_floor_s": 0}, "stream_idle_floor_s must be positive and at most stream_idle_timeout_s"),
    ({"stream_idle_floor_s": 200}, "stream_idle_floor_s must be positive and at most stream_idle_timeout_s"),
    ({"stream_idle_factor": -1}, "stream_idle_factor must not be negative"),
    ({"max_event_bytes": 0}, "max_event_bytes must be positive"),
])
def test_bad_stream_settings_are_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_dict(raw)


@pytest.mark.parametrize("events", [
    b'data: {"choices":[]}\n\n',
    b'data: {"choices":[]}\n\ndata: {"choices":[]}\n\ndata: [DONE]\n\n',
    b'event: message_start\ndata: {"type":"message_start"}\n\nevent: ping\ndata: {"type": "ping"}\n\n',
    b'data:{"a":1}\r\n\r\ndata: {"b": 2} \r\n\r\n',  # CRLF, no space after the colon, a trailing space
    b': keep-alive comment\n\nid: 7\nretry: 100\ndata: {"x":"}"}\n\n',
])
def test_what_engines_send_is_an_event_stream(events: bytes) -> None:
    assert sse_problem(events, 1 << 20) is None


@pytest.mark.parametrize("events", [
    b"\x00\xff<html>502</html>\n\n",
    b'data: {"choices":[]}\n\ngarbage\n\n',  # garbage after a good event in the same read
    b"data: not json\n\n",
    b'data: {"choices":[]\n\n',  # cut JSON
    b"data:\n\n",
    b'{"choices": []}\n\n',  # JSON, not SSE
    b'event: message_start\nGARBAGE\ndata: {"type":"message_start"}\n\n',
])
def test_what_is_not_an_event_stream_is_named(events: bytes) -> None:
    assert sse_problem(events, 1 << 20) is not None


def test_an_event_over_the_limit_is_malformed_one_under_it_is_not() -> None:
    small = b'data: {"choices":[]}\n\n'
    big = b'data: {"t":"' + b"x" * 1000 + b'"}\n\n'
    assert sse_problem(big, 1000) is not None and "max_event_bytes" in sse_problem(big, 1000)  # type: ignore[operator]
    assert sse_problem(small * 100, 1000) is None  # many small events read together are fine
    anthropic_big = b"event: content_block_delta\n" + big
    assert sse_problem(small + anthropic_big, 1000) is not None


def test_the_first_event_and_a_plain_body_must_be_the_routes_answer() -> None:
    chat, messages = ROUTES["chat"], ROUTES["messages"]
    assert first_event_problem(chat, b'data: {"choices":[{"delta":{}}]}\n\n') is None
    assert first_event_problem(chat, b'data: {"error":{"message":"bad"}}\n\n') is None  # the engine's own
    assert first_event_problem(chat, b'data: {"object":"x"}\n\n') is not None
    assert first_event_problem(chat, b": keep-alive\n\n") is None  # no data yet: nothing to judge
    assert first_event_problem(messages, b'event: message_start\ndata: {"type":"message_start"}\n\n') is None
    assert first_event_problem(messages, b"event: message_start\ndata: [1]\n\n") is not None
    doc, problem = body_answer(chat, b'{"choices":[{"message":{"content":"hi"}}],"usage":{}}')
    assert problem is None and doc["choices"]
    assert body_answer(chat, b'{"choices": null}')[1] is not None
    assert body_answer(chat, b'{"error": {"message": "x"}}')[1] is not None
    assert body_answer(chat, b"\xff\xfe")[1] is not None
    assert body_answer(ROUTES["count_tokens"], b'{"input_tokens": 12}')[1] is None
    assert body_answer(ROUTES["embeddings"], b'{"data": [{"embedding": [0.1]}]}')[1] is None
    assert body_answer(ROUTES["responses"], b'{"output": []}')[1] is None
    assert body_start_problem(chat, b'  {"choices": [') is None
    assert body_start_problem(chat, b"<html>") is not None


# --- stalls --------------------------------------------------------------------------------------

async def test_a_stream_that_stalls_ends_with_an_openai_error_event_within_the_deadline(
        sim_fleet, router, http):
    fleet = await sim_fleet(1)
    r = await router(fleet.urls, **IDLE, routing={"canary": False})
    wid = worker_at(r, fleet.urls[0])
    await set_fault(http, fleet.urls[0], kind="stall", after_tokens=3, count=1)
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    pieces = []
    t0 = time.perf_counter()
    async with client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=40, stream=True)
        with pytest.raises(openai.APIError, match="mid-stream \\(stream_idle_timeout"):
            async for chunk in stream:
                pieces.append(chunk)
    took = time.perf_counter() - t0
    assert len(pieces) == 4  # the role chunk and three tokens reached the client first
    # The ceiling (1 s: no stream of this worker has finished yet) plus the sweep's precision
    # (1 s), far from upstream_read_timeout_s (600 s); generous for a loaded machine.
    assert 1.0 <= took < 8.0
    m = await metrics(http, r)
    assert failures(m, "stream_idle_timeout") == 1 and failures(m, "midstream") == 0
    record = r.registry.get(wid)
    assert record.breaker.failures == 1 and record.last_error.startswith("midstream stream_idle_timeout")
    for _ in range(100):  # the router closed the connection: the engine aborted the request
        if not fleet.replicas[0].engine.has_work():
            break
        await asyncio.sleep(0.02)
    assert not fleet.replicas[0].engine.has_work() and record.state.inflight == 0


async def test_a_stalled_anthropic_stream_ends_with_an_error_event(sim_fleet, router, http):
    fleet = await sim_fleet(1)
    r = await router(fleet.urls, **IDLE, routing={"canary": False})
    await set_fault(http, fleet.urls[0], kind="stall", after_tokens=2, count=1)
    client = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with client:
        with pytest.raises(anthropic.APIStatusError, match="stream_idle_timeout") as caught:
            async with client.messages.stream(model=MODEL, max_tokens=40,
                                              messages=[{"role": "user", "content": PROMPT}]) as stream:
                async for _ in stream.text_stream:
                    pass
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]


async def test_once_streams_finished_a_stall_is_cut_at_the_floor_and_three_open_the_breaker(
        sim_fleet, router, http):
    fleet = await sim_fleet(2)
    # A ceiling far above the floor: the deadline that cuts the stall must be the derived one.
    r = await router(fleet.urls, policy="round-robin", stream_idle_floor_s=0.3, stream_idle_timeout_s=60.0,
                     breaker_cooldown_s=60.0, routing={"canary": False})
    victim = worker_at(r, fleet.urls[0])
    for i in range(4):  # two good streams on each: both workers' gaps are known
        status, _, body = await raw_chat(http, r, i, stream=True)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    gap = r.registry.get(victim).read_gap_s
    assert gap is not None and gap * 50 < 0.3  # so the deadline is the floor
    await set_fault(http, fleet.urls[0], kind="stall", after_tokens=2)
    cut = []
    for i in range(4, 12):
        t0 = time.perf_counter()
        status, worker, body = await raw_chat(http, r, i, stream=True)
        assert status == 200
        if worker == victim:
            assert b'"code":504' in body.rsplit(b"\n\n", 2)[-2]
            cut.append(time.perf_counter() - t0)
        else:
            assert body.endswith(b"data: [DONE]\n\n")
    # Three stalls, each cut at the 0.3 s floor (+ up to 1 s of sweep), then the breaker is open.
    assert len(cut) == 3 and max(cut) < 5.0
    record = r.registry.get(victim)
    assert record.breaker.state.value == "open" and record.breaker.reason.startswith("failures: midstream")
    m = await metrics(http, r)
    assert failures(m, "stream_idle_timeout") == 3
    assert m[("kvroute_ejections_total", (("reason", "failures"), ("worker", victim)))] == 1


async def test_a_plain_body_that_stalls_before_it_is_whole_is_retried(sim_fleet, router, http):
    fleet = await sim_fleet(2)
    r = await router(fleet.urls, policy="round-robin", **IDLE, routing={"canary": False})
    victim = worker_at(r, fleet.urls[0])
    await set_fault(http, fleet.urls[0], kind="stall")
    for i in range(2):  # round robin: one of them goes to the stalling replica first
        status, worker, body = await raw_chat(http, r, i, stream=False)
        assert status == 200 and worker != victim and orjson.loads(body)["choices"]
    m = await metrics(http, r)
    stalled = failures(m, "stream_idle_timeout")
    assert stalled >= 1 and m[("kvroute_retries_total", (("reason", "stream_idle_timeout"),))] == stalled


async def test_a_plain_answers_head_long_before_its_body_is_not_cut(echo_engines, router, http):
    """An engine may send a plain answer's head at once and its body when generation ends: the
    idle deadline starts with the body, not the head."""
    [engine] = await echo_engines(1, mode="late_body", delay_s=1.5)
    r = await router([engine.url], **IDLE, first_byte_factor=0.0)
    async with http.post(r.url + "/v1/chat/completions", json={
            "model": "echo", "messages": [{"role": "user", "content": "x"}]}) as resp:
        assert resp.status == 200 and (await resp.json())["choices"]
    assert failures(await metrics(http, r), "stream_idle_timeout") == 0


async def test_a_replica_stopped_with_sigstop_mid_stream_gets_its_client_an_error_event(router, http):
    """The reported case: a replica process stopped (SIGSTOP) while it streams.  Its client gets an
    error event within the deadline, not after upstream_read_timeout_s."""
    port = _free_port()
    sim = subprocess.Popen([*SIM, "--preset", "a4000-qwen3-4b", "--port", str(port), "--speed", "5",
                            "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(http, url, sim, "/health")
        r = await router([url], **IDLE, routing={"canary": False})
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4000,
                "ignore_eos": True, "stream": True}
        async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            got = await resp.content.readuntil(b"\n\n")
            os.kill(sim.pid, signal.SIGSTOP)
            t0 = time.perf_counter()
            async with asyncio.timeout(30):
                got += await resp.read()
            took = time.perf_counter() - t0
        last = orjson.loads(got.rsplit(b"\n\n", 2)[-2][6:])
        assert last["error"]["code"] == 504 and "stream_idle_timeout" in last["error"]["message"]
        assert took < 8.0  # the 1 s ceiling plus the sweep, far from 600 s
    finally:
        os.kill(sim.pid, signal.SIGCONT)
        sim.terminate()
        sim.wait(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- answers that are not answers ----------------------------------------------------------------

async def test_a_garbage_answering_replica_is_retried_past_and_ejected_within_three_bad_answers(
        sim_fleet, router, http):
    fleet = await sim_fleet(2)
    r = await router(fleet.urls, policy="round-robin", breaker_cooldown_s=60.0, routing={"canary": False})
    victim = worker_at(r, fleet.urls[0])
    await set_fault(http, fleet.urls[0], kind="garbage", after_tokens=0)
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        for i in range(10):  # streamed and plain in turn: every client gets a proper answer
            messages = [{"role": "user", "content": f"{i}: {PROMPT}"}]
            if i % 2:
                done = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
                assert done.choices[0].message.content
            else:
                stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                                              stream=True)
                assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    record = r.registry.get(victim)
    assert record.breaker.state.value == "open" and record.breaker.reason.startswith("failures: malformed")
    m = await metrics(http, r)
    # Exactly three bad answers: the breaker opened on the third and nothing went there since.
    assert failures(m, "malformed") == 3
    assert m[("kvroute_retries_total", (("reason", "malformed"),))] == 3
    assert m[("kvroute_ejections_total", (("reason", "failures"), ("worker", victim)))] == 1


@pytest.mark.parametrize("kind", ["garbage", "wrong_shape"])
async def test_with_nowhere_else_a_body_that_is_no_answer_is_a_502_in_the_apis_format(
        sim_fleet, router, http, kind):
    fleet = await sim_fleet(1)
    r = await router(fleet.urls, routing={"canary": False})
    await set_fault(http, fleet.urls[0], kind=kind, after_tokens=0)
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        with pytest.raises(openai.InternalServerError, match="malformed") as caught:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
        assert caught.value.status_code == 502
    aclient = anthropic.AsyncAnthropic(base_url=r.url, api_key="sk-ant-test", max_retries=0)
    async with aclient:
        with pytest.raises(anthropic.InternalServerError) as acaught:
            await aclient.messages.create(model=MODEL, max_tokens=4,
                                          messages=[{"role": "user", "content": "x"}])
        assert acaught.value.status_code == 502
        assert acaught.value.body["error"]["type"] == "api_error"  # type: ignore[index]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_garbage_mid_stream_never_reaches_the_client_which_gets_an_error_event(
        sim_fleet, router, http, path):
    fleet = await sim_fleet(1)
    r = await router(fleet.urls, routing={"canary": False})
    wid = worker_at(r, fleet.urls[0])
    await set_fault(http, fleet.urls[0], kind="garbage", after_tokens=3, count=1)
    status, _, body = await raw_chat(http, r, 0, stream=True, path=path, max_tokens=20)
    assert status == 200 and b"\x00" not in body and b"<html>" not in body
    events = body.split(b"\n\n")[:-1]
    if path == "/v1/messages":
        assert events[-1].startswith(b"event: error\ndata: ")
        error = orjson.loads(events[-1].split(b"data: ", 1)[1])
        assert error["error"]["type"] == "api_error" and "malformed" in error["error"]["message"]
    else:
        error = orjson.loads(events[-1][6:])
        assert error["error"]["code"] == 502 and "malformed" in error["error"]["message"]
    assert all(orjson.loads(e.split(b"data: ", 1)[1]) for e in events)  # every event relayed is whole
    m = await metrics(http, r)
    assert failures(m, "malformed") == 1 and r.registry.get(wid).breaker.failures == 1
    # The replica answers well again: its next stream goes through, and its streak ends.
    status, _, body = await raw_chat(http, r, 1, stream=True, path=path)
    assert status == 200 and b"error" not in body and r.registry.get(wid).breaker.failures == 0


async def test_an_answer_read_whole_before_anything_went_out_is_checked_whole(echo_engines, router, http):
    [engine] = await echo_engines(1, mode="garbage")
    r = await router([engine.url])
    record = r.registry.records()[0]
    ask = {"model": "echo", "messages": [{"role": "user", "content": "x"}]}
    # A stream written in one piece, garbage after its good first event: every event read before
    # the head goes out is checked, so the client gets a 502, not half a stream.
    async with http.post(r.url + "/v1/chat/completions", json={**ask, "stream": True}) as resp:
        assert resp.status == 502 and "malformed" in (await resp.json())["error"]["message"]
    # A plain body that is not JSON: 502, never the half body.
    async with http.post(r.url + "/v1/chat/completions", json=ask) as resp:
        assert resp.status == 502 and "malformed" in (await resp.json())["error"]["message"]
    assert record.breaker.failures == 2 and record.last_error.startswith("malformed: the body is not JSON")


async def test_an_event_over_max_event_bytes_ends_the_stream(sim_fleet, router, http):
    fleet = await sim_fleet(1)
    r = await router(fleet.urls, max_event_bytes=64 * 1024, routing={"canary": False})
    await set_fault(http, fleet.urls[0], kind="oversized", after_tokens=2, size=100_000, count=1)
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0)
    async with client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=20, stream=True)
        with pytest.raises(openai.APIError, match="max_event_bytes"):
            async for _ in stream:
                pass
    assert failures(await metrics(http, r), "malformed") == 1


async def test_a_stream_whose_first_event_is_no_answer_is_retried(sim_fleet, router, http):
    fleet = await sim_fleet(2)
    r = await router(fleet.urls, policy="round-robin", routing={"canary": False})
    victim = worker_at(r, fleet.urls[0])
    await set_fault(http, fleet.urls[0], kind="wrong_shape", count=1)
    status, worker, body = await raw_chat(http, r, 0, stream=True)
    assert status == 200 and worker != victim and body.endswith(b"data: [DONE]\n\n")
    assert b"wrong_shape" not in body
    assert failures(await metrics(http, r), "malformed") == 1


async def test_a_replica_whose_streams_only_are_garbage_is_ejected_within_three_bad_answers(
        sim_fleet, router, http):
    """Its plain answers are good, so its failures seldom come three in a row (when retries do not
    shift the rotation): the bad answers are counted apart, among its last answers, and eject it
    on the third either way (tests/fleet/test_breaker.py has the interleaved case exactly)."""
    fleet = await sim_fleet(3)
    r = await router(fleet.urls, policy="round-robin", max_event_bytes=64 * 1024, breaker_cooldown_s=60.0,
                     routing={"canary": False})
    victim = worker_at(r, fleet.urls[0])
    await set_fault(http, fleet.urls[0], kind="oversized", after_tokens=1, size=100_000)
    good_between = False
    for i in range(30):
        status, _, body = await raw_chat(http, r, i, stream=i % 2 == 0)
        assert status == 200 and b"x" * 70_000 not in body  # no oversized event reached a client
        breaker = r.registry.get(victim).breaker
        good_between = good_between or (breaker.state.value == "closed" and breaker.malformed > 0
                                        and breaker.failures == 0)
    m = await metrics(http, r)
    assert failures(m, "malformed") == 3  # the third bad answer ejected it: nothing went there since
    ejections = {labels: n for (name, labels), n in m.items()
                 if name == "kvroute_ejections_total" and ("worker", victim) in labels}
    assert sum(ejections.values()) == 1 and r.registry.get(victim).breaker.state.value == "open"
    if good_between:  # a good answer ended the streak: only the count of bad ones can have done it
        assert ejections == {(("reason", "malformed"), ("worker", victim)): 1}
