"""``session``: session stickiness.  A new conversation goes to the least-loaded worker (in
flight, then active sessions, then KV usage) and stays there, spilling over only once its worker
has more requests in flight than the overflow threshold (a quarter of ``max_num_seqs`` by
default)."""

from __future__ import annotations

from kvroute.routing import filters, pickers, scorers
from kvroute.routing.decision import DecisionKind
from kvroute.routing.explain import blocks, bound_kind, session_tag
from kvroute.routing.stages import Policy, Scorer
from kvroute.routing.view import Candidate, Signal, View


def _session_affinity(view: View, cands: list[Candidate]) -> list[float]:
    bound, placement = view.bound, view.placement
    return [0.0 if c.worker.id == bound and c.load <= placement.overflow_threshold(c.worker.max_num_seqs)
            else 1.0 for c in cands]


session_affinity = Scorer("session_affinity", _session_affinity, frozenset({Signal.BINDING}))
"""0 for the session's worker unless it is past its overflow threshold, 1 elsewhere."""


def explain(view: View, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
    """Sticky, overflow, or a new placement on the least-loaded worker."""
    c = cands[i]
    threshold = view.placement.overflow_threshold(c.worker.max_num_seqs)
    kind = bound_kind(view, c)
    if kind is DecisionKind.STICKY:
        return kind, (f"[SESSION] sticky: {session_tag(view)} stays on {c.worker.id} "
                      f"(inflight={c.load} threshold={threshold}, keeps {blocks(view, c)})")
    if kind is DecisionKind.OVERFLOW:
        old = next((x for x in cands if x.worker.id == view.bound), None)
        why = (f"inflight={old.load} > threshold={view.placement.overflow_threshold(old.worker.max_num_seqs)}"
               if old is not None else "not a candidate")
        return kind, (f"[SESSION] overflow: {session_tag(view)} {view.bound} -> {c.worker.id} "
                      f"({view.bound} {why}; now inflight={c.load})")
    who = f"new session {session_tag(view)}" if view.session is not None else "no session"
    return DecisionKind.COLD, (
        f"[SESSION] {who}: {c.worker.id} least loaded (inflight={c.load} "
        f"sessions={c.active_sessions} kv={c.worker.kv_usage if c.worker.kv_usage is not None else '-'})")


POLICY = Policy("session", filters.BASE,
                (session_affinity, scorers.inflight, scorers.active_sessions, scorers.kv_usage),
                pickers.lowest, explain,
                summary="least loaded for a new conversation, then stay until the overflow threshold")
