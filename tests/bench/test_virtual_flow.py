"""The virtual-time cluster runs the router's real flow-control queue: requests wait at the gate
when the fleet is full, the wait counts in their time to first byte, and nothing is left queued,
reserved or in flight after a run."""

from __future__ import annotations

from kvroute.bench.cluster import ClusterConfig, VirtualCluster
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig

SMALL = AgentWorkloadConfig(system_tokens=800, first_tokens=1600, rounds=3, round_tokens=200,
                            max_output_tokens=32, min_output_tokens=8, think_time_s=0.5)


def run(**policy: object) -> tuple[VirtualCluster, list[float]]:
    # Two sequence slots per replica and eight sessions: the gate must hold requests.
    policy = {"flow_control": True, **policy}  # off by default: these tests are about it on
    cluster = VirtualCluster(ClusterConfig(replicas=2, engine={"max_num_seqs": 2}, policy=policy), "auto")
    result = cluster.run(AgentWorkload(SMALL, 7), [8], 30.0)
    assert result.steps[0].errors == 0
    return cluster, [r.queue_s for r in cluster.last_records]


def test_queue_in_virtual_time_holds_and_drains() -> None:
    cluster, waits = run()
    assert sum(1 for w in waits if w > 0) > 10
    assert all(r.ttfb_s is None or r.ttfb_s >= r.queue_s for r in cluster.last_records)
    flow = cluster.dispatch.flow
    assert flow.depth() == {"qwen3-4b": (0, 0)}
    assert all(w.inflight == 0 and w.inflight_tokens == 0 for w in cluster.workers)
    assert flow.admitted[("qwen3-4b", "after_wait", "normal")] > 10
    _, waits_again = run()
    assert waits_again == waits  # deterministic


def test_off_switch_never_queues() -> None:
    _, waits = run(flow_control=False)
    assert not any(waits)
