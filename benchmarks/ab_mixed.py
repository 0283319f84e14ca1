"""Agents and shared-prefix groups on one fleet: does either kind starve the other?

    python benchmarks/ab_mixed.py                                   # default vs before, round robin
    python benchmarks/ab_mixed.py --steps 8:1,16:1,16:2,24:2 --seeds 0-7
    python benchmarks/ab_mixed.py --variants auto/default,auto/default+kv_events=True

Each step runs SESSIONS closed-loop agent sessions (``ab_flow.py``'s workload, ``--think-time``
between turns, each with its session id) beside open-loop shared-prefix requests (``ab_shared_prefix.py``'s
workload, no session id) arriving at RATE x ``--base-rate`` requests/s, both on one fleet of
``--replicas`` x a4000-qwen3-4b through one router (``VirtualCluster.run_mixed``).  A step is written
``SESSIONS:RATE``.  A variant is written as in ``ab_flow.py``.

**A kind's share** is what it gets when the fleet is split in two and it has its half to itself:
the same variant runs each kind alone, with the same arrivals and sessions, on ``--replicas`` / 2
replicas.  A router serving both on the whole fleet should give each at least that (the issue's
goal: each within 20 % of its share, i.e. ``x share`` >= 0.8).  Per step, over the seeds, the mean
(and min-max) of: the agents' output tokens/min and its ratio to their share, their session
duration p50 and continuing-turn TTFB p95; the open loop's completed requests/s and its ratio to
its share, its TTFT p50 / p95; each kind's prefix hits (from the answers' usage) and requests
shed; the fleet's preemptions.  Each (variant, seed) runs on fresh fleets, in parallel over
``--jobs`` processes; deterministic.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ab_flow import cluster_config, parse_seeds, variant_settings
from ab_shared_prefix import cell
from peer_policies import cluster_for

from kvroute.bench.results import StepResult
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig, SharedPrefixWorkload

Row = dict[str, float]
# (job kind) a mixed run on the whole fleet, or one kind alone on half of it
KINDS = ("mixed", "agents", "shared")


def _value(x: float | None) -> float:
    return math.nan if x is None else x


def _agents_row(step: StepResult) -> Row:
    return {"tokens": step.output_tokens_per_min, "session50": _value(step.session_p50_s),
            "next95": _value(step.continuing_ttfb_p95_s), "a_hits": _value(step.prefix_hit_pct),
            "a_shed": float(step.shed), "preempt": float(step.preemptions or 0)}


def _shared_row(step: StepResult) -> Row:
    return {"done": _value(step.completed_per_s), "p50": _value(step.ttfb_p50_s),
            "p95": _value(step.ttfb_p95_s), "s_hits": _value(step.prefix_hit_pct),
            "s_shed": float(step.shed)}


def _run(job: tuple[str, str, dict[str, Any], int, list[int], list[float], float, int, float]) -> list[Row]:
    kind, variant, fields, seed, sessions, rates, think, replicas, duration = job
    policy, settings = variant_settings(variant, fields)
    config = dataclasses.replace(cluster_config(settings),
                                 replicas=replicas if kind == "mixed" else max(1, replicas // 2))
    cluster = cluster_for(config, policy)
    agents = AgentWorkload(AgentWorkloadConfig(think_time_s=think), seed)
    shared = SharedPrefixWorkload(seed=seed)
    if kind == "agents":
        return [_agents_row(s) for s in cluster.run(agents, sessions, duration).steps]
    if kind == "shared":
        return [_shared_row(s) for s in cluster.run_open(shared, rates, duration).steps]
    closed, opened = cluster.run_mixed(agents, sessions, shared, rates, duration)
    return [{**_agents_row(a), **_shared_row(o)}
            for a, o in zip(closed.steps, opened.steps, strict=True)]


def of(rows: list[Row], name: str) -> list[float]:
    """``name`` of each row."""
    return [r[name] for r in rows]


def ratio(name: str, mixed: list[Row], share: list[Row]) -> list[float]:
    """``name`` of each seed's mixed run over the same seed's share."""
    return [m[name] / s[name] if s[name] else math.nan for m, s in zip(mixed, share, strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="auto/default,auto/before,round-robin/before")
    parser.add_argument("--steps", default="8:1,16:1,16:2,24:2", help="SESSIONS:RATE pairs")
    parser.add_argument("--base-rate", type=float, default=1.0, help="shared-prefix requests/s at 1x")
    parser.add_argument("--think-time", type=float, default=3.0, help="agents' mean pause between turns (s)")
    parser.add_argument("--replicas", type=int, default=4, help="the whole fleet (even: it is split in two)")
    parser.add_argument("--seeds", default="0-3")
    parser.add_argument("--duration", type=float, default=180.0, help="virtual seconds per step")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="ModelSettings field for every variant (repeatable)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--per-seed", action="store_true",
                        help="also each seed's agents / shared x share per step (the goal holds per seed)")
    args = parser.parse_args()
    if args.replicas < 2 or args.replicas % 2:
        parser.error("--replicas must be even and at least 2")

    fields = {name: ast.literal_eval(value) for name, _, value in (s.partition("=") for s in args.set)}
    variants = [v for v in args.variants.split(",") if v]
    seeds = parse_seeds(args.seeds)
    pairs = [step.split(":") for step in args.steps.split(",")]
    sessions = [int(n) for n, _ in pairs]
    multiples = [float(m) for _, m in pairs]
    rates = [m * args.base_rate for m in multiples]
    jobs = [(kind, v, fields, seed, sessions, rates, args.think_time, args.replicas, args.duration)
            for v in variants for seed in seeds for kind in KINDS]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(_run, jobs))
    extra = f", {' '.join(args.set)}" if args.set else ""
    print(f"{args.replicas} x a4000-qwen3-4b; agents think {args.think_time:g} s; shared prefix base rate "
          f"{args.base_rate:g} req/s; share = the kind alone on {args.replicas // 2} replicas; seeds "
          f"{args.seeds}, {args.duration:g} virtual s per step{extra}; mean (min-max) over seeds\n")
    print("| Step | Variant | Agents tokens/min | × share | Session p50 (s) | Continuing TTFB p95 (s) "
          "| Shared completed req/s | × share | Shared TTFT p50 / p95 (s) | Hits agents / shared (%) "
          "| Shed agents / shared | Preempt. |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k, (n, multiple) in enumerate(zip(sessions, multiples, strict=True)):
        for i, v in enumerate(variants):
            base = i * len(seeds) * len(KINDS)
            mixed = [runs[base + j * len(KINDS)][k] for j in range(len(seeds))]
            alone_a = [runs[base + j * len(KINDS) + 1][k] for j in range(len(seeds))]
            alone_s = [runs[base + j * len(KINDS) + 2][k] for j in range(len(seeds))]

            print(f"| {n}:{multiple:g}x | {v} | {cell(of(mixed, 'tokens'), 0)} "
                  f"| {cell(ratio('tokens', mixed, alone_a), 2)} | {cell(of(mixed, 'session50'), 1)} "
                  f"| {cell(of(mixed, 'next95'), 2)} | {cell(of(mixed, 'done'), 2)} "
                  f"| {cell(ratio('done', mixed, alone_s), 2)} "
                  f"| {cell(of(mixed, 'p50'), 2)} / {cell(of(mixed, 'p95'), 2)} "
                  f"| {cell(of(mixed, 'a_hits'), 1)} / {cell(of(mixed, 's_hits'), 1)} "
                  f"| {cell(of(mixed, 'a_shed'), 0)} / {cell(of(mixed, 's_shed'), 0)} "
                  f"| {cell(of(mixed, 'preempt'), 0)} |")
    if args.per_seed:
        print("\nEach seed's agents / shared x share:\n")
        print("| Step | Variant | " + " | ".join(f"seed {seed}" for seed in seeds) + " | worst |")
        print("|---|---|" + "---|" * (len(seeds) + 1))
        for k, (n, multiple) in enumerate(zip(sessions, multiples, strict=True)):
            for i, v in enumerate(variants):
                base = i * len(seeds) * len(KINDS)
                each = [[runs[base + j * len(KINDS) + n][k] for j in range(len(seeds))]
                        for n in range(len(KINDS))]
                agents = ratio("tokens", each[0], each[1])
                shared = ratio("done", each[0], each[2])
                print(f"| {n}:{multiple:g}x | {v} | "
                      + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(agents, shared, strict=True))
                      + f" | {min(agents):.2f} / {min(shared):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
