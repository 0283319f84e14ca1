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
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.api.errors import error_body
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
JSON_HEADERS = b"content-type: application/json\r\n"


@dataclass(frozen=True, slots=True)
class _HeldAnswer:
    """A 5xx answer kept while another worker is tried; returned as-is if none can take over."""

    worker: str
    status: int
    reason: bytes
    headers: bytes
    body: bytes


class _FirstByteTimer:
    """An attempt's first-byte deadline.  When it expires with somewhere else to go, the call fails
    (``first_byte_timeout``) and the request is retried there; when this attempt is the last chance,
    ``last_chance()`` gives the longer deadline it gets instead (``first_byte_ceiling_s``): a
    deadline exists to move a slow request, and with nowhere to move it, cutting it would only turn
    a slow answer (a long prefill on a loaded replica) into a 502."""

    __slots__ = ("_call", "_deadline", "_handle", "_last_chance")

    def __init__(self, call: Call, deadline: float, last_chance: Callable[[], float | None]) -> None:
        self._call = call
        self._deadline = deadline
        self._last_chance: Callable[[], float | None] | None = last_chance
        self._handle = asyncio.get_running_loop().call_later(deadline, self._expired)

    def _expired(self) -> None:
        longer = self._last_chance() if self._last_chance is not None else None
        self._last_chance = None  # extended once at most
        if longer is not None and longer > self._deadline:
            later, self._deadline = longer - self._deadline, longer
            self._handle = asyncio.get_running_loop().call_later(later, self._expired)
            return
        self._call.expire(self._deadline)

    def cancel(self) -> None:
        """The first byte came, or the attempt ended otherwise."""
        self._handle.cancel()


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

    __slots__ = ("_limit", "_ready", "_sse", "_tail", "doc", "enough", "parts", "size")

    def __init__(self, sse: bool, limit: int) -> None:
        self._sse = sse
        self._limit = limit
        self._tail = b""  # the last bytes read: an event boundary can straddle two reads
        self.parts: list[bytes] = []
        self.size = 0
        self.enough = False  # a whole event (a stream), or more than the limit, has been read
        self._ready: asyncio.Future[None] | None = None  # only made when it has to be waited for
        self.doc: object = None  # a plain body, parsed

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
            events = data[:end]
            return sse_problem(events, self._limit) or first_event_problem(route, events)
        if whole:
            self.doc, problem = body_answer(route, data)
            return problem
        return body_start_problem(route, data)


class _Relay:
    """Receives the worker's body chunk by chunk and passes it on: for a stream only whole events,
    each checked for its framing (a malformed one fails the call), so that an error event can
    follow cleanly; chunks read together leave in one write."""

    __slots__ = (
        "_call",
        "_dispatch",
        "_flight",
        "_max_event",
        "_metrics",
        "_out",
        "_rename",
        "_respond",
        "_sse",
        "_started",
        "_usage",
        "_whole",
        "_writer",
        "first_at",
        "pending",
        "problem",
        "reads",
        "ttfb",
    )

    def __init__(self, writer: ResponseWriter, sse: bool, usage: UsageSniffer, started: float,
                 flight: InFlight, router: Router, call: Call, rename: AnswerRename | None = None,
                 respond: Callable[[bytes], None] | None = None) -> None:
        self._writer = writer
        self._sse = sse
        self._usage = usage
        self._started = started
        self._flight = flight
        self._dispatch = router.dispatch
        self._metrics = router.metrics
        self._rename = rename
        self._max_event = router.settings.max_event_bytes
        self._call = call
        self._out: list[bytes] = []
        # ``respond``: the answer is held whole, then answered with it (a renamed plain answer).
        self._respond = respond
        self._whole: list[bytes] | None = [] if respond is not None else None
        self.pending = b""
        self.ttfb: float | None = None
        self.first_at = 0.0
        self.reads = 0  # batches of chunks read together: the gaps between them are the silences
        self.problem: str | None = None  # why the answer turned out malformed

    def feed(self, chunk: bytes) -> None:
        if self.problem is not None:
            return
        if self.ttfb is None:
            self._dispatch.first_byte(self._flight)
            self.first_at = time.perf_counter()
            self.ttfb = self.first_at - self._started
            self._metrics.ttfb.observe(self.ttfb)
        if self._sse:
            data = self.pending + chunk if self.pending else chunk
            end = len(data) if data.endswith(b"\n\n") else _event_end(data)
            if end == 0:
                self.pending = data
                if len(data) > self._max_event:
                    self._reject(f"an event of more than {self._max_event} bytes (max_event_bytes)")
                return
            chunk = data[:end] if end < len(data) else data
            problem = sse_problem(chunk, self._max_event)
            if problem is not None:
                self._reject(problem)
                return
            self.pending = data[end:]
            if self._rename is not None:
                chunk = self._rename.events(chunk)
        elif self._whole is not None:
            self._whole.append(chunk)
            return
        self._out.append(chunk)

    def _reject(self, problem: str) -> None:
        """A malformed event: nothing more of this answer goes out (the events before it do)."""
        self.problem = problem
        self.pending = b""
        self._call.fail("malformed", problem)  # a no-op if the whole answer is already here

    def end_problem(self) -> str | None:
        """When the answer has ended: why it was malformed (a bad event, or the incomplete event
        a stream ended with), or None."""
        tail = self.pending.rstrip(b"\r\n")
        if self.problem is None and self._sse and tail:
            self.problem = sse_problem(tail + b"\n\n", self._max_event)
        return self.problem

    def flush(self) -> None:
        self.reads += 1
        out = self._out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            self._writer.write(data)
            self._usage.feed(data)

    def finish(self) -> None:
        """The worker's answer is complete: send what is still held (a renamed plain answer, the
        rest of a stream)."""
        self.flush()
        if self._whole is not None and self._respond is not None:
            data = b"".join(self._whole)
            if self._rename is not None:
                data = self._rename.document(data)
            self._whole = None
            if not self._writer.started:  # else the shutdown cut has answered already
                self._respond(data)
            self._usage.feed(data)
        if self.pending:
            rest = self.pending
            self._writer.write(self._rename.events(rest) if self._rename is not None else rest)

    def read_gap_s(self) -> float | None:
        """The stream's mean time between two reads so far (None: too few reads to say)."""
        if self.reads < 3:
            return None
        return (time.perf_counter() - self.first_at) / (self.reads - 1)


class Proxy:
    """Sends requests to workers chosen by the scheduler and relays their answers.

    What a worker receives is the client's request but for its hop-by-hop headers; with keys of
    the router's own (``api_keys``) the client's key is not passed on, with ``worker_api_key`` the
    worker gets that one instead, and with tracing the trace context names the router's attempt."""

    def __init__(self, router: Router) -> None:
        self._r = router
        self._unknown_models = UnknownModelLog(log)
        settings = router.settings
        skip = HOP_BY_HOP
        if settings.api_keys or settings.worker_api_key:
            skip |= CLIENT_KEY_HEADERS
        if router.trails is not None and router.trails.tracing is not None:
            skip |= TRACE_HEADERS
        self._skip = skip
        key = settings.worker_api_key
        self._worker_key = b"" if key is None else b"authorization: Bearer " + key.encode("latin-1") + b"\r\n"

    async def forward(self, request: FrontRequest, writer: ResponseWriter, route: Route, key: RoutingKey,
                      started: float, rename: AnswerRename | None = None,
                      trail: RequestTrail | None = None) -> None:
        """Serve one parsed request: decide, send, retry before the first byte, relay.  ``rename``:
        an alias changed the model asked for (``key.model`` is the target); the answer names the
        asked one.  ``trail`` is told what happens (access log, trace spans) when either is on."""
        r = self._r
        pool = r.upstream
        assert pool is not None, "the router's upstream pool starts with the app"
        body = request.body
        tail = (header_lines(request.headers, self._skip) + self._worker_key
                + b"content-length: %d\r\n\r\n" % len(body) + body)
        exclude: list[str] = []
        failure: str | None = None
        held: _HeldAnswer | None = None
        decision: Decision | None = None
        attempts = 0
        dispatch = r.dispatch
        ticket = dispatch.admit(key, r.registry.states())
        if ticket.state is not TicketState.GRANTED:
            self._queue_changed(key.model)
            if not await self._wait(ticket, writer, route, key, started, trail):
                return
            if trail is not None:
                trail.queued(ticket.waited_s, ticket.why)
        waited = waited_note(ticket)
        while attempts <= r.settings.retries:
            asked_ns = time.time_ns() if trail is not None else 0
            decision = dispatch.route(key, r.registry.states(), exclude)
            if trail is not None:
                trail.decided(decision, key.model, asked_ns)
            if decision.worker_id is None:
                break
            record = r.registry.get(decision.worker_id)
            if record is None:  # cannot happen: decide only offers registered workers
                break
            state = record.state
            attempts += 1
            if failure is not None:
                r.metrics.retries.labels(failure).inc()
            call: Call | None = None
            self._log(decision, key, attempts, waited)
            r.registry.sending(record)  # a half-open breaker's trial: nothing else goes there
            flight, records = dispatch.sent(key, decision, state)
            deadline = first_byte_deadline(r.settings, decision.predicted_ttft_s, key)
            opening: _Opening | None = None
            try:
                r.publish(records)
                try:
                    origin = pool.origin(state.url)
                    traced = b"" if trail is None else trail.attempt(state.id, state.url, attempts)
                    call = await pool.send(origin, b"POST " + origin.base_path + request.target
                                           + b" HTTP/1.1\r\nhost: " + origin.host_header + b"\r\n"
                                           + traced + tail)
                    # One timer per attempt (cheaper than asyncio.timeout on the hot path); on expiry
                    # the call fails with reason first_byte_timeout, handled like any failure below.
                    timer = None if deadline is None else _FirstByteTimer(
                        call, deadline, functools.partial(self._last_chance, key, state, exclude, attempts))
                    try:
                        head = await call.head
                        if head.event_stream and head.status < 500:
                            # Nothing has gone to the client yet: a stream's first byte is its first
                            # event, and until it arrives the worker can still be replaced.
                            await call.first_body
                            dispatch.first_byte(flight)
                    finally:
                        if timer is not None:
                            timer.cancel()
                    # Once the body has started (a stream's first bytes are here) silence is bounded
                    # by the stream idle deadline, not the first-byte one.
                    call.limit_silence(stream_idle_deadline(r.settings, record.read_gap_s))
                    if 200 <= head.status < 300:
                        opening = await _Opening.read(
                            call, head.event_stream,
                            r.settings.max_event_bytes if head.event_stream else _MAX_HELD_BODY)
                except UpstreamError as exc:
                    failure = exc.reason
                    r.registry.mark_failure(state.id, f"{failure}: {exc}", unreachable=exc.unreachable)
                    r.metrics.failures.labels(failure).inc()
                    exclude.append(state.id)
                    if trail is not None:
                        trail.attempt_failed(failure)
                    continue
                except BaseException:
                    if call is not None:
                        call.abort()
                    raise
                if head.status >= 500:
                    failure = f"http_{head.status}"
                    held = await self._hold(call, head, state)
                    r.registry.mark_failure(state.id, failure)
                    r.metrics.failures.labels("http_5xx").inc()
                    exclude.append(state.id)
                    if trail is not None:
                        trail.attempt_failed(failure)
                    continue
                problem = None if opening is None else opening.problem(
                    route, call.done.done() and call.done.exception() is None)
                if problem is not None:
                    # Nothing has gone out: another worker can still answer properly.
                    call.abort()
                    failure = "malformed"
                    log.warning("worker %s answered %d with something that is not an answer: %s",
                                state.id, head.status, problem)
                    r.registry.mark_failure(state.id, f"malformed: {problem}", malformed=True)
                    r.metrics.failures.labels(failure).inc()
                    exclude.append(state.id)
                    continue
                await self._relay(request, writer, route, call, head, flight, key, started, attempts,
                                  waited, rename, trail, opening)
                return
            finally:
                dispatch.finished(flight, ok=False)  # a no-op once the relay accounted for it
        self._give_up(writer, route, key, decision, held, failure, attempts, started, rename, trail)

    def _last_chance(self, key: RoutingKey, state: WorkerState, exclude: list[str],
                     attempts: int) -> float | None:
        """The longest first-byte deadline when an attempt on ``state`` is the request's last chance
        (no retry left, or no other worker could take it now), else None.  Asked only when a
        deadline expires."""
        r = self._r
        if attempts <= r.settings.retries and any(
                w.ready and w.serves(key.model) and w is not state and w.id not in exclude
                for w in r.registry.states()):
            return None
        return first_byte_deadline(r.settings, math.inf, key)

    async def _wait(self, ticket: Ticket, writer: ResponseWriter, route: Route, key: RoutingKey,
                    started: float, trail: RequestTrail | None) -> bool:
        """Hold a request flow control queued until a replica is admissible for it (True: route it
        now) or it is shed (answered here with the API's overload error, False).  A client that
        leaves while it waits withdraws it: nothing of it stays counted."""
        r = self._r
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
        self._overloaded(ticket, writer, route, key, started, trail)
        return False

    def _queue_changed(self, model: str) -> None:
        """The model's queue may have changed (a request joined or left it): the dashboard's history."""
        depth, tokens = self._r.dispatch.flow.depth().get(model, (0, 0))
        self._r.activity.queue.changed(model, time.time(), depth, tokens)

    def _overloaded(self, ticket: Ticket, writer: ResponseWriter, route: Route, key: RoutingKey,
                    started: float, trail: RequestTrail | None) -> None:
        """The API's own overload answer: 429 with an ``error`` object on OpenAI routes, 529
        ``overloaded_error`` on Anthropic ones (what Claude Code retries), with ``Retry-After``
        from the queue's predicted drain."""
        r = self._r
        reason = ticket.reason.value if ticket.reason is not None else "shed"
        status = 529 if route.style == "anthropic" else 429
        message = (f"the router's queue for model {key.model!r} is over its limit ({reason}); "
                   f"retry after {ticket.retry_after_s} s")
        writer.respond(status, JSON_HEADERS + b"retry-after: %d\r\n" % ticket.retry_after_s,
                       error_body(route.style, status, message, code=reason))
        r.activity.record(RoutedRequest(
            time=time.time(), route=route.name, model=key.model, worker=None, kind="shed",
            reason=f"[FLOW] shed: {reason} after {ticket.waited_s:.3f} s in the queue", matched_blocks=0,
            total_blocks=0, attempts=0, status=status, ttfb_s=None, duration_s=time.perf_counter() - started,
        ))
        if trail is not None:
            if ticket.waited_s:
                trail.queued(ticket.waited_s, ticket.why)
            trail.finished(status, key.model, None, time.perf_counter() - started)

    async def _hold(self, call: Call, head: ResponseHead, state: WorkerState) -> _HeldAnswer:
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

    def _give_up(self, writer: ResponseWriter, route: Route, key: RoutingKey, decision: Decision | None,
                 held: _HeldAnswer | None, failure: str | None, attempts: int, started: float,
                 rename: AnswerRename | None, trail: RequestTrail | None) -> None:
        """No worker answered well: the last 5xx as the worker sent it, else 502 or 503; a model
        no worker serves: 404 listing the served ones (logged, rate-limited)."""
        r = self._r
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
            asked = rename.asked if rename is not None else key.model
            served = served_models(s.models for s in r.registry.states())
            self._unknown_models.unknown(route.path, asked, key.model, served)
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
                message = f"every worker tried failed ({attempts} attempts, last: {failure})"
            writer.respond(status, JSON_HEADERS + b"retry-after: 1\r\n",
                           error_body(route.style, status, message))
        r.activity.record(RoutedRequest(
            time=time.time(), route=route.name, model=key.model, worker=worker,
            kind=decision.kind.value if decision is not None else "no_worker",
            reason=decision.reason if decision is not None else "", matched_blocks=0,
            total_blocks=decision.total_blocks if decision is not None else 0, attempts=attempts,
            status=status, ttfb_s=None, duration_s=time.perf_counter() - started,
        ))
        if trail is not None:
            trail.finished(status, key.model, worker, time.perf_counter() - started, attempts=attempts)

    def _log(self, decision: Decision, key: RoutingKey, attempt: int, waited: str) -> None:
        if not decision_log.isEnabledFor(logging.INFO):
            return
        extra = waited
        if attempt > 1:
            extra += f" attempt={attempt}"
        if self._r.settings.log_prompts:
            extra += f" prompt_tail={key.prefix[-300:].decode('utf-8', 'replace')!r}"
        decision_log.info("%s model=%s worker=%s%s", decision.reason, key.model, decision.worker_id, extra)

    async def _relay(self, request: FrontRequest, writer: ResponseWriter, route: Route, call: Call,
                     head: ResponseHead, flight: InFlight, key: RoutingKey, started: float,
                     attempts: int, waited: str, rename: AnswerRename | None,
                     trail: RequestTrail | None, opening: _Opening | None) -> None:
        """Pass the worker's answer through as it arrives (``opening``: what was read of it to
        check it); account for it when it ends."""
        r = self._r
        state, decision = flight.state, flight.decision
        r.metrics.requests.labels(state.id, key.model, decision.kind.value).inc()
        r.metrics.prefix_blocks.observe(decision.matched_blocks)
        r.registry.count_request(state.id, decision.kind.value)
        headers = header_lines(head.headers)
        if r.settings.worker_header:
            headers += _WORKER_HEADER + b": " + state.id.encode() + b"\r\n"
        sse = head.event_stream
        respond = None
        if rename is not None and not sse:
            # Renaming changes a plain answer's length: it is sent whole, in one write, once read.
            respond = functools.partial(writer.respond, head.status, headers, reason=head.reason)
        else:
            # A plain answer's head waits for its first bytes, so that a small answer leaves in one write.
            writer.start(head.status, headers, length=None if sse else head.content_length,
                         reason=head.reason, defer=not sse)
        usage = UsageSniffer(sse)
        if opening is not None and opening.doc is not None:
            usage.take(opening.doc)  # the plain body was parsed to check it
        relay = _Relay(writer, sse, usage, started, flight, r, call, rename, respond)
        writer.on_pause(lambda paused: call.pause() if paused else call.resume())
        if opening is not None:
            relay.feed(opening.data())
        call.attach(relay.feed, relay.flush)
        relay.flush()
        completed = False
        outcome = head.status  # what the activity log records: 499 client gone, 502 broken
        try:
            try:
                await call.done
                relay.flush()
                problem = relay.end_problem()
                if problem is not None:
                    raise UpstreamError("malformed", problem)
            except UpstreamError as exc:
                outcome = 502
                self._broken(request, writer, route, state, exc, sse)
                return
            relay.finish()
            writer.end()
            completed = True
        except asyncio.CancelledError:
            outcome = 499
            r.metrics.failures.labels("client_disconnect").inc()
            raise
        finally:
            writer.on_pause(None)
            call.abort()  # closing the connection is what makes the engine abort the request
            if outcome < 500:  # whole, or its client left while it flowed: nothing against the worker
                r.registry.mark_success(state.id, ttft_s=flight.ttft_s, predicted_s=decision.predicted_ttft_s,
                                        read_gap_s=relay.read_gap_s() if sse and completed else None)
            self._finished(route, key, flight, usage, outcome, relay.ttfb, sse, completed, attempts, started,
                           waited, trail)

    def _broken(self, request: FrontRequest, writer: ResponseWriter, route: Route, state: WorkerState,
                exc: UpstreamError, sse: bool) -> None:
        """The worker failed after the client got the first bytes: end the stream with an error
        event (SSE) or cut the connection (a plain body cannot carry an error any more)."""
        r = self._r
        reason = exc.reason
        r.registry.mark_failure(state.id, f"midstream {reason}: {exc}", unreachable=exc.unreachable,
                                malformed=reason == "malformed")
        r.metrics.failures.labels(reason if reason in _NAMED_BREAKS else "midstream").inc()
        log.warning("worker %s failed mid-response: %s (%s)", state.id, reason, exc)
        if sse:
            status = 504 if reason == "stream_idle_timeout" else 502
            message = f"worker {state.id} failed mid-stream ({reason}: {exc}); the response is incomplete"
            writer.write(stream_error_event(route, message, status))
            writer.end()
        else:
            writer.abort()

    def _finished(self, route: Route, key: RoutingKey, flight: InFlight, usage: UsageSniffer, status: int,
                  ttfb: float | None, sse: bool, completed: bool, attempts: int, started: float,
                  waited: str, trail: RequestTrail | None) -> None:
        r = self._r
        state, decision = flight.state, flight.decision
        ok = completed and status < 400
        r.dispatch.finished(flight, ok=ok, prompt_tokens=usage.prompt_tokens if ok else None,
                            cached_tokens=usage.cached_tokens if ok else None,
                            output_tokens=usage.output_tokens if ok else None, streamed=sse)
        r.activity.record(RoutedRequest(
            time=time.time(), route=route.name, model=key.model, worker=state.id,
            kind=decision.kind.value, reason=decision.reason + waited, matched_blocks=decision.matched_blocks,
            total_blocks=decision.total_blocks, attempts=attempts, status=status,
            ttfb_s=ttfb, duration_s=time.perf_counter() - started,
        ))
        if trail is not None:
            trail.finished(status, key.model, state.id, time.perf_counter() - started, ttft_s=ttfb,
                           usage=usage if ok else None, attempts=attempts)
