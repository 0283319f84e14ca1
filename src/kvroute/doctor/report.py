"""The doctor's result: per-engine facts, findings and probe evidence, plus fleet-wide findings."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.doctor.facts import MergedFacts
from kvroute.doctor.finding import Finding, Severity, worst
from kvroute.doctor.probe import ProbeStep


@dataclass(slots=True)
class TargetReport:
    """One engine (or one startup log read on its own).

    ``kind`` is ``engine`` (a URL given directly), ``worker`` (found through a router) or ``log``.
    """

    name: str
    kind: str
    merged: MergedFacts
    findings: list[Finding]
    probe: list[ProbeStep] = field(default_factory=list)
    via: str | None = None

    def worst(self) -> Severity:
        """The most severe of this target's findings."""
        return worst(self.findings)

    def as_dict(self) -> dict[str, object]:
        """The JSON form used by ``--json``."""
        return {
            "name": self.name,
            "kind": self.kind,
            "via": self.via,
            "worst": self.worst().value,
            "facts": self.merged.facts.as_dict(),
            "findings": [f.as_dict() for f in self.findings],
            "probe": [s.as_dict() for s in self.probe],
        }


@dataclass(slots=True)
class DoctorReport:
    """Everything ``kvroute doctor`` found; ``fleet`` holds router and cross-engine findings."""

    targets: list[TargetReport] = field(default_factory=list)
    fleet: list[Finding] = field(default_factory=list)

    def worst(self) -> Severity:
        """The most severe finding anywhere in the report."""
        return worst([*self.fleet, *(f for t in self.targets for f in t.findings)])

    def as_dict(self) -> dict[str, object]:
        """The JSON form used by ``--json``."""
        return {
            "worst": self.worst().value,
            "targets": [t.as_dict() for t in self.targets],
            "fleet": [f.as_dict() for f in self.fleet],
        }
