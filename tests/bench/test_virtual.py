"""Virtual-time cluster: deterministic for a seed, and the session-stickiness benchmark's
direction on the a4000 preset."""

from __future__ import annotations

import pytest

from kvroute.bench.cluster import ClusterConfig, VirtualCluster, run_virtual_bench
from kvroute.bench.results import BenchResult
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig

SMALL = AgentWorkloadConfig(system_tokens=800, first_tokens=1600, rounds=3, round_tokens=200,
                            max_output_tokens=32, min_output_tokens=8, think_time_s=1.0)


def small_run(seed: int) -> BenchResult:
    cfg = ClusterConfig(replicas=2, engine={"num_gpu_blocks_override": 2048})
    return run_virtual_bench(cfg, ["p2c", "auto"], AgentWorkload(SMALL, seed), [2, 6], 40.0, {"seed": seed})


def test_same_seed_identical_results_other_seed_differs() -> None:
    first, second = small_run(3), small_run(3)
    assert first == second
    assert all(step.requests > 10 and step.errors == 0 for run in first.runs for step in run.steps)
    assert small_run(4) != first


def test_router_view_and_accounting() -> None:
    cluster = VirtualCluster(ClusterConfig(replicas=3, scrape_interval_s=0.5), "session")
    run = cluster.run(AgentWorkload(SMALL, 1), [3], 30.0, poll_interval_s=0.5)
    step = run.steps[0]
    assert step.stayed_pct == 100.0
    assert step.prefix_hit_pct is not None and step.prefix_hit_pct > 50.0
    assert 0 < step.replicas_busy <= 3  # type: ignore[operator]
    # After the drain nothing is in flight, and the router's counts agree.
    assert all(w.inflight == 0 for w in cluster.workers)
    assert all(not e.has_work() for e in cluster.engines)
    with pytest.raises(ValueError):
        cluster.run(AgentWorkload(SMALL, 1), [1], 0.0)


def test_stickiness_direction_at_four_to_sixteen_sessions() -> None:
    """At 4-16 sessions on four a4000-qwen3-4b replicas, keeping a session on its replica (session)
    and the default (auto) serve more of the prompt from cache and start answering sooner than
    vLLM's least-loaded balancing, as the session-stickiness benchmark measured."""
    policies = ["least-loaded", "session", "auto"]
    result = run_virtual_bench(ClusterConfig(), policies, AgentWorkload(seed=0), [4, 8, 16], 120.0, {})
    for n in (4, 8, 16):
        base = result.step("least-loaded", n)
        assert base is not None and base.ttfb_p50_s is not None and base.prefix_hit_pct is not None
        for policy in ("session", "auto"):
            step = result.step(policy, n)
            assert step is not None and step.errors == 0
            assert step.prefix_hit_pct is not None and step.prefix_hit_pct > base.prefix_hit_pct, (policy, n)
            assert step.ttfb_p50_s is not None and step.ttfb_p50_s < base.ttfb_p50_s, (policy, n)
