"""Filters: each removes candidates for one reason.

Hard filters (``ready``, ``serves_model``) may leave nothing, and then nothing can serve the
request.  Soft filters (the rest) keep every candidate when none would pass: the engine answers a
too-long prompt with its own, exact error, and when every worker is full the least loaded wins.
"""

from __future__ import annotations

from collections.abc import Callable

from kvroute.routing.candidates import Candidate, Context
from kvroute.routing.config import DEFAULT_MAX_NUM_SEQS

Filter = Callable[[Context, list[Candidate]], list[Candidate]]


def ready(ctx: Context, cands: list[Candidate]) -> list[Candidate]:
    """Healthy and not draining."""
    return [c for c in cands if c.worker.healthy and not c.worker.draining]


def serves_model(ctx: Context, cands: list[Candidate]) -> list[Candidate]:
    """Serves the requested model (a worker whose models are not yet known is accepted)."""
    model = ctx.key.model
    return [c for c in cands if c.worker.serves(model)]


def context_fits(ctx: Context, cands: list[Candidate]) -> list[Candidate]:
    """Context window holds the estimated prompt plus the requested output (soft)."""
    need = ctx.key.est_prompt_tokens + ctx.key.max_tokens
    kept = [c for c in cands if c.worker.max_model_len is None or need <= c.worker.max_model_len]
    return kept or cands


def free_slot(ctx: Context, cands: list[Candidate]) -> list[Candidate]:
    """Has a free sequence slot, by the engine's count or the router's, whichever is higher (soft)."""
    default = ctx.policy.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    kept = [c for c in cands if c.busy < (c.worker.max_num_seqs or default)]
    return kept or cands


def load_within_slack(ctx: Context, cands: list[Candidate]) -> list[Candidate]:
    """Seed 1's guard for placements: candidates carrying at most ``slack`` more requests than the
    freest, so a cached head cannot pull every new conversation onto one worker.  A session's own
    worker is exempt (the ``auto`` cost decides whether it stays)."""
    if ctx.bound is not None and any(c.worker.id == ctx.bound for c in cands):
        return cands
    slack = ctx.policy.slack_for(ctx.est_tokens)
    least = min(c.busy for c in cands)
    ctx.min_load, ctx.slack = least, slack
    return [c for c in cands if c.busy <= least + slack]


def balanced_sessions(ctx: Context, cands: list[Candidate]) -> list[Candidate]:
    """A session being placed goes where active sessions are within ``session_spread`` of the
    fewest (soft; only for a session with no usable binding).  For ``auto`` a loose guard: the cost
    weighs active sessions (``session_load``), and this only stops a long head cached on one worker
    from collecting every new session, whose turns would then all queue there."""
    spread = ctx.policy.session_spread
    if ctx.session is None or spread is None or len(cands) < 2:
        return cands
    if ctx.bound is not None and any(c.worker.id == ctx.bound for c in cands):
        return cands
    least = min(c.active_sessions for c in cands)
    return [c for c in cands if c.active_sessions <= least + spread]
