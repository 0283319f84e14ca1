"""Agents and shared-prefix traffic on one fleet in virtual time: each kind's requests are recorded
and summarised apart, the agents' sessions go on turn after turn while the open loop's requests are
never followed, both drain, and a run is a pure function of its inputs."""

from __future__ import annotations

import pytest

from kvroute.bench.cluster import ClusterConfig, VirtualCluster
from kvroute.bench.results import PolicyRun
from kvroute.bench.workloads import (
    AgentWorkload,
    AgentWorkloadConfig,
    SharedPrefixConfig,
    SharedPrefixWorkload,
)

SMALL = SharedPrefixConfig(groups=3, system_tokens=1200, questions=4, question_tokens=40, output_tokens=16)
AGENTS = AgentWorkloadConfig(system_tokens=800, first_tokens=1000, rounds=3, round_tokens=100,
                            max_output_tokens=32, min_output_tokens=32, think_time_s=0.5)


def _run() -> tuple[VirtualCluster, PolicyRun, PolicyRun]:
    cluster = VirtualCluster(ClusterConfig(replicas=2), "auto")
    agents, opened = cluster.run_mixed(AgentWorkload(AGENTS, 1), [2, 3], SharedPrefixWorkload(SMALL, 1),
                                       [1.0, 2.0], 40.0)
    return cluster, agents, opened


def test_each_kind_is_summarised_apart_and_both_drain() -> None:
    cluster, agents, opened = _run()
    shared = SharedPrefixWorkload(SMALL, 1)
    for k, (a, o) in enumerate(zip(agents.steps, opened.steps, strict=True)):
        assert a.sessions == [2, 3][k] and a.rate is None
        assert o.sessions == 0 and o.rate == [1.0, 2.0][k]
        # Every arrival is one record, once: nothing of the open loop is sent again.
        assert o.requests == len(list(shared.arrivals([1.0, 2.0][k], 40.0, k * 1_000_000)))
        assert o.errors == 0 and o.unfinished == 0 and o.sessions_completed == 0
        assert a.requests > a.sessions and a.errors == 0  # the sessions went on past their first turn
        assert a.prefix_hit_pct is not None and o.prefix_hit_pct is not None
        assert a.preemptions == o.preemptions  # the fleet's, not a kind's
    records = cluster.last_records
    assert {r.round for r in records if r.session_id is None} == {0}
    assert any(r.session_id is not None and r.round > 0 for r in records)
    assert all(w.inflight == 0 for w in cluster.workers)


def test_a_mixed_run_is_deterministic() -> None:
    assert _run()[1:] == _run()[1:]


def test_one_rate_per_step_of_sessions() -> None:
    cluster = VirtualCluster(ClusterConfig(replicas=1), "auto")
    with pytest.raises(ValueError, match="one arrival rate per step"):
        cluster.run_mixed(AgentWorkload(AGENTS, 0), [1, 2], SharedPrefixWorkload(SMALL, 0), [1.0], 10.0)
