"""The open loop in virtual time: requests arrive at their own times through the router's real
dispatch path (flow control's gate included), a shed request is recorded and not retried, and
prefix-aware routing keeps the groups' system prompts where they are cached."""

from __future__ import annotations

import pytest

from kvroute.bench.cluster import ClusterConfig, VirtualCluster, run_virtual_open_bench
from kvroute.bench.workloads import SharedPrefixConfig, SharedPrefixWorkload

SMALL = SharedPrefixConfig(groups=4, system_tokens=1500, questions=4, question_tokens=40, output_tokens=16)


def test_every_arrival_is_one_record_and_the_step_drains() -> None:
    workload = SharedPrefixWorkload(SMALL, 3)
    cluster = VirtualCluster(ClusterConfig(replicas=2), "round-robin")
    run = cluster.run_open(workload, [2.0, 4.0], 30.0)
    arrivals = [list(workload.arrivals(rate, 30.0, k * 1_000_000)) for k, rate in enumerate([2.0, 4.0])]
    for step, timed in zip(run.steps, arrivals, strict=True):
        assert step.rate is not None and step.sessions == 0
        assert step.requests == len(timed) and step.errors == 0 and step.unfinished == 0
        assert step.completed_per_s is not None and 0 < step.completed_per_s <= len(timed) / 30.0
        assert step.ttfb_p50_s is not None and step.ttfb_p99_s is not None
        assert step.sessions_completed == 0 and step.session_p50_s is None
    starts = [r.start_s for r in cluster.last_records]
    assert starts == pytest.approx([t.at_s for t in arrivals[1]])
    assert all(w.inflight == 0 for w in cluster.workers)


def test_prefix_routing_keeps_groups_cached_and_runs_are_deterministic() -> None:
    # 4,096 KV tokens per replica: room for two of the four groups' prompts, not all four.
    cfg = ClusterConfig(replicas=2, engine={"num_gpu_blocks_override": 256, "max_model_len": 4096})
    result = run_virtual_open_bench(cfg, ["round-robin", "prefix"], SharedPrefixWorkload(SMALL, 1), [3.0],
                                    40.0, {})
    rr, prefix = (run.steps[0] for run in result.runs)
    assert rr.prefix_hit_pct is not None and prefix.prefix_hit_pct is not None
    assert prefix.prefix_hit_pct > rr.prefix_hit_pct + 10
    assert result.step_sizes() == [3.0] and result.open_loop()
    again = run_virtual_open_bench(cfg, ["round-robin", "prefix"], SharedPrefixWorkload(SMALL, 1), [3.0],
                                   40.0, {})
    assert again == result


def test_gate_sheds_without_retry() -> None:
    # One sequence slot, a queue of two: a burst must be shed at the gate.
    policy = {"flow_control": True, "flow_max_queued": 2}
    cluster = VirtualCluster(ClusterConfig(replicas=1, engine={"max_num_seqs": 1}, policy=policy), "auto")
    step = cluster.run_open(SharedPrefixWorkload(SMALL, 2), [20.0], 10.0).steps[0]
    shed = [r for r in cluster.last_records if r.shed]
    assert step.shed == len(shed) > 0 and step.errors == 0
    assert all(r.worker is None and r.ttfb_s is None for r in shed)
    assert step.requests == len(cluster.last_records)  # one record per arrival: nothing was sent again
    assert cluster.dispatch.flow.depth() == {"qwen3-4b": (0, 0)}
