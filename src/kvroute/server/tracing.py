"""Trace spans over OTLP/HTTP through OpenTelemetry's SDK (the optional ``kvroute[otel]`` extra).

Off unless ``otlp_endpoint`` or the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set.  Each inference request is a server span that
continues the client's W3C trace (``traceparent``, ``tracestate``); under it a ``route`` span per
routing decision, a ``queue wait`` span when flow control held the request, and an ``upstream
attempt`` client span per worker tried, whose context is the ``traceparent`` the worker receives
(so an engine's own spans, vLLM's ``--otlp-traces-endpoint``, nest under the router's attempt).
The SDK's sampler and resource read the usual ``OTEL_*`` variables (``OTEL_TRACES_SAMPLER``,
``OTEL_SERVICE_NAME``, default ``kvroute``); spans leave in batches from the SDK's own thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("kvroute.tracing")

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# The W3C Trace Context headers: taken from the client, replaced by the attempt's own towards a worker.
TRACE_HEADERS = frozenset((b"traceparent", b"tracestate"))


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but OpenTelemetry's SDK is not installed."""


def sdk_missing() -> str | None:
    """Why tracing cannot run here (OpenTelemetry's SDK or OTLP exporter does not import), or None."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return (f"tracing needs OpenTelemetry's SDK and OTLP exporter ({exc.name} is missing): "
                "pip install 'kvroute[otel]'")
    return None


def traces_url(base: str) -> str:
    """The OTLP/HTTP traces URL for a collector's base URL (``/v1/traces`` appended, as the
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` convention has it) or a URL already ending in it."""
    base = base.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


class Tracing:
    """The router's tracer and its exporter; ``close()`` flushes what is still queued."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self.tracer = provider.get_tracer("kvroute")
        self.propagator = TraceContextTextMapPropagator()
        self.server_kind, self.client_kind = SpanKind.SERVER, SpanKind.CLIENT

    @classmethod
    def from_settings(cls, endpoint: str | None, env: Mapping[str, str] | None = None) -> Tracing | None:
        """Tracing as configured: ``endpoint`` (the ``otlp_endpoint`` setting), else the standard
        environment variables; None when neither is set or ``OTEL_SDK_DISABLED`` is true.  Raises
        TracingUnavailable when ``endpoint`` is set and the SDK is missing (from the environment
        alone, that is only logged: the variables may be meant for other programs)."""
        env = os.environ if env is None else env
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        if endpoint is None and not any(env.get(name) for name in _ENDPOINT_VARIABLES):
            return None
        missing = sdk_missing()
        if missing is not None:
            if endpoint is not None:
                raise TracingUnavailable(missing)
            log.warning("%s; OTEL_EXPORTER_OTLP_ENDPOINT is set, but no spans are exported", missing)
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        named = "OTEL_SERVICE_NAME" in env or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
        provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "kvroute"}))
        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint)) if endpoint else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("exporting trace spans over OTLP/HTTP to %s",
                 traces_url(endpoint) if endpoint else "the OTEL_EXPORTER_OTLP_* endpoint")
        return cls(provider)

    def extract(self, headers: list[tuple[bytes, bytes]]) -> Any:
        """The client's trace context from its ``traceparent``/``tracestate`` headers (an empty
        context when it sent none: the router's span starts a trace)."""
        carrier = {k.lower().decode("latin-1"): v.decode("latin-1") for k, v in headers
                   if k.lower() in TRACE_HEADERS}
        return self.propagator.extract(carrier)

    def header_lines(self, span: Any) -> bytes:
        """``traceparent`` (and ``tracestate``) lines naming ``span`` as the worker's parent."""
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=set_span_in_context(span))
        return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in carrier.items())

    def close(self) -> None:
        """Export the spans still queued and stop the exporter (blocks: run it off the loop)."""
        self._provider.shutdown()
