"""The doctor's report as readable text (rich) and as JSON."""

from __future__ import annotations

import orjson
from rich.console import Console
from rich.padding import Padding
from rich.text import Text

from kvroute.doctor.facts import EngineFacts
from kvroute.doctor.finding import Finding, Severity
from kvroute.doctor.probe import ProbeStep
from kvroute.doctor.report import DoctorReport, TargetReport

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
