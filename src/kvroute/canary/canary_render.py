"""The canary's summary as readable text (rich) and as JSON."""

from __future__ import annotations

import orjson
from rich.console import Console
from rich.text import Text

from kvroute.canary.summary import CONFIDENCE, CanarySummary


def summary_json(summary: CanarySummary, target: str) -> bytes:
    """The summary as indented JSON."""
    return orjson.dumps({"target": target, **summary.as_dict()}, option=orjson.OPT_INDENT_2)


def render_summary(summary: CanarySummary, target: str, console: Console) -> None:
    """Verdict, counts, the failure-rate bound, latency, hit rate, and a few failed replies."""
    head = Text("kvroute canary", style="bold")
    head.append(f" · {target} · ")
    head.append("PASS" if summary.passed else "FAIL", style="bold green" if summary.passed else "bold red")
    console.print(head)
    counts = " · ".join(f"{n} {name}" for name, n in summary.counts.items() if n or name == "correct")
    console.print(f"  {summary.total} requests: {counts}")
    bound = f"  failure rate < {summary.bound:.2%} ({CONFIDENCE:.0%} one-sided, exact Clopper–Pearson"
    if summary.rule_of_three is not None:
        bound += f"; rule of three 3/{summary.total} = {summary.rule_of_three:.2%}"
    console.print(bound + ")")
    if summary.latency:
        console.print("  latency " + " · ".join(f"{k} {v:.2f} s" for k, v in summary.latency.items()))
    change = summary.hit_rate
    if change is None:
        console.print("  hit rate: /metrics has no prefix-cache counters", style="dim")
    else:
        during = "n/a" if change.rate is None else f"{change.rate:.1%}"
        before = "n/a" if change.before.rate is None else f"{change.before.rate:.1%}"
        after = "n/a" if change.after.rate is None else f"{change.after.rate:.1%}"
        console.print(f"  hit rate during the run {during} of {change.queries:,.0f} prompt tokens "
                      f"(cumulative {before} → {after})")
    for reply in summary.failed_examples():
        line = Text(f"  #{reply.index} {reply.verdict.value}: ", style="red")
        line.append(f"{reply.question} expected {reply.expected}, got {reply.excerpt!r}")
        console.print(line)
