"""The virtual-time A/B over several workload seeds: mean TTFB p50 / p95 and hit share per step.

    python benchmarks/ab_seeds.py                                     # least-loaded,session,auto; seeds 0-15
    python benchmarks/ab_seeds.py --think-time 0 --seeds 0-7          # strict closed loop
    python benchmarks/ab_seeds.py --policies auto --set backlog_weight=1 --set session_spread=0

One seed's table (benchmarks/ab_policies.py) moves by a few tenths of a second between seeds at
16-32 sessions, more than most differences between policies there; this averages them.  Each
(policy, seed) runs on a fresh fleet, in parallel over ``--jobs`` processes; deterministic.
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from kvroute.bench.results import StepResult
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig
from kvroute.sim.cluster import ClusterConfig, VirtualCluster


def _seeds(text: str) -> list[int]:
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def _run(job: tuple[str, dict[str, Any], int, float, list[int], float]) -> list[StepResult]:
    policy, fields, seed, think, steps, duration = job
    cluster = VirtualCluster(ClusterConfig(policy=fields), policy)
    workload = AgentWorkload(AgentWorkloadConfig(think_time_s=think), seed)
    return cluster.run(workload, steps, duration).steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="least-loaded,session,auto")
    parser.add_argument("--seeds", default="0-15", help="e.g. 0-15 or 0,3,5")
    parser.add_argument("--think-time", type=float, default=3.0, help="mean pause between rounds (s)")
    parser.add_argument("--steps", default="4,8,16,24,32")
    parser.add_argument("--duration", type=float, default=180.0, help="virtual seconds per step")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="ModelPolicy field for every policy (repeatable)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()

    fields = {name: ast.literal_eval(value) for name, _, value in (s.partition("=") for s in args.set)}
    policies = [p for p in args.policies.split(",") if p]
    seeds, steps = _seeds(args.seeds), [int(s) for s in args.steps.split(",")]
    jobs = [(p, fields, seed, args.think_time, steps, args.duration) for p in policies for seed in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(_run, jobs))
    print(f"4 x a4000-qwen3-4b, seeds {args.seeds}, think time {args.think_time:g} s, "
          f"{args.duration:g} virtual s per step; mean TTFB p50 / p95 (s), prefix hits\n")
    print("| Sessions | " + " | ".join(policies) + " |")
    print("|---|" + "---|" * len(policies))
    for k, n in enumerate(steps):
        cells = []
        for i in range(len(policies)):
            rows = [run[k] for run in runs[i * len(seeds):(i + 1) * len(seeds)]]
            p50 = statistics.mean(r.ttfb_p50_s or 0.0 for r in rows)
            p95 = statistics.mean(r.ttfb_p95_s or 0.0 for r in rows)
            hits = statistics.mean(r.prefix_hit_pct or 0.0 for r in rows)
            cells.append(f"{p50:.2f} / {p95:.2f}, {hits:.0f} %")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
