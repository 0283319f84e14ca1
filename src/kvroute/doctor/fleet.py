"""Comparing the engines of one fleet: which differ from the rest, and in what."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvroute.doctor.facts import EngineFacts, Observed
from kvroute.doctor.finding import Finding, Severity

# Settings that should agree across replicas of one model; a router sends a conversation to any of
# them, so one odd replica silently loses the cache for every conversation it receives.
COMPARED = ("model", "enable_prefix_caching", "mamba_cache_mode", "block_size", "prefix_match_unit",
            "cache_dtype", "max_num_seqs", "max_model_len", "speculative")


def _setting(facts: EngineFacts, name: str) -> Observed[Any] | None:
    # An unset prefix_match_unit (vLLM reports "None") means the block size: compare what applies,
    # so a replica started without --prefix-match-unit stands out from those started with it.
    if name == "prefix_match_unit":
        return facts.match_unit()
    value: Observed[Any] | None = getattr(facts, name)
    return value


def compare_fleet(engines: Sequence[tuple[str, EngineFacts]]) -> list[Finding]:
    """One finding per setting on which the named engines disagree (majority value first)."""
    if len(engines) < 2:
        return []
    findings: list[Finding] = []
    for name in COMPARED:
        values = {label: _setting(facts, name) for label, facts in engines}
        known = {label: obs.value for label, obs in values.items() if obs is not None}
        distinct = Counter(known.values())
        if len(distinct) < 2:
            continue
        majority, _ = distinct.most_common(1)[0]
        odd = {label: value for label, value in known.items() if value != majority}
        same = [label for label, value in known.items() if value == majority]
        detail = "; ".join(f"{label}: {value}" for label, value in odd.items())
        findings.append(Finding(
            Severity.WARNING, "fleet-differs",
            f"{name} differs on {', '.join(odd)} (the rest: {majority})",
            f"{detail}; {majority} on {', '.join(same)}. Replicas behind one router should be "
            "configured alike, or conversations placed on the odd ones lose their cache.",
            f"start {', '.join(odd)} with the same flags as {same[0]}",
            tuple(obs.cite(f"{label} {name}") for label, obs in values.items() if obs is not None)))
    unknown = [label for label, facts in engines if all(_setting(facts, n) is None for n in COMPARED)]
    if not findings:
        findings.append(Finding(
            Severity.OK, "fleet-consistent",
            f"All {len(engines) - len(unknown)} readable engines report the same settings",
            "Compared: " + ", ".join(COMPARED) + "." + (
                f" Not readable on {', '.join(unknown)}." if unknown else ""), None))
    return findings
