"""Checks of what the engine did rather than how it is configured: counters, errors, gaps."""

from __future__ import annotations

import re

from kvroute.doctor.facts import Conflict, EngineFacts, cite
from kvroute.doctor.finding import Finding, Severity

# Startup errors another check explains in full.
_EXPLAINED = re.compile(r"exceeds available Mamba cache blocks")
# vLLM's wrapper around a root cause logged above it: noise when the root cause is known.
_WRAPPER = re.compile(r"Engine core initialization failed|See root cause above")


def check_hit_rate(facts: EngineFacts) -> list[Finding]:
    """The prefix-cache hit rate measured by the engine's own counters since it started."""
    queries, hits = facts.prefix_cache_queries, facts.prefix_cache_hits
    epc = facts.enable_prefix_caching
    if queries is None or hits is None or (epc is not None and not epc.value):
        return []
    evidence = cite(queries, "queries") + cite(hits, "hits")
    if queries.value <= 0:
        return [Finding(Severity.INFO, "hit-rate-no-traffic", "No prefix-cache lookups yet",
                        "The engine has not served a prompt since it started, so there is no hit "
                        "rate to read.", "kvroute doctor --probe URL", evidence)]
    rate = hits.value / queries.value
    if hits.value <= 0:
        return [Finding(
            Severity.WARNING, "hit-rate-zero", f"0% of {queries.value:,.0f} prompt tokens hit the cache",
            "Either the traffic never repeats a prefix, or the cache cannot hit (see the other "
            "findings). A repeated prompt tells the two apart.", "kvroute doctor --probe URL", evidence)]
    floor = ""
    if facts.cache_dtype is not None and facts.cache_dtype.value.startswith("fp8"):
        floor = " With an fp8 KV cache this is probably a floor."
    return [Finding(Severity.INFO, "hit-rate",
                    f"{rate:.1%} of {queries.value:,.0f} prompt tokens were served from the cache",
                    "Measured by the engine's own counters since it started." + floor, None, evidence)]


def check_startup_errors(facts: EngineFacts) -> list[Finding]:
    """Fatal errors in the startup log that no other check explains.

    vLLM's "Engine core initialization failed" wrapper is only reported when it is all there is.
    """
    causes = [e for e in facts.startup_errors if not _WRAPPER.search(e.value)]
    shown = causes or list(facts.startup_errors)
    return [
        Finding(Severity.ERROR, "startup-error", "The engine failed to start",
                err.value, "read the log lines before this one for the root cause", (err.source,))
        for err in shown
        if not _EXPLAINED.search(err.value)
    ]


def check_conflicts(conflicts: list[Conflict]) -> list[Finding]:
    """Sources that disagree: usually a log from another start, or a proxy in between."""
    return [
        Finding(Severity.WARNING, "sources-disagree", f"Sources disagree about {c.name}",
                f"{c.kept.value} according to {c.kept.source}, {c.other.value} according to "
                f"{c.other.source}. The first is used. Is the log from another start of the engine?",
                None, (c.kept.cite(c.name), c.other.cite(c.name)))
        for c in conflicts
    ]


def check_readable(facts: EngineFacts) -> list[Finding]:
    """Say so when the caching configuration could not be read at all."""
    if facts.enable_prefix_caching is not None or facts.startup_errors:
        return []
    return [Finding(
        Severity.WARNING, "config-unknown", "Could not read the engine's caching configuration",
        "None of /metrics (vllm:cache_config_info), /server_info or a startup log said whether "
        "prefix caching is on. The engine may not be vLLM, or its metrics may be disabled.",
        "pass the startup log with --log FILE, or run --probe for evidence from requests",
        cite(facts.model, "model"))]
