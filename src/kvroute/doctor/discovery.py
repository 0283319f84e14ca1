"""Is a URL an engine or a kvroute router, and if a router, which workers does it have?"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from kvroute.engine_client.http import Target, request


@dataclass(slots=True)
class Discovery:
    """``kind``: ``engine``, ``router`` (workers listed) or ``router-locked`` (the admin API refused
    the token, or none was given); ``metrics_text`` is the router's ``/metrics`` when locked."""

    kind: str
    workers: list[Mapping[str, object]] = field(default_factory=list)
    detail: str = ""
    metrics_text: str | None = None


async def discover(session: aiohttp.ClientSession, target: Target, admin_token: str | None) -> Discovery:
    """Ask ``GET /admin/workers``; a router answers with its workers or refuses the token."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    reply = await request(session, "GET", target.url("/admin/workers"), timeout_s=target.timeout_s,
                          headers=headers)
    if reply.status == 200:
        workers = worker_records(reply.json())
        if workers is not None:
            return Discovery("router", workers)
    if reply.status in (401, 403):
        metrics = await request(session, "GET", target.url("/metrics"), timeout_s=target.timeout_s)
        text = metrics.body.decode("utf-8", "replace") if metrics.status == 200 else ""
        if "kvroute_" in text:
            given = "no --admin-token given" if admin_token is None else "the token was refused"
            detail = f"HTTP {reply.status}, {given}: {_error_message(reply.json())}"
            return Discovery("router-locked", detail=detail, metrics_text=text)
    return Discovery("engine")


def worker_records(body: object) -> list[Mapping[str, object]] | None:
    """The worker list of an ``/admin/workers`` body (a list, or ``{"workers": [...]}``)."""
    items = body.get("workers") if isinstance(body, Mapping) else body
    if not isinstance(items, list):
        return None
    records = [w for w in items if isinstance(w, Mapping) and isinstance(w.get("url"), str)]
    return records if len(records) == len(items) else None


def _error_message(body: object) -> str:
    error = body.get("error") if isinstance(body, Mapping) else None
    message = error.get("message") if isinstance(error, Mapping) else None
    return str(message) if message else "no reason given"
