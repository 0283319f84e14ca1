"""Running the doctor against URLs and logs (the I/O around the pure checks)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from kvroute.doctor.checks import compare_fleet, diagnose
from kvroute.doctor.endpoint import Discovery, discover, facts_for_endpoint, fetch_bundle
from kvroute.doctor.facts import EngineFacts, MergedFacts, Observed, TrafficAssumptions, merge_facts
from kvroute.doctor.finding import Finding, Severity
from kvroute.doctor.probe import judge_probe, probe_size, reply_tokens, run_probe
from kvroute.doctor.report import DoctorReport, TargetReport
from kvroute.engine_client.http import Target, served_model
from kvroute.fleet import metric_names as names
from kvroute.prometheus_text import (
    MetricsParseError,
    Sample,
    label_values,
    parse_exposition,
    where,
)


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """What ``kvroute doctor`` was asked to do.  ``logs`` are (name, text) pairs: paired with
    ``urls`` in order when there are as many, read on their own when there are no URLs."""

    urls: tuple[str, ...] = ()
    logs: tuple[tuple[str, str], ...] = ()
    probe: bool = False
    probe_tokens: int | None = None
    admin_token: str | None = None
    api_key: str | None = None
    timeout_s: float = 10.0
    traffic: TrafficAssumptions = field(default_factory=TrafficAssumptions)


async def run_doctor(options: DoctorOptions) -> DoctorReport:
    """Examine every URL (engines directly, routers through their workers) and every log."""
    if options.urls and options.logs and len(options.logs) != len(options.urls):
        raise ValueError(f"{len(options.logs)} --log files for {len(options.urls)} URLs: give one log "
                         "per URL, in the same order, or logs without URLs")
    report = DoctorReport()
    if not options.urls:
        for name, text in options.logs:
            merged, _ = facts_for_endpoint(None, text)
            report.targets.append(TargetReport(name, "log", merged, diagnose(merged, options.traffic)))
        return report
    logs: list[str | None] = [text for _, text in options.logs] or [None] * len(options.urls)
    async with aiohttp.ClientSession() as session:
        for url, log_text in zip(options.urls, logs, strict=True):
            target = Target(url, options.api_key, options.timeout_s)
            found = await discover(session, target, options.admin_token)
            if found.kind == "router":
                report.targets += await _router_workers(session, options, url, found)
            elif found.kind == "router-locked":
                report.fleet.append(_locked_finding(url, found))
                report.targets += _workers_from_router_metrics(
                    url, found.metrics_text or "", options.traffic)
            else:
                report.targets.append(await _engine(session, options, target, log_text, "engine"))
    engines = [(t.name, t.merged.facts) for t in report.targets if t.kind != "log"]
    report.fleet += compare_fleet(engines)
    return report


async def examine_engine(session: aiohttp.ClientSession, target: Target, *,
                         probe: bool = False) -> TargetReport:
    """One engine's report, as ``kvroute doctor URL`` (``--probe``) makes it: what the fleet guard
    runs when a worker registers or restarts."""
    options = DoctorOptions(probe=probe, timeout_s=target.timeout_s)
    return await _engine(session, options, target, None, "engine")


async def _engine(session: aiohttp.ClientSession, options: DoctorOptions, target: Target,
                  log_text: str | None, kind: str, router_record: Mapping[str, object] | None = None,
                  via: str | None = None) -> TargetReport:
    bundle = await fetch_bundle(session, target)
    merged, reading = facts_for_endpoint(bundle, log_text, router_record)
    report = TargetReport(target.base_url, kind, merged, [], via=via)
    probe_findings: list[Finding] = []
    if options.probe and bundle.reachable:
        probe_findings = await _probe(session, target, report, options.probe_tokens)
        # Read again so the counters include the probe's own traffic, but keep the typical prompt
        # length of the real traffic: the probe's prompts are not typical.
        typical = merged.facts.mean_prompt_tokens
        bundle = await fetch_bundle(session, target)
        report.merged, reading = facts_for_endpoint(bundle, log_text, router_record)
        report.merged.facts = replace(report.merged.facts, mean_prompt_tokens=typical)
    if router_record is not None and not bundle.reachable:
        reading = [Finding(Severity.INFO, "read-through-router", "Read through the router only",
                           f"{target.base_url} is not reachable from here; its settings come from "
                           "the router's /admin/workers.", None, ())]
    findings = [*reading, *diagnose(report.merged, options.traffic), *probe_findings]
    report.findings = sorted(findings, key=lambda f: -f.severity.rank)
    return report


async def _probe(session: aiohttp.ClientSession, target: Target, report: TargetReport,
                 requested_tokens: int | None) -> list[Finding]:
    facts = report.merged.facts
    model = facts.model.value if facts.model is not None else await served_model(session, target)
    if model is None:
        return [Finding(Severity.WARNING, "probe-no-model", "Cannot probe: no model name",
                        "/v1/models listed no model.", None, ())]
    unit = facts.match_unit()
    unit_tokens = unit.value if unit is not None else None
    max_len = facts.max_model_len.value if facts.max_model_len is not None else None
    size = probe_size(unit_tokens, max_len, requested_tokens)
    report.probe = await run_probe(session, target, model, size, secrets.token_hex(6),
                                   reply_tokens(unit_tokens))
    block = facts.block_size.value if facts.block_size is not None else None
    pmu = facts.prefix_match_unit.value if facts.prefix_match_unit is not None else None
    return judge_probe(report.probe, block, pmu)


async def _router_workers(session: aiohttp.ClientSession, options: DoctorOptions, router_url: str,
                          found: Discovery) -> list[TargetReport]:
    targets = []
    for record in found.workers:
        target = Target(str(record["url"]), options.api_key, options.timeout_s)
        targets.append(await _engine(session, options, target, None, "worker", record, via=router_url))
    return targets


def _locked_finding(url: str, found: Discovery) -> Finding:
    return Finding(
        Severity.WARNING, "router-admin-locked",
        f"{url} is a kvroute router; its worker list needs the admin token",
        f"GET /admin/workers refused ({found.detail}). Only the per-worker hit counters the router "
        "re-exports on /metrics are shown; the workers' configuration is not.",
        "kvroute doctor --admin-token TOKEN URL (or set KVROUTE_ADMIN_TOKEN), or pass the worker URLs",
        (f"{url}/admin/workers",))


def _workers_from_router_metrics(url: str, text: str, traffic: TrafficAssumptions) -> list[TargetReport]:
    """Per-worker hit counters from a router's ``/metrics`` (``kvroute_worker_prefix_cache_*``)."""
    try:
        samples = parse_exposition(text)
    except MetricsParseError:
        return []
    reports = []
    for worker in label_values(samples, "worker"):
        facts = _router_counters(where(samples, "worker", worker), worker)
        merged = MergedFacts(facts)
        reports.append(TargetReport(worker, "worker", merged, diagnose(merged, traffic), via=url))
    return reports


def _router_counters(samples: Sequence[Sample], worker: str) -> EngineFacts:
    found: dict[str, Observed[float]] = {}
    for name, fact in ((names.ROUTER_WORKER_PREFIX_HITS, "prefix_cache_hits"),
                       (names.ROUTER_WORKER_PREFIX_QUERIES, "prefix_cache_queries")):
        values = [s.value for s in samples if s.name == name]
        if values:
            found[fact] = Observed(sum(values), f"router /metrics {name}{{worker={worker}}}")
    return merge_facts(EngineFacts(**found)).facts  # type: ignore[arg-type]
