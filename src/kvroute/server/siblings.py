"""One process of a router made of several (``kvroute serve --processes N``), and its siblings.

Every process serves the public port (``SO_REUSEPORT``: the kernel hands each new connection to
one of them) and also a private aiohttp app on a Unix socket, ``<run dir>/proc-<i>.sock``, in the
directory the supervisor made for this router (mode 0700: only the router's user can connect).
The private app answers for its process alone: its own ``/metrics``, the admin API applied there,
its share of the dashboard's activity, and its fleet (read by a restarted sibling to catch up).

On the public side, what an operator reads must describe the whole router, not the process the
kernel picked, so the answering process asks its siblings' private sockets and merges:

* ``GET /metrics``: ``merge_expositions``, from a middleware of the public app.  The inference
  routes are served before the aiohttp app (server/front.py), so they never pass through it;
* the admin API: every call is made in every process (``admin.BROADCAST``), so a worker added,
  removed or drained through the shared port is so in all of them;
* ``GET /dashboard/data.json``: the siblings' activity folded into this process's view
  (``views.GATHER``).

The routing state itself (prefix index, sessions, epochs, in-flight load) is shared through Redis,
exactly as between separate router instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kvroute.router_settings import WorkerSpec
from kvroute.server.admin import BROADCAST, setup_admin
from kvroute.server.context import ROUTER, Router
from kvroute.server.dashboard.merge import activity_json, merged_view
from kvroute.server.dashboard.snapshot import FleetView
from kvroute.server.dashboard.views import GATHER
from kvroute.server.metrics import merge_expositions

log = logging.getLogger("kvroute.server")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ACTIVITY_PATH = "/_kvroute/activity"
FLEET_PATH = "/_kvroute/fleet"
# Headers of an admin call passed on to the siblings (the token: each process checks it again).
_FORWARDED = ("authorization", "x-admin-token", "content-type")


def socket_path(run_dir: Path, index: int) -> Path:
    """The private socket of process ``index``."""
    return run_dir / f"proc-{index}.sock"


def _json(doc: Any) -> web.Response:
    return web.Response(body=orjson.dumps(doc), content_type="application/json")


def fleet_json(router: Router) -> dict[str, Any]:
    """The workers as registered here (declared settings, not discovered ones), whether a
    discovery source registered them, and their drain state: what a restarted sibling needs to
    match this process's fleet."""
    return {"workers": [{"id": r.id, "url": r.state.url, "models": sorted(r.declared_models),
                         "max_num_seqs": r.declared_max_num_seqs, "draining": r.state.draining,
                         "discovered": r.discovered}
                        for r in router.registry.records()]}


def fleet_specs(doc: dict[str, Any]) -> tuple[WorkerSpec, ...]:
    """The workers of a sibling's ``fleet_json``, as configured workers; not those a discovery
    source registered, which every process discovers on its own."""
    return tuple(WorkerSpec(url=w["url"], id=w["id"], models=tuple(w["models"]),
                            max_num_seqs=w["max_num_seqs"])
                 for w in doc["workers"] if not w.get("discovered"))


def copy_drains(router: Router, doc: dict[str, Any]) -> None:
    """Drain here the workers a sibling's ``fleet_json`` says are draining."""
    for w in doc["workers"]:
        router.registry.set_draining(w["id"], bool(w["draining"]))


async def apply_fleet(router: Router, doc: dict[str, Any]) -> None:
    """Make this process's fleet what a sibling's ``fleet_json`` says: workers it lacks are added,
    workers it no longer has are removed, and drain states are copied.  The workers discovery
    registered are left to this process's own discovery."""
    wanted = {w["id"]: w for w in doc["workers"] if not w.get("discovered")}
    for record in router.registry.records():
        if record.id not in wanted and not record.discovered:
            router.remove_worker(record.id)
    for wid, w in wanted.items():
        held = router.registry.get(wid)
        if (held is None or held.state.url != w["url"] or sorted(held.declared_models) != w["models"]
                or held.declared_max_num_seqs != w["max_num_seqs"]):
            await router.add_worker(w["url"], worker_id=wid, models=w["models"],
                                    max_num_seqs=w["max_num_seqs"])
    copy_drains(router, doc)


class Siblings:
    """Process ``index`` of ``processes``: its private socket and the calls to its siblings'."""

    def __init__(self, run_dir: Path, index: int, processes: int, *, timeout_s: float = 10.0) -> None:
        self.run_dir = run_dir
        self.index = index
        self.processes = processes
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._runner: web.AppRunner | None = None

    # --- this process's side -------------------------------------------------------------------

    def mount(self, app: web.Application) -> None:
        """An ``AppSetup`` for the public app: merged ``/metrics``, admin calls made everywhere,
        the dashboard of every process."""

        @web.middleware
        async def merged_metrics(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.path != "/metrics" or request.method != "GET":
                response: web.StreamResponse = await handler(request)
                return response
            return await self.metrics(request.app[ROUTER])

        app.middlewares.append(merged_metrics)
        app[BROADCAST] = self.broadcast
        app[GATHER] = self.gather

    async def start(self, router: Router) -> None:
        """Serve the private app; siblings see it once ``publish`` is called."""
        app = web.Application(client_max_size=router.settings.max_body_bytes)
        app[ROUTER] = router
        app.router.add_get("/metrics", self._local_metrics)
        app.router.add_get(ACTIVITY_PATH, self._activity)
        app.router.add_get(FLEET_PATH, self._fleet)
        setup_admin(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        with contextlib.suppress(FileNotFoundError):
            self._staging_path.unlink()
        await web.UnixSite(self._runner, str(self._staging_path)).start()

    @property
    def _staging_path(self) -> Path:
        return self.run_dir / f".proc-{self.index}.sock"

    def publish(self) -> None:
        """Make the private socket visible to the siblings (and the supervisor: this process is
        ready).  The rename is atomic: a sibling never connects to a socket not yet listening."""
        os.replace(self._staging_path, socket_path(self.run_dir, self.index))

    def unpublish(self) -> None:
        """Stop being asked by the siblings (at shutdown)."""
        with contextlib.suppress(FileNotFoundError):
            socket_path(self.run_dir, self.index).unlink()

    async def close(self) -> None:
        """Stop the private app."""
        self.unpublish()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _local_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=request.app[ROUTER].metrics.render(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _activity(self, request: web.Request) -> web.Response:
        return _json(activity_json(request.app[ROUTER]))

    async def _fleet(self, request: web.Request) -> web.Response:
        return _json(fleet_json(request.app[ROUTER]))

    # --- asking the siblings -------------------------------------------------------------------

    def _others(self) -> list[int]:
        return [i for i in range(self.processes) if i != self.index]

    async def _ask(self, index: int, method: str, path: str, *, headers: dict[str, str] | None = None,
                   body: bytes = b"") -> tuple[int, bytes] | None:
        """One call to process ``index``'s private app; None if it is not there or does not answer
        (it is restarting, or shutting down)."""
        path_ = socket_path(self.run_dir, index)
        if not path_.exists():
            return None
        try:
            async with (aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path_)),
                                              timeout=self._timeout) as http,
                        http.request(method, "http://kvroute" + path, headers=headers,
                                     data=body or None) as resp):
                return resp.status, await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.debug("router process %d did not answer %s %s: %s", index, method, path, exc)
            return None

    async def _ask_others(self, path: str) -> list[tuple[int, bytes]]:
        """``GET path`` from every sibling; the 200 answers, by process index."""
        answers = await asyncio.gather(*(self._ask(i, "GET", path) for i in self._others()))
        return [(i, a[1]) for i, a in zip(self._others(), answers, strict=True)
                if a is not None and a[0] == 200]

    async def metrics(self, router: Router) -> web.Response:
        """The whole router's ``/metrics``."""
        parts = [(str(self.index), router.metrics.render().decode())]
        parts += [(str(i), body.decode()) for i, body in await self._ask_others("/metrics")]
        return web.Response(body=merge_expositions(parts), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def gather(self, router: Router) -> FleetView:
        """The dashboard's view of the whole router."""
        docs = []
        for i, body in await self._ask_others(ACTIVITY_PATH):
            try:
                docs.append(orjson.loads(body))
            except orjson.JSONDecodeError as exc:
                log.warning("router process %d sent unreadable activity: %s", i, exc)
        return merged_view(router, docs)

    async def broadcast(self, request: web.Request) -> Sequence[tuple[int, bytes] | None]:
        """Make an admin call in every process, this one first (``admin.BROADCAST``)."""
        body = await request.read()
        headers = {k: v for k in _FORWARDED if (v := request.headers.get(k)) is not None}
        order = [self.index, *self._others()]
        answers = await asyncio.gather(*(self._ask(i, request.method, request.path_qs, headers=headers,
                                                   body=body) for i in order))
        statuses = {a[0] for a in answers if a is not None}
        if len(statuses) > 1:
            log.warning("admin %s %s: the router processes answered differently (%s)", request.method,
                        request.path, ", ".join(str(a[0]) if a else "none" for a in answers))
        return answers

    async def fleet(self) -> dict[str, Any] | None:
        """The ``fleet_json`` of the first sibling that answers; None if none does.  A restarted
        process starts from it: it missed the admin calls made while it was away."""
        for i in self._others():
            answer = await self._ask(i, "GET", FLEET_PATH)
            if answer is not None and answer[0] == 200:
                doc: dict[str, Any] = orjson.loads(answer[1])
                return doc
        return None
