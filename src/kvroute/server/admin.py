"""The admin API: register, remove, drain and list workers.  Every call needs the admin token
(``Authorization: Bearer <token>`` or ``x-admin-token: <token>``); without a configured token the
admin API is off.

In a router of several processes (``kvroute serve --processes N``) each call is made in every
process (the app then holds a ``BROADCAST`` function) and the listing sums their counts."""

from __future__ import annotations

import functools
import hmac
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from kvroute.api.errors import error_body
from kvroute.fleet.registry import SOURCE_ADMIN
from kvroute.router_settings import SettingsError, parse_worker_spec
from kvroute.server.context import ROUTER, Router


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=error_body("openai", status, message),
                        content_type="application/json")


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json")


def _authorised(request: web.Request, router: Router) -> web.Response | None:
    """None when the caller holds the admin token, else the error to answer with."""
    token = router.settings.admin_token
    if not token:
        return _error(403, "the admin API is disabled: set admin_token (KVROUTE_ADMIN_TOKEN)")
    given = request.headers.get("x-admin-token")
    if given is None:
        auth = request.headers.get("authorization", "")
        scheme, _, value = auth.partition(" ")
        given = value.strip() if scheme.lower() == "bearer" else None
    if given is None:
        return _error(401, "admin token required (Authorization: Bearer <token> or x-admin-token)")
    if not hmac.compare_digest(given.encode(), token.encode()):
        return _error(403, "wrong admin token")
    return None


Handler = Callable[[web.Request], Awaitable[web.Response]]
# Makes the same call in every router process; each one's (status, body), the answering process's
# first, None for a process that did not answer.
Broadcast = Callable[[web.Request], Awaitable[Sequence[tuple[int, bytes] | None]]]
BROADCAST: web.AppKey[Broadcast] = web.AppKey("kvroute.admin.broadcast")


def admin_only(handler: Handler) -> Handler:
    """Wrap a handler so that it answers only callers holding the admin token."""

    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.Response:
        denied = _authorised(request, request.app[ROUTER])
        return denied if denied is not None else await handler(request)

    return guarded


async def list_workers(request: web.Request) -> web.Response:
    """``GET /admin/workers``: every worker with its state and what the fleet guard found, the
    scheduler's statistics, and per model whether its fleet is saturated (docs/saturation.md)."""
    router = request.app[ROUTER]
    return _json({"workers": [{**r.to_json(), **router.cache_json(r.id), **router.guard_json(r.id)}
                              for r in router.registry.records()],
                  "scheduler": router.scheduler.stats(),
                  "saturation": {model: sat.to_json() for model, sat in router.dispatch.saturation.items()}})


async def add_worker(request: web.Request) -> web.Response:
    """``POST /admin/workers`` ``{"url", "id"?, "models"?, "max_num_seqs"?}``: register a worker
    (re-registering an id starts a new epoch).  Answers 201 with the worker after one probe."""
    router = request.app[ROUTER]
    try:
        doc = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        return _error(400, f"invalid JSON body: {exc}")
    try:
        spec = parse_worker_spec(doc)
    except SettingsError as exc:
        return _error(400, str(exc))
    record = await router.add_worker(spec.url, worker_id=spec.id, models=spec.models,
                                     max_num_seqs=spec.max_num_seqs, source=SOURCE_ADMIN)
    return _json(record.to_json(), status=201)


async def remove_worker(request: web.Request) -> web.Response:
    """``DELETE /admin/workers/{id}``: forget a worker (its in-flight requests finish)."""
    router = request.app[ROUTER]
    wid = request.match_info["id"]
    if not router.remove_worker(wid):
        return _error(404, f"no worker {wid!r}")
    return _json({"removed": wid})


async def drain_worker(request: web.Request) -> web.Response:
    """``POST /admin/workers/{id}/drain`` (optional body ``{"draining": false}`` to undo): no new
    requests go to the worker; in-flight ones finish."""
    router = request.app[ROUTER]
    wid = request.match_info["id"]
    draining = True
    raw = await request.read()
    if raw.strip():
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return _error(400, f"invalid JSON body: {exc}")
        if not isinstance(doc, dict) or not isinstance(doc.get("draining", True), bool):
            return _error(400, 'body must be {"draining": true|false}')
        draining = doc.get("draining", True)
    record = router.registry.set_draining(wid, draining)
    if record is None:
        return _error(404, f"no worker {wid!r}")
    return _json(record.to_json())


def merge_listings(bodies: Sequence[bytes]) -> bytes:
    """``GET /admin/workers`` of several router processes as one: the first one's listing, with
    every worker's in-flight (also per data-parallel rank) and request counts summed over the
    processes, and ``peer_inflight``
    left with what router instances outside this router have in flight there."""
    docs = [orjson.loads(b) for b in bodies]
    first = docs[0]
    for worker in first["workers"]:
        same = [w for doc in docs[1:] for w in doc["workers"] if w["id"] == worker["id"]]
        extra = sum(w["inflight"] for w in same)
        worker["inflight"] += extra
        worker["peer_inflight"] = max(0, worker["peer_inflight"] - extra)
        requests = Counter(worker["requests"])
        pinned = Counter(worker.get("rank_inflight", {}))
        for w in same:
            requests.update(w["requests"])
            pinned.update(w.get("rank_inflight", {}))
        worker["requests"] = dict(requests)
        worker["rank_inflight"] = {r: n for r, n in sorted(pinned.items(), key=lambda i: int(i[0])) if n}
    return orjson.dumps(first)


def _everywhere(handler: Handler, merge: Callable[[Sequence[bytes]], bytes] | None = None) -> Handler:
    """Wrap a handler so that, in a router of several processes, every process runs it: the
    answer is the answering process's (or ``merge`` of all the 200 ones), with
    ``x-kvroute-processes: <answered>/<processes>``."""

    @functools.wraps(handler)
    async def everywhere(request: web.Request) -> web.Response:
        broadcast = request.app.get(BROADCAST)
        if broadcast is None:
            return await handler(request)
        answers = await broadcast(request)
        answered = [a for a in answers if a is not None]
        if not answered:
            return _error(503, "no router process answered")
        status, body = answered[0]
        if merge is not None and status == 200:
            body = merge([b for s, b in answered if s == 200])
        return web.Response(status=status, body=body, content_type="application/json",
                            headers={"x-kvroute-processes": f"{len(answered)}/{len(answers)}"})

    return everywhere


def setup_admin(app: web.Application) -> None:
    """Mount the admin routes on ``app``."""
    app.router.add_get("/admin/workers", admin_only(_everywhere(list_workers, merge_listings)))
    app.router.add_post("/admin/workers", admin_only(_everywhere(add_worker)))
    app.router.add_delete("/admin/workers/{id}", admin_only(_everywhere(remove_worker)))
    app.router.add_post("/admin/workers/{id}/drain", admin_only(_everywhere(drain_worker)))
