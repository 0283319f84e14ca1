"""A virtual run is a function of its inputs alone: what the runs before it leave in the process
(module state, caches, registries, counters) does not move it, nor does the interpreter it runs in
(the string hash seed, which orders sets of session ids).  The benchmarks run their seeds one after
another in one process and their figures are compared across commands (docs/benchmarks.md, "A
seed's figures are its own")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvroute
from kvroute.bench.cluster import ClusterConfig, VirtualCluster
from kvroute.bench.workloads import (
    AgentWorkload,
    AgentWorkloadConfig,
    SharedPrefixConfig,
    SharedPrefixWorkload,
)

# Two replicas of 4,800 tokens each: the second step's 20 agents beside 3 req/s of shared-prefix
# questions fill them, so saturation, the session door with both kinds served, and shedding engage
# (where a run builds the most state).
ENGINE = {"num_gpu_blocks": 300, "max_model_len": 4096}
SHARED = SharedPrefixConfig(groups=3, system_tokens=1200, questions=4, question_tokens=40, output_tokens=16)
AGENTS = AgentWorkloadConfig(system_tokens=800, first_tokens=1000, rounds=6, round_tokens=300,
                            max_output_tokens=64, min_output_tokens=16, think_time_s=1.0)


def run(seed: int = 0, policy: str = "auto", kv_events: bool = False) -> tuple[VirtualCluster, str]:
    """A small saturated mixed run, and everything it reports: each step's summary of each kind
    and the last step's request records."""
    cluster = VirtualCluster(ClusterConfig(replicas=2, engine=ENGINE, kv_events=kv_events), policy)
    agents, opened = cluster.run_mixed(AgentWorkload(AGENTS, seed), [10, 20],
                                       SharedPrefixWorkload(SHARED, seed), [1.0, 3.0], 40.0)
    return cluster, repr((agents.steps, opened.steps, cluster.last_records))


def test_the_run_reaches_the_door() -> None:
    cluster, _ = run()
    assert cluster.dispatch.saturation[cluster.model].engagements > 0
    assert cluster.dispatch.flow.counters.shed.get((cluster.model, "door_wait", "normal"), 0) > 0


def test_a_run_does_not_depend_on_the_runs_before_it_in_the_process() -> None:
    _, first = run()
    # Other seeds, exact cache state and other policies in between: each leaves whatever it leaves.
    others = [run(seed=1), run(seed=2, kv_events=True), run(policy="round-robin"), run(policy="p2c")]
    assert all(text != first for _, text in others)
    assert run()[1] == first


def test_a_run_is_the_same_in_a_fresh_interpreter_whatever_its_hash_seed() -> None:
    # The kvroute this process imported, whichever tree that is.
    env = {**os.environ, "PYTHONPATH": str(Path(kvroute.__file__).parents[1])}
    outs = [subprocess.run([sys.executable, __file__], env={**env, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, timeout=120, check=True).stdout
            for seed in ("1", "2")]
    assert outs[0] == outs[1] == run()[1] + "\n"


if __name__ == "__main__":
    print(run()[1])
