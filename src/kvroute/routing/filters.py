"""Filters every policy may use.  Hard ones (``ready``, ``serves_model``) may leave nothing;
soft ones keep every candidate when none would pass: the engine answers a too-long prompt with its
own, exact error, and when every worker is full the least loaded wins."""

from __future__ import annotations

from kvroute.routing.settings import DEFAULT_MAX_NUM_SEQS, PlacementSettings
from kvroute.routing.stages import Filter
from kvroute.routing.view import Candidate, Signal, View
from kvroute.routing.worker import WorkerState


def _ready(view: View, cands: list[Candidate]) -> list[Candidate]:
    return [c for c in cands if c.worker.ready]


def _serves_model(view: View, cands: list[Candidate]) -> list[Candidate]:
    model = view.key.model
    return [c for c in cands if c.worker.serves(model)]


def fitting_context(view: View, cands: list[Candidate]) -> list[Candidate]:
    """The candidates whose context window holds the estimated prompt plus the requested output."""
    need = view.key.est_prompt_tokens + view.key.max_tokens
    return [c for c in cands if c.worker.max_model_len is None or need <= c.worker.max_model_len]


def seq_slots(worker: WorkerState, placement: PlacementSettings) -> int:
    """The worker's sequence slots: what it reports, else the configured or vLLM's default."""
    return worker.max_num_seqs or placement.max_num_seqs or DEFAULT_MAX_NUM_SEQS


def with_free_slot(view: View, cands: list[Candidate]) -> list[Candidate]:
    """The candidates with fewer requests busy than their sequence slots."""
    slots = view.placement.max_num_seqs or DEFAULT_MAX_NUM_SEQS  # ``seq_slots``, once per decision
    return [c for c in cands if c.busy < (c.worker.max_num_seqs or slots)]


def _context_fits(view: View, cands: list[Candidate]) -> list[Candidate]:
    return fitting_context(view, cands) or cands


def _free_slot(view: View, cands: list[Candidate]) -> list[Candidate]:
    return with_free_slot(view, cands) or cands


def _load_within_slack(view: View, cands: list[Candidate]) -> list[Candidate]:
    if view.bound_in(cands):
        return cands
    least = min([c.busy for c in cands])  # a list: a generator resumes once per item
    limit = least + view.placement.slack_for(view.est_tokens)
    return [c for c in cands if c.busy <= limit]


ready: Filter = Filter("ready", _ready)
"""Healthy, not draining and not ejected by the circuit breaker (hard)."""

serves_model: Filter = Filter("serves_model", _serves_model)
"""Serves the requested model; a worker whose models are not yet known is accepted (hard)."""

context_fits: Filter = Filter("context_fits", _context_fits)
"""Context window holds the estimated prompt plus the requested output (soft)."""

free_slot: Filter = Filter("free_slot", _free_slot)
"""Has a free sequence slot, by the engine's count or the router's, whichever is higher (soft)."""

load_within_slack: Filter = Filter("load_within_slack", _load_within_slack, frozenset({Signal.BINDING}))
"""The prompt-size slack as a guard for placements: candidates carrying at most ``slack`` more
requests than the freest, so a cached head cannot pull every new conversation onto one worker.  A
session's own worker is exempt (the policy's cost decides whether it stays)."""

BASE: tuple[Filter, ...] = (ready, serves_model, context_fits, free_slot)
"""What every built-in policy filters on first."""
