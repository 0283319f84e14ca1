"""A canary run's replies -> counts, the bound on the silent failure rate, latency, hit rate."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

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
