"""Flow control on and off, through the virtual-time cluster, averaged over workload seeds.

    python benchmarks/ab_flow.py                          # auto on/off, least-loaded; seeds 0-7
    python benchmarks/ab_flow.py --variants auto,auto/off --steps 24,32,48 --seeds 0-3
    python benchmarks/ab_flow.py --variants auto,auto/off --set flow_kv_fill=1.0
    python benchmarks/ab_flow.py --variants auto/sessions,auto,auto/off,least-loaded/off --steps 24,32,48

A variant is ``POLICY`` (``flow_control = true``, the rest as ``--set``), ``POLICY/default``
(every setting at its default: flow control and fleet placement engage while the fleet is
saturated, docs/saturation.md), ``POLICY/before`` (the previous release's defaults: flow control
and session admission off, placement by predicted TTFT even when saturated), ``POLICY/off``
(``flow_control = false``), ``POLICY/sessions`` (``flow_session_admission = true``) or
``POLICY/footprint`` (session admission with the first version's rule,
``flow_session_rule = "footprint"``), optionally followed by ``+FIELD=VALUE`` settings of that
variant alone (``auto/sessions+flow_session_fill=1.2``; ``+kv_events=True``: the engines publish
KV events, so the router routes on their exact cache state; ``+client_header=False``: the agents
send no ``x-kvroute-client``).  ``--think-time 0`` is the closed loop
with no pause between rounds.  Per
step, the mean over seeds of: output tokens/min, TTFB p50 / p95, prefix hits, engine
preemptions, the router-queue wait p50 / p95 (over every routed request, zero for those
admitted at once), the requests shed, and per session: its duration p50 / p95 (first request
sent to last answer, over the sessions that finished), the first turn's TTFB p95 (its gate wait
included) and the continuing turns' TTFB p95 (``nan`` where no seed finished a session inside
the step: with 180 s steps a six-round session at overload may not fit).  Each (variant, seed)
runs on a fresh fleet, in parallel over ``--jobs`` processes; deterministic.
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

from kvroute.bench.cluster import ClusterConfig
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig
from kvroute.quantiles import percentile

Row = dict[str, float]


def parse_seeds(text: str) -> list[int]:
    """``0-7`` or ``0,3,5``: the workload seeds to run."""
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(s) for s in text.split(",")]


def variant_settings(variant: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The policy of ``variant`` and its ModelSettings settings (``fields`` for every variant, then
    the variant's switch and its own ``+FIELD=VALUE``; the module docstring lists the switches)."""
    name, *extra = variant.split("+")
    policy, _, switch = name.partition("/")
    settings = dict(fields)
    if switch == "before":  # the previous release's defaults: nothing engages at saturation
        settings.update(flow_control=False, flow_session_admission=False, fleet_full_placement="request")
    elif switch != "default":
        settings["flow_control"] = switch != "off"
    if switch in ("sessions", "footprint"):
        settings["flow_session_admission"] = True
    if switch == "footprint":
        settings["flow_session_rule"] = "footprint"
    settings.update({k: ast.literal_eval(v) for k, _, v in (e.partition("=") for e in extra)})
    return policy, settings


def cluster_config(settings: dict[str, Any]) -> ClusterConfig:
    """The virtual fleet for a variant's settings: ``+kv_events=True`` (a fleet whose engines
    publish KV events, so the router is in exact mode) and ``+client_header=False`` (agents that do
    not name themselves with x-kvroute-client) are the cluster's, the rest the policy's."""
    policy = dict(settings)
    kv_events = bool(policy.pop("kv_events", False))
    client_header = bool(policy.pop("client_header", True))
    return ClusterConfig(policy=policy, kv_events=kv_events, client_header=client_header)


def _or_nan(value: float | None) -> float:
    # A step without a finished session has no session figures; NaN keeps it out of the mean.
    return math.nan if value is None else value


def _run(job: tuple[str, dict[str, Any], int, float, list[int], float]) -> list[Row]:
    variant, fields, seed, think, steps, duration = job
    policy, settings = variant_settings(variant, fields)
    cluster = cluster_for(cluster_config(settings), policy)
    block = cluster.config.engine_config().block_size
    records_by_step: list[list[Any]] = []
    run = cluster.run(AgentWorkload(AgentWorkloadConfig(think_time_s=think), seed), steps, duration,
                      on_step=lambda _: records_by_step.append(list(cluster.last_records)))
    rows: list[Row] = []
    for step, records in zip(run.steps, records_by_step, strict=True):
        waits = [r.queue_s for r in records if r.error is None and r.worker is not None]
        rows.append({
            "tokens": step.output_tokens_per_min, "p50": step.ttfb_p50_s or 0.0,
            "p95": step.ttfb_p95_s or 0.0, "hits": step.prefix_hit_pct or 0.0,
            "preempt": float(step.preemptions or 0),
            "wait50": percentile(waits, 50) or 0.0, "wait95": percentile(waits, 95) or 0.0,
            "shed": float(step.shed),
            "session50": _or_nan(step.session_p50_s), "session95": _or_nan(step.session_p95_s),
            "first95": _or_nan(step.first_ttfb_p95_s), "next95": _or_nan(step.continuing_ttfb_p95_s),
            **_prediction(records, block),
        })
    return rows


def _prediction(records: list[Any], block: int) -> Row:
    """How well the router predicted each finished request's cached prompt tokens (what its index
    said the chosen worker held) against what the engine reported: the share within one engine
    block, and reported / predicted over all of them."""
    pairs = [(r.predicted_cached, r.cached_tokens) for r in records
             if r.error is None and r.end_s is not None and r.predicted_cached is not None]
    if not pairs:
        return {"within": math.nan, "realised": math.nan}
    within = sum(1 for p, c in pairs if abs(p - c) <= block) / len(pairs)
    predicted = sum(p for p, _ in pairs)
    realised = sum(c for _, c in pairs) / predicted if predicted else math.nan
    return {"within": 100.0 * within, "realised": realised}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="auto,auto/off,least-loaded/off")
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--think-time", type=float, default=3.0, help="mean pause between rounds (s)")
    parser.add_argument("--steps", default="4,8,16,24,32,48")
    parser.add_argument("--duration", type=float, default=180.0, help="virtual seconds per step")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="ModelSettings field for every variant (repeatable)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--prediction", action="store_true",
                        help="also print how well the router predicted each request's cached tokens")
    parser.add_argument("--spread", action="store_true",
                        help="also print each cell's standard deviation over the seeds")
    args = parser.parse_args()

    fields = {name: ast.literal_eval(value) for name, _, value in (s.partition("=") for s in args.set)}
    variants = [v for v in args.variants.split(",") if v]
    seeds, steps = parse_seeds(args.seeds), [int(s) for s in args.steps.split(",")]
    jobs = [(v, fields, seed, args.think_time, steps, args.duration) for v in variants for seed in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(_run, jobs))
    extra = f", {' '.join(args.set)}" if args.set else ""
    print(f"4 x a4000-qwen3-4b, seeds {args.seeds}, think time {args.think_time:g} s, "
          f"{args.duration:g} virtual s per step{extra}; means over seeds\n")
    print("| Sessions | Variant | Output tokens/min | TTFB p50 (s) | TTFB p95 (s) | Prefix hits (%) "
          "| Preemptions | Queue wait p50 / p95 (s) | Shed | Session p50 / p95 (s) "
          "| First-turn TTFB p95 (s) | Continuing TTFB p95 (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k, n in enumerate(steps):
        for i, v in enumerate(variants):
            rows = [run[k] for run in runs[i * len(seeds):(i + 1) * len(seeds)]]

            def mean(name: str, rows: list[Row] = rows) -> float:
                # Over the seeds that have the figure (session figures can be missing).
                present = [r[name] for r in rows if not math.isnan(r[name])]
                return statistics.mean(present) if present else math.nan

            print(f"| {n} | {v} | {mean('tokens'):,.0f} | {mean('p50'):.2f} | {mean('p95'):.2f} "
                  f"| {mean('hits'):.1f} | {mean('preempt'):.0f} | {mean('wait50'):.2f} / "
                  f"{mean('wait95'):.2f} | {mean('shed'):.1f} | {mean('session50'):.1f} / "
                  f"{mean('session95'):.1f} | {mean('first95'):.2f} | {mean('next95'):.2f} |")
    if args.prediction:
        print("\nThe router's predicted cached tokens against the engine's report, per finished request:\n")
        print("| Sessions | Variant | Within one block (%) | Reported / predicted |")
        print("|---|---|---|---|")
        for k, n in enumerate(steps):
            for i, v in enumerate(variants):
                rows = [run[k] for run in runs[i * len(seeds):(i + 1) * len(seeds)]]
                within = statistics.mean(r["within"] for r in rows)
                realised = statistics.mean(r["realised"] for r in rows)
                print(f"| {n} | {v} | {within:.1f} | {realised:.2f} |")
    if args.spread and len(seeds) > 1:
        print("\nStandard deviation over the seeds:\n")
        print("| Sessions | Variant | Output tokens/min | TTFB p50 (s) | TTFB p95 (s) "
              "| Prefix hits (%) |")
        print("|---|---|---|---|---|---|")
        for k, n in enumerate(steps):
            for i, v in enumerate(variants):
                rows = [run[k] for run in runs[i * len(seeds):(i + 1) * len(seeds)]]

                def sd(name: str, rows: list[Row] = rows) -> float:
                    return statistics.stdev(r[name] for r in rows)

                print(f"| {n} | {v} | {sd('tokens'):,.0f} | {sd('p50'):.2f} | {sd('p95'):.2f} "
                      f"| {sd('hits'):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
