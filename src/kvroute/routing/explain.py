"""One log line per decision: what was chosen, why, and the figures that decided it.

Never any prompt text: workers, block counts, loads, estimated tokens, and a session's 64-bit
hash (8 hex digits), not its id.
"""

from __future__ import annotations

from collections.abc import Callable

from kvroute.routing.candidates import Candidate, Context
from kvroute.routing.decision import DecisionKind

Explainer = Callable[[str, Context, list[Candidate], int], tuple[DecisionKind, str]]


def _sid(ctx: Context) -> str:
    return f"{(ctx.session or 0) >> 32:08x}"


def _blocks(ctx: Context, c: Candidate) -> str:
    return f"{c.matched_blocks}/{ctx.total_blocks} blocks"


def _bound_kind(ctx: Context, chosen: Candidate) -> DecisionKind | None:
    if ctx.bound is None:
        return None
    return DecisionKind.STICKY if chosen.worker.id == ctx.bound else DecisionKind.OVERFLOW


def balance(name: str, ctx: Context, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
    """Load-only policies."""
    c = cands[i]
    loads = [x.engine_load for x in cands]
    return DecisionKind.BALANCE, (
        f"[{name.upper()}] {c.worker.id} load={c.engine_load} (min={min(loads)} max={max(loads)} "
        f"of {len(cands)}, keeps {_blocks(ctx, c)}, ~{ctx.est_tokens} tokens)")


def prefix(name: str, ctx: Context, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
    """Seed 1: ``[PREFIX] hit: 905487f1 keeps 64/64 blocks (slots=0 min=0 slack=3, ~12952 tokens)``."""
    c = cands[i]
    figures = f"slots={c.load} min={ctx.min_load} slack={ctx.slack}"
    if c.matched_blocks:
        return DecisionKind.PREFIX_HIT, (
            f"[PREFIX] hit: {c.worker.id} keeps {_blocks(ctx, c)} ({figures}, ~{ctx.est_tokens} tokens)")
    best = max(cands, key=lambda x: x.matched_blocks)
    cached = (f"best cache {best.worker.id} {_blocks(ctx, best)} at slots={best.load}"
              if best.matched_blocks else "no cached worker")
    return DecisionKind.COLD, (
        f"[PREFIX] cold: {c.worker.id} ({figures}, {cached}, ~{ctx.est_tokens} tokens)")


def session(name: str, ctx: Context, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
    """Seed 2: sticky, overflow, or a new placement on the least-loaded worker."""
    c = cands[i]
    threshold = ctx.policy.overflow_threshold(c.worker.max_num_seqs)
    kind = _bound_kind(ctx, c)
    if kind is DecisionKind.STICKY:
        return kind, (f"[SESSION] sticky: {_sid(ctx)} stays on {c.worker.id} "
                      f"(inflight={c.load} threshold={threshold}, keeps {_blocks(ctx, c)})")
    if kind is DecisionKind.OVERFLOW:
        old = next((x for x in cands if x.worker.id == ctx.bound), None)
        why = (f"inflight={old.load} > threshold={ctx.policy.overflow_threshold(old.worker.max_num_seqs)}"
               if old is not None else "not a candidate")
        return kind, (f"[SESSION] overflow: {_sid(ctx)} {ctx.bound} -> {c.worker.id} "
                      f"({ctx.bound} {why}; now inflight={c.load})")
    who = f"new session {_sid(ctx)}" if ctx.session is not None else "no session"
    return DecisionKind.COLD, (
        f"[SESSION] {who}: {c.worker.id} least loaded (inflight={c.load} "
        f"sessions={c.active_sessions} kv={c.worker.kv_usage if c.worker.kv_usage is not None else '-'})")


def auto(name: str, ctx: Context, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
    """The default policy: sticky, overflow, prefix hit or cold, with the predictions compared."""
    c = cands[i]
    others = [x for j, x in enumerate(cands) if j != i]
    alt = min(others, key=lambda x: x.predicted_s) if others else None
    versus = f" vs {alt.predicted_s:.3f}s on {alt.worker.id}" if alt is not None else ""
    figures = (f"predicted {c.predicted_s:.3f}s{versus}; keeps {_blocks(ctx, c)}, "
               f"busy={c.busy}, ~{ctx.est_tokens} tokens")
    kind = _bound_kind(ctx, c)
    if kind is DecisionKind.STICKY:
        return kind, f"[AUTO] sticky: {_sid(ctx)} stays on {c.worker.id} ({figures})"
    if kind is DecisionKind.OVERFLOW:
        return kind, f"[AUTO] overflow: {_sid(ctx)} {ctx.bound} -> {c.worker.id} ({figures})"
    who = f" new session {_sid(ctx)}" if ctx.session is not None else ""
    if c.matched_blocks:
        return DecisionKind.PREFIX_HIT, f"[AUTO] hit:{who} {c.worker.id} ({figures})"
    return DecisionKind.COLD, f"[AUTO] cold:{who} {c.worker.id} ({figures})"
