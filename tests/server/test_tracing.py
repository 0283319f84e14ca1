"""W3C trace context towards the workers, and OTLP trace spans (``otlp_endpoint``) received by a real
OTLP/HTTP endpoint on loopback (an aiohttp server decoding the protobuf export requests)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp import web

from kvroute.router_settings import Settings, parse_worker_spec
from kvroute.server.app import start_router

pytest.importorskip("opentelemetry.sdk.trace", reason="tracing needs kvroute[otel]")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
TRACESTATE = "vendor=opaque,other=1"
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello"}]}


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it was sent, with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.resources: list[dict[str, Any]] = []
        self.content_types: set[str] = set()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def _export(self, request: web.Request) -> web.Response:
        self.content_types.add(request.content_type)
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in export.resource_spans:
            self.resources.append({a.key: a.value.string_value for a in resource_spans.resource.attributes})
            for scope in resource_spans.scope_spans:
                self.spans.extend(scope.spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def named(self, name: str) -> list[Span]:
        return [s for s in self.spans if s.name == name]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    started = await Receiver().start()
    yield started
    await started.close()


def attrs(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        out[a.key] = getattr(a.value, kind) if kind else None
    return out


async def test_trace_context_reaches_the_worker_unchanged_without_tracing(echo_engines, router, http):
    [engine] = await echo_engines(1)
    r = await router([engine.url])
    headers = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    async with http.post(r.url + "/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
    got = {k.lower(): v for k, v in engine.seen[-1].headers.items()}
    assert got["traceparent"] == TRACEPARENT and got["tracestate"] == TRACESTATE


async def test_spans_continue_the_clients_trace_and_the_worker_gets_the_attempts_context(
        echo_engines, receiver, monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    bad, good = await echo_engines(2)
    bad.mode = "error"
    settings = Settings.from_dict({"probe_interval_s": 0.1, "policy": "round-robin", "retries": 1,
                                   "otlp_endpoint": receiver.url}).replace(
        workers=tuple(parse_worker_spec(e.url) for e in (bad, good)))
    r = await start_router(settings)
    try:
        ids = [rec.id for rec in r.registry.records()]
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="sk-client", max_retries=0)
        async with client:
            done = await client.chat.completions.create(
                model="echo", messages=CHAT["messages"],
                extra_headers={"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
            assert done.choices[0].message.content == "hello"
            # A request without trace context starts a trace of its own.
            await client.chat.completions.create(model="echo", messages=CHAT["messages"])
    finally:
        await r.close()  # flushes the spans still queued
    assert receiver.content_types == {"application/x-protobuf"}
    assert receiver.resources[0]["service.name"] == "kvroute"
    traced = [s for s in receiver.spans if s.trace_id.hex() == TRACE_ID]
    [root] = [s for s in traced if s.name == "POST /v1/chat/completions"]
    assert root.parent_span_id.hex() == CLIENT_SPAN and root.kind == Span.SPAN_KIND_SERVER
    assert attrs(root)["http.response.status_code"] == 200 and attrs(root)["kvroute.worker"] == ids[1]
    assert root.trace_state == TRACESTATE
    children = [s for s in traced if s.parent_span_id == root.span_id]
    routes = [s for s in children if s.name == "route"]
    attempts = sorted((s for s in children if s.name == "upstream attempt"),
                      key=lambda s: s.start_time_unix_nano)
    assert [attrs(s)["kvroute.worker"] for s in routes] == ids
    assert [attrs(s)["kvroute.worker"] for s in attempts] == ids
    assert all(attrs(s)["kvroute.decision.kind"] == "balance" for s in routes)
    failed, served = attempts
    assert failed.kind == served.kind == Span.SPAN_KIND_CLIENT
    assert failed.status.code == Status.STATUS_CODE_ERROR and attrs(failed)["error.type"] == "http_500"
    assert attrs(served)["http.response.status_code"] == 200
    for span in children:
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano
    # Each worker got the trace context of the attempt sent to it, the client's tracestate kept.
    sent = [{k.lower(): v for k, v in e.seen[0].headers.items()} for e in (bad, good)]
    for headers, attempt in zip(sent, (failed, served), strict=True):
        assert headers["traceparent"] == f"00-{TRACE_ID}-{attempt.span_id.hex()}-01"
        assert headers["tracestate"] == TRACESTATE
    assert sent[0]["authorization"] == "Bearer sk-client"  # tracing changes nothing else
    untraced = [s for s in receiver.named("POST /v1/chat/completions") if s.trace_id.hex() != TRACE_ID]
    assert len(untraced) == 1 and not untraced[0].parent_span_id
    later = {k.lower(): v for k, v in good.seen[-1].headers.items()}
    assert later["traceparent"].split("-")[1] == untraced[0].trace_id.hex()


async def test_a_queued_request_has_a_queue_wait_span(echo_engines, receiver):
    [engine] = await echo_engines(1, delay_s=0.3)
    spec = parse_worker_spec({"url": engine.url, "max_num_seqs": 1})
    settings = Settings.from_dict({"probe_interval_s": 0.1, "otlp_endpoint": receiver.url,
                                   "routing": {"flow_control": True}}).replace(workers=(spec,))
    r = await start_router(settings)
    try:
        client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="k", max_retries=0)
        async with client:
            await asyncio.gather(*(client.chat.completions.create(model="echo", messages=CHAT["messages"])
                                   for _ in range(2)))
    finally:
        await r.close()
    [wait] = receiver.named("queue wait")
    roots = {s.span_id: s for s in receiver.named("POST /v1/chat/completions")}
    assert wait.parent_span_id in roots
    assert wait.end_time_unix_nano - wait.start_time_unix_nano > 0.1e9  # behind the other's 0.3 s
    assert attrs(wait)["kvroute.queue.waited_s"] > 0.1


def test_tracing_is_off_unless_configured_and_says_what_is_missing(monkeypatch, caplog):
    from kvroute.server.tracing import Tracing, TracingUnavailable, traces_url

    assert traces_url("http://c:4318") == traces_url("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"
    assert Tracing.from_settings(None, env={}) is None
    assert Tracing.from_settings("http://c:4318", env={"OTEL_SDK_DISABLED": "true"}) is None
    # Without the SDK (an import of it fails): an explicit endpoint is an error, the environment a warning.
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(TracingUnavailable, match=r"pip install 'kvroute\[otel\]'"):
        Tracing.from_settings("http://c:4318", env={})
    assert Tracing.from_settings(None, env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) is None
    assert "no spans are exported" in caplog.text
