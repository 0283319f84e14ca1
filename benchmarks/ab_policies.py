"""Every routing policy, or variants of one, through the virtual-time cluster: seed 2's five steps.

    python benchmarks/ab_policies.py                                  # all six policies
    python benchmarks/ab_policies.py --policies session,auto --steps 16,24
    python benchmarks/ab_policies.py --policies auto --sweep stay_tokens=0,512,4096
    python benchmarks/ab_policies.py --policies auto,vllm-sll --steps 4,8,16,32 --duration 150

A sweep runs the listed policies once per value of one ModelSettings field (the tunables of ``auto``,
the overflow threshold, ...), each on a fresh fleet, and labels the runs ``policy[field=value]``.
``vllm-sll`` is vllm-router's ``sticky_least_loaded`` (benchmarks/peer_policies.py).  Prints the
Markdown table docs/benchmarks.md shows; deterministic for a seed.
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from typing import Any

from peer_policies import cluster_for

from kvroute.bench.cluster import ClusterConfig
from kvroute.bench.report import markdown_table
from kvroute.bench.results import BenchResult
from kvroute.bench.workloads import AgentWorkload
from kvroute.routing.policies import BUILT_IN_NAMES


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=",".join(BUILT_IN_NAMES))
    parser.add_argument("--steps", default="4,8,16,24,32")
    parser.add_argument("--duration", type=float, default=180.0, help="virtual seconds per step")
    parser.add_argument("--preset", default="a4000-qwen3-4b")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--sweep", help="FIELD=V1,V2,... : one run per value of a ModelSettings field")
    args = parser.parse_args()

    policies = [p for p in args.policies.split(",") if p]
    steps = [int(s) for s in args.steps.split(",")]
    variants: list[tuple[str, dict[str, Any]]] = [("", {})]
    if args.sweep:
        name, _, values = args.sweep.partition("=")
        variants = [(f"[{name}={v}]", {name: _value(v)}) for v in values.split(",")]
    workload = AgentWorkload(seed=args.seed)
    result = BenchResult({"preset": args.preset, "replicas": args.replicas, "seed": args.seed,
                          "duration_s": args.duration, "steps": steps})
    started = time.perf_counter()
    for policy in policies:
        for suffix, fields in variants:
            cfg = ClusterConfig(args.preset, args.replicas, policy=fields,
                                scrape_interval_s=args.scrape_interval)
            result.runs.append(cluster_for(cfg, policy).run(workload, steps, args.duration,
                                                            label=policy + suffix))
            print(f"{policy + suffix}: done at {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(f"{args.replicas} x {args.preset}, seed {args.seed}, {args.duration:g} virtual s per step\n")
    print(markdown_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
