"""The load a worker's sessions will bring: each session active there keeps sending turns.

A request's own queue (backlog, in flight, waiting) is what delays it now; a new session also
joins the worker for every later turn, next to the sessions already living there.  Counting those
sessions as a cost term rather than filtering on them (``filters.balanced_sessions``) keeps what
is known exactly (the work queued right now) in charge: "active" only means "sent a request within
``session_active_s``", so it also counts sessions that have just ended, and a hard filter on it sent
whole bursts of new sessions to the workers whose previous sessions happened to have finished
(measured in docs/routing.md).  The filter stays, with ``session_spread`` = 2, as a guard against
piles behind a shared head.
"""

from __future__ import annotations

from kvroute.routing.candidates import Candidate, Context


def session_load_tokens(ctx: Context, c: Candidate) -> float:
    """Token-equivalents of future load on ``c`` from the other sessions active there (0 for a
    request without a session: it joins nobody's conversation)."""
    per_session = ctx.policy.active_session_tokens
    if ctx.session is None or not per_session:
        return 0.0
    others = c.active_sessions - (1 if c.worker.id == ctx.bound else 0)
    return per_session * others if others > 0 else 0.0
