"""Forwarding one request upstream: decide, send the original bytes, relay the answer as it comes.

Before the first byte reaches the client, a worker that cannot be reached, drops the connection,
times out, answers 5xx or sends no first byte (for a stream: no first token) within the request's
first-byte deadline is marked and the request is decided again without it (bounded by
``retries``).  A streamed answer's head is held back until its first whole event, a plain 2xx
answer until its whole body (up to 1 MiB), so a worker that answers the head and then hangs, or
answers 200 with something that is not the API's answer (server/answer_shape.py), can still be
replaced.  Once bytes have gone out, a broken upstream, a malformed event or a silence longer
than the stream idle deadline ends the stream with an error event in the route's own format.  A
client that goes away closes the upstream connection, which is how an engine learns to abort the
request.  A worker's breaker hears of every attempt: a failure when it fails, a success only
when its answer ended well.

Each request's life is one ``Exchange`` (docs/design.md, "A request in the proxy"): its
attempts, the answer being relayed, the usage read from it and its first-byte timer are its
attributes, and its steps are its methods, in the order a request goes through them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.api.errors import error_body
from kvroute.fleet.registry import WorkerRecord
from kvroute.router_settings import Settings
from kvroute.routing.decision import Decision
from kvroute.routing.dispatch import InFlight
from kvroute.routing.flow import Ticket, TicketState
from kvroute.routing.key import RoutingKey
from kvroute.routing.worker import WorkerState
from kvroute.server.activity import RoutedRequest
from kvroute.server.answer_shape import body_answer, body_start_problem, first_event_problem, sse_problem
from kvroute.server.api_keys import CLIENT_KEY_HEADERS
from kvroute.server.context import Router
from kvroute.server.front import FrontRequest, ResponseWriter
from kvroute.server.model_names import AnswerRename, UnknownModelLog, served_models, unknown_model_message
from kvroute.server.routes import Route
from kvroute.server.tracing import TRACE_HEADERS
from kvroute.server.trail import RequestTrail
from kvroute.server.upstream import Call, ResponseHead, UpstreamError
from kvroute.server.usage import UsageSniffer

decision_log = logging.getLogger("kvroute.decision")
log = logging.getLogger("kvroute.proxy")

WORKER_HEADER = "x-kvroute-worker"
_WORKER_HEADER = WORKER_HEADER.encode("ascii")
# Hop-by-hop headers (RFC 9110 §7.6.1) and the framing headers each side sets for itself.
HOP_BY_HOP = frozenset((
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection",
    b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    b"expect",
))
# What nearly every client sends as Connection: naming no other header.
_PLAIN_CONNECTION = frozenset((b"keep-alive", b"close"))
_MAX_HELD_ERROR = 64 * 1024
# A plain 2xx body up to this size is read whole and checked before any of it goes out; a larger
# one only by its first bytes.
_MAX_HELD_BODY = 1 << 20
# Mid-stream failures counted under their own reason (the others under "midstream").
_NAMED_BREAKS = frozenset(("malformed", "stream_idle_timeout"))
# Read at every request's gate; a member read from its enum class costs ~900 instructions on
# Python 3.11 (docs/benchmarks.md, "2026-12-07: instructions per request").
_GRANTED = TicketState.GRANTED
JSON_HEADERS = b"content-type: application/json\r\n"


@dataclass(frozen=True, slots=True)
class _HeldAnswer:
    """A 5xx answer kept while another worker is tried; returned as-is if none can take over."""

    worker: str
    status: int
    reason: bytes
    headers: bytes
    body: bytes



def first_byte_deadline(settings: Settings, predicted_ttft_s: float, key: RoutingKey) -> float | None:
    """Seconds an attempt may wait for its first byte before it is abandoned and retried elsewhere
    (None: no deadline but ``upstream_read_timeout_s``).

    The predicted time to first token times ``first_byte_factor``, within ``[first_byte_floor_s,
    first_byte_ceiling_s]``.  A plain answer's first byte is its last, so it also gets
    ``max_tokens * first_byte_decode_s_per_token``; without ``max_tokens`` its length is unknown and
    only the read timeout applies."""
    if not settings.first_byte_factor:
        return None
    deadline = min(max(predicted_ttft_s * settings.first_byte_factor, settings.first_byte_floor_s),
                   settings.first_byte_ceiling_s)
    if key.stream:
        return deadline
    if key.max_tokens and settings.first_byte_decode_s_per_token:
        return deadline + key.max_tokens * settings.first_byte_decode_s_per_token
    return None


def stream_idle_deadline(settings: Settings, read_gap_s: float | None) -> float:
    """Seconds a worker may stay silent once its answer's body has started (for a stream: after
    its first event) before the answer is given up (``stream_idle_timeout``).

    ``stream_idle_factor`` times the worker's average gap between two reads of a stream
    (``read_gap_s``), within ``[stream_idle_floor_s, stream_idle_timeout_s]``; the ceiling while no
    stream of the worker has finished yet, or with the factor 0."""
    if read_gap_s is None or not settings.stream_idle_factor:
        return settings.stream_idle_timeout_s
    return min(max(read_gap_s * settings.stream_idle_factor, settings.stream_idle_floor_s),
               settings.stream_idle_timeout_s)


def waited_note(ticket: Ticket) -> str:
    """What a request's decision line adds when it waited at the gate: `` waited=0.412s (why)``;
    empty when it did not wait."""
    if not ticket.why:
        return ""
    return f" waited={ticket.waited_s:.3f}s ({ticket.why})"


def serves_model(states: Sequence[WorkerState], model: str) -> bool:
    """Whether any worker (healthy or not) serves ``model``, or might (models not yet known)."""
    return not states or any(s.serves(model) for s in states)


def header_lines(headers: list[tuple[bytes, bytes]], skip: frozenset[bytes] = HOP_BY_HOP) -> bytes:
    """``name: value`` lines of ``headers`` minus hop-by-hop ones (``HOP_BY_HOP``, any ``Proxy-*``
    and those the ``Connection`` header names), in either direction, and any other name in ``skip``
    (lower case, a superset of ``HOP_BY_HOP``): auth, API versions, betas and trace context pass
    unchanged, names keep their case."""
    lines = []
    named: set[bytes] | None = None
    for k, v in headers:
        lk = k.lower()
        if lk in skip or lk[:6] == b"proxy-":
            if lk == b"connection" and v.lower() not in _PLAIN_CONNECTION:
                tokens = {t.strip().lower() for t in v.split(b",")} - HOP_BY_HOP - {b"close"}
                if tokens:
                    named = (named or set()) | tokens
            continue
        lines.append(k + b": " + v + b"\r\n")
    if named is not None:  # rare: the headers it names go too
        lines = [k + b": " + v + b"\r\n" for k, v in headers
                 if (lk := k.lower()) not in skip and lk[:6] != b"proxy-" and lk not in named]
    return b"".join(lines)


def stream_error_event(route: Route, message: str, status: int = 502) -> bytes:
    """An SSE event that tells the client's SDK the stream failed (it raises an API error)."""
    data = error_body(route.style, status, message)
    if route.sse_error_event:
        return b"event: error\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\n"


def _event_end(data: bytes) -> int:
    """Index just past the last complete SSE event in ``data`` (0 if none is complete)."""
    end = data.rfind(b"\n\n")
    end = end + 2 if end != -1 else 0
    crlf = data.rfind(b"\r\n\r\n")
    return max(end, crlf + 4) if crlf != -1 else end


class _Opening:
    """The start of a 2xx answer, read before anything of it goes to the client, so that an answer
    that is not the API's can still be replaced: a stream's first whole event, a plain body whole
    (or its first ``limit`` bytes)."""

    __slots__ = ("_limit", "_ready", "_sse", "_tail", "checked", "doc", "enough", "parts", "size")

    def __init__(self, sse: bool, limit: int) -> None:
        self._sse = sse
        self._limit = limit
        self._tail = b""  # the last bytes read: an event boundary can straddle two reads
        self.parts: list[bytes] = []
        self.size = 0
        self.enough = False  # a whole event (a stream), or more than the limit, has been read
        self._ready: asyncio.Future[None] | None = None  # only made when it has to be waited for
        self.doc: object = None  # a plain body, parsed
        self.checked = 0  # a stream: the bytes of whole events ``problem`` found well-formed

    @classmethod
    async def read(cls, call: Call, sse: bool, limit: int) -> _Opening:
        """Read the start of ``call``'s answer (UpstreamError if the answer fails before)."""
        opening = cls(sse, limit)
        call.attach(opening.feed)
        done = call.done
        if done.done():
            done.result()  # raises the answer's failure, if it failed
        elif not opening.enough:
            opening._ready = asyncio.get_running_loop().create_future()
            done.add_done_callback(opening._ended)
            await opening._ready
        # else the common case: a stream's first event came with its first read (a plain answer
        # usually comes whole with its head): nothing to wait for.
        return opening

    def feed(self, chunk: bytes) -> None:
        self.parts.append(chunk)
        self.size += len(chunk)
        if self.enough:
            return
        if self._sse:
            window = self._tail + chunk
            self._tail = window[-3:]
            if b"\n\n" not in window and b"\r\n\r\n" not in window and self.size <= self._limit:
                return
        elif self.size <= self._limit:
            return
        self.enough = True
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def _ended(self, done: asyncio.Future[None]) -> None:
        ready = self._ready
        if ready is None or ready.done():
            return
        error = done.exception()
        if error is None:
            ready.set_result(None)
        else:
            ready.set_exception(error)
            ready.exception()  # retrieved: whoever awaits it still gets it

    def data(self) -> bytes:
        """What has been read so far."""
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)

    def problem(self, route: Route, whole: bool) -> str | None:
        """Why this is not the start of ``route``'s answer (None: relay it); ``whole``: the answer
        ended within what was read."""
        data = self.data()
        if self._sse:
            end = _event_end(data)
            if end == 0:
                if self.size > self._limit:
                    return f"an event of more than {self._limit} bytes (max_event_bytes)"
                if not data.strip():
                    return "an event stream that ended without an event"
                end, data = len(data) + 2, data.rstrip(b"\r\n") + b"\n\n"  # a last event, unterminated
            else:
                self.checked = end
            events = data[:end]
            problem = sse_problem(events, self._limit) or first_event_problem(route, events)
            if problem is not None:
                self.checked = 0
            return problem
        if whole:
            self.doc, problem = body_answer(route, data)
            return problem
        return body_start_problem(route, data)


class Proxy:
    """Sends requests to workers chosen by the scheduler and relays their answers; each request's
    life is an ``Exchange``.

    What a worker receives is the client's request but for its hop-by-hop headers; with keys of
    the router's own (``api_keys``) the client's key is not passed on, with ``worker_api_key`` the
    worker gets that one instead, and with tracing the trace context names the router's attempt."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.unknown_models = UnknownModelLog(log)
        settings = router.settings
        skip = HOP_BY_HOP
        if settings.api_keys or settings.worker_api_key:
            skip |= CLIENT_KEY_HEADERS
        if router.trails is not None and router.trails.tracing is not None:
            skip |= TRACE_HEADERS
        # Request headers not passed on, and the key the worker gets instead of the client's.
        self.skip = skip
        key = settings.worker_api_key
        self.worker_key = b"" if key is None else b"authorization: Bearer " + key.encode("latin-1") + b"\r\n"

    async def forward(self, request: FrontRequest, writer: ResponseWriter, route: Route, key: RoutingKey,
                      started: float, rename: AnswerRename | None = None,
                      trail: RequestTrail | None = None) -> None:
        """Serve one parsed request: decide, send, retry before the first byte, relay.  ``rename``:
        an alias changed the model asked for (``key.model`` is the target); the answer names the
        asked one.  ``trail`` is told what happens (access log, trace spans) when either is on."""
        await Exchange(self, request, writer, route, key, started, rename, trail).run()


class Exchange:
    """One request's life in the proxy, from the gate to the last byte of its answer.

    ``run`` reads top to bottom as the request lives:

    1. **the gate** (``_pass_gate``): flow control grants it at once (the common case: nothing is
       made for waiting), queues it (``_wait``) or sheds it (``_overloaded``: the API's 429/529);
    2. **attempts** (``_attempt``, up to ``retries + 1``): the scheduler decides a worker, the
       request goes out (``_send``) and its answer's head, first byte (a stream's first event:
       under the first-byte deadline, ``_first_byte_late``) and opening are checked; a failure,
       a 5xx (kept in ``held``) or a malformed opening marks the worker and moves on;
    3. **the relay** (``_relay``): the answer passes through as it arrives (``_feed`` and
       ``_flush``, called by the upstream connection), a stream in whole events; a failure now
       ends it with an error event (``_broken``);
    4. **the end**: accounted once (``_finished``), or, if no worker answered, ``_give_up``.

    Everything a step needs is an attribute here, set by the step before it, so the steps take
    no parameters but what changes between them."""

    __slots__ = (
        "_answer_head",
        "_deadline",
        "_extended",
        "_max_event",
        "_out",
        "_pending",
        "_problem",
        "_proxy",
        "_r",
        "_reads",
        "_tail",
        "_timer",
        "_whole",
        "attempts",
        "call",
        "decision",
        "exclude",
        "failure",
        "first_at",
        "flight",
        "held",
        "key",
        "rename",
        "request",
        "route",
        "sse",
        "started",
        "state",
        "trail",
        "ttfb",
        "usage",
        "waited",
        "writer",
    )

    def __init__(self, proxy: Proxy, request: FrontRequest, writer: ResponseWriter, route: Route,
                 key: RoutingKey, started: float, rename: AnswerRename | None = None,
                 trail: RequestTrail | None = None) -> None:
        self._proxy = proxy
        self._r = proxy.router
        # What arrived: the request as received (its body is forwarded as it is), where the answer
        # goes, its route and routing key, when it arrived (perf_counter), the alias renaming its
        # answer, and its access-log line and trace spans (None when both are off).
        self.request = request
        self.writer = writer
        self.route = route
        self.key = key
        self.started = started
        self.rename = rename
        self.trail = trail
        # The attempts: how many were made, the workers that failed, why the last one failed, the
        # last 5xx answer (returned as it is if no worker takes over), the last decision, and what
        # the decision line says of the wait at the gate.
        self.attempts = 0
        self.exclude: list[str] = []
        self.failure: str | None = None
        self.held: _HeldAnswer | None = None
        self.decision: Decision | None = None
        self.waited = ""
        # The attempt under way: its worker, its place in the dispatcher's books, its upstream call
        # and first-byte deadline (a timer only where the settings give a deadline).
        self.state: WorkerState | None = None
        self.flight: InFlight | None = None
        self.call: Call | None = None
        self._tail: bytes | None = None  # the request's headers and body as every worker gets them
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._extended = False
        # The answer being relayed: whether it is an event stream, the usage read from it, when
        # its first byte came and after how long, what is read and not yet written, an incomplete
        # event, the reads so far (their gaps are the stream's silences) and why it turned out
        # malformed.  A renamed plain answer is held whole (``_whole``) and answered with
        # ``_answer_head`` (status, headers, reason) once read, since renaming changes its length.
        self.sse = False
        self.usage: UsageSniffer | None = None
        self.first_at = 0.0
        self.ttfb: float | None = None
        self._out: list[bytes] = []
        self._pending = b""
        self._reads = 0
        self._problem: str | None = None
        self._whole: list[bytes] | None = None
        self._answer_head: tuple[int, bytes, bytes] | None = None
        self._max_event = self._r.settings.max_event_bytes

    async def run(self) -> None:
        """The request's whole life: the gate, the attempts, the relay, the accounting."""
        if not await self._pass_gate():
            return
        retries = self._r.settings.retries
        while self.attempts <= retries:
            record = self._decide()
            if record is None:
                break
            if await self._attempt(record):
                return
        self._give_up()

    # --- 1. the gate ---

    async def _pass_gate(self) -> bool:
        """Flow control's gate: True when the request may be routed now (after waiting, if it
        was queued); False when it was shed (answered here)."""
        key = self.key
        ticket = self._r.dispatch.admit(key, self._r.registry.states())
        if ticket.state is not _GRANTED:
            self._queue_changed(key.model)
            if not await self._wait(ticket):
                return False
            if self.trail is not None:
                self.trail.queued(ticket.waited_s, ticket.why)
        self.waited = waited_note(ticket)
        return True

    async def _wait(self, ticket: Ticket) -> bool:
        """Hold a request flow control queued until a replica is admissible for it (True: route it
        now) or it is shed (answered here with the API's overload error, False).  A client that
        leaves while it waits withdraws it: nothing of it stays counted."""
        r = self._r
        key = self.key
        dispatch = r.dispatch
        if ticket.queued:
            woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def decided(_: Ticket) -> None:
                if not woken.done():
                    woken.set_result(None)

            ticket.on_decided = decided
            try:
                await asyncio.wait_for(woken, dispatch.expires_in(ticket))
            except TimeoutError:
                dispatch.expire(ticket)
            except asyncio.CancelledError:
                dispatch.withdraw(ticket)
                self._queue_changed(key.model)
                r.metrics.failures.labels("client_disconnect").inc()
                raise
            self._queue_changed(key.model)
        if ticket.state is TicketState.GRANTED:
            dispatch.claim(ticket)
            r.metrics.queue_wait.labels(key.model).observe(ticket.waited_s)
            r.activity.queue.waited(key.model, time.time(), ticket.waited_s)
            return True
        self._overloaded(ticket)
        return False

    def _queue_changed(self, model: str) -> None:
        """The model's queue may have changed (a request joined or left it): the dashboard's history."""
        depth, tokens = self._r.dispatch.flow.depth().get(model, (0, 0))
        self._r.activity.queue.changed(model, time.time(), depth, tokens)

    def _overloaded(self, ticket: Ticket) -> None:
        """The API's own overload answer: 429 with an ``error`` object on OpenAI routes, 529
        ``overloaded_error`` on Anthropic ones (what Claude Code retries), with ``Retry-After``
        from the queue's predicted drain."""
        r, route, key, trail = self._r, self.route, self.key, self.trail
        reason = ticket.reason.value if ticket.reason is not None else "shed"
        status = 529 if route.style == "anthropic" else 429
        message = (f"the router's queue for model {key.model!r} is over its limit ({reason}); "
                   f"retry after {ticket.retry_after_s} s")
        self.writer.respond(status, JSON_HEADERS + b"retry-after: %d\r\n" % ticket.retry_after_s,
                            error_body(route.style, status, message, code=reason))
        r.activity.record(RoutedRequest(
            time=time.time(), route=route.name, model=key.model, worker=None, kind="shed",
            reason=f"[FLOW] shed: {reason} after {ticket.waited_s:.3f} s in the queue", matched_blocks=0,
            total_blocks=0, attempts=0, status=status, ttfb_s=None,
            duration_s=time.perf_counter() - self.started,
        ))
        if trail is not None:
            if ticket.waited_s:
                trail.queued(ticket.waited_s, ticket.why)
            trail.finished(status, key.model, None, time.perf_counter() - self.started)

    # --- 2. attempts ---

    def _decide(self) -> WorkerRecord | None:
        """Ask the scheduler for a worker not tried yet; None: no worker can take the request."""
        r, trail = self._r, self.trail
        asked_ns = time.time_ns() if trail is not None else 0
        decision = self.decision = r.dispatch.route(self.key, r.registry.states(), self.exclude)
        if trail is not None:
            trail.decided(decision, self.key.model, asked_ns)
        if decision.worker_id is None:
            return None
        return r.registry.get(decision.worker_id)  # None cannot happen: decide offers registered workers

    async def _attempt(self, record: WorkerRecord) -> bool:
        """One attempt on the decided worker: True when its answer was relayed (well or not),
        False when the attempt failed before anything reached the client (try another)."""
        r = self._r
        dispatch = r.dispatch
        decision = self.decision
        assert decision is not None
        state = self.state = record.state
        self.attempts += 1
        if self.failure is not None:
            r.metrics.retries.labels(self.failure).inc()
        self._log(decision)
        r.registry.sending(record)  # a half-open breaker's trial: nothing else goes there
        flight, records = dispatch.sent(self.key, decision, state)
        self.flight = flight
        try:
            r.publish(records)
            try:
                head, opening = await self._send(record)
            except UpstreamError as exc:
                self._attempt_failed(exc.reason, f"{exc.reason}: {exc}", exc.reason,
                                     unreachable=exc.unreachable)
                return False
            if head.status >= 500:
                failure = f"http_{head.status}"
                self.held = await self._hold(head)
                self._attempt_failed(failure, failure, "http_5xx")
                return False
            call = self.call
            assert call is not None
            problem = None if opening is None else opening.problem(
                self.route, call.done.done() and call.done.exception() is None)
            if problem is not None:
                # Nothing has gone out: another worker can still answer properly.
                call.abort()
                log.warning("worker %s answered %d with something that is not an answer: %s",
                            state.id, head.status, problem)
                self.failure = "malformed"
                r.registry.mark_failure(state.id, f"malformed: {problem}", malformed=True)
                r.metrics.failures.labels("malformed").inc()
                self.exclude.append(state.id)
                return False
            await self._relay(head, opening)
            return True
        finally:
            dispatch.finished(flight, ok=False)  # a no-op once the relay accounted for it

    def _attempt_failed(self, failure: str, mark: str, counted: str, *, unreachable: bool = False) -> None:
        """The attempt failed before its answer could be relayed: the worker is marked (``mark``),
        the failure counted (``counted``), and the next attempt goes elsewhere."""
        r = self._r
        state = self.state
        assert state is not None
        self.failure = failure
        r.registry.mark_failure(state.id, mark, unreachable=unreachable)
        r.metrics.failures.labels(counted).inc()
        self.exclude.append(state.id)
        if self.trail is not None:
            self.trail.attempt_failed(failure)

    async def _send(self, record: WorkerRecord) -> tuple[ResponseHead, _Opening | None]:
        """Send the request to ``record``'s worker and wait for what decides whether its answer can
        be relayed: the head, a stream's first event (under the first-byte deadline) and the start
        of a 2xx answer (UpstreamError if the attempt fails before)."""
        r, key, state = self._r, self.key, record.state
        settings = r.settings
        pool = r.upstream
        assert pool is not None, "the router's upstream pool starts with the app"
        tail = self._tail
        if tail is None:
            body = self.request.body  # forwarded as the client sent it
            tail = self._tail = (header_lines(self.request.headers, self._proxy.skip) + self._proxy.worker_key
                                 + b"content-length: %d\r\n\r\n" % len(body) + body)
        origin = pool.origin(state.url)
        traced = b"" if self.trail is None else self.trail.attempt(state.id, state.url, self.attempts)
        # The decision's data-parallel rank, ahead of any the client sent (vLLM reads the first).
        rank = self.decision.rank if self.decision is not None else None
        pinned = b"" if rank is None else b"x-data-parallel-rank: %d\r\n" % rank
        self.call = None
        call = self.call = await pool.send(origin, b"POST " + origin.base_path + self.request.target
                                           + b" HTTP/1.1\r\nhost: " + origin.host_header + b"\r\n"
                                           + traced + pinned + tail)
        try:
            assert self.decision is not None
            deadline = first_byte_deadline(settings, self.decision.predicted_ttft_s, key)
            if deadline is not None:
                # One timer per attempt (cheaper than asyncio.timeout on the hot path); on expiry
                # the call fails with reason first_byte_timeout, handled like any failure.
                self._deadline, self._extended = deadline, False
                self._timer = call.loop.call_later(deadline, self._first_byte_late)
            try:
                head = await call.head
                if head.event_stream and head.status < 500:
                    # Nothing has gone to the client yet: a stream's first byte is its first
                    # event, and until it arrives the worker can still be replaced.
                    await call.first_body
                    assert self.flight is not None
                    r.dispatch.first_byte(self.flight)
            finally:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            # Once the body has started (a stream's first bytes are here) silence is bounded by the
            # stream idle deadline, not the first-byte one.
            call.limit_silence(stream_idle_deadline(settings, record.read_gap_s))
            opening = None
            if 200 <= head.status < 300:
                limit = settings.max_event_bytes if head.event_stream else _MAX_HELD_BODY
                opening = await _Opening.read(call, head.event_stream, limit)
            return head, opening
        except UpstreamError:
            raise
        except BaseException:
            call.abort()
            raise

    def _first_byte_late(self) -> None:
        """The attempt's first-byte deadline expired.  With somewhere else to go, the call fails
        (``first_byte_timeout``) and the request is retried there; when this attempt is the last
        chance, it gets the longer deadline instead, once (``first_byte_ceiling_s``): a deadline
        exists to move a slow request, and with nowhere to move it, cutting it would only turn a
        slow answer (a long prefill on a loaded replica) into a 502."""
        if not self._extended:
            self._extended = True
            longer = self._last_chance()
            if longer is not None and longer > self._deadline:
                later, self._deadline = longer - self._deadline, longer
                self._timer = asyncio.get_running_loop().call_later(later, self._first_byte_late)  # rare
                return
        if self.call is not None:
            self.call.expire(self._deadline)

    def _last_chance(self) -> float | None:
        """The longest first-byte deadline when the attempt under way is the request's last chance
        (no retry left, or no other worker could take it now), else None."""
        r, state, exclude = self._r, self.state, self.exclude
        if self.attempts <= r.settings.retries and any(
                w.ready and w.serves(self.key.model) and w is not state and w.id not in exclude
                for w in r.registry.states()):
            return None
        return first_byte_deadline(r.settings, math.inf, self.key)

    async def _hold(self, head: ResponseHead) -> _HeldAnswer:
        """Read a 5xx answer (its first 64 KiB) to return it as it is if no worker takes over."""
        call, state = self.call, self.state
        assert call is not None and state is not None
        parts: list[bytes] = []
        size = 0

        def keep(chunk: bytes) -> None:
            nonlocal size
            if size < _MAX_HELD_ERROR:
                parts.append(chunk)
                size += len(chunk)

        call.attach(keep)
        try:
            await call.done
        except UpstreamError:
            pass
        finally:
            call.abort()
        return _HeldAnswer(state.id, head.status, head.reason, header_lines(head.headers),
                           b"".join(parts)[:_MAX_HELD_ERROR])

    def _log(self, decision: Decision) -> None:
        if not decision_log.isEnabledFor(logging.INFO):
            return
        extra = self.waited
        if self.attempts > 1:
            extra += f" attempt={self.attempts}"
        if self._r.settings.log_prompts:
            extra += f" prompt_tail={self.key.prefix[-300:].decode('utf-8', 'replace')!r}"
        decision_log.info("%s model=%s worker=%s%s", decision.reason, self.key.model, decision.worker_id,
                          extra)

    # --- 3. the relay ---

    async def _relay(self, head: ResponseHead, opening: _Opening | None) -> None:
        """Pass the worker's answer through as it arrives (``opening``: what was read of it to
        check it); account for it when it ends."""
        r, writer, call, flight = self._r, self.writer, self.call, self.flight
        assert call is not None and flight is not None
        state, decision = flight.state, flight.decision
        # An Enum's value is a property (two Python calls, ~1,700 instructions): read once, here.
        kind = decision.kind.value
        r.metrics.count_request(state.id, self.key.model, kind)
        r.metrics.prefix_blocks.observe(decision.matched_blocks)
        r.registry.count_request(state.id, kind)
        headers = header_lines(head.headers)
        if r.settings.worker_header:
            headers += _WORKER_HEADER + b": " + state.id.encode() + b"\r\n"
        sse = self.sse = head.event_stream
        if self.rename is not None and not sse:
            # Renaming changes a plain answer's length: it is sent whole, in one write, once read.
            self._whole = []
            self._answer_head = (head.status, headers, head.reason)
        else:
            # The head waits for the first bytes (a stream's first event is here already), so that
            # both leave in one write.
            writer.start(head.status, headers, length=None if sse else head.content_length,
                         reason=head.reason, defer=True)
        usage = self.usage = UsageSniffer(sse)
        if opening is not None and opening.doc is not None:
            usage.take(opening.doc)  # the plain body was parsed to check it
        writer.on_pause(self._client_paused)
        if opening is not None:
            self._feed_opening(opening)
        call.attach(self._feed, self._flush)
        self._flush()
        completed = False
        outcome = head.status  # what the activity log records: 499 client gone, 502 broken
        try:
            try:
                await call.done
                self._reads += 1  # the answer's end closes its last gap (read_gap_s)
                problem = self._end_problem()
                if problem is not None:
                    raise UpstreamError("malformed", problem)
            except UpstreamError as exc:
                outcome = 502
                self._broken(exc)
                return
            self._finish()
            completed = True
        except asyncio.CancelledError:
            outcome = 499
            r.metrics.failures.labels("client_disconnect").inc()
            raise
        finally:
            writer.on_pause(None)
            call.abort()  # closing the connection is what makes the engine abort the request
            if outcome < 500:  # whole, or its client left while it flowed: nothing against the worker
                # While the fleet is saturated every replica queues and the slowest is the one
                # holding the hottest prefixes: its time to first token says load, not sickness,
                # and ejecting it would move those prefixes (and the load) onto cold caches.
                ttft = None if r.dispatch.saturated(self.key.model) else flight.ttft_s
                r.registry.mark_success(state.id, ttft_s=ttft, predicted_s=decision.predicted_ttft_s,
                                        read_gap_s=self._read_gap_s() if sse and completed else None)
            self._finished(outcome, completed, kind)

    def _client_paused(self, paused: bool) -> None:
        """The client stopped taking data quickly enough (or takes it again): so does the relay."""
        call = self.call
        if call is not None:
            if paused:
                call.pause()
            else:
                call.resume()

    def _first_byte(self) -> None:
        """The answer's first byte is being relayed: its time to first byte."""
        assert self.flight is not None
        self._r.dispatch.first_byte(self.flight)
        self.first_at = time.perf_counter()
        self.ttfb = self.first_at - self.started
        self._r.metrics.ttfb.observe(self.ttfb)

    def _feed_opening(self, opening: _Opening) -> None:
        """Relay what was read to check the answer: a stream's events that were checked then are
        not checked again."""
        data = opening.data()
        checked = opening.checked
        if not checked:
            self._feed(data)
            return
        self._first_byte()
        events = data[:checked]
        self._out.append(self.rename.events(events) if self.rename is not None else events)
        if checked < len(data):
            self._feed(data[checked:])

    def _feed(self, chunk: bytes) -> None:
        """A chunk of the worker's body (the upstream connection calls it): for a stream only whole
        events, each checked for its framing (a malformed one fails the call), so that an error
        event can follow cleanly; chunks read together leave in one write (``_flush``)."""
        if self._problem is not None:
            return
        if self.ttfb is None:
            self._first_byte()
        if self.sse:
            data = self._pending + chunk if self._pending else chunk
            end = len(data) if data.endswith(b"\n\n") else _event_end(data)
            if end == 0:
                self._pending = data
                if len(data) > self._max_event:
                    self._reject(f"an event of more than {self._max_event} bytes (max_event_bytes)")
                return
            chunk = data[:end] if end < len(data) else data
            problem = sse_problem(chunk, self._max_event)
            if problem is not None:
                self._reject(problem)
                return
            self._pending = data[end:]
            if self.rename is not None:
                chunk = self.rename.events(chunk)
        elif self._whole is not None:
            self._whole.append(chunk)
            return
        self._out.append(chunk)

    def _reject(self, problem: str) -> None:
        """A malformed event: nothing more of this answer goes out (the events before it do)."""
        self._problem = problem
        self._pending = b""
        assert self.call is not None
        self.call.fail("malformed", problem)  # a no-op if the whole answer is already here

    def _flush(self) -> None:
        """A batch of reads ended: write what they brought, in one write.  Once the answer is
        complete its last bytes wait for ``_finish``, which sends them with the end of the
        response, again in one write."""
        self._reads += 1
        call = self.call
        if self._out and not (call is not None and call.completed):
            self._write_out()

    def _write_out(self) -> None:
        out = self._out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            self.writer.write(data)
            assert self.usage is not None
            self.usage.feed(data)

    def _end_problem(self) -> str | None:
        """When the answer has ended: why it was malformed (a bad event, or the incomplete event
        a stream ended with), or None."""
        tail = self._pending.rstrip(b"\r\n")
        if self._problem is None and self.sse and tail:
            self._problem = sse_problem(tail + b"\n\n", self._max_event)
        return self._problem

    def _finish(self) -> None:
        """The worker's answer is complete: send what is still held (a renamed plain answer, the
        rest of a stream) and end the response, in one write."""
        writer, usage, out = self.writer, self.usage, self._out
        assert usage is not None
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        usage.feed(data)
        if self._whole is not None and self._answer_head is not None:
            whole = b"".join(self._whole)
            if self.rename is not None:
                whole = self.rename.document(whole)
            self._whole = None
            if not writer.started:  # else the shutdown cut has answered already
                status, headers, reason = self._answer_head
                writer.respond(status, headers, whole, reason=reason)
            usage.feed(whole)
        if self._pending:
            rest = self._pending
            data += self.rename.events(rest) if self.rename is not None else rest
        writer.end(data)

    def _read_gap_s(self) -> float | None:
        """The stream's mean time between two reads so far (None: too few reads to say)."""
        if self._reads < 3:
            return None
        return (time.perf_counter() - self.first_at) / (self._reads - 1)

    def _broken(self, exc: UpstreamError) -> None:
        """The worker failed after the client got the first bytes: end the stream with an error
        event (SSE) or cut the connection (a plain body cannot carry an error any more)."""
        r, state, writer = self._r, self.state, self.writer
        assert state is not None
        reason = exc.reason
        r.registry.mark_failure(state.id, f"midstream {reason}: {exc}", unreachable=exc.unreachable,
                                malformed=reason == "malformed")
        r.metrics.failures.labels(reason if reason in _NAMED_BREAKS else "midstream").inc()
        log.warning("worker %s failed mid-response: %s (%s)", state.id, reason, exc)
        if self.sse:
            self._write_out()  # the whole events read before the failure
            status = 504 if reason == "stream_idle_timeout" else 502
            message = f"worker {state.id} failed mid-stream ({reason}: {exc}); the response is incomplete"
            writer.write(stream_error_event(self.route, message, status))
            writer.end()
        else:
            writer.abort()

    # --- 4. the end ---

    def _finished(self, status: int, completed: bool, kind: str) -> None:
        """Account for a relayed answer, once: the dispatcher's books (and what the engine said it
        used), the activity log, the request's trail (``kind``: the decision's, as ``_relay`` read
        it)."""
        r, key, flight, usage = self._r, self.key, self.flight, self.usage
        assert flight is not None and usage is not None
        state, decision = flight.state, flight.decision
        ok = completed and status < 400
        r.dispatch.finished(flight, ok=ok, prompt_tokens=usage.prompt_tokens if ok else None,
                            cached_tokens=usage.cached_tokens if ok else None,
                            output_tokens=usage.output_tokens if ok else None, streamed=self.sse)
        duration = time.perf_counter() - self.started
        r.activity.record(RoutedRequest(
            time=time.time(), route=self.route.name, model=key.model, worker=state.id,
            kind=kind, reason=decision.reason + self.waited,
            matched_blocks=decision.matched_blocks, total_blocks=decision.total_blocks,
            attempts=self.attempts, status=status, ttfb_s=self.ttfb, duration_s=duration,
        ))
        if self.trail is not None:
            self.trail.finished(status, key.model, state.id, duration, ttft_s=self.ttfb,
                                usage=usage if ok else None, attempts=self.attempts)

    def _give_up(self) -> None:
        """No worker answered well: the last 5xx as the worker sent it, else 502 or 503; a model
        no worker serves: 404 listing the served ones (logged, rate-limited)."""
        r, writer, route, key, decision = self._r, self.writer, self.route, self.key, self.decision
        held, attempts = self.held, self.attempts
        if held is not None:
            headers = held.headers
            if r.settings.worker_header:
                headers += _WORKER_HEADER + b": " + held.worker.encode() + b"\r\n"
            writer.respond(held.status, headers, held.body, held.reason)
            status = held.status
            worker: str | None = held.worker
        elif attempts == 0 and not serves_model(r.registry.states(), key.model):
            # Asked only when no worker was chosen, so the hot path never pays for it.
            r.metrics.failures.labels("unknown_model").inc()
            status, worker = 404, None
            asked = self.rename.asked if self.rename is not None else key.model
            served = served_models(s.models for s in r.registry.states())
            self._proxy.unknown_models.unknown(route.path, asked, key.model, served)
            message = unknown_model_message(asked, key.model, served)
            writer.respond(status, JSON_HEADERS,
                           error_body(route.style, 404, message, "model", "model_not_found"))
        else:
            worker = None
            if attempts == 0:
                status = 503
                message = (f"no healthy worker can serve model {key.model!r}"
                           + (f" ({decision.reason})" if decision is not None else ""))
                r.metrics.failures.labels("no_worker").inc()
            else:
                status = 502
                message = f"every worker tried failed ({attempts} attempts, last: {self.failure})"
            writer.respond(status, JSON_HEADERS + b"retry-after: 1\r\n",
                           error_body(route.style, status, message))
        r.activity.record(RoutedRequest(
            time=time.time(), route=route.name, model=key.model, worker=worker,
            kind=decision.kind.value if decision is not None else "no_worker",
            reason=decision.reason if decision is not None else "", matched_blocks=0,
            total_blocks=decision.total_blocks if decision is not None else 0, attempts=attempts,
            status=status, ttfb_s=None, duration_s=time.perf_counter() - self.started,
        ))
        if self.trail is not None:
            self.trail.finished(status, key.model, worker, time.perf_counter() - self.started,
                                attempts=attempts)
