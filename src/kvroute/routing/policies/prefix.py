"""``prefix``: prefix hashing with the cache only as a tie-break within the prompt-size slack.

A worker holding the request's prefix wins only while it carries at most ``slack`` more requests
in flight than the freest candidate (``slack`` grows with the prompt: ``slack_steps``); among
those, the deepest match wins, then the fewest in flight.
"""

from __future__ import annotations

from kvroute.routing import filters, pickers, scorers
from kvroute.routing.decision import DecisionKind
from kvroute.routing.explain import blocks
from kvroute.routing.stages import Policy, Scorer
from kvroute.routing.view import Candidate, Signal, View


def _cache_within_slack(view: View, cands: list[Candidate]) -> list[float]:
    limit = min(c.load for c in cands) + view.placement.slack_for(view.est_tokens)
    return [-float(c.matched_blocks) if c.matched_blocks and c.load <= limit else 0.0 for c in cands]


cache_within_slack = Scorer("cache_within_slack", _cache_within_slack, frozenset({Signal.PREFIX}))
"""The deepest match among workers within the prompt-size slack of the freest; 0 elsewhere."""


def explain(view: View, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
    """``[PREFIX] hit: 905487f1 keeps 64/64 blocks (slots=0 min=0 slack=3, ~12952 tokens)``."""
    c = cands[i]
    least = min(x.load for x in cands)
    figures = f"slots={c.load} min={least} slack={view.placement.slack_for(view.est_tokens)}"
    if c.matched_blocks:
        return DecisionKind.PREFIX_HIT, (
            f"[PREFIX] hit: {c.worker.id} keeps {blocks(view, c)} ({figures}, ~{view.est_tokens} tokens)")
    best = max(cands, key=lambda x: x.matched_blocks)
    cached = (f"best cache {best.worker.id} {blocks(view, best)} at slots={best.load}"
              if best.matched_blocks else "no cached worker")
    return DecisionKind.COLD, (
        f"[PREFIX] cold: {c.worker.id} ({figures}, {cached}, ~{view.est_tokens} tokens)")


POLICY = Policy("prefix", filters.BASE, (cache_within_slack, scorers.inflight), pickers.lowest, explain,
                summary="the cached worker within the prompt-size slack, else the least loaded")
