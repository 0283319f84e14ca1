"""The dashboard's HTTP face: the static page, its script and stylesheet, and the JSON it polls.

``GET /dashboard``                 the page (it polls the JSON every 2 s)
``GET /dashboard/data.json``       the snapshot (see docs/dashboard.md for its fields)
``GET /dashboard/dashboard.js``    the page's script; ``/dashboard/dashboard.css`` its stylesheet

All read-only.  With ``dashboard_requires_token`` the page and the JSON need the admin token, given
as ``Authorization: Bearer <token>``, ``x-admin-token`` or ``?token=`` (the page passes its own
``?token=`` on to its fetches as a bearer header); the script and stylesheet hold no data and stay
open.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from importlib import resources

import orjson
from aiohttp import web

from kvroute.api.errors import error_body
from kvroute.server.context import ROUTER, Router
from kvroute.server.dashboard.snapshot import FleetView, QueueView, build_snapshot

PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data.json"
_ASSETS = {
    "dashboard.js": "application/javascript",
    "dashboard.css": "text/css",
}
# Viewers poll every 2 s; several open tabs share one snapshot instead of each rebuilding it.
_SNAPSHOT_TTL_S = 1.0
_NO_STORE = {"Cache-Control": "no-store"}


# Set on the app of each process of ``kvroute serve --processes N``: builds the view of the whole
# router (every process's requests) instead of this process's own (see server/siblings.py).
Gather = Callable[[Router], Awaitable[FleetView]]
GATHER: web.AppKey[Gather] = web.AppKey("kvroute.dashboard.gather")


def local_view(router: Router) -> FleetView:
    """What the snapshot is built from, as this process sees it."""
    return FleetView(
        records=router.registry.records(),
        scheduler_stats=router.scheduler.stats(),
        routing=router.scheduler.config,
        requests=router.activity.requests,
        ttfb=router.activity.ttfb,
        queue=local_queue(router),
        guard=router.guard_json,
    )


def local_queue(router: Router) -> QueueView:
    """Flow control's queues and counters and their recent history, as this process sees them."""
    flow, recent = router.dispatch.flow, router.activity.queue
    return QueueView(depth=flow.depth(), by_class=flow.depth_by_class(),
                     sessions=flow.session_counts(router.dispatch.now()),
                     tenant_tokens=dict(flow.tenant_tokens),
                     admitted=_without_class(flow.admitted), shed=_without_class(flow.shed),
                     waits=list(recent.waits),
                     history={model: [list(samples)] for model, samples in recent.history.items()},
                     saturation={model: (int(s.engaged), int(s.thrashing))
                                 for model, s in router.dispatch.saturation.items()})


def _without_class(counts: dict[tuple[str, str, str], int]) -> dict[tuple[str, str], int]:
    """Flow control's (model, what, class) counters summed over the priority classes: the
    dashboard's queue panel is per model."""
    out: dict[tuple[str, str], int] = {}
    for (model, what, _cls), n in counts.items():
        out[(model, what)] = out.get((model, what), 0) + n
    return out


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=error_body("openai", status, message),
                        content_type="application/json", headers=_NO_STORE)


def _denied(request: web.Request, router: Router) -> web.Response | None:
    """None when the dashboard is open or the caller holds the admin token, else the answer."""
    if not router.settings.dashboard_requires_token:
        return None
    token = router.settings.admin_token
    if not token:
        return _error(403, "dashboard_requires_token is set but no admin_token is configured")
    given = request.headers.get("x-admin-token") or request.query.get("token")
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        given = value.strip()
    if not given:
        return _error(401, "the dashboard needs the admin token: open /dashboard?token=<admin token>")
    if not hmac.compare_digest(given.encode(), token.encode()):
        return _error(403, "wrong admin token")
    return None


class Dashboard:
    """Handlers for one app; holds the page's files (read once) and the last snapshot."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        files = resources.files("kvroute.server.dashboard") / "static"
        self._page = (files / "index.html").read_bytes()
        self._assets = {name: (files / name).read_bytes() for name in _ASSETS}
        self._clock = clock
        self._cached: tuple[float, bytes] | None = None

    def _guarded(self, handler: Callable[[web.Request], Awaitable[web.Response]]
                 ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def guarded(request: web.Request) -> web.Response:
            denied = _denied(request, request.app[ROUTER])
            return denied if denied is not None else await handler(request)
        return guarded

    async def page(self, request: web.Request) -> web.Response:
        """``GET /dashboard``."""
        return web.Response(body=self._page, content_type="text/html", charset="utf-8", headers=_NO_STORE)

    async def slash(self, request: web.Request) -> web.Response:
        """``GET /dashboard/``: the page lives without the slash (its links are relative to it)."""
        raise web.HTTPFound(request.rel_url.with_path(PAGE_PATH).with_query(request.query))

    async def asset(self, request: web.Request) -> web.Response:
        """``GET /dashboard/{name}``: the script or the stylesheet."""
        name = request.match_info["name"]
        body = self._assets.get(name)
        if body is None:
            return _error(404, f"no such dashboard file: {name}")
        return web.Response(body=body, content_type=_ASSETS[name], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def data(self, request: web.Request) -> web.Response:
        """``GET /dashboard/data.json``: the snapshot, rebuilt at most once per second."""
        now = self._clock()
        if self._cached is None or now - self._cached[0] >= _SNAPSHOT_TTL_S:
            router = request.app[ROUTER]
            gather = request.app.get(GATHER)
            view = local_view(router) if gather is None else await gather(router)
            self._cached = (now, orjson.dumps(build_snapshot(view, now)))
        return web.Response(body=self._cached[1], content_type="application/json", headers=_NO_STORE)

    def mount(self, app: web.Application) -> None:
        """Add the dashboard's routes to ``app``."""
        app.router.add_get(PAGE_PATH, self._guarded(self.page))
        app.router.add_get(PAGE_PATH + "/", self.slash)
        app.router.add_get(DATA_PATH, self._guarded(self.data))
        # The script and stylesheet are the same for every router and hold no fleet data; they
        # stay open so that the page, opened with ?token=, can load them without it.
        app.router.add_get(PAGE_PATH + "/{name}", self.asset)


def setup_dashboard(app: web.Application) -> None:
    """Mount the dashboard on a router app (an ``AppSetup`` for ``build_app``/``start_router``)."""
    Dashboard().mount(app)
