"""Facts about one engine -> findings, most severe first."""

from __future__ import annotations

from kvroute.doctor.checks import (
    check_experimental,
    check_kv_dtype,
    check_mamba_mode,
    check_match_unit,
    check_prefix_caching,
)
from kvroute.doctor.checks_capacity import check_kv_capacity, check_mamba_slots
from kvroute.doctor.checks_observed import (
    check_conflicts,
    check_hit_rate,
    check_readable,
    check_startup_errors,
)
from kvroute.doctor.facts import MergedFacts
from kvroute.doctor.finding import Finding
from kvroute.doctor.workload import Workload


def diagnose(merged: MergedFacts, workload: Workload | None = None) -> list[Finding]:
    """Every check's findings for one engine, sorted most severe first (stable within a severity)."""
    facts = merged.facts
    load = workload or Workload()
    findings = [
        *check_startup_errors(facts),
        *check_mamba_slots(facts),
        *check_prefix_caching(facts),
        *check_mamba_mode(facts),
        *check_match_unit(facts, load),
        *check_kv_dtype(facts),
        *check_experimental(facts),
        *check_hit_rate(facts),
        *check_kv_capacity(facts, load),
        *check_conflicts(merged.conflicts),
        *check_readable(facts),
    ]
    return sorted(findings, key=lambda f: -f.severity.rank)
