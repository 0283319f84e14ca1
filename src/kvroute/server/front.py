"""The router's listening side: an HTTP/1.1 server on asyncio protocols and httptools (llhttp).

Every request is read whole (bodies are bounded), then handed to one handler coroutine with a
``ResponseWriter``; requests pipelined on a connection are answered in order.  A client that goes
away cancels its handler, as aiohttp's ``handler_cancellation`` did, which is how an upstream
request gets aborted.  The inference routes are served here directly; everything else (fleet
endpoints, admin API, dashboard) is relayed by the handler to the aiohttp application behind it.

Being hand-written, it owns the protocol's edge cases (see ``FrontLimits`` and docs/reliability.md):
request line and header sizes, header count, body size (answered early on ``Expect:
100-continue``), chunk extensions and trailers (bounded like a head, trailers dropped), timeouts
for headers, bodies (a total and a minimum rate) and idle keep-alive connections, a connection
cap that closes idle connections first and then the slowest request still arriving, ``Upgrade``
ignored (HTTP/1.1 is served), ``CONNECT`` refused, absolute-form targets served by their path,
every well-formed request before a malformed one answered, paths percent-decoded once, and a
shutdown that answers or cleanly ends whatever is still running.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import enum
import fcntl
import ipaddress
import logging
import math
import resource
import socket
import termios
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, cast
from urllib.parse import unquote

import httptools

from kvroute.api.errors import ApiStyle, error_body
from kvroute.router_settings import Settings

if TYPE_CHECKING:
    from kvroute.server.routes import Route

log = logging.getLogger("kvroute.front")

Header = tuple[bytes, bytes]

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_JSON = b"content-type: application/json\r\n"
# Requests a client may pipeline before the router stops reading from it.
_MAX_QUEUED = 16
# Open files kept for the router's own use (worker connections beyond those in flight, the app
# socket, Redis, logs) when the connection cap is derived from the open-file limit.
_RESERVED_FILES = 128
# What a connection is reading: nothing yet (between requests), a request's head, its body.
_BETWEEN, _HEAD, _BODY = 0, 1, 2
_NEVER = math.inf
# Request headers the listening side itself acts on.
_FRAMING = frozenset((b"content-length", b"expect", b"upgrade", b"transfer-encoding"))
# How long a connection closed after an error answer keeps reading (and dropping) the client's bytes.
_LINGER_S = 2.0
# Connections lingering at once; more are closed at once.
_MAX_LINGERING = 256
# Why a connection was closed to make room at the cap: idle after a request, new (nothing sent
# since it connected), its request's head or body still arriving (answered 408).
EVICTION_REASONS = ("idle", "new", "slow_head", "slow_body")
# Why a body was answered 408: it took longer than body_timeout_s in all, or fell behind
# body_min_rate_bytes_s after the grace.
BODY_TIMEOUT_REASONS = ("total", "min_rate")
# A chunk in progress may have consumed its size line (at most 16 hex digits) and CRLF before its
# data is complete; framing beyond what each chunk needs counts as extensions or trailers.
_CHUNK_SLACK = 20


def reason_phrase(status: int) -> bytes:
    """The standard reason phrase of ``status`` (empty for unknown codes)."""
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


def style_of_path(path: str) -> ApiStyle:
    """The error format a client calling ``path`` expects: Anthropic's under /v1/messages."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def origin_form(target: bytes) -> bytes:
    """A request target as path and query: an absolute-form target (``http://host/path?q``, which
    RFC 9112 section 3.2.2 says a server must accept) loses its scheme and authority; any other
    target is returned as it is."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return target
    ends = [i for i in (rest.find(b"/"), rest.find(b"?")) if i != -1]
    path = rest[min(ends):] if ends else b""
    return path if path[:1] == b"/" else b"/" + path


def raise_open_file_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (each client connection and
    each worker connection is a file); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return open_file_limit()


def open_file_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` now (unlimited counts as 2**20)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return int(soft) if soft != resource.RLIM_INFINITY else 1 << 20


def connections_allowed(open_files: int) -> int:
    """The automatic connection cap for ``open_files``: half of what is left after the router's
    own files, since every request in flight holds a worker connection as well."""
    return max(16, (open_files - _RESERVED_FILES) // 2)


class RateLimitedLog:
    """Logs an unexpected error with its traceback at most once per ``interval_s``, one line
    otherwise: a flood of bad requests must not become a flood of tracebacks."""

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._next = 0.0
        self._quiet = 0

    def error(self, what: str) -> None:
        """Log the exception being handled (call from an ``except`` block)."""
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self._interval
            more = f" ({self._quiet} more since the last traceback)" if self._quiet else ""
            self._quiet = 0
            self._log.exception("unexpected error %s%s", what, more)
        else:
            self._quiet += 1
            self._log.error("unexpected error %s (traceback logged at most every %.0f s)", what,
                            self._interval)


@dataclass(frozen=True, slots=True)
class FrontLimits:
    """What the listening side accepts from a client: the settings of the same names (see
    docs/server.md), which hold their defaults (``from_settings``).  ``max_connections``: open
    client connections; at the cap the oldest idle connection is closed for a new one, else the
    request arriving slowest is answered 408 and closed, and when every connection is serving the
    new one gets 503.  ``body_timeout_s`` is the time a whole body may take; after
    ``body_min_rate_grace_s`` it must also keep arriving at ``body_min_rate_bytes_s`` on average
    (0: no minimum rate)."""

    max_body_bytes: int
    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    body_min_rate_bytes_s: float
    body_min_rate_grace_s: float
    keepalive_timeout_s: float
    max_connections: int

    @classmethod
    def from_settings(cls, settings: Settings | None = None, open_files: int | None = None) -> FrontLimits:
        """The limits ``settings`` give (the defaults: ``Settings()``).  ``max_connections = 0``
        derives the cap from ``open_files`` (``connections_allowed``; by default this process's
        open-file limit now)."""
        s = settings if settings is not None else Settings()
        if open_files is None:
            open_files = open_file_limit()
        return cls(max_body_bytes=s.max_body_bytes, max_header_bytes=s.max_header_bytes,
                   max_headers=s.max_headers, header_timeout_s=s.header_timeout_s,
                   body_timeout_s=s.body_timeout_s, body_min_rate_bytes_s=s.body_min_rate_bytes_s,
                   body_min_rate_grace_s=s.body_min_rate_grace_s, keepalive_timeout_s=s.keepalive_timeout_s,
                   max_connections=s.max_connections or connections_allowed(open_files))


@dataclass(slots=True)
class FrontRequest:
    """One request as received: ``target`` is the raw request target (path and query), ``path``
    its path percent-decoded once."""

    method: bytes
    target: bytes
    path: str
    headers: list[Header]
    body: bytes
    http_minor: int
    keep_alive: bool
    # Set when the body was larger than the limit (it was not kept).
    too_large: bool = False
    # Set for a request that broke the protocol or a limit: the error answered in its place.
    reject: tuple[int, str] | None = field(default=None)


class Cut(enum.Enum):
    """How the shutdown ended a response still running when its timeout expired (what a
    ``Cutter`` did); the value is how the log says it."""

    ANSWERED_503 = "answered 503"  # nothing had been sent: the API's 503 instead
    STREAM_ENDED = "stream ended with an error event"  # in the route's API format
    TRUNCATED = "truncated (a plain body under way cannot carry an error)"  # the connection closed


@dataclass(slots=True)
class ShutdownReport:
    """What ``FrontServer.close`` had to cut when its timeout expired."""

    streams_ended: int = 0    # event streams ended with an error event in their API's format
    answered_503: int = 0     # requests answered 503 (not started, or queued behind another)
    truncated: int = 0        # plain bodies already under way: the connection was closed
    details: list[str] = field(default_factory=list)

    @property
    def cut(self) -> int:
        """Requests that did not complete normally."""
        return self.streams_ended + self.answered_503 + self.truncated

    def add(self, how: Cut, path: str, *, queued: bool = False) -> None:
        """Count one response cut ``how`` (``queued``: a request waiting behind the one served)."""
        if how is Cut.ANSWERED_503:
            self.answered_503 += 1
        elif how is Cut.STREAM_ENDED:
            self.streams_ended += 1
        else:
            self.truncated += 1
        self.details.append(f"{how.value}{' (queued)' if queued else ''}: {path}")


class ResponseWriter:
    """Writes one response to the client: whole (``respond``) or as a stream (``start``, ``write``,
    ``end``).  Writes after the client left, or after the end, are dropped; ``lost`` tells."""

    __slots__ = ("_chunked", "_conn", "_held", "finished", "keep_alive", "pause_hook", "route", "sse",
                 "started")

    def __init__(self, conn: _FrontConnection, keep_alive: bool) -> None:
        self._conn = conn
        self._chunked = False
        self._held = b""
        self.started = False
        self.finished = False
        self.keep_alive = keep_alive
        # Called with True when the client stops taking data quickly enough, False when it does again.
        self.pause_hook: Callable[[bool], None] | None = None
        # The inference route being answered (set by the handler): how to end it at shutdown.
        self.route: Route | None = None
        # Whether the streamed answer is an event stream (it can end with an error event).
        self.sse = False

    @property
    def lost(self) -> bool:
        """Whether the client's connection is gone."""
        return self._conn.lost

    @property
    def client_is_loopback(self) -> bool:
        """Whether the client connected from a loopback address."""
        return self._conn.loopback

    @property
    def unsent(self) -> bool:
        """Nothing of the response has reached the client yet (a deferred head included)."""
        return not self.started or bool(self._held)

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
        else:
            self.sse = b"text/event-stream" in headers
            if self._conn.http_minor:
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
        if data and not self.finished:
            if self._chunked:
                data = b"%x\r\n%s\r\n" % (len(data), data)
            if self._held:
                data, self._held = self._held + data, b""
            self._conn.write(data)

    def end(self, data: bytes = b"") -> None:
        """The streamed body is complete; ``data``: its last bytes, sent in the same write as the
        end (and a head still held back)."""
        if not self.finished:
            self.finished = True
            if self._chunked:
                data = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)) if data else b"0\r\n\r\n"
            if self._held or data:
                data, self._held = self._held + data, b""
                self._conn.write(data)

    def abort(self) -> None:
        """Cut the connection: a body that cannot be completed must not look complete."""
        self.finished = True
        self.keep_alive = False
        self._conn.close()

    def restart(self) -> None:
        """Forget a response whose head is still held back (nothing was sent), to answer another
        way; only valid while ``unsent``."""
        if not self.unsent:
            raise RuntimeError("response already under way")
        self.started = self.finished = self.sse = self._chunked = False
        self._held = b""


Handler = Callable[[FrontRequest, ResponseWriter], Awaitable[None]]
# Ends a response still running when the shutdown timeout expires; says how.
Cutter = Callable[[ResponseWriter], Cut]


class _LimitBroken(Exception):
    """Raised from a parser callback: the request breaks a limit (the error is on the connection)."""


def error_response(writer: ResponseWriter, style: ApiStyle, status: int, message: str, *,
                   retry_after: bool = False) -> None:
    """Answer with ``status`` and an error body in the API's own format."""
    headers = _JSON + (b"retry-after: 1\r\n" if retry_after else b"")
    writer.respond(status, headers, error_body(style, status, message))


class _FrontConnection(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: FrontServer) -> None:
        self._server = server
        self._limits = server.limits
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        # Asked once per connection, not per request: on Python 3.11 it costs a system call (getpid).
        self._loop = asyncio.get_running_loop()
        self._queue: deque[FrontRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._writer: ResponseWriter | None = None
        self._reading_paused = False
        self.write_paused = False
        self.lost = False
        self.loopback = False
        self.http_minor = 1
        # No request has begun on this connection yet.
        self.fresh = True
        self._fd = -1
        # Accepted at the cap with nothing to close for it: answered 503 once its first bytes say
        # which API it calls (see _refuse).
        self._refusing = False
        # Reading state: _BETWEEN, _HEAD or _BODY; when the current phase times out.
        self._phase = _BETWEEN
        self.deadline = time.monotonic() + self._limits.keepalive_timeout_s
        # Parsing stopped for good (a malformed request or a broken limit).
        self._dead = False
        self._lingering = False
        self._error: tuple[int, str] | None = None
        self._owe_continue = False
        # The head of a request whose Upgrade would make llhttp skip its body, re-fed without it.
        self._resend: bytes | None = None
        # The request being read.
        self._url = b""
        self._url_counted = 0
        self._headers: list[Header] = []
        # The head's header fields once the head is complete (``_headers`` then collects trailers).
        self._fields: list[Header] = []
        self._trailers: list[Header] = []
        self._body: list[bytes] = []
        # Body bytes received (kept or not), and when the body's first read ended (0: not yet).
        self._size = 0
        self._body_start = 0.0
        self._too_large = False
        # A chunked body: its bytes that are not data (framing, extensions, trailers) counted over
        # the reads that neither start nor end it, the framing its completed chunks need, and the
        # body size at the start of the chunk in progress.
        self._chunked = False
        self._excess = 0
        self._framing = 0
        self._chunk_mark = 0
        # Bytes in the read being parsed, and whether the current head spans several reads: a head
        # that does not is no larger than its read, so its size is only counted when either is big.
        self._read_len = 0
        self._spanned = False
        # For a head spanning reads: its bytes counted so far (URL and whole headers), the headers
        # counted, and the bytes of reads that completed nothing (a header still arriving, held
        # inside the parser where callbacks do not see it).
        self._head_size = 0
        self._counted = 0
        self._quiet = 0
        limits = self._limits
        self._max_head = limits.max_header_bytes
        self._max_headers = limits.max_headers
        self._header_timeout = limits.header_timeout_s
        self._body_timeout = limits.body_timeout_s
        self._min_rate = limits.body_min_rate_bytes_s
        self._rate_grace = limits.body_min_rate_grace_s

    # --- used by ResponseWriter ---

    def write(self, data: bytes) -> None:
        if not self.lost and self._transport is not None:
            self._transport.write(data)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def linger(self) -> None:
        """Close after an error answer without losing it: end our side after the answer and drop
        what the client is still sending for a moment.  Closing with unread bytes would make the
        kernel reset the connection, which can destroy the answer before the client reads it."""
        self._dead = True
        transport = self._transport
        server = self._server
        if transport is None or self.lost:
            return
        if server.lingering >= _MAX_LINGERING or not transport.can_write_eof():
            # Past this many, a flood of refused or broken connections would hold files open.
            self.close()
            return
        try:
            transport.write_eof()
        except (OSError, RuntimeError):
            self.close()
            return
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        server.lingering += 1
        self._lingering = True
        asyncio.get_running_loop().call_later(_LINGER_S, self.close)

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        server = self._server
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            self._fd = sock.fileno()
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = transport.get_extra_info("peername")
            with contextlib.suppress(ValueError, TypeError, IndexError):
                address = ipaddress.ip_address(peer[0])
                mapped = getattr(address, "ipv4_mapped", None)
                self.loopback = (mapped or address).is_loopback
        connections = server._connections
        if len(connections) >= self._limits.max_connections and not server._make_room():
            # Accepted only to say why: every connection is serving, none can make room.
            server.refused += 1
            self._dead = self._refusing = True
            if server.lingering >= _MAX_LINGERING:
                self._refuse(b"")
                return
            server.lingering += 1
            self._lingering = True
            loop = asyncio.get_running_loop()
            loop.call_later(_LINGER_S / 2, self._refuse, b"")
            loop.call_later(_LINGER_S, self.close)
            return
        connections[self] = None

    def _refuse(self, data: bytes) -> None:
        """Answer a connection refused at the cap with 503, in the format of the API its request
        line names (OpenAI's when none came in time), then end it like an error answer."""
        if not self._refusing or self.lost:
            return  # answered already, or gone
        self._refusing = False
        line = data.split(b"\r\n", 1)[0].split(b" ")
        target = origin_form(line[1]) if len(line) > 2 else b""
        path = unquote(target.partition(b"?")[0].decode("latin-1"), errors="replace")
        error_response(ResponseWriter(self, keep_alive=False), style_of_path(path), 503,
                       f"the router is at its connection limit ({self._limits.max_connections} open "
                       "connections, all serving); retry shortly", retry_after=True)
        transport = self._transport
        if not self._lingering or transport is None or not transport.can_write_eof():
            self.close()
            return
        try:
            transport.write_eof()  # what the client still sends is dropped until the close
        except (OSError, RuntimeError):
            self.close()

    def unread(self) -> bool:
        """Whether the client has sent bytes not read yet (a request on its way to this idle
        connection: closing it now would lose the request)."""
        if self._fd < 0:
            return False
        count = array.array("i", [0])
        try:
            fcntl.ioctl(self._fd, termios.FIONREAD, count, True)
        except OSError:
            return False
        return count[0] > 0

    def data_received(self, data: bytes) -> None:
        if self._dead:
            if self._refusing:
                self._refuse(data)
            return
        self._read_len = len(data)
        # A body read that neither starts nor ends its body: its bytes that are not data are
        # extensions, trailers or framing (measured below for chunked bodies).
        body_mark = self._size if self._phase == _BODY else -1
        parser = self._parser
        while True:
            try:
                parser.feed_data(data)
            except httptools.HttpParserUpgrade as exc:
                # The request asked to switch protocols (h2c, WebSocket): it is answered over
                # HTTP/1.1 like any other; what follows is parsed as more requests.
                offset = int(exc.args[0]) if exc.args else len(data)
                data = data[offset:]
                if self._resend is not None:
                    # llhttp ended it at its head, leaving its body unread: parse it again
                    # without the upgrade, followed by the body.
                    data, self._resend = self._resend + data, None
                    self._parser = parser = httptools.HttpRequestParser(self)
                if data:
                    continue
            except httptools.HttpParserCallbackError:
                self._fail(*(self._error or (500, "internal router error")))
            except httptools.HttpParserError as exc:
                self._fail(400, f"malformed request: {exc}")
            break
        phase = self._phase
        if phase == _BETWEEN or self._dead:
            return
        # A request is partly received (rare for small requests, which arrive in one read): its
        # clock starts now; its head or its body's framing is measured.  Doing it here rather than
        # in the callbacks keeps both off the common path.
        if phase == _BODY:
            if self._body_start == 0.0:
                self._body_start = time.monotonic()
            elif self._chunked and body_mark >= 0:
                self._measure_framing(len(data) - (self._size - body_mark))
            if not self._dead:
                self.deadline = self._body_deadline()
            return
        if self.deadline == _NEVER:
            self.deadline = time.monotonic() + self._header_timeout
        self._measure_head(len(data))

    def _body_deadline(self) -> float:
        """When the body being read times out: its total time, or sooner if it falls behind the
        minimum rate (after the grace)."""
        start = self._body_start
        deadline = start + self._body_timeout
        if self._min_rate > 0:
            deadline = min(deadline, start + self._rate_grace + self._size / self._min_rate)
        return deadline

    def _measure_framing(self, overhead: int) -> None:
        """Count ``overhead`` bytes of a chunked body that were not data; 431 once what exceeds
        the chunks' own framing (extensions, trailers) is over ``max_header_bytes``, or trailer
        fields over ``max_headers``."""
        self._excess += overhead
        if self._excess - self._framing - _CHUNK_SLACK > self._max_head:
            self._fail(431, f"chunk extensions and trailer fields larger than {self._max_head} bytes")
        elif len(self._trailers) > self._max_headers:
            self._fail(431, f"more than {self._max_headers} trailer fields")

    def _measure_head(self, read: int) -> None:
        """Count the head received so far (at the end of a read that left it incomplete); 414 or
        431 once it is over the limit."""
        if not self._spanned:
            self._spanned = True
            self._head_size = self._counted = self._url_counted = self._quiet = 0
        headers, url = self._headers, len(self._url)
        new = headers[self._counted:]
        size = self._head_size + url - self._url_counted + sum(len(n) + len(v) + 4 for n, v in new)
        # A read that completed nothing (no header, no URL part) fed a header still arriving.
        self._quiet = self._quiet + read if size == self._head_size else 0
        self._head_size, self._counted, self._url_counted = size, len(headers), url
        if size + self._quiet > self._max_head:
            if len(self._url) > self._max_head:
                self._fail(414, f"request target longer than {self._max_head} bytes")
            else:
                self._fail(431, f"request header fields larger than {self._max_head} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        # The parser holds this protocol's callbacks: a reference cycle only the cyclic collector
        # would free, and under connection churn thousands of closed connections (tens of MB)
        # waited for its rare full collections.
        del self._parser
        if self._lingering:
            self._lingering = False
            self._server.lingering -= 1
        self._server._connections.pop(self, None)
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
        self.fresh = False
        self._url = b""
        self._headers = []
        self._body = []
        self._size = 0
        self._body_start = 0.0
        self._too_large = False
        self._chunked = False
        self._spanned = False
        self._phase = _HEAD
        self.deadline = _NEVER  # set when the read ends with the head incomplete (data_received)

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._phase = _BODY
        limits = self._limits
        headers = self._fields = self._headers
        # Fields after the body are trailers: collected apart, bounded, never forwarded.
        self._headers = self._trailers
        if len(headers) > self._max_headers:
            self._error = (431, f"more than {self._max_headers} request header fields")
            raise _LimitBroken
        if self._spanned or self._read_len > self._max_head:
            # The head may be over the limit (it spanned reads, or its read was large): count it.
            url = len(self._url)
            size = url + sum(len(n) + len(v) + 4 for n, v in headers)
            if size > self._max_head:
                self._error = ((414, f"request target longer than {self._max_head} bytes")
                               if url > self._max_head
                               else (431, f"request header fields larger than {self._max_head} bytes"))
                raise _LimitBroken
        expect = upgrade = has_body = False
        for k, v in headers:
            lk = k.lower()
            if lk not in _FRAMING:
                continue
            if lk == b"content-length":
                with contextlib.suppress(ValueError):
                    size = int(v)
                    has_body = size > 0
                    if size > limits.max_body_bytes:
                        self._too_large = True
            elif lk == b"expect":
                expect = v.lower() == b"100-continue"
            elif lk == b"upgrade":
                upgrade = True
            else:
                has_body = self._chunked = True
                self._excess = self._framing = 0
        if upgrade and has_body:
            self._resend = self._head_without_upgrade()
        if expect:
            if self._too_large:
                # The client waits for our go-ahead: refuse now instead of reading the body.
                self._error = (413, f"request body larger than {limits.max_body_bytes} bytes")
                raise _LimitBroken
            if self.idle_for_interim:
                self.write(_CONTINUE)
            else:
                # A 100 now would land inside the answer to an earlier pipelined request.
                self._owe_continue = True

    def _head_without_upgrade(self) -> bytes | None:
        """This request's head minus ``Upgrade`` (and the ``upgrade`` token of ``Connection``), or
        None when llhttp does not treat it as an upgrade (no ``Connection: upgrade``)."""
        lines = []
        switching = False
        for name, value in self._fields:
            lname = name.lower()
            if lname == b"upgrade":
                continue
            if lname == b"connection":
                tokens = [t.strip() for t in value.split(b",")]
                kept = [t for t in tokens if t.lower() != b"upgrade"]
                switching = switching or len(kept) < len(tokens)
                if not kept:
                    continue
                value = b", ".join(kept)
            lines.append(name + b": " + value + b"\r\n")
        if not switching:
            return None
        version = self._parser.get_http_version().encode("ascii")
        return b"%s %s HTTP/%s\r\n%s\r\n" % (self._parser.get_method(), self._url, version, b"".join(lines))

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._too_large:
            return
        if self._size > self._limits.max_body_bytes:
            self._too_large = True
            self._body = []
        else:
            self._body.append(body)

    def on_chunk_header(self) -> None:
        self._chunk_mark = self._size

    def on_chunk_complete(self) -> None:
        # What this chunk needed: its size in hex, CRLF, its data, CRLF (the last chunk: "0" and
        # the CRLF ending the trailers).
        n = self._size - self._chunk_mark
        self._framing += (n.bit_length() + 3) // 4 + 4 if n else 5

    def _check_trailers(self) -> None:
        """The trailer fields of the request just completed: over the head's limits they are a
        431; otherwise they are dropped (the body is forwarded with a Content-Length, which
        carries no trailers)."""
        trailers = self._trailers
        size = sum(len(n) + len(v) + 4 for n, v in trailers)
        count = len(trailers)
        trailers.clear()
        if count > self._max_headers:
            self._error = (431, f"more than {self._max_headers} trailer fields")
            raise _LimitBroken
        if size > self._max_head:
            self._error = (431, f"trailer fields larger than {self._max_head} bytes")
            raise _LimitBroken

    def on_message_complete(self) -> None:
        if self._resend is not None:
            return  # not complete: its body follows (see data_received)
        if self._trailers:
            self._check_trailers()
        parser = self._parser
        method = parser.get_method()
        target = self._url
        if target[:1] != b"/" or method == b"CONNECT":
            if method == b"CONNECT":
                # What follows would be a tunnel's bytes: answered, then the connection closes.
                self._error = (405, "CONNECT is not supported: this is an API server, not a proxy")
                raise _LimitBroken
            target = self._url = origin_form(target)
        path_end = len(target)
        for sep in (b"?", b"#"):
            i = target.find(sep)
            if i != -1:
                path_end = min(path_end, i)
        path = target[:path_end].decode("latin-1")
        if "%" in path:
            # Decoded once here; every later step (routing, errors) names the real path.
            path = unquote(path, errors="replace")
        minor = 1 if parser.get_http_version() != "1.0" else 0
        request = FrontRequest(
            method=method, target=target, path=path,
            headers=self._fields, body=b"".join(self._body) if len(self._body) != 1 else self._body[0],
            http_minor=minor, keep_alive=parser.should_keep_alive() and not self._too_large,
            too_large=self._too_large)
        self._phase = _BETWEEN
        self._owe_continue = False
        self.deadline = _NEVER
        queue = self._queue
        queue.append(request)
        if len(queue) > _MAX_QUEUED and self._transport is not None and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()
        if self._task is None:
            self._next()

    # --- serving ---

    @property
    def idle_for_interim(self) -> bool:
        """No answer is being written or waiting: an interim response cannot interleave."""
        return self._task is None and not self._queue

    @property
    def idle(self) -> bool:
        """No request is being served, waiting or partly received."""
        return self._task is None and not self._queue and self._phase == _BETWEEN and not self._dead

    @property
    def arriving(self) -> bool:
        """A request is partly received and nothing is being served or waiting."""
        return self._task is None and not self._queue and self._phase != _BETWEEN and not self._dead

    @property
    def lag(self) -> float:
        """For a request still arriving, when it falls (or fell) behind: a head's deadline, or
        the moment a body's bytes so far stop meeting the minimum rate.  The smallest is the
        slowest request, the first closed to make room at the connection cap."""
        if self._phase != _BODY or self._body_start == 0.0:
            return self.deadline
        if self._min_rate > 0:
            return self._body_start + self._rate_grace + self._size / self._min_rate
        return self._body_start + self._body_timeout

    def evict(self) -> str:
        """Close this connection to make room at the cap; a client whose request is still arriving
        is told (408) why.  Returns what it was doing (``EVICTION_REASONS``)."""
        if self._phase == _BETWEEN:
            self.close()
            return "new"
        reason = "slow_head" if self._phase == _HEAD else "slow_body"
        what = "headers" if self._phase == _HEAD else f"body ({self._size} bytes so far)"
        started = self._body_start if self._phase == _BODY and self._body_start else None
        since = f" after {time.monotonic() - started:.1f} s" if started is not None else ""
        self._fail(408, f"the request's {what} was still arriving{since} when the router needed its "
                        f"connection for another client ({self._limits.max_connections} open "
                        "connections); send it faster or retry", count=False)
        return reason

    def _enqueue(self, request: FrontRequest) -> None:
        self._queue.append(request)
        if len(self._queue) > _MAX_QUEUED and self._transport is not None and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()
        if self._task is None:
            self._next()

    def _fail(self, status: int, message: str, *, count: bool = True) -> None:
        """The request being read broke the protocol or a limit: it is answered with ``status``
        after every request before it, then the connection closes (a byte stream that cannot be
        parsed cannot be resynchronised).  ``count``: in ``FrontServer.rejected``."""
        if self._dead:
            return
        self._dead = True
        self._phase = _BETWEEN
        self.deadline = _NEVER
        if self._transport is not None and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()
        end = min((i for i in (self._url.find(b"?"), self._url.find(b"#")) if i != -1),
                  default=len(self._url))
        path = unquote(origin_form(self._url[:end]).decode("latin-1"), errors="replace")
        if count:
            self._server.rejected += 1
        self._enqueue(FrontRequest(method=b"", target=self._url, path=path, headers=[], body=b"",
                                   http_minor=1, keep_alive=False, reject=(status, message)))

    def expire(self, now: float) -> None:
        """The current phase's deadline passed: an idle connection is closed, a request still
        arriving is answered 408."""
        phase = self._phase
        if (self._task is not None or self._queue) and (phase != _BODY or self._reading_paused):
            # Serving: an upstream timeout bounds that; the next request's clock starts after it.
            # A body arriving meanwhile (pipelined) keeps its own deadline while it is being read.
            self.deadline = now + self._limits.header_timeout_s
            return
        if phase == _BETWEEN:
            self.deadline = _NEVER
            self.close()
            return
        self._server.timed_out += 1
        if phase == _HEAD:
            self._fail(408, f"the request's headers did not arrive within {self._header_timeout:g} s")
            return
        elapsed = now - self._body_start
        if elapsed >= self._body_timeout:
            self._server.body_timeouts["total"] += 1
            self._fail(408, f"the request's body did not arrive within {self._body_timeout:g} s")
        else:
            self._server.body_timeouts["min_rate"] += 1
            self._fail(408, f"the request's body arrived slower than {self._min_rate:g} bytes/s "
                            f"({self._size} bytes in {elapsed:.1f} s)")

    def _next(self) -> None:
        if self.lost or not self._queue:
            self._task = None
            if self._server.closing or self._dead:
                self.close()
            elif self._phase == _BETWEEN:
                self.deadline = time.monotonic() + self._limits.keepalive_timeout_s
            if self._owe_continue and not self.lost:
                self._owe_continue = False
                self.write(_CONTINUE)
            return
        if (self._reading_paused and not self._dead and len(self._queue) <= _MAX_QUEUED // 2
                and self._transport is not None):
            self._reading_paused = False
            self._transport.resume_reading()
        request = self._queue.popleft()
        self.http_minor = request.http_minor
        if request.reject is not None:
            self._task = None
            status, message = request.reject
            error_response(ResponseWriter(self, keep_alive=False), style_of_path(request.path), status,
                           message)
            self._queue.clear()
            self.linger()
            return
        # While shutting down, the last request received is answered with connection: close.
        keep_alive = request.keep_alive and not (self._server.closing and not self._queue)
        self._writer = writer = ResponseWriter(self, keep_alive)
        self._task = task = self._loop.create_task(self._serve(request, writer))
        self._server._tasks.add(task)
        task.add_done_callback(self._served)

    async def _serve(self, request: FrontRequest, writer: ResponseWriter) -> None:
        server = self._server
        try:
            await server.handler(request, writer)
        except asyncio.CancelledError:
            raise
        except Exception:
            server.internal_error(f"serving {request.path}")
            if writer.unsent:
                writer.restart()
                error_response(writer, style_of_path(request.path), 500, "internal router error")
            else:
                writer.abort()
            return
        if not writer.started:
            log.error("handler for %s sent no response", request.path)
            error_response(writer, style_of_path(request.path), 500, "internal router error")
        elif not writer.finished:
            writer.end()

    def _served(self, task: asyncio.Task[None]) -> None:
        self._server._tasks.discard(task)
        writer = self._writer
        self._writer = None
        if self.lost:
            self._task = None
            return
        if task.cancelled() or writer is None or not writer.finished:
            self._task = None
            self.close()
            return
        if not writer.keep_alive:
            # The answer said connection: close; bytes the client sent after its request may still
            # be unread, and closing over them would reset the connection under the answer.
            self._task = None
            if self._server.closing:
                self.close()
            else:
                self.linger()
            return
        self._next()

    def cut(self, cutter: Cutter | None, report: ShutdownReport) -> None:
        """Shutdown time is up: end the response under way (``cutter`` knows its API), answer
        every request queued behind it with 503, and close."""
        writer = self._writer
        queued = [r for r in self._queue if r.reject is None]
        self._queue.clear()
        if writer is not None and not writer.finished and not self.lost:
            if writer.unsent:
                writer.restart()
                writer.keep_alive = writer.keep_alive and bool(queued)
            # Without a cutter nothing ends the response: closing the connection truncates it.
            how = cutter(writer) if cutter is not None else Cut.TRUNCATED
            report.add(how, writer.route.path if writer.route else "request")
            if how is Cut.TRUNCATED:
                queued = []  # the connection is gone with the truncated body
        if not self.lost:
            for i, request in enumerate(queued):
                answer = ResponseWriter(self, keep_alive=i < len(queued) - 1)
                self.http_minor = request.http_minor
                error_response(answer, style_of_path(request.path), 503,
                               "the router shut down before this request was served", retry_after=True)
                report.add(Cut.ANSWERED_503, request.path, queued=True)
        self._dead = True
        self.close()


class FrontServer:
    """Listens and serves until ``close``.  ``internal_error`` is told (with a description) of
    every unexpected error a handler raised; ``cutter`` ends responses still running when the
    shutdown timeout expires (see ``close``)."""

    def __init__(self, handler: Handler, *, limits: FrontLimits | None = None,
                 max_body_bytes: int | None = None, cutter: Cutter | None = None,
                 internal_error: Callable[[str], None] | None = None) -> None:
        self.handler = handler
        limits = limits or FrontLimits.from_settings()
        if max_body_bytes is not None:
            limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
        self.limits = limits
        self.max_body_bytes = limits.max_body_bytes
        self.cutter = cutter
        self._errors = RateLimitedLog(log)
        self.internal_error: Callable[[str], None] = internal_error or self._errors.error
        self.closing = False
        # Counters for tests and benchmarks: connections refused at the cap, requests rejected by
        # the parser or a limit, requests timed out.
        self.refused = self.rejected = self.timed_out = 0
        # Connections closed to make room at the cap, by what they were doing, and bodies answered
        # 408 for arriving too slowly, by the bound they broke (/metrics: kvroute_front_*).
        self.evictions = dict.fromkeys(EVICTION_REASONS, 0)
        self.body_timeouts = dict.fromkeys(BODY_TIMEOUT_REASONS, 0)
        # Connections closing after an error answer (see _FrontConnection.linger).
        self.lingering = 0
        self._server: asyncio.Server | None = None
        # Insertion-ordered: the oldest connection first, which is the one closed to make room.
        self._connections: dict[_FrontConnection, None] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def connection_count(self) -> int:
        """Client connections open now."""
        return len(self._connections)

    @property
    def evicted(self) -> int:
        """Connections closed to make room at the cap, all reasons."""
        return sum(self.evictions.values())

    def _make_room(self) -> bool:
        """Close a connection to make room for a new one: the oldest one idle after a request (not
        one whose next request is already on its way), else the one furthest behind: a request
        arriving slowest (answered 408) or a new connection that sent nothing for longest; False
        when every connection is serving."""
        slowest: _FrontConnection | None = None
        lag = _NEVER
        for conn in self._connections:
            if conn.idle:
                if conn.fresh:
                    # Nothing received yet: its request may be on its way (a client writes after
                    # connecting), so it ranks with the slow ones, by its deadline.
                    if conn.deadline <= lag and not conn.unread():
                        slowest, lag = conn, conn.deadline
                    continue
                if conn.unread():
                    continue
                del self._connections[conn]
                self.evictions["idle"] += 1
                conn.close()
                return True
            if conn.arriving and conn.lag <= lag:
                slowest, lag = conn, conn.lag
        if slowest is None:
            return False
        del self._connections[slowest]
        self.evictions[slowest.evict()] += 1
        return True

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _FrontConnection(self), host, port,
                                                reuse_port=reuse_port or None, backlog=1024)
        self._sweeper = loop.create_task(self._sweep())
        return int(self._server.sockets[0].getsockname()[1])

    async def _sweep(self) -> None:
        """Enforce the header, body and keep-alive deadlines: one pass over the connections at a
        fraction of the shortest timeout, rather than a timer per request on the hot path."""
        limits = self.limits
        period = min(1.0, limits.header_timeout_s / 4, limits.body_timeout_s / 4,
                     limits.keepalive_timeout_s / 4, limits.body_min_rate_grace_s / 4 or 1.0)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in [c for c in self._connections if c.deadline <= now]:
                conn.expire(now)

    async def close(self, timeout_s: float) -> ShutdownReport:
        """Stop accepting, close idle connections, let requests under way finish for up to
        ``timeout_s``; then end each stream still running with an error event, answer each
        request not yet answered with 503, close what cannot be ended cleanly, and say so in the
        report returned (and the log)."""
        self.closing = True
        report = ShutdownReport()
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            if conn.idle:
                conn.close()
        # Requests that arrive meanwhile on open connections count too (they are answered quickly:
        # inference routes get 503 while the router is closing).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (live := {t for t in self._tasks if not t.done()}) and (left := deadline - loop.time()) > 0:
            await asyncio.wait(live, timeout=left)
        pending = [t for t in self._tasks if not t.done()]
        for conn in list(self._connections):
            if conn._task is not None and not conn._task.done():
                conn.cut(self.cutter, report)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=1.0)
        for line in report.details:
            log.warning("shutdown timeout (%.0f s) expired: %s", timeout_s, line)
        if report.cut:
            log.warning("shutdown cut %d request(s): %d streams ended with an error event, %d answered "
                        "503, %d plain bodies truncated", report.cut, report.streams_ended,
                        report.answered_503, report.truncated)
        return report
