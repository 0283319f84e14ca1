"""The router's aiohttp application: inference routes, fleet endpoints, metrics, admin API.

``start_router`` is the public way to run one in-process (tests, demo, benchmarks); ``kvroute
serve`` uses it too.  The hot path of an inference request: read the body once, parse it once
(orjson), reduce it to a ``RoutingKey``, then hand it to the proxy, which forwards those same bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvroute.api.errors import ApiError, ApiStyle, error_body
from kvroute.api.requests import parse_request
from kvroute.config import Settings
from kvroute.fleet.probe import Prober
from kvroute.fleet.registry import Registry
from kvroute.routing.scheduler import Scheduler
from kvroute.server.activity import Activity
from kvroute.server.admin import setup_admin
from kvroute.server.context import ROUTER, Router, RouteSync
from kvroute.server.metrics import RouterMetrics
from kvroute.server.proxy import Proxy
from kvroute.server.routes import ROUTES, Route
from kvroute.sync.redis_bus import RedisBus

log = logging.getLogger("kvroute.server")

# Called with the app before it starts, to mount more routes (the dashboard reads app[ROUTER]).
AppSetup = Callable[[web.Application], None]

# Engine figures are kept for the last hour (the dashboard's window).
_HISTORY_S = 3600.0


def _error(style: ApiStyle, status: int, message: str, *, param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(style, status, message, param, code),
                        content_type="application/json", headers=headers)


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


def _serves(router: Router, model: str) -> bool:
    """Whether any worker (healthy or not) serves ``model``, or might (models not yet known)."""
    states = router.registry.states()
    return not states or any(s.serves(model) for s in states)


def _inference_handler(route: Route, proxy: Proxy) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        router = request.app[ROUTER]
        style = route.style
        failures = router.metrics.failures
        if router.closing:
            return _error(style, 503, "the router is shutting down", headers={"Retry-After": "1"})
        limit = router.settings.max_body_bytes
        too_large = f"request body larger than {limit} bytes"
        if request.content_length is not None and request.content_length > limit:
            failures.labels("too_large").inc()
            return _error(style, 413, too_large)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            failures.labels("too_large").inc()
            return _error(style, 413, too_large)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            failures.labels("bad_request").inc()
            return _error(style, 400, f"request body is not valid JSON: {exc}", param="body")
        try:
            key = parse_request(route.name, doc, request.headers, router.request_options)
        except ApiError as exc:
            failures.labels("bad_request").inc()
            return _error(style, exc.status, exc.message, param=exc.param, code=exc.code)
        if not _serves(router, key.model):
            failures.labels("unknown_model").inc()
            return _error(style, 404, f"The model `{key.model}` does not exist.", param="model",
                          code="model_not_found")
        try:
            return await proxy.forward(request, route, body, key, started)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unexpected error serving %s", route.path)
            failures.labels("internal").inc()
            return _error(style, 500, "internal router error")

    return handle


async def _models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the union of what healthy workers serve (Anthropic's shape when the
    client sends ``anthropic-version``)."""
    cards = request.app[ROUTER].registry.model_cards()
    if "anthropic-version" in request.headers:
        data = [{"type": "model", "id": m, "display_name": m, "created_at": "1970-01-01T00:00:00Z"}
                for m in sorted(cards)]
        return _json({"data": data, "has_more": False,
                      "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None})
    out = []
    for model in sorted(cards):
        card = {"object": "model", "created": 0, "owned_by": "kvroute", **cards[model][0]}
        lens = [c["max_model_len"] for c in cards[model] if isinstance(c.get("max_model_len"), int)]
        if lens:
            card["max_model_len"] = min(lens)  # the smallest window is the one every worker accepts
        out.append(card)
    return _json({"object": "list", "data": out})


async def _health(request: web.Request) -> web.Response:
    """Liveness: the process answers."""
    return _json({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    """Readiness: not shutting down, and at least one healthy, undrained worker."""
    router = request.app[ROUTER]
    healthy = sum(1 for s in router.registry.states() if s.healthy and not s.draining)
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
    for route in ROUTES:
        if request.path == route.path:
            return _error(route.style, 405, f"{request.method} is not allowed on {route.path}; use POST")
    style: ApiStyle = "anthropic" if request.path.startswith("/v1/messages") else "openai"
    return _error(style, 404, f"no such endpoint: {request.method} {request.path}")


async def _startup(app: web.Application) -> None:
    router = app[ROUTER]
    s = router.settings
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=s.connections_per_worker,
                                     keepalive_timeout=s.upstream_keepalive_s, ttl_dns_cache=300)
    router.client = aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.upstream_connect_timeout_s,
                                      sock_read=s.upstream_read_timeout_s),
        auto_decompress=False,  # bytes pass through as the worker encoded them
        skip_auto_headers=("Accept", "Accept-Encoding", "Content-Type", "User-Agent"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    records = [router.registry.add(w.url, worker_id=w.id, models=w.models, max_num_seqs=w.max_num_seqs)
               for w in s.workers]
    if router.sync is not None:
        # After registering the workers, so that the facts read on catch-up apply to them at once.
        await router.sync.start(router.scheduler.apply_remote)
    # One probe round before accepting requests, so the first requests see the fleet's real state.
    await asyncio.gather(*(router.prober.probe_once(r.id, with_server_info=True) for r in records))
    for record in records:
        router.prober.watch(record.id)


async def _shutdown(app: web.Application) -> None:
    # Runs after the listening sockets closed and before in-flight requests are awaited.
    app[ROUTER].closing = True


async def _cleanup(app: web.Application) -> None:
    router = app[ROUTER]
    await router.prober.close()
    if router.sync is not None:
        await router.sync.stop()
    if router.client is not None:
        await router.client.close()


def build_app(settings: Settings, *, scheduler: Scheduler | None = None, sync: RouteSync | None = None,
              setup: Sequence[AppSetup] = ()) -> web.Application:
    """The router as an aiohttp application (not yet started).  ``setup`` callbacks mount more
    routes on it; ``sync`` shares routing facts with other instances (by default the Redis bus
    when ``settings.redis_url`` is set)."""
    registry = Registry(failure_threshold=settings.failure_threshold,
                        history_len=math.ceil(_HISTORY_S / settings.probe_interval_s))
    scheduler = scheduler or Scheduler(settings.routing_config())
    router = Router(
        settings=settings,
        registry=registry,
        scheduler=scheduler,
        metrics=RouterMetrics(registry, scheduler.stats),
        activity=Activity(),
        prober=Prober(registry, interval_s=settings.probe_interval_s, timeout_s=settings.probe_timeout_s),
        request_options=settings.request_options(),
        sync=sync,
    )
    if sync is None and settings.redis_url:
        router.sync = RedisBus(settings.redis_url, registry=registry, scheduler=scheduler,
                               metrics_registry=router.metrics.prometheus)
    registry.subscribe(router)
    proxy = Proxy(router)
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[ROUTER] = router
    for route in ROUTES:
        app.router.add_post(route.path, _inference_handler(route, proxy))
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


@dataclass(slots=True)
class RunningRouter:
    """A router serving on ``url`` until ``close()``."""

    url: str
    app: web.Application
    runner: web.AppRunner

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

    async def close(self) -> None:
        """Stop accepting connections, let in-flight requests finish (up to the settings'
        ``shutdown_timeout_s``), then stop probing and close upstream connections."""
        with contextlib.suppress(RuntimeError):  # closing twice is harmless
            await self.runner.cleanup()


async def start_router(settings: Settings, *, host: str = "127.0.0.1", port: int = 0,
                       sync: RouteSync | None = None, setup: Sequence[AppSetup] = (),
                       scheduler: Scheduler | None = None) -> RunningRouter:
    """Start a router on ``host:port`` (port 0: a free one) and return once it accepts requests.

    The configured workers are registered and probed once before this returns."""
    app = build_app(settings, scheduler=scheduler, sync=sync, setup=setup)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=settings.shutdown_timeout_s,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    shown = f"[{host}]" if ":" in host else host
    return RunningRouter(url=f"http://{shown}:{bound_port}", app=app, runner=runner)
