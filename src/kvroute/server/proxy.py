"""Forwarding one request upstream: decide, send the original bytes, relay the answer as it comes.

Before the first byte reaches the client, a worker that cannot be reached, drops the connection,
times out or answers 5xx is marked and the request is decided again without it (bounded by
``retries``).  Once bytes have gone out, a broken upstream ends the stream with an error event in
the route's own format.  A client that goes away closes the upstream connection, which is how
an engine learns to abort the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from kvroute.api.errors import error_body
from kvroute.routing.decision import Decision
from kvroute.routing.key import RoutingKey
from kvroute.routing.worker import WorkerState
from kvroute.server.activity import RequestRecord
from kvroute.server.context import Router
from kvroute.server.routes import Route
from kvroute.server.usage import UsageSniffer

decision_log = logging.getLogger("kvroute.decision")
log = logging.getLogger("kvroute.proxy")

WORKER_HEADER = "x-kvroute-worker"
# Hop-by-hop headers (RFC 9110 §7.6.1) and those the client library recomputes.
_HOP_BY_HOP = frozenset((
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length", "expect",
))
_MAX_HELD_ERROR = 64 * 1024
# Longest incomplete SSE event held back so that an error event can follow a clean boundary.
_MAX_PENDING = 64 * 1024


@dataclass(frozen=True, slots=True)
class _HeldAnswer:
    """A 5xx answer kept while another worker is tried; returned as-is if none can take over."""

    worker: str
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes


def upstream_headers(headers: CIMultiDictProxy[str]) -> list[tuple[str, str]]:
    """The client's headers minus hop-by-hop ones: auth, API versions and betas pass unchanged."""
    return [(k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP]


def _classify(exc: BaseException) -> tuple[str, bool]:
    """A failure reason for metrics, and whether the worker is plainly unreachable."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect", True
    if isinstance(exc, TimeoutError):
        return "timeout", False
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "disconnect", False
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "payload", False
    return "reset", False


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


class Proxy:
    """Sends requests to workers chosen by the scheduler and relays their answers."""

    def __init__(self, router: Router) -> None:
        self._r = router

    async def forward(self, request: web.Request, route: Route, body: bytes, key: RoutingKey,
                      started: float) -> web.StreamResponse:
        """Serve one parsed request: decide, send, retry before the first byte, relay."""
        r = self._r
        client = r.client
        assert client is not None, "the router's HTTP client starts with the app"
        headers = upstream_headers(request.headers)
        exclude: list[str] = []
        failure: str | None = None
        held: _HeldAnswer | None = None
        decision: Decision | None = None
        attempts = 0
        while attempts <= r.settings.retries:
            decision = r.scheduler.decide(key, r.registry.states(), exclude)
            if decision.worker_id is None:
                break
            state = r.registry.begin(decision.worker_id)
            if state is None:  # cannot happen: decide only offers registered workers
                break
            attempts += 1
            if failure is not None:
                r.metrics.retries.labels(failure).inc()
            try:
                self._log(decision, key, attempts)
                r.publish(r.scheduler.commit(key, decision))
                try:
                    upstream = await client.post(state.url + request.raw_path, data=body, headers=headers)
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    failure, unreachable = _classify(exc)
                    r.registry.mark_failure(state.id, f"{failure}: {exc}", unreachable=unreachable)
                    r.metrics.failures.labels(failure).inc()
                    exclude.append(state.id)
                    continue
                if upstream.status >= 500:
                    failure = f"http_{upstream.status}"
                    held = await self._hold(upstream, state)
                    r.registry.mark_failure(state.id, failure)
                    r.metrics.failures.labels("http_5xx").inc()
                    exclude.append(state.id)
                    continue
                r.registry.mark_success(state.id)
                return await self._relay(request, route, upstream, state, decision, key, started, attempts)
            finally:
                r.registry.end(state)
        return self._give_up(request, route, key, decision, held, failure, attempts, started)

    async def _hold(self, upstream: aiohttp.ClientResponse, state: WorkerState) -> _HeldAnswer | None:
        try:
            body = await upstream.content.read(_MAX_HELD_ERROR)
        except (aiohttp.ClientError, OSError, TimeoutError):
            body = b""
        finally:
            upstream.close()
        return _HeldAnswer(state.id, upstream.status, upstream.headers, body)

    def _give_up(self, request: web.Request, route: Route, key: RoutingKey, decision: Decision | None,
                 held: _HeldAnswer | None, failure: str | None, attempts: int,
                 started: float) -> web.Response:
        """No worker answered well: the last 5xx as the worker sent it, else 502 or 503."""
        r = self._r
        if held is not None:
            headers = CIMultiDict((k, v) for k, v in held.headers.items() if k.lower() not in _HOP_BY_HOP)
            if r.settings.worker_header:
                headers[WORKER_HEADER] = held.worker
            resp = web.Response(status=held.status, body=held.body, headers=headers)
            worker: str | None = held.worker
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
            resp = web.Response(status=status, body=error_body(route.style, status, message),
                                content_type="application/json", headers={"Retry-After": "1"})
        r.activity.record(RequestRecord(
            time=time.time(), route=route.name, model=key.model, worker=worker,
            kind=decision.kind.value if decision is not None else "no_worker",
            reason=decision.reason if decision is not None else "", matched_blocks=0,
            total_blocks=decision.total_blocks if decision is not None else 0, attempts=attempts,
            status=resp.status, ttfb_s=None, duration_s=time.perf_counter() - started,
        ))
        return resp

    def _log(self, decision: Decision, key: RoutingKey, attempt: int) -> None:
        if not decision_log.isEnabledFor(logging.INFO):
            return
        extra = f" attempt={attempt}" if attempt > 1 else ""
        if self._r.settings.log_prompts:
            extra += f" prompt_tail={key.prefix[-300:].decode('utf-8', 'replace')!r}"
        decision_log.info("%s model=%s worker=%s%s", decision.reason, key.model, decision.worker_id, extra)

    async def _relay(self, request: web.Request, route: Route, upstream: aiohttp.ClientResponse,
                     state: WorkerState, decision: Decision, key: RoutingKey, started: float,
                     attempts: int) -> web.StreamResponse:
        """Pass the worker's answer through as it arrives; account for it when it ends."""
        r = self._r
        sent_at = time.perf_counter()
        r.metrics.requests.labels(state.id, key.model, decision.kind.value).inc()
        r.metrics.prefix_blocks.observe(decision.matched_blocks)
        r.registry.count_request(state.id, decision.kind.value)
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in _HOP_BY_HOP:
                resp.headers.add(k, v)
        if r.settings.worker_header:
            resp.headers[WORKER_HEADER] = state.id
        sse = upstream.content_type == "text/event-stream"
        if not sse and upstream.content_length is not None:
            resp.content_length = upstream.content_length
        usage = UsageSniffer(sse)
        ttfb: float | None = None
        first_chunk_s: float | None = None
        pending = b""
        completed = False
        outcome = upstream.status  # what the activity log records: 499 client gone, 502 broken
        try:
            await resp.prepare(request)
            while True:
                try:
                    chunk = await upstream.content.readany()
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    outcome = 502
                    await self._broken(request, route, resp, state, exc, sse)
                    return resp
                if not chunk:
                    break
                if ttfb is None:
                    now = time.perf_counter()
                    ttfb, first_chunk_s = now - started, now - sent_at
                    r.metrics.ttfb.observe(ttfb)
                if sse:
                    # Only whole events go out, so that an error event can follow cleanly.
                    data = pending + chunk if pending else chunk
                    end = len(data) if data.endswith(b"\n\n") else _event_end(data)
                    if end == 0 and len(data) <= _MAX_PENDING:
                        pending = data
                        continue
                    end = end or len(data)
                    pending = data[end:]
                    chunk = data[:end] if end < len(data) else data
                await resp.write(chunk)
                usage.feed(chunk)
            if pending:
                await resp.write(pending)
            await resp.write_eof()
            completed = True
        except ConnectionResetError:
            outcome = 499
            r.metrics.failures.labels("client_disconnect").inc()
        except asyncio.CancelledError:
            outcome = 499
            r.metrics.failures.labels("client_disconnect").inc()
            raise
        finally:
            if completed:
                upstream.release()
            else:
                upstream.close()  # closing the connection is what makes the engine abort the request
            self._finished(route, key, state, decision, usage, outcome, ttfb, first_chunk_s,
                           sse, completed, attempts, started)
        return resp

    async def _broken(self, request: web.Request, route: Route, resp: web.StreamResponse,
                      state: WorkerState, exc: BaseException, sse: bool) -> None:
        """The worker failed after the client got the first bytes: end the stream with an error
        event (SSE) or cut the connection (a plain body cannot carry an error any more)."""
        r = self._r
        reason, unreachable = _classify(exc)
        r.registry.mark_failure(state.id, f"midstream {reason}: {exc}", unreachable=unreachable)
        r.metrics.failures.labels("midstream").inc()
        log.warning("worker %s failed mid-response: %s", state.id, reason)
        if sse:
            message = f"worker {state.id} failed mid-stream ({reason}); the response is incomplete"
            try:
                await resp.write(stream_error_event(route, message))
                await resp.write_eof()
            except ConnectionResetError:
                pass
        elif request.transport is not None:
            request.transport.close()

    def _finished(self, route: Route, key: RoutingKey, state: WorkerState, decision: Decision,
                  usage: UsageSniffer, status: int, ttfb: float | None, first_chunk_s: float | None,
                  sse: bool, completed: bool, attempts: int, started: float) -> None:
        r = self._r
        if completed and status < 400:
            usage.finish()
            r.scheduler.on_finished(state.id, prompt_tokens=usage.prompt_tokens,
                                    cached_tokens=usage.cached_tokens,
                                    ttft_s=first_chunk_s if sse else None)
        r.activity.record(RequestRecord(
            time=time.time(), route=route.name, model=key.model, worker=state.id,
            kind=decision.kind.value, reason=decision.reason, matched_blocks=decision.matched_blocks,
            total_blocks=decision.total_blocks, attempts=attempts, status=status,
            ttfb_s=ttfb, duration_s=time.perf_counter() - started,
        ))
