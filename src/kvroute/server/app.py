"""The router: its listening side with the inference routes, and the aiohttp application with
the fleet endpoints, metrics and admin API.

``start_router`` is the public way to run one in-process (tests, demo, benchmarks); ``kvroute
serve`` uses it too.  The hot path of an inference request: read the body once, parse it once
(orjson), reduce it to a ``RoutingKey``, then hand it to the proxy, which forwards those same bytes.
It runs on asyncio protocols (``front``, ``upstream``) because aiohttp's request handling, on both
sides of the proxy, cost most of the router's CPU per request; the other endpoints are rare and
keep aiohttp, reached over a private Unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson
from aiohttp import web

from kvroute.api.errors import ApiError, ApiStyle, error_body
from kvroute.api.model_aliases import ModelAliases, body_for
from kvroute.api.requests import RequestHeaders, parse_request
from kvroute.fleet.kv_events import CacheModeCollector, KvEventMetrics, KvEventWatch
from kvroute.fleet.probe import Prober
from kvroute.fleet.registry import Registry
from kvroute.guard.canary_metrics import CanaryCollector
from kvroute.guard.canary_runner import CanaryRunner
from kvroute.guard.doctor_watch import DoctorWatch
from kvroute.guard.drift_watch import DriftWatch
from kvroute.router_settings import Settings
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.server.activity import Activity
from kvroute.server.admin import setup_admin
from kvroute.server.api_keys import KeyCheck
from kvroute.server.context import ROUTER, Router, RouteSync
from kvroute.server.discovery import DiscoveryWatch
from kvroute.server.engine_tokens import EngineTokens, TokenizeMetrics
from kvroute.server.front import (
    Cut,
    FrontLimits,
    FrontRequest,
    FrontServer,
    Handler,
    RateLimitedLog,
    ResponseWriter,
    ShutdownReport,
    raise_open_file_limit,
    style_of_path,
)
from kvroute.server.metrics import FamiliesCollector, RouterMetrics, front_families
from kvroute.server.model_names import AnswerRename
from kvroute.server.proxy import JSON_HEADERS, Proxy, header_lines, stream_error_event
from kvroute.server.routes import HTTP_ROUTES
from kvroute.server.tracing import Tracing
from kvroute.server.trail import RequestTrail, Trails
from kvroute.server.upstream import Origin, UpstreamError, UpstreamPool
from kvroute.sync.redis_bus import RedisBus

log = logging.getLogger("kvroute.server")

# Called with the app before it starts, to mount more routes (the dashboard reads app[ROUTER]).
AppSetup = Callable[[web.Application], None]

DISCOVERY: web.AppKey[DiscoveryWatch] = web.AppKey("kvroute.discovery", DiscoveryWatch)
# Engine figures are kept for the last hour (the dashboard's window).
_HISTORY_S = 3600.0
# What metrics_access guards: they list workers and traffic.  The dashboard's script and
# stylesheet hold no data and stay open.
_OBSERVER_PATHS = frozenset(("/metrics", "/dashboard", "/dashboard/data.json"))


def _error(writer: ResponseWriter, style: ApiStyle, status: int, message: str, *, param: str | None = None,
           code: str | None = None, retry_after: bool = False) -> None:
    headers = JSON_HEADERS + (b"retry-after: 1\r\n" if retry_after else b"")
    writer.respond(status, headers, error_body(style, status, message, param, code))


def _refuse(writer: ResponseWriter, trail: RequestTrail | None, started: float, status: int, message: str,
            *, param: str | None = None, code: str | None = None, retry_after: bool = False) -> None:
    """Answer an inference request with an error before it reaches the proxy (and say so in its trail)."""
    _error(writer, writer.route.style if writer.route else "openai", status, message, param=param, code=code,
           retry_after=retry_after)
    if trail is not None:
        trail.finished(status, None, None, time.perf_counter() - started)


def _unauthorized(writer: ResponseWriter, keys: KeyCheck, request: FrontRequest, style: ApiStyle,
                  trail: RequestTrail | None, started: float) -> None:
    headers, body = keys.rejection(request.headers, style)
    writer.respond(401, headers, body)
    if trail is not None:
        trail.finished(401, None, None, time.perf_counter() - started)


def _app_error(style: ApiStyle, status: int, message: str) -> web.Response:
    return web.Response(status=status, body=error_body(style, status, message),
                        content_type="application/json")


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


def _token_given(request: FrontRequest) -> str | None:
    """The token a caller sent: ``Authorization: Bearer``, ``x-admin-token`` or ``?token=``."""
    for name, value in request.headers:
        lname = name.lower()
        if lname == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif lname == b"x-admin-token" and value.strip():
            return value.decode("latin-1").strip()
    _, _, query = request.target.partition(b"?")
    for pair in query.split(b"&"):
        key, _, value = pair.partition(b"=")
        if key == b"token" and value:
            return unquote(value.decode("latin-1"))
    return None


def observer_denied(settings: Settings, request: FrontRequest, loopback: bool) -> tuple[int, str] | None:
    """None when the caller may read /metrics or the dashboard (``metrics_access``), else the
    status and message to answer with."""
    mode = settings.metrics_access
    if mode == "open" or (mode == "loopback" and loopback):
        return None
    tokens = [t for t in (settings.metrics_token, settings.admin_token) if t]
    if not tokens:
        return 403, (f"{request.path} answers clients on this machine only (metrics_access = loopback); "
                     "set metrics_token to let others in with it, or metrics_access = open")
    given = _token_given(request)
    if given is None:
        return 401, (f"{request.path} needs a token: Authorization: Bearer <metrics_token or admin_token>"
                     " (the dashboard also takes ?token=)")
    if not any(hmac.compare_digest(given.encode(), t.encode()) for t in tokens):
        return 403, "wrong token"
    return None


def front_handler(router: Router, proxy: Proxy, app_origin: Origin,
                  internal_error: Callable[[str], None] | None = None) -> Handler:
    """What the listening side does with each request: the inference routes are served here,
    everything else goes to the aiohttp application at ``app_origin``.  ``internal_error`` is
    told of unexpected errors (counted and logged, rate-limited)."""
    routes = {route.path: route for route in HTTP_ROUTES}
    failures = router.metrics.failures
    limit = router.settings.max_body_bytes
    too_large = f"request body larger than {limit} bytes"
    internal = internal_error or internal_error_reporter(router)
    aliases = router.model_aliases
    trails, keys = router.trails, router.keys

    async def handle(request: FrontRequest, writer: ResponseWriter) -> None:
        route = routes.get(request.path) if request.method == b"POST" else None
        if route is None:
            if request.too_large:
                failures.labels("too_large").inc()
                _error(writer, style_of_path(request.path), 413, too_large)
                return
            if request.path in _OBSERVER_PATHS:
                denied = observer_denied(router.settings, request, writer.client_is_loopback)
                if denied is not None:
                    _error(writer, "openai", *denied)
                    return
            elif keys is not None and request.path == "/v1/models" and not keys.allows(request.headers):
                failures.labels("unauthorized").inc()
                anthropic = any(k.lower() == b"anthropic-version" for k, _ in request.headers)
                _unauthorized(writer, keys, request, "anthropic" if anthropic else "openai", None, 0.0)
                return
            await _pass_to_app(request, writer, router, app_origin)
            return
        started = time.perf_counter()
        writer.route = route
        trail = trails.start(request, route) if trails is not None else None
        if b"%" in request.target:
            # The path was percent-decoded to find the route: the worker gets the route's own path.
            _, sep, query = request.target.partition(b"?")
            request.target = route.path.encode() + sep + query
        if router.closing:
            _refuse(writer, trail, started, 503, "the router is shutting down", retry_after=True)
            return
        if keys is not None and not keys.allows(request.headers):
            failures.labels("unauthorized").inc()
            _unauthorized(writer, keys, request, route.style, trail, started)
            return
        if request.too_large:
            failures.labels("too_large").inc()
            _refuse(writer, trail, started, 413, too_large)
            return
        try:
            doc = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            failures.labels("bad_request").inc()
            _refuse(writer, trail, started, 400, f"request body is not valid JSON: {exc}", param="body")
            return
        try:
            key = parse_request(route.name, doc, RequestHeaders.of(request.headers), router.request_options)
        except ApiError as exc:
            failures.labels("bad_request").inc()
            _refuse(writer, trail, started, exc.status, exc.message, param=exc.param, code=exc.code)
            return
        except Exception:
            internal(f"reading a request to {route.path}")
            _refuse(writer, trail, started, 500, "internal router error")
            return
        rename = None
        if aliases.active:
            try:
                key, rename = _apply_aliases(aliases, router, request, doc, key)
            except ApiError as exc:
                failures.labels("bad_request").inc()
                _refuse(writer, trail, started, exc.status, exc.message, param=exc.param, code=exc.code)
                return
        if router.tokens is not None:
            key = await router.tokens.keyed(route.name, doc, key)
        try:
            await proxy.forward(request, writer, route, key, started, rename, trail)
        except asyncio.CancelledError:
            if trail is not None:  # the client left while the request waited (a no-op once relayed)
                trail.finished(499, key.model, None, time.perf_counter() - started)
            raise
        except Exception:
            internal(f"serving {route.path}")
            if trail is not None:
                trail.finished(500, key.model, None, time.perf_counter() - started)
            if writer.unsent:
                writer.restart()
                _error(writer, route.style, 500, "internal router error")
            else:
                writer.abort()

    return handle


def _apply_aliases(aliases: ModelAliases, router: Router, request: FrontRequest, doc: dict[str, Any],
                   key: RoutingKey) -> tuple[RoutingKey, AnswerRename | None]:
    """The request's model after the aliases and the default model: when they change it, the body
    sent upstream names the target (``body_for``) and so does the key (routing, per-model
    settings and the prefix cache are the target's); the returned rename restores the asked name
    in the answer."""
    states = router.registry.states()
    target = aliases.resolve(key.model, lambda name: any(name in s.models for s in states))
    if target == key.model:
        return key, None
    asked = key.model
    request.body = body_for(request.body, doc, target)
    return dataclasses.replace(key, model=target), AnswerRename(asked, target)


def internal_error_reporter(router: Router) -> Callable[[str], None]:
    """Counts an unexpected error in ``kvroute_failures_total{reason="internal"}`` and logs it,
    with a traceback at most once a minute (call from an ``except`` block)."""
    errors = RateLimitedLog(log)
    internal = router.metrics.failures.labels("internal")

    def report(what: str) -> None:
        internal.inc()
        errors.error(what)

    return report


def shutdown_cutter(writer: ResponseWriter) -> Cut:
    """Ends a response still running when the shutdown timeout expires: a request not yet
    answered gets 503, an event stream an error event in its API's format; a plain body already
    under way cannot carry an error, so its connection is closed.  Returns what it did."""
    route = writer.route
    if writer.unsent:
        _error(writer, route.style if route is not None else "openai", 503,
               "the router shut down before this request was answered", retry_after=True)
        return Cut.ANSWERED_503
    if writer.sse and route is not None:
        writer.write(stream_error_event(route, "the router shut down before the response was complete; "
                                               "it is incomplete", 503))
        writer.end()
        return Cut.STREAM_ENDED
    writer.abort()
    return Cut.TRUNCATED


# Headers aiohttp refuses to see twice (400, and a traceback in its log); host and content-length
# are set by the relay itself.
_SINGLETONS = frozenset((b"content-location", b"content-range", b"content-type", b"etag", b"max-forwards",
                         b"server", b"user-agent"))


def _repeated_singleton(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The first header that may appear once but appears twice, if any."""
    seen: set[bytes] = set()
    for name, _ in headers:
        lname = name.lower()
        if lname in _SINGLETONS:
            if lname in seen:
                return lname
            seen.add(lname)
    return None


async def _pass_to_app(request: FrontRequest, writer: ResponseWriter, router: Router, origin: Origin) -> None:
    """Relay a request to the aiohttp application behind the listening side, and its answer back."""
    repeated = _repeated_singleton(request.headers)
    if repeated is not None:
        _error(writer, style_of_path(request.path), 400,
               f"the {repeated.decode()} header appears more than once")
        return
    pool = router.upstream
    assert pool is not None, "the router's upstream pool starts with the app"
    head_only = request.method == b"HEAD"
    body = request.body
    data = ((b"GET" if head_only else request.method) + b" " + request.target + b" HTTP/1.1\r\nhost: "
            + origin.host_header + b"\r\n" + header_lines(request.headers)
            + b"content-length: %d\r\n\r\n" % len(body) + body)
    call = None
    try:
        call = await pool.send(origin, data)
        head = await call.head
    except UpstreamError as exc:
        log.error("the router's own application did not answer: %s", exc)
        _error(writer, style_of_path(request.path), 502, "router application unavailable")
        return
    except BaseException:
        if call is not None:
            call.abort()
        raise
    headers = header_lines(head.headers)
    parts: list[bytes] = []
    try:
        if head_only:
            call.attach(parts.append)
            await call.done
            writer.respond(head.status, headers, b"", head.reason, length=len(b"".join(parts)))
            return
        writer.start(head.status, headers, length=head.content_length, reason=head.reason)
        writer.on_pause(lambda paused: call.pause() if paused else call.resume())

        def flush() -> None:
            if parts:
                writer.write(b"".join(parts))
                parts.clear()

        call.attach(parts.append, flush)
        await call.done
        flush()
        writer.end()
    except UpstreamError:
        writer.abort()
    finally:
        writer.on_pause(None)
        call.abort()


async def _models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the union of what healthy workers serve, then each exact alias whose
    model is served, as a model of its own whose ``parent`` names that model (Anthropic's shape
    when the client sends ``anthropic-version``).  Glob patterns cannot be listed as models: every
    alias, in order, and the default model appear beside the list (``aliases``, ``default_model``)."""
    router = request.app[ROUTER]
    cards = router.registry.model_cards()
    aliases = router.model_aliases
    listed = {alias: target for alias, target in aliases.exact.items() if target in cards}
    names = [*sorted(m for m in cards if m not in listed), *listed]
    extra: dict[str, Any] = {}
    if aliases.patterns:
        extra["aliases"] = dict(aliases.patterns)
    if aliases.default_model is not None:
        extra["default_model"] = aliases.default_model
    if "anthropic-version" in request.headers:
        data = [{"type": "model", "id": m, "created_at": "1970-01-01T00:00:00Z",
                 "display_name": f"{m} (alias of {listed[m]})" if m in listed else m} for m in names]
        return _json({"data": data, "has_more": False,
                      "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None, **extra})
    out = []
    for model in names:
        served = listed.get(model, model)
        card = {"object": "model", "created": 0, "owned_by": "kvroute", **cards[served][0]}
        lens = [c["max_model_len"] for c in cards[served] if isinstance(c.get("max_model_len"), int)]
        if lens:
            card["max_model_len"] = min(lens)  # the smallest window is the one every worker accepts
        if model in listed:
            card.update(id=model, parent=served, owned_by="kvroute")
        out.append(card)
    return _json({"object": "list", "data": out, **extra})


async def _health(request: web.Request) -> web.Response:
    """Liveness: the process answers."""
    return _json({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    """Readiness: not shutting down, and at least one worker taking requests (healthy, not
    draining, not ejected by its circuit breaker)."""
    router = request.app[ROUTER]
    healthy = sum(1 for s in router.registry.states() if s.ready)
    if router.closing:
        return _json({"status": "shutting down", "healthy_workers": healthy}, status=503)
    if healthy == 0:
        return _json({"status": "no healthy worker", "healthy_workers": 0}, status=503)
    return _json({"status": "ready", "healthy_workers": healthy})


async def _metrics(request: web.Request) -> web.Response:
    """The router's own Prometheus metrics."""
    body = request.app[ROUTER].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _not_found(request: web.Request) -> web.Response:
    """Anything else under /v1: 404 (405 for a known path with the wrong method), API-styled."""
    for route in HTTP_ROUTES:
        if request.path == route.path and request.method != "POST":
            return _not_allowed(route.style, request.method, route.path, ("POST",))
    return _app_error(style_of_path(request.path), 404, f"no such endpoint: {request.method} {request.path}")


def _not_allowed(style: ApiStyle, method: str, path: str, allowed: Iterable[str]) -> web.Response:
    methods = ", ".join(sorted(allowed))
    response = _app_error(style, 405, f"{method} is not allowed on {path}; it takes {methods}")
    response.headers["Allow"] = methods
    return response


@web.middleware
async def _api_errors(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """aiohttp's own 404 and 405 (no route takes this path, or this method) in the API's JSON
    format, like every other error the router writes."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPMethodNotAllowed as exc:
        return _not_allowed(style_of_path(request.path), request.method, request.path, exc.allowed_methods)
    except web.HTTPNotFound:
        message = f"no such endpoint: {request.method} {request.path}"
        return _app_error(style_of_path(request.path), 404, message)


async def _startup(app: web.Application) -> None:
    router = app[ROUTER]
    s = router.settings
    router.upstream = UpstreamPool(connect_timeout_s=s.upstream_connect_timeout_s,
                                   read_timeout_s=s.upstream_read_timeout_s,
                                   keepalive_s=s.upstream_keepalive_s,
                                   limit_per_origin=s.connections_per_worker)
    records = [router.registry.add(w.url, worker_id=w.id, models=w.models, max_num_seqs=w.max_num_seqs)
               for w in s.workers]
    if router.drift_watch is not None:
        router.drift_watch.start()
    if router.sync is not None:
        # After registering the workers, so that the facts read on catch-up apply to them at once.
        await router.sync.start(router.dispatch.remote)
    # One probe round before accepting requests, so the first requests see the fleet's real state.
    await asyncio.gather(*(router.first_probe(r.id) for r in records))
    for record in records:
        router.prober.watch(record.id)
    if DISCOVERY in app:
        await app[DISCOVERY].start()
    router.canary = CanaryRunner(router.registry, share=router.canary_share, api_key=s.worker_api_key)
    router.metrics.prometheus.register(CanaryCollector(router.canary.watch, router.registry))
    router.canary.start()


async def _shutdown(app: web.Application) -> None:
    # Runs after the listening sockets closed and before in-flight requests are awaited.
    app[ROUTER].shut_down()


async def _cleanup(app: web.Application) -> None:
    router = app[ROUTER]
    if DISCOVERY in app:
        await app[DISCOVERY].close()
    await router.prober.close()
    for watch in (router.doctor_watch, router.drift_watch):
        if watch is not None:
            await watch.close()
    if router.canary is not None:
        await router.canary.close()
    if router.kv_events is not None:
        await router.kv_events.close()
    if router.sync is not None:
        await router.sync.stop()
    if router.upstream is not None:
        router.upstream.close()
    if router.trails is not None:
        await asyncio.to_thread(router.trails.close)


def build_app(settings: Settings, *, scheduler: Scheduler | None = None, sync: RouteSync | None = None,
              setup: Sequence[AppSetup] = (), canary_share: float = 1.0) -> web.Application:
    """The router as an aiohttp application (not yet started).  ``setup`` callbacks mount more
    routes on it; ``sync`` shares routing facts with other instances (by default the Redis bus
    when ``settings.redis_url`` is set); ``canary_share`` is this process's part of the fleet
    guard canary's budget (each process of a multi-process router runs its own canary)."""
    scheduler = scheduler or Scheduler(settings.routing_config())
    dispatch = Dispatcher(scheduler)
    registry = Registry(failure_threshold=settings.failure_threshold, breaker=settings.breaker_settings(),
                        history_len=math.ceil(_HISTORY_S / settings.probe_interval_s), dispatch=dispatch)
    # The fleet guard (docs/fleet-guard.md): each part is turned off per model by its own setting.
    doctor = DoctorWatch(registry, scheduler.settings_for, timeout_s=max(10.0, settings.probe_timeout_s),
                         api_key=settings.worker_api_key)
    drift = DriftWatch(registry, scheduler, interval_s=settings.probe_interval_s, context=doctor.summary)
    router = Router(
        settings=settings,
        registry=registry,
        dispatch=dispatch,
        metrics=RouterMetrics(registry, scheduler.stats),
        activity=Activity(),
        prober=Prober(registry, interval_s=settings.probe_interval_s, timeout_s=settings.probe_timeout_s,
                      api_key=settings.worker_api_key),
        request_options=settings.request_options(),
        model_aliases=settings.model_aliases(),
        sync=sync,
        doctor_watch=doctor,
        drift_watch=drift,
        canary_share=canary_share,
        keys=KeyCheck(settings.api_keys) if settings.api_keys else None,
    )
    tracing = Tracing.from_settings(settings.otlp_endpoint)
    if settings.access_log or tracing is not None:
        router.trails = Trails(access=settings.access_log, tracing=tracing)
    if sync is None and settings.redis_url:
        router.sync = RedisBus(settings.redis_url, registry=registry, scheduler=scheduler,
                               metrics_registry=router.metrics.prometheus, secret=settings.sync_key(),
                               max_clock_skew_s=settings.sync_max_clock_skew_s)
    # Without a bus nobody hears the facts a request's commit would make for other instances.
    scheduler.publishes = router.sync is not None
    registry.subscribe(router)
    registry.subscribe(doctor)
    router.kv_events = KvEventWatch(
        scheduler.exact, settings.kv_event_settings(),
        lambda wid: (r.state.url if (r := registry.get(wid)) is not None else None),
        KvEventMetrics(router.metrics.prometheus), known_urls=[w.url for w in settings.workers])
    registry.subscribe(router.kv_events)
    router.tokens = EngineTokens(registry, scheduler, lambda: router.upstream,
                                 metrics=TokenizeMetrics(router.metrics.prometheus))
    router.metrics.prometheus.register(
        CacheModeCollector(scheduler.exact, lambda: [r.id for r in registry.records()]))
    for families in (doctor.families, drift.families):
        router.metrics.prometheus.register(FamiliesCollector(families))
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[_api_errors])
    app[ROUTER] = router
    if settings.discover:
        app[DISCOVERY] = DiscoveryWatch(router)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    setup_admin(app)
    for mount in setup:
        mount(app)
    app.router.add_route("*", "/v1/{tail:.*}", _not_found)
    app.on_startup.append(_startup)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    return app


# The exit status of a router whose shutdown timeout cut requests (docs/server.md#shutdown).
CUT_EXIT_CODE = 3


@dataclass(slots=True)
class RunningRouter:
    """A router serving on ``url`` until ``close()``."""

    url: str
    app: web.Application
    runner: web.AppRunner
    front: FrontServer
    app_dir: tempfile.TemporaryDirectory[str]

    @property
    def router(self) -> Router:
        """Everything the router holds (settings, registry, scheduler, metrics, activity)."""
        return self.app[ROUTER]

    @property
    def registry(self) -> Registry:
        """The fleet registry."""
        return self.app[ROUTER].registry

    @property
    def scheduler(self) -> Scheduler:
        """The routing scheduler."""
        return self.app[ROUTER].scheduler

    @property
    def discovery(self) -> DiscoveryWatch | None:
        """The discovery loops (docs/discovery.md), when ``settings.discover`` names sources."""
        return self.app.get(DISCOVERY)

    async def close(self) -> ShutdownReport:
        """Stop accepting connections, let in-flight requests finish (up to the settings'
        ``shutdown_timeout_s``), end what is left cleanly (``FrontServer.close``), then stop
        probing and close upstream connections.  Returns what had to be cut."""
        router = self.app[ROUTER]
        router.shut_down()
        report = await self.front.close(router.settings.shutdown_timeout_s)
        with contextlib.suppress(RuntimeError):  # closing twice is harmless
            await self.runner.cleanup()
        self.app_dir.cleanup()
        return report


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, settings, the app, the fleet) out of the cyclic
    garbage collector's sight: called once by ``kvroute serve`` when the router is up.

    A full collection otherwise traverses all ~100k objects of the started router (~60 ms of
    CPU, during requests); frozen, it traverses only what was made since.  Garbage is collected
    first, so nothing dead is kept; an object frozen here is still freed when its last reference
    goes, but never found in a reference cycle, which the objects made at start-up are not
    expected to end in.  Not for in-process routers (tests): each would keep the last ones'."""
    gc.collect()
    gc.freeze()


async def start_router(settings: Settings, *, host: str = "127.0.0.1", port: int = 0,
                       sync: RouteSync | None = None, setup: Sequence[AppSetup] = (),
                       scheduler: Scheduler | None = None, reuse_port: bool = False,
                       canary_share: float = 1.0) -> RunningRouter:
    """Start a router on ``host:port`` (port 0: a free one) and return once it accepts requests.
    ``reuse_port``: several processes may listen on the same port (the kernel spreads connections);
    ``canary_share``: this process's part of the canary budget.

    The configured workers, and those the discovery sources list, are registered and probed once
    before this returns.  The inference
    routes are served by the listening side itself (``front_handler``); the other endpoints by the
    aiohttp application, which listens on a private Unix socket behind it."""
    app = build_app(settings, scheduler=scheduler, sync=sync, setup=setup, canary_share=canary_share)
    # The listening side enforces the header limits; the app behind it must not be stricter, or a
    # request the front accepted would fail there (aiohttp: 8190-byte lines, with a traceback).
    head = settings.max_header_bytes + 1024
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=settings.shutdown_timeout_s,
                           access_log=None, max_line_size=head, max_field_size=head,
                           max_headers=settings.max_headers + 8)
    await runner.setup()
    app_dir = tempfile.TemporaryDirectory(prefix="kvroute-")
    socket_path = os.path.join(app_dir.name, "app.sock")
    router = app[ROUTER]
    open_files = raise_open_file_limit()
    limits = FrontLimits.from_settings(settings, open_files)
    internal = internal_error_reporter(router)
    handler = front_handler(router, Proxy(router), Origin.from_url("unix:" + socket_path), internal)
    front = FrontServer(handler, limits=limits, cutter=shutdown_cutter, internal_error=internal)
    router.metrics.prometheus.register(FamiliesCollector(front_families(front)))
    try:
        await web.UnixSite(runner, socket_path).start()
        bound_port = await front.start(host, port, reuse_port=reuse_port)
    except BaseException:
        await front.close(0)
        await runner.cleanup()
        app_dir.cleanup()
        raise
    log.info("accepting up to %d client connections (open-file limit %d%s)", limits.max_connections,
             open_files, "" if settings.max_connections else "; max_connections = 0 derives the cap from it")
    shown = f"[{host}]" if ":" in host else host
    return RunningRouter(url=f"http://{shown}:{bound_port}", app=app, runner=runner, front=front,
                         app_dir=app_dir)
