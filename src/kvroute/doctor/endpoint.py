"""One URL: is it an engine or a kvroute router (and which workers), what it serves, and the facts
it yields."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from kvroute.doctor.facts import EngineFacts, MergedFacts, Observed, merge_facts
from kvroute.doctor.finding import Finding, Severity
from kvroute.doctor.settings import facts_from_settings
from kvroute.doctor.sources import (
    facts_from_log,
    facts_from_metrics,
    facts_from_models,
    facts_from_server_info,
)
from kvroute.engine_client.http import Reply, Target, request
from kvroute.prometheus_text import MetricsParseError, parse_exposition

# A second look after a dropped request or a 5xx (see fetch_bundle).
_RETRY_AFTER_S = 0.5


@dataclass(slots=True)
class EndpointBundle:
    """Raw bodies from one engine; None where the endpoint was missing or failed.

    ``problems`` holds one line per endpoint that could not be read (``/server_info: HTTP 404``).
    ``reachable`` is False when not even a connection could be made.
    """

    url: str
    metrics_text: str | None = None
    models: object | None = None
    server_info: object | None = None
    problems: list[str] = field(default_factory=list)
    reachable: bool = True


def facts_for_endpoint(
    bundle: EndpointBundle | None,
    log_text: str | None = None,
    router_record: Mapping[str, object] | None = None,
) -> tuple[MergedFacts, list[Finding]]:
    """Merge everything known about one engine: its live endpoints first, then what a router
    reported about it, then its startup log.  Returns the facts and findings about reading them."""
    partials: list[EngineFacts] = []
    findings: list[Finding] = []
    if bundle is not None:
        if bundle.metrics_text is not None:
            try:
                partials.append(facts_from_metrics(parse_exposition(bundle.metrics_text)))
            except MetricsParseError as exc:
                findings.append(Finding(Severity.WARNING, "metrics-unreadable",
                                        "/metrics is not Prometheus text", str(exc), None, (bundle.url,)))
        if bundle.server_info is not None:
            partials.append(facts_from_server_info(bundle.server_info))
        if bundle.models is not None:
            partials.append(facts_from_models(bundle.models))
        findings.extend(_reading_problems(bundle))
    if router_record is not None:
        partials.append(facts_from_router_record(router_record))
    if log_text is not None:
        partials.append(facts_from_log(log_text))
    return merge_facts(*partials), findings


def facts_from_router_record(record: Mapping[str, object]) -> EngineFacts:
    """What ``GET /admin/workers`` on a kvroute router says about one of its workers."""
    source = "router /admin/workers"
    config = record.get("cache_config")
    settings = dict(config) if isinstance(config, Mapping) else {}
    for key in ("max_num_seqs", "max_model_len"):
        if record.get(key) is not None:
            settings[key] = record[key]
    models = record.get("models")
    if isinstance(models, list) and models:
        settings["served_model_name"] = models[0]
    facts = facts_from_settings(settings, source)
    hits, queries = record.get("prefix_cache_hits"), record.get("prefix_cache_queries")
    if isinstance(hits, int | float) and isinstance(queries, int | float):
        counters = EngineFacts(
            prefix_cache_hits=Observed(float(hits), f"{source} prefix_cache_hits"),
            prefix_cache_queries=Observed(float(queries), f"{source} prefix_cache_queries"),
        )
        facts = merge_facts(facts, counters).facts
    return facts


def _reading_problems(bundle: EndpointBundle) -> list[Finding]:
    if not bundle.reachable:
        return [Finding(Severity.ERROR, "unreachable", f"Cannot reach {bundle.url}",
                        "; ".join(bundle.problems) or "no connection",
                        "check the URL and that the engine is running", (bundle.url,))]
    if bundle.metrics_text is None and bundle.server_info is None:
        return [Finding(Severity.WARNING, "no-engine-endpoints",
                        "Neither /metrics nor /server_info could be read",
                        "; ".join(bundle.problems) + ". Without them the doctor cannot see the "
                        "engine's cache configuration.",
                        "enable vLLM's metrics endpoint, or pass the startup log with --log FILE",
                        (bundle.url,))]
    return []


# --- is a URL an engine or a kvroute router, and which workers does it have? ----------------------

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


# --- reading an engine's endpoints ----------------------------------------------------------------

async def fetch_bundle(session: aiohttp.ClientSession, target: Target) -> EndpointBundle:
    """Read ``/metrics``, ``/v1/models`` and ``/server_info`` concurrently."""
    paths = ("/metrics", "/v1/models", "/server_info")

    async def get(path: str) -> Reply:
        reply = await request(session, "GET", target.url(path), timeout_s=target.timeout_s,
                              headers=target.headers())
        if reply.status is None or reply.status >= 500:
            # An engine that has just started (or is busy) can drop one request; a second look
            # keeps one hiccup from turning into "prefix caching unknown".
            await asyncio.sleep(_RETRY_AFTER_S)
            reply = await request(session, "GET", target.url(path), timeout_s=target.timeout_s,
                                  headers=target.headers())
        return reply

    replies = await asyncio.gather(*(get(p) for p in paths))
    bundle = EndpointBundle(target.base_url)
    bundle.reachable = any(r.status is not None for r in replies)
    for path, reply in zip(paths, replies, strict=True):
        if reply.status != 200:
            bundle.problems.append(f"{path}: {reply.error or f'HTTP {reply.status}'}")
            continue
        if path == "/metrics":
            bundle.metrics_text = reply.body.decode("utf-8", "replace")
        elif (parsed := reply.json()) is None:
            bundle.problems.append(f"{path}: not JSON")
        elif path == "/v1/models":
            bundle.models = parsed
        else:
            bundle.server_info = parsed
    return bundle
