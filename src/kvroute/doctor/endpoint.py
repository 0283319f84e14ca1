"""What was read from one engine over HTTP (filled in by ``fetch``), and the facts it yields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvroute.doctor.api_facts import facts_from_models, facts_from_server_info
from kvroute.doctor.facts import EngineFacts, MergedFacts, Observed, merge_facts
from kvroute.doctor.finding import Finding, Severity
from kvroute.doctor.metrics_facts import facts_from_metrics
from kvroute.doctor.settings import facts_from_settings
from kvroute.doctor.sources import facts_from_log
from kvroute.prometheus_text import MetricsParseError, parse_exposition


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
