"""The router's listening side: an HTTP/1.1 server on asyncio protocols and httptools (llhttp).

Every request is read whole (bodies are bounded), then handed to one handler coroutine with a
``ResponseWriter``; requests pipelined on a connection are answered in order.  A client that goes
away cancels its handler, as aiohttp's ``handler_cancellation`` did, which is how an upstream
request gets aborted.  The inference routes are served here directly; everything else (fleet
endpoints, admin API, dashboard) is relayed by the handler to the aiohttp application behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import cast

import httptools

log = logging.getLogger("kvroute.front")

Header = tuple[bytes, bytes]

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Requests a client may pipeline before the router stops reading from it.
_MAX_QUEUED = 16


def reason_phrase(status: int) -> bytes:
    """The standard reason phrase of ``status`` (empty for unknown codes)."""
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


@dataclass(slots=True)
class FrontRequest:
    """One request as received: ``target`` is the raw request target (path and query)."""

    method: bytes
    target: bytes
    path: str
    headers: list[Header]
    body: bytes
    http_minor: int
    keep_alive: bool
    # Set when the body was larger than the limit (it was not kept).
    too_large: bool = False


class ResponseWriter:
    """Writes one response to the client: whole (``respond``) or as a stream (``start``, ``write``,
    ``end``).  Writes after the client left are dropped; ``lost`` tells."""

    __slots__ = ("_chunked", "_conn", "_held", "finished", "keep_alive", "pause_hook", "started")

    def __init__(self, conn: _FrontConnection, keep_alive: bool) -> None:
        self._conn = conn
        self._chunked = False
        self._held = b""
        self.started = False
        self.finished = False
        self.keep_alive = keep_alive
        # Called with True when the client stops taking data quickly enough, False when it does again.
        self.pause_hook: Callable[[bool], None] | None = None

    @property
    def lost(self) -> bool:
        """Whether the client's connection is gone."""
        return self._conn.lost

    def on_pause(self, hook: Callable[[bool], None] | None) -> None:
        """Call ``hook(True)`` when the client stops taking data quickly enough (at once if it
        already has), ``hook(False)`` when it does again; None: stop telling."""
        self.pause_hook = hook
        if hook is not None and self._conn.write_paused:
            hook(True)

    def _head(self, status: int, reason: bytes, headers: bytes, framing: bytes) -> bytes:
        connection = b"" if self.keep_alive else b"connection: close\r\n"
        version = b"HTTP/1.1" if self._conn.http_minor else b"HTTP/1.0"
        return b"%s %d %s\r\n%s%s%s\r\n" % (version, status, reason or reason_phrase(status), headers,
                                              framing, connection)

    def respond(self, status: int, headers: bytes, body: bytes, reason: bytes = b"", *,
                length: int | None = None) -> None:
        """Send a whole response.  ``headers``: serialised ``name: value\\r\\n`` lines, without the
        framing headers (content-length, transfer-encoding, connection).  ``length`` overrides the
        content length announced (the answer to a HEAD request carries no body)."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        size = len(body) if length is None else length
        self._conn.write(self._head(status, reason, headers, b"content-length: %d\r\n" % size) + body)

    def start(self, status: int, headers: bytes, *, length: int | None, reason: bytes = b"",
              defer: bool = False) -> None:
        """Send the head of a streamed response; ``length`` None: chunked (or until close on
        HTTP/1.0).  ``defer``: keep the head until the first body bytes or the end, to send both
        in one write."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        if length is not None:
            framing = b"content-length: %d\r\n" % length
        elif self._conn.http_minor:
            framing = b"transfer-encoding: chunked\r\n"
            self._chunked = True
        else:
            framing = b""
            self.keep_alive = False
        head = self._head(status, reason, headers, framing)
        if defer:
            self._held = head
        else:
            self._conn.write(head)

    def write(self, data: bytes) -> None:
        """Send part of a streamed body."""
        if data:
            if self._chunked:
                data = b"%x\r\n%s\r\n" % (len(data), data)
            if self._held:
                data, self._held = self._held + data, b""
            self._conn.write(data)

    def end(self) -> None:
        """The streamed body is complete."""
        if not self.finished:
            self.finished = True
            tail = b"0\r\n\r\n" if self._chunked else b""
            if self._held or tail:
                data, self._held = self._held + tail, b""
                self._conn.write(data)

    def abort(self) -> None:
        """Cut the connection: a body that cannot be completed must not look complete."""
        self.finished = True
        self.keep_alive = False
        self._conn.close()


Handler = Callable[[FrontRequest, ResponseWriter], Awaitable[None]]


class _FrontConnection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: FrontServer) -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._queue: deque[FrontRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._writer: ResponseWriter | None = None
        self._reading_paused = False
        self.write_paused = False
        self.lost = False
        self.http_minor = 1
        # The request being read.
        self._url = b""
        self._headers: list[Header] = []
        self._body: list[bytes] = []
        self._size = 0
        self._too_large = False

    # --- used by ResponseWriter ---

    def write(self, data: bytes) -> None:
        if not self.lost and self._transport is not None:
            self._transport.write(data)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._server._connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(b"upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._reject(f"malformed request: {exc}".encode())

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._server._connections.discard(self)
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def pause_writing(self) -> None:
        self.write_paused = True
        writer = self._writer
        if writer is not None and writer.pause_hook is not None:
            writer.pause_hook(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        writer = self._writer
        if writer is not None and writer.pause_hook is not None:
            writer.pause_hook(False)

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0
        self._too_large = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        limit = self._server.max_body_bytes
        for k, v in self._headers:
            lk = k.lower()
            if lk == b"content-length":
                with contextlib.suppress(ValueError):
                    if int(v) > limit:
                        self._too_large = True
            elif lk == b"expect" and v.lower() == b"100-continue" and not self._too_large:
                self.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        self._size += len(body)
        if self._size > self._server.max_body_bytes:
            self._too_large = True
            self._body = []
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        target = self._url
        path_end = len(target)
        for sep in (b"?", b"#"):
            i = target.find(sep)
            if i != -1:
                path_end = min(path_end, i)
        minor = 1 if parser.get_http_version() != "1.0" else 0
        request = FrontRequest(
            method=parser.get_method(), target=target, path=target[:path_end].decode("latin-1"),
            headers=self._headers, body=b"".join(self._body) if len(self._body) != 1 else self._body[0],
            http_minor=minor, keep_alive=parser.should_keep_alive() and not self._too_large,
            too_large=self._too_large)
        self._queue.append(request)
        if len(self._queue) > _MAX_QUEUED and self._transport is not None and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()
        if self._task is None:
            self._next()

    # --- serving ---

    def _reject(self, message: bytes) -> None:
        """A request that cannot be parsed: 400, then close (the stream cannot be resynchronised)."""
        if self._task is None and self._transport is not None:
            self.http_minor = 1
            writer = ResponseWriter(self, keep_alive=False)
            writer.respond(400, b"content-type: text/plain; charset=utf-8\r\n", message)
        self.close()

    def _next(self) -> None:
        if self.lost or not self._queue:
            self._task = None
            if self._server.closing:
                self.close()
            return
        if self._reading_paused and len(self._queue) <= _MAX_QUEUED // 2 and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()
        request = self._queue.popleft()
        self.http_minor = request.http_minor
        keep_alive = request.keep_alive and not self._server.closing
        self._writer = writer = ResponseWriter(self, keep_alive)
        self._task = task = asyncio.get_running_loop().create_task(self._serve(request, writer))
        self._server._tasks.add(task)
        task.add_done_callback(self._served)

    async def _serve(self, request: FrontRequest, writer: ResponseWriter) -> None:
        try:
            await self._server.handler(request, writer)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unexpected error serving %s", request.path)
            if not writer.started:
                writer.respond(500, b"content-type: text/plain; charset=utf-8\r\n", b"internal router error")
            else:
                writer.abort()
            return
        if not writer.started:
            log.error("handler for %s sent no response", request.path)
            writer.respond(500, b"content-type: text/plain; charset=utf-8\r\n", b"internal router error")
        elif not writer.finished:
            writer.end()

    def _served(self, task: asyncio.Task[None]) -> None:
        self._server._tasks.discard(task)
        writer = self._writer
        self._writer = None
        if self.lost:
            self._task = None
            return
        if task.cancelled() or writer is None or not writer.keep_alive or not writer.finished:
            self._task = None
            self.close()
            return
        self._next()

    @property
    def idle(self) -> bool:
        """No request is being served or waiting."""
        return self._task is None and not self._queue


class FrontServer:
    """Listens and serves until ``close``."""

    def __init__(self, handler: Handler, *, max_body_bytes: int) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.closing = False
        self._server: asyncio.Server | None = None
        self._connections: set[_FrontConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _FrontConnection(self), host, port,
                                                reuse_port=reuse_port or None, backlog=1024)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self, timeout_s: float) -> None:
        """Stop accepting, close idle connections, let requests under way finish for up to
        ``timeout_s``, then cancel what is left."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            if conn.idle:
                conn.close()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
