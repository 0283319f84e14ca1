"""The snapshot built from a registry, scheduler statistics, routing config and activity (no I/O)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvroute.fleet.breaker import BreakerSettings
from kvroute.fleet.registry import ProbeResult, Registry
from kvroute.fleet.vllm_metrics import EngineMetrics
from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.server.activity import Activity, RoutedRequest
from kvroute.server.dashboard.snapshot import UNKNOWN_MODEL, FleetView, QueueView, build_snapshot


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def probe(registry: Registry, wid: str, *, hits: float, queries: float, prompt: float,
          running: int = 0, waiting: int = 0, kv: float = 0.0) -> None:
    metrics = EngineMetrics(running=running, waiting=waiting, kv_usage=kv, prefix_hits=hits,
                            prefix_queries=queries, prompt_tokens=prompt, process_start_time=1.0)
    registry.apply_probe(wid, ProbeResult(reachable=True, healthy=True, metrics=metrics))


def request(t: float, worker: str, kind: str, ttfb: float, model: str = "m") -> RoutedRequest:
    return RoutedRequest(time=t, route="chat", model=model, worker=worker, kind=kind,
                         reason=f"[AUTO] {kind}: {worker}", matched_blocks=3, total_blocks=4, attempts=1,
                         status=200, ttfb_s=ttfb, duration_s=ttfb * 2)


def view(registry: Registry, activity: Activity, routing: RoutingConfig | None = None,
         stats: dict[str, Any] | None = None) -> FleetView:
    return FleetView(records=registry.records(), scheduler_stats=stats or {},
                     routing=routing or RoutingConfig(), requests=activity.requests, ttfb=activity.ttfb)


def test_empty_fleet() -> None:
    clock = Clock()
    snap = build_snapshot(view(Registry(clock=clock), Activity()), clock())
    assert snap["models"] == [] and snap["decisions"] == []
    assert snap["router"]["workers"] == 0 and snap["router"]["healthy"] == 0
    assert snap["ttfb"]["count"] == 0 and snap["ttfb"]["window_p50"] is None
    orjson.dumps(snap)  # JSON-ready as it is


def test_replicas_per_model_with_counters_totals_and_token_rates() -> None:
    clock = Clock()
    reg = Registry(clock=clock)
    reg.add("http://a:1", worker_id="a", models=["m"], max_num_seqs=32)
    reg.add("http://b:1", worker_id="b", models=["m"], max_num_seqs=32)
    reg.add("http://c:1", worker_id="c", models=["other"])
    for wid in "abc":
        probe(reg, wid, hits=0, queries=0, prompt=0)
    clock.now += 10
    probe(reg, "a", hits=800, queries=1000, prompt=1000, running=2, waiting=1, kv=0.5)
    probe(reg, "b", hits=100, queries=1000, prompt=1000, running=1, kv=0.1)
    for kind in ("sticky", "sticky", "sticky", "overflow", "cold"):
        reg.count_request("a", kind)
    reg.count_request("b", "cold")
    reg.get("a").state.inflight = 2  # type: ignore[union-attr]
    reg.set_draining("b")
    activity = Activity()
    for i in range(40):
        activity.record(request(clock.now - 5 + i * 0.1, "a", "sticky", 0.01 * (i + 1)))
    stats = {"index_blocks": 12, "index_max_blocks": 100, "sessions": 3, "session_max": 10,
             "workers": {"a": {"sessions": 2, "cache_mode": "exact"}, "b": {"sessions": 1}}}

    snap = build_snapshot(view(reg, activity, stats=stats), clock.now, decisions=10)

    assert [m["name"] for m in snap["models"]] == ["m", "other"]
    m = snap["models"][0]
    a, b = m["replicas"]
    assert (a["id"], b["id"]) == ("a", "b")
    assert a["requests"] == {"sticky": 3, "overflow": 1, "prefix_hit": 0, "cold": 1, "balance": 0}
    assert a["requests_total"] == 5 and a["sticky_share"] == pytest.approx(0.75)
    assert (a["running"], a["waiting"], a["kv_usage"], a["inflight"], a["sessions"]) == (2, 1, 0.5, 2, 2)
    assert [r["cache_mode"] for r in snap["models"][0]["replicas"]] == ["exact", "approximate"]
    assert a["hit_share"] == pytest.approx(0.8) and a["status"] == "healthy"
    assert b["status"] == "draining" and b["sticky_share"] is None
    t = m["totals"]
    assert (t["replicas"], t["healthy"], t["requests_total"], t["running"], t["sessions"]) == (2, 1, 6, 3, 3)
    assert t["hit_share"] == pytest.approx(0.45)
    assert t["kv_usage"] == pytest.approx(0.3)
    assert m["tokens"]["prompt_tokens"] == 2000 and m["tokens"]["hit_share"] == pytest.approx(0.45)
    assert sum(m["tokens"]["cached"]) * snap["window"]["bin_s"] == pytest.approx(900, abs=1)
    assert snap["models"][1]["tokens"]["hit_share"] is None  # c's counters did not move
    assert snap["router"] == {"workers": 3, "healthy": 2, "inflight": 2, "index_blocks": 12,
                              "index_max_blocks": 100, "sessions": 3, "session_max": 10}
    assert snap["ttfb"]["count"] == 40
    assert snap["ttfb"]["window_p95"] == pytest.approx(0.3805, abs=1e-3)
    assert len(snap["decisions"]) == 10
    assert snap["decisions"][0]["time"] > snap["decisions"][-1]["time"]  # newest first
    assert snap["decisions"][0]["ttfb_s"] == pytest.approx(0.40)


def test_workers_without_known_models_are_listed_not_hidden() -> None:
    clock = Clock()
    reg = Registry(clock=clock)
    reg.add("http://a:1", worker_id="a")
    reg.apply_probe("a", ProbeResult(reachable=False, healthy=False, error="connection refused"))
    snap = build_snapshot(view(reg, Activity()), clock())
    (model,) = snap["models"]
    assert model["name"] == UNKNOWN_MODEL
    assert model["replicas"][0]["status"] == "down"
    assert model["replicas"][0]["last_error"] == "connection refused"
    assert model["replicas"][0]["hit_share"] is None


def test_a_replica_out_by_its_breaker_is_shown_ejected_then_on_trial() -> None:
    clock = Clock()
    reg = Registry(clock=clock, breaker=BreakerSettings(failures=2, cooldown_s=5.0))
    reg.add("http://a:1", worker_id="a", models=["m"])
    for _ in range(2):
        reg.mark_failure("a", "first_byte_timeout: no first byte in 10 s")
    (replica,) = build_snapshot(view(reg, Activity()), clock())["models"][0]["replicas"]
    assert replica["status"] == "ejected"
    assert replica["breaker"]["ejections"] == {"failures": 1} and replica["breaker"]["reopens_in_s"] == 5.0
    clock.now += 5.0
    reg.apply_probe("a", ProbeResult(reachable=True, healthy=True))
    (replica,) = build_snapshot(view(reg, Activity()), clock())["models"][0]["replicas"]
    assert replica["status"] == "trial"


def test_policy_in_force_per_model() -> None:
    clock = Clock()
    reg = Registry(clock=clock)
    reg.add("http://a:1", worker_id="a", models=["s"], max_num_seqs=32)
    reg.add("http://b:1", worker_id="b", models=["p"])
    reg.add("http://c:1", worker_id="c", models=["x"])
    routing = RoutingConfig(models={
        "s": ModelSettings(policy="session"),
        "p": ModelSettings(policy="prefix", slack_steps=(100, 200)),
        "x": ModelSettings(policy="auto", overflow=6, sticky=False),
    })
    snap = build_snapshot(view(reg, Activity(), routing), clock())
    policies = {m["name"]: m["policy"] for m in snap["models"]}
    replicas = {m["name"]: m["replicas"][0] for m in snap["models"]}
    assert policies["s"]["sticky"] is True and policies["s"]["overflow"] == "auto"
    assert "quarter of max_num_seqs" in policies["s"]["overflow_rule"]
    assert replicas["s"]["overflow_threshold"] == 8  # 32 // 4
    assert policies["p"]["sticky"] is False and policies["p"]["slack_steps"] == [100, 200]
    assert replicas["p"]["overflow_threshold"] is None
    assert policies["x"]["sticky"] is False and "past 6 in flight" in policies["x"]["overflow_rule"]
    assert replicas["x"]["overflow_threshold"] == 6


def test_no_prompt_text_reaches_the_snapshot() -> None:
    clock = Clock()
    activity = Activity()
    activity.record(request(clock(), "a", "cold", 0.1))
    snap = build_snapshot(view(Registry(clock=clock), activity), clock())
    assert set(snap["decisions"][0]) == {"time", "route", "model", "worker", "kind", "reason",
                                         "matched_blocks", "total_blocks", "attempts", "status", "ttfb_s",
                                         "duration_s"}


def test_the_queue_per_model_or_flow_control_off() -> None:
    clock = Clock()
    reg = Registry(clock=clock)
    reg.add("http://a:1", worker_id="a", models=["on"])
    reg.add("http://b:1", worker_id="b", models=["off"])
    routing = RoutingConfig(models={"on": ModelSettings(flow_control=True),
                                    "off": ModelSettings(flow_control=False)})
    activity = Activity()
    now = clock.now
    for i, depth in enumerate((1, 3, 2, 0)):
        activity.queue.changed("on", now - 8 + i, depth, depth * 100)
    for wait in (0.1, 0.2, 0.3, 0.4, 2.0):
        activity.queue.waited("on", now - 5, wait)
    activity.queue.waited("on", now - 7200, 99.0)  # outside the window
    flow = QueueView(depth={"on": (2, 250)},
                     by_class={("on", "high"): (0, 0), ("on", "normal"): (2, 250), ("on", "low"): (0, 0)},
                     sessions={"on": (7, 2)},
                     tenant_tokens={("on", "a"): 300, ("on", "b"): 100, ("off", "c"): 5},
                     admitted={("on", "at_once"): 40, ("on", "after_wait"): 5},
                     shed={("on", "ttl"): 1, ("on", "queue_full"): 2},
                     waits=activity.queue.waits,
                     history={m: [h] for m, h in activity.queue.history.items()},
                     saturation={"on": (2, 1)})
    v = FleetView(records=reg.records(), scheduler_stats={}, routing=routing, requests=activity.requests,
                  ttfb=activity.ttfb, queue=flow)

    snap = build_snapshot(v, now)

    off, on = snap["models"]
    q = on["queue"]
    assert q["flow_control"] is True and (q["depth"], q["tokens"]) == (2, 250)
    assert (q["saturated"], q["thrashing"], q["gate"]) == (True, True, True)
    assert (off["queue"]["saturated"], off["queue"]["gate"]) == (False, False)
    assert len(q["series"]["depth"]) == snap["window"]["bins"]
    assert max(q["series"]["depth"]) == 3 and max(q["series"]["tokens"]) == 300
    assert q["wait"]["count"] == 5
    assert q["wait"]["p50"] == pytest.approx(0.3) and q["wait"]["p95"] == pytest.approx(1.68)
    assert q["classes"] == {"high": {"depth": 0, "tokens": 0}, "normal": {"depth": 2, "tokens": 250},
                            "low": {"depth": 0, "tokens": 0}}
    assert q["sessions"] == {"admitted": 7, "waiting": 2}
    assert q["tenants"] == [{"tenant": "a", "tokens": 300, "share": 0.75},
                            {"tenant": "b", "tokens": 100, "share": 0.25}]
    assert q["admitted"] == {"at_once": 40, "after_wait": 5}
    assert q["shed"] == {"queue_full": 2, "ttl": 1} and q["shed_total"] == 3
    # Switched off: the page says so, and there is nothing to count.
    assert off["queue"]["flow_control"] is False
    quiet = off["queue"]
    assert quiet["depth"] == 0 and quiet["wait"]["count"] == 0 and quiet["shed_total"] == 0
    assert quiet["classes"] == {} and quiet["sessions"] is None  # no session admission: no door
    orjson.dumps(snap)


def test_a_shed_request_is_an_activity_row() -> None:
    clock = Clock()
    activity = Activity()
    activity.record(RoutedRequest(time=clock.now, route="chat", model="m", worker=None, kind="shed",
                                  reason="[FLOW] shed: ttl after 60.000 s in the queue", matched_blocks=0,
                                  total_blocks=0, attempts=0, status=429, ttfb_s=None, duration_s=60.0))
    snap = build_snapshot(view(Registry(clock=clock), activity), clock())
    (row,) = snap["decisions"]
    assert (row["kind"], row["status"], row["worker"], row["ttfb_s"]) == ("shed", 429, None, None)
    assert snap["ttfb"]["count"] == 0  # a shed request has no first byte


def test_the_fleet_guard_findings_and_holds_ride_along_per_replica() -> None:
    clock = Clock()
    reg = Registry(clock=clock)
    reg.add("http://a:1", worker_id="a", models=["m"])
    reg.add("http://b:1", worker_id="b", models=["m"])
    reg.set_guard_hold("a", "doctor")
    guard = {"a": {"doctor": {"worst": "error", "held": True, "findings": []},
                   "cache_drift": {"alarm": True, "realisation": 0.0}}}
    fleet = FleetView(records=reg.records(), scheduler_stats={}, routing=RoutingConfig(), requests=[],
                      ttfb=[], guard=lambda wid: guard.get(wid, {"doctor": None, "cache_drift": None}))
    a, b = build_snapshot(fleet, clock())["models"][0]["replicas"]
    assert a["status"] == "guarded" and a["guard_holds"] == ["doctor"]
    assert a["doctor"]["worst"] == "error" and a["cache_drift"]["alarm"]
    assert b["status"] == "healthy" and b["doctor"] is None and b["cache_drift"] is None
