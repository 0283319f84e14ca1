"""The proxy's HTTP/1.1 client: pooled keep-alive connections to workers, answers parsed by
httptools (llhttp) and handed on chunk by chunk as they arrive.

A reverse proxy needs little of a general HTTP client: send bytes it already holds, read a status
line and headers, pass the body through.  aiohttp's client spent more CPU per small request than
everything else the router does (docs/benchmarks.md, "Router cost"), so the hot path uses this
instead; the probe and the Redis bus keep their ordinary clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import httptools

BodySink = Callable[[bytes], None]


class UpstreamError(Exception):
    """An attempt failed.  ``reason`` names how (connect, timeout, disconnect, payload, reset) for
    metrics; ``unreachable`` says the worker could not even be connected to."""

    def __init__(self, reason: str, detail: str, *, unreachable: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.unreachable = unreachable


@dataclass(frozen=True, slots=True)
class Origin:
    """Where one worker listens: TCP host and port (TLS for https), or a Unix socket."""

    host: str
    port: int
    tls: bool = False
    unix_path: str | None = None
    host_header: bytes = b""
    # A path the worker's URL carries (``http://h/engine-a``), put before every request's target.
    base_path: bytes = b""

    @classmethod
    def from_url(cls, url: str) -> Origin:
        """``http://host:port[/base]``, ``https://host[:port][/base]`` or ``unix:/path``."""
        if url.startswith("unix:"):
            return cls("localhost", 0, unix_path=url[5:], host_header=b"localhost")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        default = port == (443 if tls else 80)
        shown = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        header = shown if default else f"{shown}:{port}"
        return cls(parts.hostname, port, tls, None, header.encode("ascii"),
                   parts.path.rstrip("/").encode("ascii"))


@dataclass(slots=True)
class ResponseHead:
    """Status line and headers of an answer, as the worker sent them (names keep their case)."""

    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    content_length: int | None = None
    chunked: bool = False
    event_stream: bool = False


class Call:
    """One request on one connection: ``head`` resolves with the answer's head, then body chunks go
    to the sink given to ``attach`` and ``done`` resolves when the answer ended (or fails).
    ``first_body`` resolves with the first body bytes (or the end of an empty body): for a stream,
    the first token, which the proxy's first-byte deadline waits for."""

    __slots__ = ("_conn", "_early", "_flush", "_silence", "_sink", "completed", "done", "first_body", "head",
                 "loop")

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn
        self.loop = loop  # the event loop the answer arrives on (for timers around it)
        self.head: asyncio.Future[ResponseHead] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.first_body: asyncio.Future[None] = loop.create_future()
        self._sink: BodySink | None = None
        self._flush: Callable[[], None] | None = None
        self._early: list[bytes] = []
        self._silence: float | None = None  # limit_silence's, until the body starts
        # The whole answer arrived (its connection may already serve another request).
        self.completed = False

    def attach(self, sink: BodySink, flush: Callable[[], None] | None = None) -> None:
        """Send the body to ``sink`` from now on (chunks that arrived before are passed at once);
        ``flush`` is called after each batch of chunks read together, so writes can be joined."""
        self._sink = sink
        self._flush = flush
        early, self._early = self._early, []
        for chunk in early:
            sink(chunk)
        if early and flush is not None:
            flush()

    def pause(self) -> None:
        """Stop reading from the worker (the client is slower than the worker)."""
        self._conn.pause()

    def resume(self) -> None:
        """Read from the worker again."""
        self._conn.resume()

    def abort(self) -> None:
        """Give up on the answer: closing the connection is how an engine learns to stop.  Called
        when the caller is done with the call, complete or not: the sinks are dropped, since a
        sink is usually a bound method of whoever holds the call, and the reference cycle would
        leave the request's objects to the cyclic garbage collector instead of freeing them."""
        self._sink = self._flush = None
        if self.completed:
            return
        self._fail(UpstreamError("reset", "aborted by the router"))
        self._conn.close()

    def limit_silence(self, seconds: float) -> None:
        """Once the answer's body has started (now, if it has), fail the call
        (``stream_idle_timeout``) and close its connection when the worker sends nothing for
        ``seconds`` (at most the pool's read timeout, which applies until then: an engine may send
        a plain answer's head long before its body)."""
        if self.first_body.done():
            self._conn.limit_silence(seconds)
        else:
            self._silence = seconds

    def fail(self, reason: str, detail: str) -> None:
        """Give up on an answer the router judged unusable (``reason`` names why, for metrics):
        the call fails with that reason and the connection is closed, which aborts the request.
        Nothing happens once the whole answer arrived (its connection may serve another request)."""
        if self.completed:
            return
        self._fail(UpstreamError(reason, detail))
        self._conn.close()

    def expire(self, seconds: float) -> None:
        """The first byte did not come within ``seconds``: fail the call (``first_byte_timeout``) and
        close the connection, which is how the engine learns to abort.  Nothing happens once the
        first byte is here: a plain answer's head, a stream's first body bytes, or a 5xx head."""
        if self.completed or self.first_body.done():
            return
        head = self.head
        if head.done() and head.exception() is None and (
                not head.result().event_stream or head.result().status >= 500):
            return
        self._fail(UpstreamError("first_byte_timeout", f"no first byte in {seconds:g} s"))
        self._conn.close()

    def _body(self, data: bytes) -> None:
        if not self.first_body.done():
            self.first_body.set_result(None)
            if self._silence is not None:
                self._conn.limit_silence(self._silence)
        if self._sink is not None:
            self._sink(data)
        else:
            self._early.append(data)

    def _fail(self, error: UpstreamError) -> None:
        # Each future is marked retrieved: whoever awaits it still gets the error, and one nobody
        # awaits any more (the caller moved on to another worker) logs nothing.
        for future in (self.head, self.first_body, self.done):
            if not future.done():
                future.set_exception(error)
                future.exception()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request at a time."""

    def __init__(self, pool: UpstreamPool, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._origin = origin
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._call: Call | None = None
        self._head: ResponseHead | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._last_read = 0.0
        # The longest silence accepted from the worker for the request under way; the pool's read
        # timeout unless the proxy set a shorter one (stream_idle_timeout).
        self.silence_limit_s = pool.read_timeout_s
        self._paused = False
        self._reason = b""
        self.idle_since = 0.0
        self.closed = False

    # --- used by the pool and by Call ---

    def start(self, data: bytes) -> Call:
        """Send one request (head and body already serialised); returns its Call."""
        assert self._transport is not None and self._call is None
        call = Call(self, self._loop)
        self._call = call
        self._head = None
        self._last_read = self._loop.time()
        self.silence_limit_s = self._pool.read_timeout_s
        self._pool._watch(self)
        self._transport.write(data)
        return call

    def pause(self) -> None:
        if self._transport is not None and not self.closed:
            self._paused = True
            with contextlib.suppress(RuntimeError):
                self._transport.pause_reading()

    def resume(self) -> None:
        if self._transport is not None and not self.closed:
            self._paused = False
            with contextlib.suppress(RuntimeError):
                self._transport.resume_reading()
            self._last_read = self._loop.time()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._pool._unwatch(self)
            if self._transport is not None:
                self._transport.close()

    def limit_silence(self, seconds: float) -> None:
        self.silence_limit_s = min(seconds, self._pool.read_timeout_s)

    def silent_for(self, now: float) -> float:
        """Seconds since the worker last sent a byte for the request under way (0 while the
        router itself stopped reading, waiting for a slow client)."""
        return 0.0 if self._paused or self._call is None else now - self._last_read

    def time_out(self) -> None:
        """The request under way got no byte for too long: fail it and drop the connection."""
        call, self._call = self._call, None
        self.close()
        if call is not None:
            limit = self.silence_limit_s
            reason = "timeout" if limit >= self._pool.read_timeout_s else "stream_idle_timeout"
            call._fail(UpstreamError(reason, f"no data for {limit:g} s"))

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        if self._call is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        call = self._call
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._call = None
            self.close()
            call._fail(UpstreamError("payload", f"malformed answer: {exc}"))
            return
        if call._flush is not None:
            call._flush()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost settles the call

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        del self._parser  # a reference cycle through its callbacks (see front.py's connection_lost)
        self._pool._unwatch(self)
        self._pool._forget(self)
        call, self._call = self._call, None
        if call is None:
            return
        head = self._head
        if head is not None and head.content_length is None and not head.chunked:
            # An answer delimited by the end of the connection ends here.
            if not call.first_body.done():
                call.first_body.set_result(None)
            call.done.set_result(None)
            return
        detail = f"connection closed by the worker{f': {exc}' if exc else ''}"
        call._fail(UpstreamError("disconnect", detail))

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        self._headers = []
        self._reason = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_status(self, status: bytes) -> None:
        self._reason = status

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the real one follows
            return
        head = ResponseHead(status, self._reason, self._headers)
        for k, v in self._headers:
            lk = k.lower()
            if lk == b"content-length":
                with contextlib.suppress(ValueError):
                    head.content_length = int(v)
            elif lk == b"transfer-encoding":
                head.chunked = b"chunked" in v.lower()
            elif lk == b"content-type":
                head.event_stream = v.startswith(b"text/event-stream")
        self._head = head
        call = self._call
        if call is not None and not call.head.done():
            call.head.set_result(head)

    def on_body(self, body: bytes) -> None:
        if self._call is not None:
            self._call._body(body)

    def on_message_complete(self) -> None:
        if self._head is None:  # the end of an interim (1xx) answer
            return
        call, self._call = self._call, None
        self._pool._unwatch(self)
        if call is not None:
            call.completed = True
        keep = self._parser.should_keep_alive() and not self.closed
        if keep:
            self.idle_since = self._loop.time()
            self._pool._release(self._origin, self)
        else:
            self.close()
        if call is not None and not call.first_body.done():
            call.first_body.set_result(None)
        if call is not None and not call.done.done():
            call.done.set_result(None)


@dataclass(slots=True)
class _Slots:
    """Connections to one origin: idle ones (most recent last), how many exist, who waits."""

    idle: list[_Connection] = field(default_factory=list)
    count: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)


class UpstreamPool:
    """Keep-alive connections per worker, bounded per worker; idle ones are closed after
    ``keepalive_s``, before the engine's own keep-alive timeout would close them under a request
    (and so that a worker is not left holding connections nobody will use)."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float,
                 limit_per_origin: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self.limit_per_origin = limit_per_origin
        self._ssl = ssl_context
        self._origins: dict[Origin, _Slots] = {}
        self._by_url: dict[str, Origin] = {}
        self._closed = False
        # Connections with a request under way, checked for the read timeout by one periodic timer
        # rather than a timer per request (cheaper on the hot path; precision a quarter timeout);
        # the same timer closes idle connections kept past keepalive_s.
        self._busy: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        # The loop of the first request: asking for the running loop costs a system call on
        # Python 3.11 (a getpid), and the pool's connections all live on one loop.
        self._loop: asyncio.AbstractEventLoop | None = None

    def origin(self, url: str) -> Origin:
        """The parsed origin of a worker URL (cached)."""
        origin = self._by_url.get(url)
        if origin is None:
            origin = self._by_url[url] = Origin.from_url(url)
        return origin

    def connection_count(self, url: str) -> int:
        """Open connections to the worker at ``url`` (busy and idle)."""
        slots = self._origins.get(self.origin(url))
        return 0 if slots is None else slots.count

    async def send(self, origin: Origin, data: bytes) -> Call:
        """Send a serialised request on an idle or new connection; raises UpstreamError if no
        connection can be had."""
        if self._closed:
            raise UpstreamError("reset", "the router is shutting down")
        slots = self._origins.get(origin)
        if slots is None:
            slots = self._origins[origin] = _Slots()
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        now = loop.time()
        while slots.idle:
            conn = slots.idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn.start(data)
            conn.close()  # counted out when its connection_lost arrives
        while slots.count >= self.limit_per_origin:
            waiter = loop.create_future()
            slots.waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    slots.waiters.remove(waiter)
            if slots.idle:
                conn = slots.idle.pop()
                if not conn.closed:
                    return conn.start(data)
        slots.count += 1
        try:
            conn = await self._connect(origin, loop)
        except BaseException:
            slots.count -= 1
            self._wake(slots)
            raise
        return conn.start(data)

    async def _connect(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> _Connection:
        def factory() -> _Connection:
            return _Connection(self, origin, loop)

        try:
            async with asyncio.timeout(self.connect_timeout_s):
                if origin.unix_path is not None:
                    _, conn = await loop.create_unix_connection(factory, origin.unix_path)
                else:
                    tls = (self._ssl or ssl.create_default_context()) if origin.tls else None
                    _, conn = await loop.create_connection(
                        factory, origin.host, origin.port, ssl=tls,
                        server_hostname=origin.host if tls else None)
        except TimeoutError:
            raise UpstreamError("connect", f"connect timed out after {self.connect_timeout_s:g} s",
                                unreachable=True) from None
        except OSError as exc:
            raise UpstreamError("connect", f"cannot connect: {exc}", unreachable=True) from None
        return conn

    def _watch(self, conn: _Connection) -> None:
        self._busy.add(conn)
        if self._sweeper is None:
            self._arm_sweeper()

    def _unwatch(self, conn: _Connection) -> None:
        self._busy.discard(conn)

    def _arm_sweeper(self) -> None:
        loop = asyncio.get_running_loop()
        period = min(1.0, self.read_timeout_s / 4, self.keepalive_s / 4)
        self._sweeper = loop.call_later(period, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweeper = None
        now = loop.time()
        for conn in [c for c in self._busy if c.silent_for(now) >= c.silence_limit_s]:
            conn.time_out()
        idle = self._close_stale(now)
        if (self._busy or idle) and not self._closed:
            self._arm_sweeper()

    def _close_stale(self, now: float) -> bool:
        """Close the idle connections kept ``keepalive_s`` or longer; True if others stay idle."""
        left = False
        for slots in self._origins.values():
            idle = slots.idle
            stale = 0
            while stale < len(idle) and now - idle[stale].idle_since >= self.keepalive_s:
                stale += 1  # oldest first: a connection is put back at the end
            if stale:
                closing = idle[:stale]
                del idle[:stale]
                for conn in closing:
                    conn.close()  # counted out when its connection_lost arrives
            left = left or bool(idle)
        return left

    def _release(self, origin: Origin, conn: _Connection) -> None:
        slots = self._origins.get(origin)
        if slots is None or self._closed:
            conn.close()
            return
        slots.idle.append(conn)
        if self._sweeper is None:
            self._arm_sweeper()
        self._wake(slots)

    def _forget(self, conn: _Connection) -> None:
        slots = self._origins.get(conn._origin)
        if slots is None:
            return
        if conn in slots.idle:
            slots.idle.remove(conn)
        slots.count -= 1
        self._wake(slots)

    @staticmethod
    def _wake(slots: _Slots) -> None:
        while slots.waiters:
            waiter = slots.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Close idle connections and refuse new requests; answers under way finish."""
        self._closed = True
        if self._sweeper is not None and not self._busy:
            self._sweeper.cancel()
            self._sweeper = None
        for slots in self._origins.values():
            for conn in list(slots.idle):
                conn.close()
