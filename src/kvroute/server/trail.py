"""What an inference request leaves behind besides its answer: a line in the access log
(``access_log``) and trace spans (server/tracing.py), whichever are on.

The router holds a ``Trails`` only when one of them is on, and the proxy asks for a
``RequestTrail`` per request only then: with both off the hot path pays one ``is None`` test per
step.  The access log never holds the prompt: method, route, model, status, worker, time to first
byte, tokens (prompt, cached, output, as the engine's usage reported them), duration, attempts,
time queued and the W3C trace id when the client sent one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvroute.routing.decision import Decision
from kvroute.server.front import FrontRequest
from kvroute.server.routes import Route
from kvroute.server.tracing import Tracing
from kvroute.server.usage import UsageSniffer

access_log = logging.getLogger("kvroute.access")


class Trails:
    """Starts each inference request's trail: access log on or off, tracing or None."""

    def __init__(self, *, access: bool, tracing: Tracing | None) -> None:
        self.access = access
        self.tracing = tracing
        if access:
            # The access log is written whatever --log-level says (as a web server's is).
            access_log.setLevel(logging.INFO)

    def start(self, request: FrontRequest, route: Route) -> RequestTrail:
        """The trail of one request on ``route``, from now."""
        return RequestTrail(self, request, route)

    def close(self) -> None:
        """Flush the spans still queued (blocks: run it off the event loop)."""
        if self.tracing is not None:
            self.tracing.close()


def traceparent_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The trace id of a well-formed W3C ``traceparent`` header (``00-<32 hex>-<16 hex>-<2 hex>``)."""
    for name, value in headers:
        if name.lower() == b"traceparent":
            parts = value.strip().split(b"-")
            if len(parts) >= 4 and len(parts[1]) == 32 and parts[1] != b"0" * 32:
                try:
                    int(parts[1], 16)
                except ValueError:
                    return None
                return parts[1].decode("ascii").lower()
            return None
    return None


class RequestTrail:
    """One request's spans and access-log line; ``finished`` ends it (once)."""

    __slots__ = ("_access", "_attempt", "_done", "_root", "_tracing", "queued_s", "route", "trace_id")

    def __init__(self, trails: Trails, request: FrontRequest, route: Route) -> None:
        self._access = trails.access
        self._tracing = tracing = trails.tracing
        self.route = route
        self.queued_s: float | None = None
        self._attempt: Any = None
        self._done = False
        if tracing is None:
            self._root: Any = None
            self.trace_id = traceparent_id(request.headers)
            return
        self._root = tracing.tracer.start_span(
            f"POST {route.path}", context=tracing.extract(request.headers), kind=tracing.server_kind,
            attributes={"http.request.method": "POST", "url.path": route.path, "kvroute.route": route.name})
        context = self._root.get_span_context()
        self.trace_id = f"{context.trace_id:032x}" if context.is_valid else None

    def _child(self, name: str, **kwargs: Any) -> Any:
        from opentelemetry.trace import set_span_in_context

        assert self._tracing is not None
        return self._tracing.tracer.start_span(name, context=set_span_in_context(self._root), **kwargs)

    def queued(self, waited_s: float, why: str) -> None:
        """Flow control held the request ``waited_s`` seconds (``why``), ending now."""
        self.queued_s = waited_s
        if self._tracing is not None:
            now = time.time_ns()
            span = self._child("queue wait", start_time=now - int(waited_s * 1e9),
                               attributes={"kvroute.queue.why": why, "kvroute.queue.waited_s": waited_s})
            span.end(end_time=now)

    def decided(self, decision: Decision, model: str, started_ns: int) -> None:
        """The scheduler decided (``started_ns``: ``time.time_ns()`` when it was asked)."""
        if self._tracing is None:
            return
        span = self._child("route", start_time=started_ns, attributes={
            "gen_ai.request.model": model, "kvroute.policy": decision.policy,
            "kvroute.decision.kind": decision.kind.value, "kvroute.decision.reason": decision.reason,
            "kvroute.worker": decision.worker_id or "",
            "kvroute.prefix.matched_blocks": decision.matched_blocks,
            "kvroute.prefix.total_blocks": decision.total_blocks,
            "kvroute.predicted_ttft_s": decision.predicted_ttft_s})
        span.end()

    def attempt(self, worker_id: str, url: str, number: int) -> bytes:
        """An attempt on ``worker_id`` starts; returns the trace header lines the worker gets
        (empty without tracing: the client's own headers pass unchanged then)."""
        tracing = self._tracing
        if tracing is None:
            return b""
        self._attempt = self._child("upstream attempt", kind=tracing.client_kind, attributes={
            "kvroute.worker": worker_id, "url.full": url + self.route.path, "kvroute.attempt": number})
        return tracing.header_lines(self._attempt)

    def attempt_failed(self, failure: str) -> None:
        """The attempt under way failed before its answer could be relayed; the request may move on."""
        span, self._attempt = self._attempt, None
        if span is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_attribute("error.type", failure)
            span.set_status(Status(StatusCode.ERROR, failure))
            span.end()

    def finished(self, status: int, model: str | None, worker: str | None, duration_s: float, *,
                 ttft_s: float | None = None, usage: UsageSniffer | None = None, attempts: int = 0) -> None:
        """The answer is complete (or the client left: 499); ends the spans, writes the line."""
        if self._done:
            return
        self._done = True
        prompt = cached = output = None
        if usage is not None:
            prompt, cached, output = usage.prompt_tokens, usage.cached_tokens, usage.output_tokens
        if self._tracing is not None:
            self._end_spans(status, model, worker, ttft_s, prompt, output)
        if not self._access:
            return
        fields = {"method": "POST", "route": self.route.path, "model": model, "status": status,
                  "worker": worker, "ttft_s": None if ttft_s is None else round(ttft_s, 4),
                  "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
                  "duration_s": round(duration_s, 4), "attempts": attempts,
                  "queued_s": None if self.queued_s is None else round(self.queued_s, 4),
                  "trace_id": self.trace_id}
        text = (f"POST {self.route.path} {status} model={model or '-'} worker={worker or '-'} "
                f"ttft={'-' if ttft_s is None else f'{ttft_s:.3f}s'} duration={duration_s:.3f}s "
                f"tokens_in={_n(prompt)} cached={_n(cached)} tokens_out={_n(output)} attempts={attempts}")
        if self.queued_s is not None:
            text += f" queued={self.queued_s:.3f}s"
        if self.trace_id is not None:
            text += f" trace={self.trace_id}"
        access_log.info(text, extra={"fields": fields})

    def _end_spans(self, status: int, model: str | None, worker: str | None, ttft_s: float | None,
                   prompt: int | None, output: int | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        attempt, self._attempt = self._attempt, None
        if attempt is not None:
            attempt.set_attribute("http.response.status_code", status)
            if ttft_s is not None:
                attempt.set_attribute("kvroute.ttfb_s", ttft_s)
            if status >= 500 or status == 499:
                attempt.set_status(Status(StatusCode.ERROR, f"status {status}"))
            attempt.end()
        root = self._root
        root.set_attribute("http.response.status_code", status)
        for key, value in (("gen_ai.request.model", model), ("kvroute.worker", worker),
                           ("gen_ai.usage.input_tokens", prompt), ("gen_ai.usage.output_tokens", output)):
            if value is not None:
                root.set_attribute(key, value)
        if status >= 500:
            root.set_status(Status(StatusCode.ERROR, f"status {status}"))
        root.end()


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)
