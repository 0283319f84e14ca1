"""Named policies: each is a configuration of the same pipeline (filters -> scorers -> picker),
so a benchmark compares them on equal terms."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.routing import explain, filters, pickers, scorers
from kvroute.routing.explain import Explainer
from kvroute.routing.filters import Filter
from kvroute.routing.pickers import Picker
from kvroute.routing.scorers import Scorer


@dataclass(frozen=True, slots=True)
class Policy:
    """One routing policy.

    ``uses_session``: the request's session binding is read and kept (unless the model's policy
    turns stickiness off).  ``uses_learning``: candidates carry learned prefill rates, cache
    realisation and backlog.
    """

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[Scorer, ...]
    picker: Picker
    explain: Explainer
    uses_session: bool = False
    uses_learning: bool = False


_BASE = (filters.ready, filters.serves_model, filters.context_fits, filters.free_slot)

POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("round-robin", _BASE, (), pickers.round_robin, explain.balance),
        Policy("p2c", _BASE, (scorers.engine_load,), pickers.two_choices, explain.balance),
        Policy("least-loaded", _BASE, (scorers.engine_load,), pickers.lowest, explain.balance),
        Policy("prefix", _BASE, (scorers.cache_within_slack, scorers.inflight), pickers.lowest,
               explain.prefix),
        Policy("session", _BASE,
               (scorers.session_affinity, scorers.inflight, scorers.active_sessions, scorers.kv_usage),
               pickers.lowest, explain.session, uses_session=True),
        Policy("auto", (*_BASE, filters.load_within_slack, filters.balanced_sessions),
               (scorers.predicted_ttft, scorers.deepest_match, scorers.inflight),
               pickers.lowest, explain.auto, uses_session=True, uses_learning=True),
    )
}


def policy_named(name: str) -> Policy:
    """The policy called ``name``; raises ValueError naming the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}") from None
