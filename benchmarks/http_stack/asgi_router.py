"""EXPERIMENT, not product code: kvroute's inference path served as an ASGI application, so that
the same routing and forwarding can run behind granian (Rust, hyper) or uvicorn (httptools, uvloop)
and be measured against ``kvroute serve``'s hand-written listening side (issue 17).

What runs per request is kvroute's own code, unchanged: ``front_handler`` (orjson parse,
``parse_request``, the ``Dispatcher``/``Scheduler`` decision, metrics, activity log) and
``Proxy.forward`` (the ``server/upstream.py`` keep-alive pool to the replicas, retries before the
first byte, SSE relay on event boundaries, mid-stream error events).  The only new code is the
adapter between kvroute's ``ResponseWriter`` interface and ASGI ``send``/``receive``: what any
switch to an ASGI server would have to add.  The aiohttp application (``/v1/models``, admin, …)
is started for its startup hooks (upstream pool, first probe round, periodic probes) but not
served: a switch would mount it differently; it is not on the measured path.

Configuration from the environment: ``HTTPSTACK_WORKERS`` (comma-separated replica URLs),
``HTTPSTACK_PROBE_INTERVAL_S`` (default 1.0).  Logging at WARNING, as ``kvroute serve
--log-level warning`` in the benchmarks.

    granian --interface asgi --loop uvloop --workers 1 --host 127.0.0.1 --port 8100 \\
        --app-dir benchmarks/http_stack asgi_router:app
    uvicorn --loop uvloop --http httptools --no-access-log --host 127.0.0.1 --port 8101 \\
        --app-dir benchmarks/http_stack asgi_router:app
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import web
from kvroute.config import Settings

from kvroute.server.app import build_app, front_handler
from kvroute.server.context import ROUTER
from kvroute.server.front import FrontRequest
from kvroute.server.proxy import Proxy
from kvroute.server.upstream import Origin

logging.basicConfig(level=logging.WARNING)

# Bytes queued for the client above which the upstream is paused (the hand-written side relies on
# the transport's own high-water mark, 64 KiB by default).
_HIGH_WATER = 64 * 1024
_LOW_WATER = 16 * 1024
LEAN = os.environ.get("HTTPSTACK_LEAN") == "1"


def _header_list(headers: bytes) -> list[tuple[bytes, bytes]]:
    """``name: value\\r\\n`` lines (kvroute's serialised form) as ASGI header pairs."""
    out = []
    for line in headers.split(b"\r\n"):
        if line:
            name, _, value = line.partition(b":")
            out.append((name.strip().lower(), value.strip()))
    return out


class _Abort(Exception):
    """Raised out of the ASGI app to make the server cut the connection."""


class AsgiWriter:
    """kvroute's ``ResponseWriter`` interface on top of ASGI ``send``: writes are queued
    synchronously (as kvroute's relay expects) and a pump coroutine awaits ``send`` for them."""

    __slots__ = (
        "_events",
        "_pending",
        "_wake",
        "aborted",
        "finished",
        "keep_alive",
        "lost",
        "pause_hook",
        "paused",
        "started",
    )

    def __init__(self) -> None:
        self._events: deque[dict[str, Any]] = deque()
        self._pending = 0
        self._wake = asyncio.Event()
        self.started = self.finished = self.aborted = self.lost = self.paused = False
        self.keep_alive = True
        self.pause_hook: Callable[[bool], None] | None = None

    def _push(self, event: dict[str, Any], size: int = 0) -> None:
        self._events.append(event)
        self._pending += size
        self._wake.set()
        if not self.paused and self._pending > _HIGH_WATER:
            self.paused = True
            if self.pause_hook is not None:
                self.pause_hook(True)

    def on_pause(self, hook: Callable[[bool], None] | None) -> None:
        self.pause_hook = hook
        if hook is not None and self.paused:
            hook(True)

    def respond(
        self, status: int, headers: bytes, body: bytes, reason: bytes = b"", *, length: int | None = None
    ) -> None:
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        hdrs = _header_list(headers)
        hdrs.append((b"content-length", b"%d" % (len(body) if length is None else length)))
        self._push({"type": "http.response.start", "status": status, "headers": hdrs})
        self._push({"type": "http.response.body", "body": body, "more_body": False}, len(body))

    def start(
        self, status: int, headers: bytes, *, length: int | None, reason: bytes = b"", defer: bool = False
    ) -> None:
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        hdrs = _header_list(headers)
        if length is not None:
            hdrs.append((b"content-length", b"%d" % length))
        self._push({"type": "http.response.start", "status": status, "headers": hdrs})

    def write(self, data: bytes) -> None:
        if data:
            self._push({"type": "http.response.body", "body": data, "more_body": True}, len(data))

    def end(self) -> None:
        if not self.finished:
            self.finished = True
            self._push({"type": "http.response.body", "body": b"", "more_body": False})

    def abort(self) -> None:
        self.finished = self.aborted = True
        self.keep_alive = False
        self._wake.set()

    async def pump(self, send: Callable[[dict[str, Any]], Any], handler: asyncio.Task[None]) -> None:
        """Send what is queued until the handler is done and the queue is empty."""
        events = self._events
        while True:
            while events:
                event = events.popleft()
                await send(event)
                body = event.get("body")
                if body:
                    self._pending -= len(body)
                    if self.paused and self._pending < _LOW_WATER:
                        self.paused = False
                        if self.pause_hook is not None:
                            self.pause_hook(False)
            if self.aborted:
                raise _Abort("response cannot be completed")
            if handler.done():
                return
            self._wake.clear()
            waiter = asyncio.ensure_future(self._wake.wait())
            await asyncio.wait((waiter, handler), return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()


def make_app() -> Callable[..., Any]:
    workers = [u for u in os.environ.get("HTTPSTACK_WORKERS", "").split(",") if u]
    settings = Settings.load(
        overrides={
            "workers": workers,
            "probe_interval_s": float(os.environ.get("HTTPSTACK_PROBE_INTERVAL_S", "1.0")),
        }
    )
    state: dict[str, Any] = {}
    limit = settings.max_body_bytes

    async def lifespan(receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                aio = build_app(settings)
                runner = web.AppRunner(aio, access_log=None)
                await runner.setup()  # runs kvroute's startup hooks: upstream pool, probes
                router = aio[ROUTER]
                state["runner"] = runner
                state["router"] = router
                state["handle"] = front_handler(router, Proxy(router), Origin.from_url("unix:/nonexistent"))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                state["router"].shut_down()
                await state["runner"].cleanup()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        # Read the whole body (bounded, as kvroute's listening side does).  A declared length over
        # the limit is refused before the first receive(): ASGI servers send "100 Continue" on
        # the first receive(), so this is how an ASGI app answers 413 early on Expect.
        parts: list[bytes] = []
        size = 0
        too_large = False
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > limit:
                too_large = True
        while not too_large:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            if chunk and not too_large:
                size += len(chunk)
                if size > limit:
                    too_large, parts = True, []
                else:
                    parts.append(chunk)
            if not message.get("more_body", False):
                break
        query = scope.get("query_string", b"")
        raw_path = scope.get("raw_path") or scope["path"].encode()
        request = FrontRequest(
            method=scope["method"].encode(),
            target=raw_path + (b"?" + query if query else b""),
            path=scope["path"],
            headers=list(scope["headers"]),
            body=parts[0] if len(parts) == 1 else b"".join(parts),
            http_minor=1 if scope.get("http_version", "1.1") != "1.0" else 0,
            keep_alive=True,
            too_large=too_large,
        )
        writer = AsgiWriter()
        handler = asyncio.ensure_future(state["handle"](request, writer))  # type: ignore[arg-type]

        async def watch_disconnect() -> None:
            # A client that goes away cancels the handler, which aborts the upstream request.
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    writer.lost = True
                    handler.cancel()
                    return

        # HTTPSTACK_LEAN=1 leaves the watcher out (a lower bound on the adapter's cost: a client
        # that goes away then no longer aborts the upstream request, which the product needs).
        watcher = None if LEAN else asyncio.ensure_future(watch_disconnect())
        try:
            await writer.pump(send, handler)
            if not handler.cancelled():
                handler.result()
        finally:
            if watcher is not None:
                watcher.cancel()
            if not handler.done():
                handler.cancel()

    return app


app = make_app()
