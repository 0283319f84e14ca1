"""The dashboard's JSON: one snapshot of the fleet, per model and per replica (pure: no I/O).

Everything here is read from state the router already keeps: the registry's worker records and
their scraped counter history, the scheduler's statistics and routing configuration, flow
control's queues and counters, and the recent-activity rings.  No prompt text exists in any of
them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.fleet.breaker import BreakerState
from kvroute.fleet.registry import WorkerRecord
from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.decision import DecisionKind
from kvroute.routing.flow import FlowSettings
from kvroute.routing.policies import policy_named
from kvroute.routing.saturation import switch_on
from kvroute.routing.view import Signal
from kvroute.server.activity import QueueSample, RoutedRequest
from kvroute.server.dashboard.series import (
    Window,
    choose_window,
    latency_percentiles,
    queue_depths,
    token_rates,
)

# Workers whose /v1/models has not been read yet (and that declared none) are listed under this.
UNKNOWN_MODEL = "(model not yet known)"
_KINDS = tuple(k.value for k in DecisionKind if k is not DecisionKind.NO_WORKER)


@dataclass(frozen=True, slots=True)
class QueueView:
    """Flow control's side of a snapshot: each model's queue now (requests, estimated prompt
    tokens), the same by (model, priority class), session admission's door (sessions admitted and
    new sessions waiting, by model, where it is on), the tokens served per (model, tenant label),
    the admitted (by model and ``at_once`` /
    ``after_wait``) and shed (by model and reason) counts since the router started, the waits of the
    requests that waited (``(time, model, seconds)``), and each model's depth history, one timeline
    per router process; ``saturation`` counts, per model, the processes that see its fleet
    saturated and thrashing (routing/saturation.py)."""

    depth: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    by_class: Mapping[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    sessions: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    tenant_tokens: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (model, tenant)
    admitted: Mapping[tuple[str, str], int] = field(default_factory=dict)
    shed: Mapping[tuple[str, str], int] = field(default_factory=dict)
    waits: Iterable[tuple[float, str, float]] = ()
    history: Mapping[str, Sequence[Iterable[QueueSample]]] = field(default_factory=dict)
    saturation: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FleetView:
    """What a snapshot is built from; the server fills it from its live objects."""

    records: list[WorkerRecord]
    scheduler_stats: Mapping[str, Any]
    routing: RoutingConfig
    requests: Iterable[RoutedRequest]
    ttfb: Iterable[tuple[float, float]]
    queue: QueueView = field(default_factory=QueueView)
    # What the fleet guard knows about a worker (``Router.guard_json``): the doctor's findings and
    # the cache-drift alarm.
    guard: Callable[[str], Mapping[str, Any]] = lambda _: {}


def build_snapshot(view: FleetView, now: float, *, span_s: float = 3600.0,
                   decisions: int = 25) -> dict[str, Any]:
    """The dashboard's data at time ``now``: router summary, the charts' shared window, TTFB through
    the router, one entry per model (policy, replicas, totals, prompt-token rates, flow control's
    queue) and the latest ``decisions`` requests with their routing reasons."""
    ttfb = list(view.ttfb)
    earliest = _earliest(view.records, ttfb)
    window = choose_window(now, earliest, span_s=span_s)
    worker_stats: Mapping[str, Mapping[str, Any]] = view.scheduler_stats.get("workers", {})
    by_model: dict[str, list[WorkerRecord]] = {}
    for record in view.records:
        for model in sorted(record.state.models) or [UNKNOWN_MODEL]:
            by_model.setdefault(model, []).append(record)
    waits: dict[str, list[tuple[float, float]]] = {}
    for t, model, wait_s in view.queue.waits:
        waits.setdefault(model, []).append((t, wait_s))
    recent = list(view.requests)[-decisions:]
    recent.reverse()
    stats = view.scheduler_stats
    return {
        "generated_at": now,
        "router": {
            "workers": len(view.records),
            "healthy": sum(1 for r in view.records if _usable(r)),
            "inflight": sum(r.state.inflight for r in view.records),
            "index_blocks": stats.get("index_blocks"),
            "index_max_blocks": stats.get("index_max_blocks"),
            "sessions": stats.get("sessions"),
            "session_max": stats.get("session_max"),
        },
        "window": window.to_json(),
        "ttfb": latency_percentiles(ttfb, window).to_json(),
        "models": [
            _model(name, records, view.routing.settings_for(name), worker_stats, window, now,
                   _queue(name, view.routing.settings_for(name), view.queue, waits.get(name, ()), window),
                   view.guard)
            for name, records in sorted(by_model.items())
        ],
        "decisions": [_decision(r) for r in recent],
    }


def _earliest(records: list[WorkerRecord], ttfb: list[tuple[float, float]]) -> float | None:
    times = [r.history.first().time for r in records if len(r.history)]
    if ttfb:
        times.append(ttfb[0][0])
    return min(times, default=None)


def _usable(record: WorkerRecord) -> bool:
    return record.state.ready


def _status(record: WorkerRecord) -> str:
    """draining, down (unhealthy), guarded (held out by the fleet guard), ejected (breaker open),
    trial (half-open) or healthy."""
    s, breaker = record.state, record.breaker.state
    if s.draining:
        return "draining"
    if s.guard_holds:
        return "guarded"
    if not s.healthy:
        return "down"
    if breaker is BreakerState.OPEN:
        return "ejected"
    return "trial" if breaker is BreakerState.HALF_OPEN else "healthy"


def _model(name: str, records: list[WorkerRecord], policy: ModelSettings,
           worker_stats: Mapping[str, Mapping[str, Any]], window: Window, now: float,
           queue: dict[str, Any], guard: Callable[[str], Mapping[str, Any]]) -> dict[str, Any]:
    replicas = [_replica(r, policy, worker_stats.get(r.id, {}), now, guard(r.id)) for r in records]
    return {
        "name": name,
        "policy": _policy(policy),
        "replicas": replicas,
        "totals": _totals(replicas),
        "tokens": token_rates((r.history for r in records), window).to_json(),
        "queue": queue,
    }


def _queue(name: str, policy: ModelSettings, view: QueueView, waits: Iterable[tuple[float, float]],
           window: Window) -> dict[str, Any]:
    """The model's queue at the router: whether flow control is on, its depth now (in all and by
    priority class) and per bin (peak), session admission's door (null where it is off), the waits
    over the window (p50/p95 of the requests that waited), admitted and shed."""
    depth, tokens = view.depth.get(name, (0, 0))
    sessions = view.sessions.get(name)
    wait = latency_percentiles(waits, window).to_json()
    shed = {reason: n for (model, reason), n in sorted(view.shed.items()) if model == name}
    saturated, thrashing = view.saturation.get(name, (0, 0))
    switch = policy.block(FlowSettings).flow_control
    return {
        "flow_control": switch,
        "saturated": saturated > 0,
        "thrashing": thrashing > 0,
        "gate": switch_on(switch, saturated > 0),
        "depth": depth,
        "tokens": tokens,
        "classes": {cls: {"depth": n, "tokens": t}
                    for (model, cls), (n, t) in view.by_class.items() if model == name},
        "sessions": None if sessions is None else {"admitted": sessions[0], "waiting": sessions[1]},
        "tenants": _tenant_shares(name, view.tenant_tokens),
        "series": queue_depths(view.history.get(name, ()), window).to_json(),
        "wait": {"count": wait["count"], "p50": wait["window_p50"], "p95": wait["window_p95"]},
        "admitted": {when: view.admitted.get((name, when), 0) for when in ("at_once", "after_wait")},
        "shed": shed,
        "shed_total": sum(shed.values()),
    }


def _tenant_shares(model: str, tokens: Mapping[tuple[str, str], int]) -> list[dict[str, Any]]:
    """Each tenant label's tokens served through the gate and share of the model's, largest first."""
    mine = sorted(((n, tenant) for (m, tenant), n in tokens.items() if m == model and n > 0), reverse=True)
    total = sum(n for n, _ in mine)
    return [{"tenant": tenant, "tokens": n, "share": n / total} for n, tenant in mine]


def _policy(policy: ModelSettings) -> dict[str, Any]:
    """The knobs in force; ``overflow_rule`` says in words what ``overflow`` means for this policy."""
    if policy.policy == "session":
        rule = ("a quarter of max_num_seqs in flight" if policy.overflow == "auto"
                else f"more than {policy.overflow} in flight")
    elif policy.policy == "auto":
        rule = ("when another replica is predicted faster by more than "
                f"{policy.stay_tokens:g} tokens of prefill")
        if policy.overflow != "auto":
            rule += f", and always past {policy.overflow} in flight"
    else:
        rule = "not used by this policy"
    uses_session = Signal.BINDING in policy_named(policy.policy).needs
    return {
        "name": policy.policy,
        "sticky": policy.sticky and uses_session,
        "overflow": policy.overflow,
        "overflow_rule": rule,
        "slack_steps": list(policy.slack_steps),
        "stay_tokens": policy.stay_tokens,
        "session_spread": policy.session_spread,
        "max_num_seqs": policy.max_num_seqs,
    }


def _replica(record: WorkerRecord, policy: ModelSettings, stats: Mapping[str, Any],
             now: float, guard: Mapping[str, Any]) -> dict[str, Any]:
    s, m = record.state, record.metrics
    requests = {kind: record.requests.get(kind, 0) for kind in _KINDS}
    sticky, overflow = requests["sticky"], requests["overflow"]
    hits = None if m is None else m.prefix_hits
    queries = None if m is None else m.prefix_queries
    threshold = (policy.overflow_threshold(s.max_num_seqs)
                 if policy.policy == "session" or policy.overflow != "auto" else None)
    return {
        "id": s.id,
        "url": s.url,
        "status": _status(record),
        "breaker": record.breaker.to_json(now),
        "epoch": s.epoch,
        "restarts": record.restarts,
        "last_error": record.last_error,
        "inflight": s.inflight,
        "peer_inflight": s.peer_inflight,
        "running": s.running,
        "waiting": s.waiting,
        "kv_usage": s.kv_usage,
        "max_num_seqs": s.max_num_seqs,
        "overflow_threshold": threshold,
        "sessions": stats.get("sessions", 0),
        # How the router knows the replica's cache: its KV events (exact) or the prefix index.
        "cache_mode": stats.get("cache_mode", "approximate"),
        "requests": requests,
        "requests_total": sum(requests.values()),
        "sticky_share": _share(sticky, sticky + overflow),
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "hit_share": _share(hits, queries),
        "guard_holds": sorted(s.guard_holds),
        "doctor": guard.get("doctor"),
        "cache_drift": guard.get("cache_drift"),
        "canary": guard.get("canary"),
    }


def _totals(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    def total(key: str) -> float | None:
        values = [r[key] for r in replicas if r[key] is not None]
        return sum(values) if values else None

    kv = [r["kv_usage"] for r in replicas if r["kv_usage"] is not None]
    sticky = sum(r["requests"]["sticky"] for r in replicas)
    overflow = sum(r["requests"]["overflow"] for r in replicas)
    hits, queries = total("prefix_cache_hits"), total("prefix_cache_queries")
    return {
        "replicas": len(replicas),
        "healthy": sum(1 for r in replicas if r["status"] == "healthy"),
        "requests": {kind: sum(r["requests"][kind] for r in replicas) for kind in _KINDS},
        "requests_total": sum(r["requests_total"] for r in replicas),
        "sticky_share": _share(sticky, sticky + overflow),
        "sessions": sum(r["sessions"] for r in replicas),
        "inflight": sum(r["inflight"] for r in replicas),
        "running": total("running"),
        "waiting": total("waiting"),
        "kv_usage": sum(kv) / len(kv) if kv else None,
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "hit_share": _share(hits, queries),
    }


def _share(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return part / whole


def _decision(r: RoutedRequest) -> dict[str, Any]:
    return {
        "time": r.time,
        "route": r.route,
        "model": r.model,
        "worker": r.worker,
        "kind": r.kind,
        "reason": r.reason,
        "matched_blocks": r.matched_blocks,
        "total_blocks": r.total_blocks,
        "attempts": r.attempts,
        "status": r.status,
        "ttfb_s": r.ttfb_s,
        "duration_s": r.duration_s,
    }
