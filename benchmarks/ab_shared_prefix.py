"""The shared-prefix open loop (llm-d's benchmark shape) through the virtual-time cluster.

    python benchmarks/ab_shared_prefix.py                 # the previous defaults against today's
    python benchmarks/ab_shared_prefix.py --rates 1,2,3 --base-rate 2.0 --seeds 0-7
    python benchmarks/ab_shared_prefix.py --variants auto,auto/off --set flow_kv_fill=1.0

Groups of clients share a long system prompt each (``SharedPrefixConfig``: by default 14 groups of
6,000 tokens, half of 4 x a4000-qwen3-4b's KV) and ask short questions without a session id; the
requests arrive open-loop, Poisson at each step's rate (``--rates`` multiples of ``--base-rate``
requests/s), whatever the fleet does, and a request the router sheds is not retried.  A variant is
written as in ``ab_flow.py`` (``POLICY``, ``POLICY/default``, ``POLICY/before``, ``POLICY/off``,
``+FIELD=VALUE``).  Per step, over the
seeds, the mean and the spread (min-max) of: TTFT p50 / p95 (every request that got a first token,
its wait at the router's gate included), completed requests/s (ended inside the window / its
length), the engines' prefix-cache hit share, engine preemptions and requests shed.  Each (variant,
seed) runs on a fresh fleet, in parallel over ``--jobs`` processes; deterministic.
"""

from __future__ import annotations

import argparse
import ast
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ab_flow import cluster_config, parse_seeds, variant_settings
from peer_policies import cluster_for

from kvroute.bench.workloads import SharedPrefixConfig, SharedPrefixWorkload

Row = dict[str, float]
DEFAULT = SharedPrefixConfig()
FIGURES = (("p50", "TTFT p50 (s)", 2), ("p95", "TTFT p95 (s)", 2), ("done", "Completed req/s", 2),
           ("hits", "Prefix hits (%)", 1), ("preempt", "Preemptions", 0), ("shed", "Shed", 0))


def _run(job: tuple[str, dict[str, Any], int, list[float], float, SharedPrefixConfig]) -> list[Row]:
    variant, fields, seed, rates, duration, workload = job
    policy, settings = variant_settings(variant, fields)
    cluster = cluster_for(cluster_config(settings), policy)
    run = cluster.run_open(SharedPrefixWorkload(workload, seed), rates, duration)
    return [{"p50": step.ttfb_p50_s or 0.0, "p95": step.ttfb_p95_s or 0.0,
             "done": step.completed_per_s or 0.0, "hits": step.prefix_hit_pct or 0.0,
             "preempt": float(step.preemptions or 0), "shed": float(step.shed),
             "offered": step.requests / duration}
            for step in run.steps]


def cell(values: list[float], digits: int) -> str:
    """The mean of ``values`` and, over more than one, their range: ``mean (min-max)``; values
    that are NaN (a figure a seed lacks) are left out, and none at all reads ``nan``."""
    present = [v for v in values if not math.isnan(v)]
    if not present:
        return "nan"
    mean = statistics.mean(present)
    if len(present) == 1:
        return f"{mean:,.{digits}f}"
    return f"{mean:,.{digits}f} ({min(present):,.{digits}f}-{max(present):,.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="round-robin/before,prefix/before,auto/before,auto/default")
    parser.add_argument("--rates", default="1,2,3", help="multiples of --base-rate")
    parser.add_argument("--base-rate", type=float, default=2.0, help="requests/s at 1x")
    parser.add_argument("--seeds", default="0-3")
    parser.add_argument("--duration", type=float, default=180.0, help="virtual seconds per step")
    parser.add_argument("--groups", type=int, default=DEFAULT.groups)
    parser.add_argument("--system-tokens", type=int, default=DEFAULT.system_tokens)
    parser.add_argument("--questions", type=int, default=DEFAULT.questions)
    parser.add_argument("--question-tokens", type=int, default=DEFAULT.question_tokens)
    parser.add_argument("--output-tokens", type=int, default=DEFAULT.output_tokens)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="ModelSettings field for every variant (repeatable)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()

    fields = {name: ast.literal_eval(value) for name, _, value in (s.partition("=") for s in args.set)}
    variants = [v for v in args.variants.split(",") if v]
    seeds = parse_seeds(args.seeds)
    multiples = [float(m) for m in args.rates.split(",")]
    rates = [m * args.base_rate for m in multiples]
    workload = SharedPrefixConfig(args.groups, args.system_tokens, args.questions, args.question_tokens,
                                  args.output_tokens)
    jobs = [(v, fields, seed, rates, args.duration, workload) for v in variants for seed in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(_run, jobs))
    extra = f", {' '.join(args.set)}" if args.set else ""
    print(f"4 x a4000-qwen3-4b, shared prefix: {workload.groups} groups x {workload.system_tokens:,} "
          f"system tokens, {workload.questions} questions of {workload.question_tokens} tokens, "
          f"{workload.output_tokens} output tokens; base rate {args.base_rate:g} req/s, seeds "
          f"{args.seeds}, {args.duration:g} virtual s per step{extra}; mean (min-max) over seeds\n")
    print("| Rate | Variant | Offered req/s | " + " | ".join(h for _, h, _ in FIGURES) + " |")
    print("|---|---|---|" + "---|" * len(FIGURES))
    for k, (multiple, rate) in enumerate(zip(multiples, rates, strict=True)):
        for i, v in enumerate(variants):
            rows = [run[k] for run in runs[i * len(seeds):(i + 1) * len(seeds)]]
            cells = [cell([r[name] for r in rows], digits) for name, _, digits in FIGURES]
            offered = statistics.mean(r["offered"] for r in rows)
            print(f"| {multiple:g}x ({rate:g}/s) | {v} | {offered:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
