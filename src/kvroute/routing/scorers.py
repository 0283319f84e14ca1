"""Scorers every policy may use: one number per candidate, lower is better."""

from __future__ import annotations

from kvroute.routing.stages import Scorer
from kvroute.routing.view import Candidate, Signal, View


def _inflight(view: View, cands: list[Candidate]) -> list[float]:
    return [float(c.load) for c in cands]


def _engine_load(view: View, cands: list[Candidate]) -> list[float]:
    return [float(c.engine_load) for c in cands]


def _active_sessions(view: View, cands: list[Candidate]) -> list[float]:
    return [float(c.active_sessions) for c in cands]


def _kv_usage(view: View, cands: list[Candidate]) -> list[float]:
    return [c.worker.kv_usage or 0.0 for c in cands]


def _deepest_match(view: View, cands: list[Candidate]) -> list[float]:
    return [-float(c.matched_blocks) for c in cands]


inflight: Scorer = Scorer("inflight", _inflight)
"""Requests in flight from every router instance."""

engine_load: Scorer = Scorer("engine_load", _engine_load)
"""vLLM's data-parallel balancer: ``4 * waiting + running``, at least the in-flight count."""

active_sessions: Scorer = Scorer("active_sessions", _active_sessions, frozenset({Signal.SESSIONS}))
"""Sessions recently active on the worker."""

kv_usage: Scorer = Scorer("kv_usage", _kv_usage)
"""The engine's KV-cache usage (0 when not reported)."""

deepest_match: Scorer = Scorer("deepest_match", _deepest_match, frozenset({Signal.PREFIX}))
"""More cached blocks is better."""
