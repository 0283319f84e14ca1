"""Scorers: each gives one opinion per candidate, lower is better.

A policy lists scorers in priority order and the picker compares their values lexicographically,
so a later scorer only breaks ties left by the earlier ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvroute.routing.cache_survival import expected_held_tokens
from kvroute.routing.candidates import Candidate, Context
from kvroute.routing.session_load import session_load_tokens

Scorer = Callable[[Context, list[Candidate]], list[float]]


def inflight(ctx: Context, cands: list[Candidate]) -> list[float]:
    """Requests in flight from every router instance."""
    return [float(c.load) for c in cands]


def engine_load(ctx: Context, cands: list[Candidate]) -> list[float]:
    """vLLM's data-parallel balancer: ``4 * waiting + running``, at least the in-flight count."""
    return [float(c.engine_load) for c in cands]


def active_sessions(ctx: Context, cands: list[Candidate]) -> list[float]:
    """Sessions recently active on the worker."""
    return [float(c.active_sessions) for c in cands]


def kv_usage(ctx: Context, cands: list[Candidate]) -> list[float]:
    """The engine's KV-cache usage (0 when not reported)."""
    return [c.worker.kv_usage or 0.0 for c in cands]


def deepest_match(ctx: Context, cands: list[Candidate]) -> list[float]:
    """More cached blocks is better."""
    return [-float(c.matched_blocks) for c in cands]


def cache_within_slack(ctx: Context, cands: list[Candidate]) -> list[float]:
    """Seed 1's rule: a cached worker wins only while it carries at most ``slack`` more in-flight
    requests than the freest candidate; among those, the deepest match wins."""
    least = min(c.load for c in cands)
    slack = ctx.policy.slack_for(ctx.est_tokens)
    ctx.min_load, ctx.slack = least, slack
    return [-float(c.matched_blocks) if c.matched_blocks and c.load <= least + slack else 0.0
            for c in cands]


def session_affinity(ctx: Context, cands: list[Candidate]) -> list[float]:
    """Seed 2's rule: the session's worker, unless it has more in flight than its overflow
    threshold (a quarter of ``max_num_seqs`` by default)."""
    bound, pol = ctx.bound, ctx.policy
    return [0.0 if c.worker.id == bound and c.load <= pol.overflow_threshold(c.worker.max_num_seqs)
            else 1.0 for c in cands]


def predicted_ttft(ctx: Context, cands: list[Candidate]) -> list[float]:
    """The ``auto`` policy's cost of each candidate, in seconds; lowest wins.

    Predicted time to first token, ``s_per_token * (queue + uncached)``: the prompt tokens the
    worker is not expected to hold at admission (``cache_survival``), behind a queue of the
    router's backlog estimate (weighted up by ``eviction_weight`` as the engine fails to keep what
    the index predicts), the requests in flight and the engine's waiting queue, priced in
    prefill-token equivalents.  To that the cost adds ``prefill_penalty`` times the uncached
    prefill, the delay it causes to every request queued behind it, and the turns the other
    sessions active there will send (``session_load``).  The session's own worker is credited
    ``stay_tokens`` so that noise does not move it; with a numeric ``overflow`` it is never kept
    past that many requests in flight.  ``Candidate.predicted_s`` keeps the plain prediction and
    ``Candidate.held_tokens`` what it counted on, so the backlog adds what the prefill will be.
    """
    pol, est = ctx.policy, float(ctx.est_tokens)
    per_inflight, per_waiting, per_backlog = pol.inflight_tokens, pol.waiting_tokens, pol.backlog_weight
    penalty, evicting = pol.prefill_penalty, pol.eviction_weight
    cap = pol.overflow if pol.overflow != "auto" else None
    out: list[float] = []
    for c in cands:
        held = c.held_tokens = expected_held_tokens(ctx, c)
        uncached = est - held
        backlog = per_backlog * c.backlog_tokens * (1.0 + evicting * (1.0 - c.realisation))
        queue = backlog + per_inflight * c.busy + per_waiting * (c.worker.waiting or 0)
        c.predicted_s = c.s_per_token * (queue + uncached)
        cost = c.s_per_token * (queue + session_load_tokens(ctx, c) + (1.0 + penalty) * uncached)
        if c.worker.id == ctx.bound:
            if cap is not None and c.load > cap:
                cost = math.inf
            else:
                cost -= c.s_per_token * pol.stay_tokens
        out.append(cost)
    return out
