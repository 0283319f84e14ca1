"""Bounded fuzzing of the listening side against a real router and a real engine on loopback:
JSON bodies from hypothesis on every inference route, and mutated raw requests.  What must hold:
no 5xx from the router itself (an engine's own 5xx carries ``x-kvroute-worker``), every error in
its route's format, no hang (every connection answered or closed within a bound), no response cut
short, and the router serving afterwards with nothing counted as ``internal``."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import threading
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from echo_engine import EchoEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.router_settings import Settings, parse_worker_spec
from kvroute.server.app import RunningRouter, start_router
from kvroute_dev.raw_http import HEALTH, Conversation, exchange, mutate, post

ROUTES = {
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
    "/v1/responses": "openai",
    "/v1/embeddings": "openai",
}
# Short timeouts so that requests the mutations leave incomplete are answered (408) quickly.
FUZZ_SETTINGS = {"probe_interval_s": 0.2, "header_timeout_s": 0.3, "body_timeout_s": 0.3,
                 "keepalive_timeout_s": 0.3, "max_body_bytes": 256 * 1024, "max_header_bytes": 8192,
                 "max_headers": 64, "shutdown_timeout_s": 1.0}


class _Served:
    """An engine and a router on their own event loop in a thread, for synchronous clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine, self.router = self._run(self._start())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self) -> tuple[EchoEngine, RunningRouter]:
        engine = await EchoEngine(events=2).start()
        s = Settings.from_dict(FUZZ_SETTINGS).replace(workers=(parse_worker_spec(engine.url),))
        return engine, await start_router(s)

    async def _stop(self) -> None:
        await self.router.close()
        await self.engine.close()

    def close(self) -> None:
        self._run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def served() -> Iterator[_Served]:
    s = _Served()
    yield s
    s.close()


def _check(status: int, headers: http.client.HTTPMessage, body: bytes, style: str) -> None:
    if status >= 500:
        assert headers.get("x-kvroute-worker"), (status, body[:300])  # the engine's own answer
        return
    if status >= 400:
        doc = orjson.loads(body)
        if style == "anthropic":
            assert doc["type"] == "error" and {"type", "message"} <= set(doc["error"])
        else:
            assert {"message", "type", "param", "code"} == set(doc["error"])


def _deep(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
parts = st.fixed_dictionaries({"type": st.sampled_from(
    ["text", "image_url", "tool_use", "tool_result", "input_image", "image", "document", "file", "x"])},
    optional={"text": json_values, "image_url": json_values, "input": json_values, "source": json_values,
              "content": json_values, "id": json_values})
content = st.text(max_size=20) | json_values | st.lists(parts, max_size=2)
messages = st.lists(st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "assistant", "tool"]) | json_values, "content": content,
    "tool_calls": json_values}), max_size=2)
# The fields the router reads, each absent, plausible or anything.
plausible = st.fixed_dictionaries({"model": st.just("echo") | json_values}, optional={
    "messages": messages | json_values, "tools": st.lists(json_values, max_size=2),
    "prompt": json_values, "input": json_values | messages, "system": content,
    "stream": st.booleans(), "max_tokens": json_values, "metadata": json_values})


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["plausible", "any", "deep", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "any":
        return json.dumps(draw(json_values)).encode()
    doc = draw(plausible)
    raw = json.dumps(doc).encode()  # integers beyond 64 bits included
    if kind == "deep":
        # Somewhere the router re-serialises (or not), nested past what it can write.
        field = draw(st.sampled_from(["tools", "messages", "input", "system", "metadata", "prompt"]))
        depth = draw(st.integers(200, 1100))
        doc[field] = "@@deep@@"
        raw = json.dumps(doc).encode().replace(b'"@@deep@@"', b"[" + _deep(depth) + b"]")
    return raw


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(path=st.sampled_from(sorted(ROUTES)), body=bodies())
def test_fuzzed_bodies_never_get_a_router_5xx(served: _Served, path: str, body: bytes) -> None:
    host, port = served.router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=15)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    _check(resp.status, resp.headers, data, ROUTES[path])


BASES = [
    post(b"/v1/chat/completions", orjson.dumps({"model": "echo",
                                                "messages": [{"role": "user", "content": "hi"}]})),
    post(b"/v1/messages", orjson.dumps({"model": "echo", "max_tokens": 4, "stream": True,
                                        "messages": [{"role": "user", "content": "hi"}]})),
    post(b"/v1/responses", orjson.dumps({"model": "echo", "input": "hi"}), b"expect: 100-continue\r\n"),
    b"GET /v1/models HTTP/1.1\r\nhost: x\r\nanthropic-version: 2023-06-01\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    b"10\r\n{\"model\":\"echo\",\r\n11\r\n\"prompt\":\"abcdef\"\r\n1\r\n}\r\n0\r\n\r\n",
    HEALTH,
]
TOKENS = [b"\r\n", b"\n", b"\r", b"\x00", b" ", b":", b"%", b"%00", b"%2F", b"\xff", b"\r\n\r\n",
          b"transfer-encoding: chunked\r\n", b"content-length: 99999999\r\n", b"content-length: -1\r\n",
          b"upgrade: h2c\r\nconnection: upgrade\r\n", b"expect: 100-continue\r\n", b"x" * 9000,
          b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1", b"\t", b"{", b"}", b"[" * 300, b"0\r\n\r\n"]


def _metric(text: str, name: str, reason: str) -> float:
    m = re.search(rf'^{name}\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def fuzz_raw(url: str, count: int, *, seed: int = 17, concurrency: int = 50,
                   timeout: float = 10.0) -> dict[str, int]:
    """Send ``count`` mutated requests, each followed by a well-formed ``GET /health``, on their own
    connections; asserts the invariants and returns tallies."""
    rng = random.Random(seed)
    cases = [(base, mutate(rng, base, TOKENS) if i % 10 else base) for i, base in
             ((i, rng.choice(BASES)) for i in range(count))]
    gate = asyncio.Semaphore(concurrency)
    reset_cases: list[tuple[bytes, list[int]]] = []
    tally = {"connections": 0, "answers": 0, "router_5xx": 0, "unanswered": 0, "cut_short": 0, "resets": 0}

    async def one(base: bytes, data: bytes) -> None:
        async with gate:
            conv: Conversation = await exchange(url, data + HEALTH, timeout=timeout)
        tally["connections"] += 1
        tally["answers"] += len(conv.answers)
        tally["router_5xx"] += sum(1 for a in conv.answers
                                   if a.status >= 500 and b"x-kvroute-worker" not in a.headers)
        tally["cut_short"] += sum(1 for a in conv.answers if not a.complete)
        tally["resets"] += conv.reset
        if conv.reset:
            reset_cases.append((data, conv.statuses))
        if not conv.answers:
            tally["unanswered"] += 1
        if data == base:  # untouched: both requests answered
            assert [a.status for a in conv.answers][-1:] == [200] and len(conv.answers) == 2, (
                conv.statuses, conv.reset, conv.closed, conv.interim, data[:120])

    await asyncio.gather(*(one(base, data) for base, data in cases))
    # Every close is clean: an answer is never lost to a reset.
    assert not reset_cases, [(statuses, data[:200]) for data, statuses in reset_cases[:3]]
    return tally


async def test_mutated_raw_requests_are_answered_or_closed_never_hung(echo_engines, router, http):
    [engine] = await echo_engines(1, events=2)
    # Client, router and engine share this test's event loop: a keep-alive timeout shorter than
    # its lag under load would close connections whose client has not written yet.
    r = await router([engine.url], **{**FUZZ_SETTINGS, "keepalive_timeout_s": 1.0})
    tally = await fuzz_raw(r.url, 600, concurrency=100)
    assert tally["connections"] == 600
    assert tally["router_5xx"] == 0 and tally["unanswered"] == 0 and tally["cut_short"] == 0, tally
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    assert _metric(text, "kvroute_failures_total", "internal") == 0
    conv = await exchange(r.url, BASES[0], count=1)
    assert conv.statuses == [200]
