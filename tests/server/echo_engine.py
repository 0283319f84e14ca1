"""A tiny real HTTP engine for proxy tests: vLLM-shaped endpoints with scripted misbehaviour.

The simulator (kvroute.sim) is what the behavioural tests use; this one exists for what a test
must control exactly: the bytes answered, the headers received, failing on the Nth request.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class Seen:
    """One request as the engine received it."""

    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class EchoEngine:
    """``mode``: ok | error (500 before any byte) | hang (never answers) | stall (a stream's head,
    then nothing) | drop (cuts the stream after the first event, or a plain body halfway) |
    garbage (a stream written in one piece with a line of garbage after its first event; a plain
    body that is not JSON) | whole (a stream's events and its end written at once) | late_body (a
    plain answer's head at once, its body ``delay_s`` later) |
    unhealthy (/health 503).  ``events`` and
    ``delay_s`` shape streams; ``reply`` is a plain answer's text; ``headers`` are added to every
    plain answer.  ``api_key``: like vLLM's ``--api-key``, /v1/* answers 401 without
    ``Authorization: Bearer`` that key."""

    model: str = "echo"
    mode: str = "ok"
    events: int = 3
    delay_s: float = 0.0
    reply: str = "hello"
    headers: dict[str, str] = field(default_factory=dict)
    metrics: bool = True
    api_key: str | None = None
    start_time: float = field(default_factory=time.time)
    running: int = 0
    served: int = 0
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> EchoEngine:
        app = web.Application()
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                     "/v1/responses", "/v1/embeddings"):
            app.router.add_post(path, self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def restart(self) -> None:
        """Pretend the engine restarted: a new process start time."""
        self.start_time += 100.0

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.mode == "unhealthy" else 200)

    def _refused(self, request: web.Request) -> web.Response | None:
        if self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}":
            return None
        return web.json_response({"error": {"message": "Unauthorized"}}, status=401)

    async def _models(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        doc = {"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": 8192}]}
        return web.json_response(doc)

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.metrics:
            return web.Response(status=404)
        labels = f'engine="0",model_name="{self.model}"'
        text = (
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {self.running}\n"
            f"vllm:num_requests_waiting{{{labels}}} 0.0\nvllm:kv_cache_usage_perc{{{labels}}} 0.25\n"
            f"vllm:prefix_cache_queries_total{{{labels}}} {100.0 * self.served}\n"
            f"vllm:prefix_cache_hits_total{{{labels}}} {50.0 * self.served}\n"
            f"vllm:prompt_tokens_total{{{labels}}} {100.0 * self.served}\n"
            f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",{labels}}} 1.0\n'
            f"process_start_time_seconds {self.start_time}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Seen(request.path, dict(request.headers), body))
        if (refused := self._refused(request)) is not None:
            return refused
        self.running += 1
        try:
            if self.mode == "error":
                return web.json_response({"error": {"message": "engine exploded", "code": 500}}, status=500)
            if self.mode == "hang":
                await asyncio.sleep(3600)
            doc = orjson.loads(body)
            if doc.get("stream"):
                return await self._stream(request, doc)
            if self.delay_s and self.mode != "late_body":
                await asyncio.sleep(self.delay_s)
            final = orjson.dumps(self._final(request.path, doc))
            if self.mode == "late_body":
                return await self._late(request, final)
            if self.mode == "garbage":
                final = final[: len(final) // 2]
            if self.mode == "drop":
                return await self._cut(request, final)
            self.served += 1
            return web.Response(body=final, content_type="application/json", headers=self.headers)
        finally:
            self.running -= 1

    def _final(self, path: str, doc: dict[str, Any]) -> dict[str, Any]:
        if path == "/v1/messages/count_tokens":
            return {"input_tokens": 10}
        if path == "/v1/responses":
            return {"id": "resp_1", "object": "response", "status": "completed", "model": self.model,
                    "output": [{"type": "message", "role": "assistant",
                                "content": [{"type": "output_text", "text": self.reply}]}],
                    "usage": {"input_tokens": 10, "output_tokens": 1}}
        if path == "/v1/embeddings":
            return {"object": "list", "model": self.model, "usage": {"prompt_tokens": 10, "total_tokens": 10},
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.5]}]}
        if path.startswith("/v1/messages"):
            return {"id": "msg_1", "type": "message", "role": "assistant", "model": self.model,
                    "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
                    "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 1}}
        return {"id": "cmpl-1", "object": "chat.completion", "created": 1, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.reply},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                          "prompt_tokens_details": {"cached_tokens": 4}}}

    def _events(self, path: str) -> list[bytes]:
        if path == "/v1/responses":
            def typed(name: str, data: dict[str, Any]) -> bytes:
                payload = orjson.dumps({"type": name, **data})
                return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"
            created = {"response": {"id": "resp_1", "status": "in_progress", "model": self.model}}
            return ([typed("response.created", created)]
                    + [typed("response.output_text.delta", {"delta": f"w{i} "}) for i in range(self.events)]
                    + [typed("response.completed", {"response": {
                        "id": "resp_1", "status": "completed",
                        "usage": {"input_tokens": 10, "output_tokens": self.events}}})])
        if path.startswith("/v1/messages"):
            def ev(name: str, data: dict[str, Any]) -> bytes:
                return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"
            message = {"id": "msg_1", "type": "message", "role": "assistant", "model": self.model,
                       "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": 10, "output_tokens": 0}}
            out = [ev("message_start", {"type": "message_start", "message": message}),
                   ev("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}})]
            out += [ev("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": f"w{i} "}})
                    for i in range(self.events)]
            out += [ev("content_block_stop", {"type": "content_block_stop", "index": 0}),
                    ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn",
                                         "stop_sequence": None}, "usage": {"output_tokens": self.events}}),
                    ev("message_stop", {"type": "message_stop"})]
            return out
        out = [b"data: " + orjson.dumps({
            "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": self.model,
            "choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}) + b"\n\n"
            for i in range(self.events)]
        out.append(b"data: " + orjson.dumps({
            "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": self.model, "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": self.events, "total_tokens": 13}}) + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return out

    async def _late(self, request: web.Request, body: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        await asyncio.sleep(self.delay_s)
        await resp.write(body)
        await resp.write_eof()
        self.served += 1
        return resp

    async def _cut(self, request: web.Request, body: bytes) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[: len(body) // 2])
        assert request.transport is not None
        request.transport.close()
        return resp

    async def _stream(self, request: web.Request, doc: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-engine": "echo"})
        await resp.prepare(request)
        if self.mode == "stall":
            await asyncio.sleep(3600)
        if self.mode == "garbage":
            first, *rest = self._events(request.path)
            await resp.write(first + b"\x00 not an event\n\n" + b"".join(rest))
            await resp.write_eof()
            return resp
        if self.mode == "whole":
            self.served += 1
            await resp.write_eof(b"".join(self._events(request.path)))  # the events and the end, one write
            return resp
        for i, event in enumerate(self._events(request.path)):
            if self.mode == "drop" and i == 1:
                await resp.write(event[: len(event) // 2])  # half an event, then the connection dies
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write(event)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        self.served += 1
        await resp.write_eof()
        return resp
