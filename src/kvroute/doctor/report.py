"""The doctor's result: per-engine facts, findings and probe evidence, plus fleet-wide findings;
as readable text (rich) and as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson
from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from kvroute.doctor.facts import EngineFacts, MergedFacts
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


# --- as readable text (rich) and as JSON ----------------------------------------------------------

_STYLE = {
    Severity.OK: "green",
    Severity.INFO: "cyan",
    Severity.WARNING: "yellow",
    Severity.ERROR: "bold red",
}
_INDENT = 10


def report_json(report: DoctorReport) -> bytes:
    """The report as indented JSON."""
    return orjson.dumps(report.as_dict(), option=orjson.OPT_INDENT_2)


def render_report(report: DoctorReport, console: Console) -> None:
    """Print every target with its settings line, findings (fix and evidence) and probe."""
    worst = report.worst()
    header = Text("kvroute doctor", style="bold")
    header.append(f" · {len(report.targets)} target{'s' if len(report.targets) != 1 else ''} · worst: ")
    header.append(worst.value, style=_STYLE[worst])
    console.print(header)
    for target in report.targets:
        console.print()
        _render_target(target, console)
    if report.fleet:
        console.print()
        console.print(Text("fleet", style="bold"))
        for finding in report.fleet:
            _render_finding(finding, console)


def _render_target(target: TargetReport, console: Console) -> None:
    facts = target.merged.facts
    title = Text("● ", style=_STYLE[target.worst()])
    title.append(target.name, style="bold")
    extra = [target.kind]
    if target.via:
        extra.append(f"via {target.via}")
    if facts.model is not None:
        extra.append(facts.model.value)
    if facts.hybrid is not None:
        extra.append("hybrid" if facts.hybrid.value else "attention-only")
    title.append("  " + " · ".join(extra), style="dim")
    console.print(title)
    console.print(Text("  " + settings_line(facts), style="dim"))
    for finding in target.findings:
        _render_finding(finding, console)
    if target.probe:
        console.print(Text("  probe: " + " · ".join(_probe_cell(s) for s in target.probe), style="dim"))


def settings_line(facts: EngineFacts) -> str:
    """One line with the settings the checks look at ("?" where unknown)."""
    def show(value: object, fmt: str = "{}") -> str:
        return "?" if value is None else fmt.format(value)

    def val(name: str) -> object:
        observed = getattr(facts, name)
        return None if observed is None else observed.value

    total = facts.total_kv_tokens()
    rate = "?"
    if facts.prefix_cache_queries is not None and facts.prefix_cache_hits is not None:
        queries = facts.prefix_cache_queries.value
        rate = f"{facts.prefix_cache_hits.value / queries:.1%} of {queries:,.0f}" if queries else "no lookups"
    return " · ".join((
        f"prefix caching {show(val('enable_prefix_caching'))}",
        f"mamba mode {show(val('mamba_cache_mode'))}",
        f"block {show(val('block_size'), '{:,}')}",
        f"match unit {show(val('prefix_match_unit'), '{:,}')}",
        f"kv {show(val('cache_dtype'))}",
        f"max_num_seqs {show(val('max_num_seqs'))}",
        f"KV {show(None if total is None else total.value, '{:,} tokens')}",
        f"hit rate {rate}",
    ))


def _render_finding(finding: Finding, console: Console) -> None:
    line = Text("  ")
    line.append(f"{finding.severity.value.upper():<8}", style=_STYLE[finding.severity])
    line.append(finding.title, style="bold" if finding.severity.rank >= Severity.WARNING.rank else "")
    line.append(f"  [{finding.code}]", style="dim")
    console.print(line)
    if finding.severity is Severity.OK:
        return
    console.print(Padding(Text(finding.detail), (0, 0, 0, _INDENT)))
    if finding.fix:
        fix = Text("fix: ", style="bold")
        fix.append(finding.fix, style="bold green")
        console.print(Padding(fix, (0, 0, 0, _INDENT)))
    for item in finding.evidence:
        console.print(Padding(Text("· " + item, style="dim"), (0, 0, 0, _INDENT)))


def _probe_cell(step: ProbeStep) -> str:
    reused = step.reused()
    cached = "" if reused is None else f", reused {reused:,.0f}"
    size = "" if step.prompt_tokens is None else f" ({step.prompt_tokens:,} tok{cached})"
    return f"{step.label} {step.seconds:.2f} s{size}" + (f" error: {step.error}" if step.error else "")
