"""How the figures of several router processes combine (pure functions), and the setting."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.fleet.registry import Registry
from kvroute.fleet.vllm_metrics import EngineMetrics
from kvroute.router_settings import Settings, SettingsError
from kvroute.server.activity import QueueActivity
from kvroute.server.admin import merge_listings
from kvroute.server.dashboard.merge import _merged_queue, _parse_queue
from kvroute.server.dashboard.snapshot import QueueView
from kvroute.server.metrics import RouterMetrics, merge_expositions

WORKER = "127.0.0.1:9000"


def process_metrics(routed: int, inflight: int, *, hits: float, connected: bool) -> str:
    """One process's /metrics: ``routed`` requests, ``inflight`` in flight, the engine's counter."""
    registry = Registry()
    record = registry.add(f"http://{WORKER}")
    record.state.inflight = inflight
    record.metrics = EngineMetrics(prefix_hits=hits, prefix_queries=2 * hits)
    metrics = RouterMetrics(registry, lambda: {"index_blocks": 40, "sessions": 3})
    for _ in range(routed):
        metrics.count_request(WORKER, "m", "cold")
        metrics.ttfb.observe(0.02)
    text = metrics.render().decode()
    # What the Redis bus adds to a process's registry.
    text += ("# HELP kvroute_sync_connected 1 while connected\n# TYPE kvroute_sync_connected gauge\n"
             f"kvroute_sync_connected {1.0 if connected else 0.0}\n")
    return text


def values(body: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def test_counters_and_in_flight_add_up_fleet_figures_are_not_multiplied():
    merged = values(merge_expositions([
        ("1", process_metrics(3, 2, hits=100.0, connected=True)),
        ("0", process_metrics(5, 1, hits=104.0, connected=False)),
    ]))
    w = (("worker", WORKER),)
    assert merged[("kvroute_requests_total", (("kind", "cold"), ("model", "m"), ("worker", WORKER)))] == 8
    assert merged[("kvroute_ttfb_seconds_count", ())] == 8
    assert merged[("kvroute_ttfb_seconds_bucket", (("le", "0.025"),))] == 8
    assert merged[("kvroute_inflight", w)] == 3
    # The engine's own counter and the shared index: the answering (first) process's figures.
    assert merged[("kvroute_worker_prefix_cache_hits_total", w)] == 100
    assert merged[("kvroute_worker_healthy", w)] == 1
    assert merged[("kvroute_index_blocks", ())] == 40
    assert merged[("kvroute_sync_connected", ())] == 0  # connected only if every process is
    assert merged[("kvroute_processes", ())] == 2
    assert merged[("kvroute_process_requests_total", (("process", "0"),))] == 5
    assert merged[("kvroute_process_requests_total", (("process", "1"),))] == 3


def test_a_single_exposition_passes_through_unchanged():
    text = process_metrics(2, 0, hits=1.0, connected=True)
    merged = values(merge_expositions([("0", text)]))
    alone = values(text.encode())
    assert {k: v for k, v in merged.items() if k in alone} == alone


def test_the_admin_listing_sums_counts_over_processes():
    def listing(inflight: int, peer: int, requests: dict[str, int], ranks: dict[str, int]) -> bytes:
        return orjson.dumps({"workers": [{"id": WORKER, "inflight": inflight, "peer_inflight": peer,
                                          "requests": requests, "draining": True,
                                          "rank_inflight": ranks}],
                             "scheduler": {"sessions": 4}})

    answering = listing(2, 5, {"cold": 1}, {"1": 2})
    sibling = listing(3, 4, {"cold": 2, "sticky": 6}, {"10": 1, "1": 1})
    merged = orjson.loads(merge_listings([answering, sibling]))
    worker = merged["workers"][0]
    assert worker["inflight"] == 5
    assert worker["rank_inflight"] == {"1": 3, "10": 1}
    assert worker["peer_inflight"] == 2  # the sibling's 3 were counted as a peer's
    assert worker["requests"] == {"cold": 3, "sticky": 6}
    assert worker["draining"] is True and merged["scheduler"] == {"sessions": 4}


def test_processes_setting_from_toml_env_and_its_bounds(tmp_path):
    config = tmp_path / "kvroute.toml"
    config.write_text("processes = 3\n")
    assert Settings.load(config, env={}).processes == 3
    assert Settings.load(None, env={"KVROUTE_PROCESSES": "4"}).processes == 4
    assert Settings.load(config, env={}, overrides={"processes": 2}).processes == 2
    assert Settings().processes == 1
    with pytest.raises(SettingsError, match="processes must be at least 1"):
        Settings.from_dict({"processes": 0})
    with pytest.raises(SettingsError, match="processes must be an integer"):
        Settings.from_dict({"processes": "many"})


def test_the_dashboard_sums_the_processes_queues():
    mine = QueueActivity()
    mine.changed("m", 100.0, 2, 20)
    mine.waited("m", 101.0, 0.5)
    local = QueueView(depth={"m": (2, 20)}, by_class={("m", "high"): (1, 5), ("m", "normal"): (1, 15)},
                      sessions={"m": (4, 1)}, tenant_tokens={("m", "a"): 10},
                      admitted={("m", "at_once"): 3}, shed={("m", "ttl"): 1},
                      waits=list(mine.waits), history={"m": [list(mine.history["m"])]})
    # Another process's share as it travels (JSON), with a queue of its own.
    sibling = orjson.loads(orjson.dumps({
        "depth": {"m": [1, 30]}, "by_class": [["m", "normal", 1, 30]], "sessions": {"m": [2, 0]},
        "tenant_tokens": [["m", "a", 5], ["m", "other", 7]],
        "admitted": [["m", "at_once", 2], ["m", "after_wait", 4]],
        "shed": [["m", "ttl", 2]], "waits": [[99.0, "m", 1.5]], "history": {"m": [[100, 3, 40, 1, 30]]}}))
    merged = _merged_queue([local, _parse_queue(sibling), _parse_queue({})])  # {}: an older process
    assert merged.depth == {"m": (3, 50)}
    assert merged.by_class == {("m", "high"): (1, 5), ("m", "normal"): (2, 45)}
    assert merged.sessions == {"m": (6, 1)}
    assert merged.tenant_tokens == {("m", "a"): 15, ("m", "other"): 7}
    assert merged.admitted == {("m", "at_once"): 5, ("m", "after_wait"): 4}
    assert merged.shed == {("m", "ttl"): 3}
    assert list(merged.waits) == [(99.0, "m", 1.5), (101.0, "m", 0.5)]
    assert [[s.second for s in t] for t in merged.history["m"]] == [[100], [100]]
