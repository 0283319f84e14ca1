"""The virtual-time A/B over several workload seeds: mean TTFB p50 / p95 and hit share per step.

    python benchmarks/ab_seeds.py                                     # least-loaded,session,auto; seeds 0-15
    python benchmarks/ab_seeds.py --think-time 0 --seeds 0-7          # strict closed loop
    python benchmarks/ab_seeds.py --policies auto --set backlog_weight=1 --set session_spread=0
    python benchmarks/ab_seeds.py --policies auto,vllm-sll --versus vllm-sll --steps 4,8,16,32
    python benchmarks/ab_seeds.py --policies auto,vllm-sll --versus vllm-sll --router-clock 0.1
    python benchmarks/ab_seeds.py --policies auto,auto/no-id --versus auto --steps 4,8,16

One seed's table (benchmarks/ab_policies.py) moves by a few tenths of a second between seeds at
16-32 sessions, more than most differences between policies there; this averages them.  Each
(policy, seed) runs on a fresh fleet, in parallel over ``--jobs`` processes; deterministic.
``vllm-sll`` is vllm-router's ``sticky_least_loaded`` (benchmarks/peer_policies.py).  ``--versus P``
adds, per step, each other policy's paired difference to P over the seeds (mean ± standard error,
and in how many seeds it was lower), which is what tells a real gap from seed noise; ``--per-seed``
prints every seed's p50 / p95.  ``--router-clock 0.1`` runs the router's clock (and the TTFTs it
is told) at a tenth of the engines' model time, which is what kvroute sees behind replicas simulated
at ``--speed 10`` over HTTP (benchmarks/peers.py): engines ten times faster than its clock.
A policy written ``P/no-id`` runs ``P`` on the same sessions sent without any session header (the
router then derives each conversation's identity from its prompt).
"""

from __future__ import annotations

import argparse
import ast
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from peer_policies import cluster_for
from peers.workload import KeyedWorkload

from kvroute.bench.cluster import EPOCH, ClusterConfig, VirtualCluster
from kvroute.bench.results import StepResult
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig


def _seeds(text: str) -> list[int]:
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def _slow_router_clock(cluster: VirtualCluster, scale: float) -> None:
    """The router's clock, and every TTFT it is told, at ``scale`` times the engines' model time."""
    scheduler = cluster.scheduler
    scheduler._clock = lambda: EPOCH + cluster.now * scale
    finished = scheduler.on_finished

    def on_finished(worker_id: str, *, prompt_tokens: int | None = None,
                    cached_tokens: int | None = None, ttft_s: float | None = None) -> None:
        finished(worker_id, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                 ttft_s=None if ttft_s is None else ttft_s * scale)

    scheduler.on_finished = on_finished  # type: ignore[method-assign]


def _run(job: tuple[str, dict[str, Any], int, float, list[int], float, float]) -> list[StepResult]:
    policy, fields, seed, think, steps, duration, clock = job
    name, _, variant = policy.partition("/")
    cluster = cluster_for(ClusterConfig(policy=fields), name)
    if clock != 1.0:
        _slow_router_clock(cluster, clock)
    agents = AgentWorkload(AgentWorkloadConfig(think_time_s=think), seed)
    workload = KeyedWorkload(agents, with_ids=False) if variant == "no-id" else agents
    return cluster.run(workload, steps, duration).steps


def _diff(a: list[float], b: list[float]) -> str:
    d = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else 0.0
    lower = sum(1 for x in d if x < 0)
    return f"{statistics.mean(d):+.3f} ± {se:.3f} ({lower}/{len(d)} lower)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="least-loaded,session,auto")
    parser.add_argument("--seeds", default="0-15", help="e.g. 0-15 or 0,3,5")
    parser.add_argument("--think-time", type=float, default=3.0, help="mean pause between rounds (s)")
    parser.add_argument("--steps", default="4,8,16,24,32")
    parser.add_argument("--duration", type=float, default=180.0, help="virtual seconds per step")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="ModelSettings field for every kvroute policy (repeatable)")
    parser.add_argument("--versus", help="policy to compare every other one with, seed by seed")
    parser.add_argument("--per-seed", action="store_true", help="print every seed's p50 / p95")
    parser.add_argument("--router-clock", type=float, default=1.0,
                        help="router clock seconds per model second (0.1: as behind --speed 10)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()

    fields = {name: ast.literal_eval(value) for name, _, value in (s.partition("=") for s in args.set)}
    policies = [p for p in args.policies.split(",") if p]
    if args.versus is not None and args.versus not in policies:
        parser.error("--versus must be one of --policies")
    if any(p.partition("/")[2] not in ("", "no-id") for p in policies):
        parser.error("a policy's only variant is P/no-id")
    seeds, steps = _seeds(args.seeds), [int(s) for s in args.steps.split(",")]
    if not args.router_clock > 0:
        parser.error("--router-clock must be positive")
    jobs = [(p, fields, seed, args.think_time, steps, args.duration, args.router_clock)
            for p in policies for seed in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(_run, jobs))
    by_policy = {p: runs[i * len(seeds):(i + 1) * len(seeds)] for i, p in enumerate(policies)}
    clock = f", router clock x{args.router_clock:g}" if args.router_clock != 1.0 else ""
    print(f"4 x a4000-qwen3-4b, seeds {args.seeds}, think time {args.think_time:g} s, "
          f"{args.duration:g} virtual s per step{clock}; mean TTFB p50 / p95 (s), prefix hits, "
          f"follow-ups on their replica\n")
    print("| Sessions | " + " | ".join(policies) + " |")
    print("|---|" + "---|" * len(policies))
    for k, n in enumerate(steps):
        cells = []
        for p in policies:
            rows = [run[k] for run in by_policy[p]]
            p50 = statistics.mean(r.ttfb_p50_s or 0.0 for r in rows)
            p95 = statistics.mean(r.ttfb_p95_s or 0.0 for r in rows)
            hits = statistics.mean(r.prefix_hit_pct or 0.0 for r in rows)
            stayed = statistics.mean(r.stayed_pct or 0.0 for r in rows)
            cells.append(f"{p50:.2f} / {p95:.2f}, {hits:.0f} %, {stayed:.0f} %")
        print(f"| {n} | " + " | ".join(cells) + " |")
    if args.versus is not None:
        base = by_policy[args.versus]
        for p in policies:
            if p == args.versus:
                continue
            print(f"\n{p} − {args.versus}, paired over seeds: p50 | p95 (s)\n")
            for k, n in enumerate(steps):
                mine, theirs = [run[k] for run in by_policy[p]], [run[k] for run in base]
                p50 = _diff([r.ttfb_p50_s or 0.0 for r in mine], [r.ttfb_p50_s or 0.0 for r in theirs])
                p95 = _diff([r.ttfb_p95_s or 0.0 for r in mine], [r.ttfb_p95_s or 0.0 for r in theirs])
                print(f"  {n:>3}: {p50} | {p95}")
    if args.per_seed:
        for p in policies:
            print(f"\n{p}, per seed p50/p95 (s):")
            for seed, run in zip(seeds, by_policy[p], strict=True):
                print(f"  seed {seed:>2}: " + "  ".join(
                    f"{s.sessions}: {s.ttfb_p50_s or 0:.2f}/{s.ttfb_p95_s or 0:.2f}" for s in run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
