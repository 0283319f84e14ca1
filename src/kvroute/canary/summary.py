"""A canary run's replies -> counts, the bound on the silent failure rate, latency, hit rate; as
readable text (rich) and as JSON."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
from rich.console import Console
from rich.text import Text

from kvroute.canary.binomial_bound import rule_of_three, upper_bound
from kvroute.canary.questions import Verdict
from kvroute.engine_client.cache_counters import CounterChange
from kvroute.quantiles import percentile

CONFIDENCE = 0.95
_PERCENTILES = (50, 90, 99)
_EXAMPLES = 5
_EXCERPT = 80


@dataclass(frozen=True, slots=True)
class CanaryReply:
    """One request of the run as judged.  ``excerpt`` is the start of the content (or the error)."""

    index: int
    question: str
    expected: int
    verdict: Verdict
    seconds: float
    excerpt: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CanarySummary:
    """Everything the canary reports."""

    replies: tuple[CanaryReply, ...]
    counts: dict[str, int]
    failures: int
    bound: float
    rule_of_three: float | None
    latency: dict[str, float]
    hit_rate: CounterChange | None

    @property
    def total(self) -> int:
        """Requests sent."""
        return len(self.replies)

    @property
    def passed(self) -> bool:
        """Every reply correct (and there was at least one)."""
        return self.total > 0 and self.failures == 0

    def failed_examples(self) -> list[CanaryReply]:
        """The first few failed replies, for the report."""
        return [r for r in self.replies if r.verdict is not Verdict.CORRECT][:_EXAMPLES]

    def as_dict(self) -> dict[str, object]:
        """The JSON form used by ``--json``."""
        return {
            "passed": self.passed,
            "requests": self.total,
            "counts": self.counts,
            "failures": self.failures,
            "confidence": CONFIDENCE,
            "failure_rate_upper_bound": self.bound,
            "rule_of_three": self.rule_of_three,
            "latency_s": self.latency,
            "hit_rate": None if self.hit_rate is None else self.hit_rate.as_dict(),
            "failed_examples": [
                {"index": r.index, "question": r.question, "expected": r.expected,
                 "verdict": r.verdict.value, "reply": r.excerpt}
                for r in self.failed_examples()
            ],
        }


def summarize(replies: Sequence[CanaryReply], hit_rate: CounterChange | None) -> CanarySummary:
    """Count verdicts, bound the failure rate (exact Clopper–Pearson, one-sided 95%), and take
    latency percentiles over every reply that came back."""
    if not replies:
        raise ValueError("a canary run needs at least one reply")
    counts = Counter(r.verdict.value for r in replies)
    ordered = {v.value: counts.get(v.value, 0) for v in Verdict}
    failures = len(replies) - ordered[Verdict.CORRECT.value]
    timed = [r.seconds for r in replies if r.verdict is not Verdict.ERROR]
    latency: dict[str, float] = {}
    if timed:
        latency = {f"p{q}": float(percentile(timed, q) or 0.0) for q in _PERCENTILES}
        latency["max"] = max(timed)
    return CanarySummary(
        replies=tuple(replies),
        counts=ordered,
        failures=failures,
        bound=upper_bound(failures, len(replies), CONFIDENCE),
        rule_of_three=rule_of_three(len(replies)) if failures == 0 else None,
        latency=latency,
        hit_rate=hit_rate,
    )


def excerpt(text: str) -> str:
    """The start of a reply, short enough for one report line."""
    return text if len(text) <= _EXCERPT else text[:_EXCERPT] + "…"


# --- as readable text (rich) and as JSON ----------------------------------------------------------

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
