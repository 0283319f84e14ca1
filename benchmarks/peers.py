"""kvroute side by side with the Rust routers users can ``pip install``: vllm-router and sglang-router.

    python benchmarks/peers.py                              # the whole comparison (~20 min on 2 cores)
    python benchmarks/peers.py --steps 4,8 --duration 60 --routers kvroute:auto,vllm-router:cache_aware
    python benchmarks/peers.py --skip-quality               # router cost only
    python benchmarks/peers.py --plots-dir docs/img         # also write the plots the docs show
    python benchmarks/peers.py --routers flow --skip-cost --steps 24,32,48   # flow control's A/B
    python benchmarks/peers.py --routers 'kvroute:auto/flow+flow_control=true,sglang-router:cache_aware'

Each peer is installed once in its own virtual environment under ``--cache-dir``.  Every router —
kvroute (``kvroute serve``) and each peer policy — runs in its own process on 127.0.0.1 in front of
the same simulated replicas (``kvroute sim``'s replicas, in a process of their own, restarted for
every router so each starts cold), and is driven by the same seeded load from this process:

1. routing quality: ``kvroute.bench``'s agent sessions (shared ~3.5k-token system prompt, unique
   ~7k-token first message, 5 rounds of ~400 tokens, 256 output tokens) at each step of concurrent
   sessions — TTFB p50/p95, output tokens/min, prefix-cache hit share from the replicas' counters,
   and the share of follow-ups served by their session's previous replica, from the replicas' own
   placement log (peers do not say where they routed); or, with ``--rates``, the shared-prefix open
   loop (llm-d's benchmark shape: groups of requests sharing a long system prompt, no session id,
   Poisson arrivals at each rate) — TTFT p50/p95/p99, completed requests/s, hits, shed;
2. router cost: small chat requests (non-streaming, then streaming) from 64 concurrent clients
   against each router and directly against the replicas — requests/s and p50/p99 latency.

``--speed`` runs the replicas' model time that many times faster than the wall clock; every time
reported is in model seconds.  It scales the engine only: HTTP, routers and this load generator run
at their real speed on the machine's cores, which is what the router-cost part measures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from peers.cost import CostPlan, CostResult, median_of, run_cost
from peers.placements import Placement, attribute, placement_map
from peers.procs import Proc, fetch_json, start_sim, wait_serving
from peers.report import DIRECT, cost_markdown, quality_markdown, quality_tables, write_plots
from peers.routers import (
    DEFAULT_ROUTERS,
    KVROUTE,
    PEER_VERSIONS,
    Ports,
    RouterSpec,
    flow_routers,
    kvroute_config,
    kvroute_launch,
    parse_router,
    peer_launch,
)
from peers.venvs import DEFAULT_CACHE, ensure_peer
from peers.workload import KeyedWorkload

from kvroute.bench.http_ab import discover_model
from kvroute.bench.report import markdown_table
from kvroute.bench.results import BenchResult, PolicyRun, RequestRecord
from kvroute.bench.runner import HttpTarget, StepPlan, run_policy
from kvroute.bench.stats import stayed_share
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig, SharedPrefixWorkload
from kvroute.event_loop import run_event_loop
from kvroute.sync.local_redis import free_port

# Router cost is about the router's own work per request, so kvroute probes at its default rate
# there rather than once per (very short) model second.
COST_PROBE_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class Options:
    """Everything one run needs, from the command line."""

    preset: str
    replicas: int
    speed: float
    steps: tuple[int, ...]
    rates: tuple[float, ...]
    duration_s: float
    drain_s: float
    seed: int
    routers: tuple[RouterSpec, ...]
    cost_routers: tuple[RouterSpec, ...]
    cost_plan: CostPlan
    cost_speed: float
    cost_rounds: int
    probe_model_s: float
    sim_opts: tuple[str, ...]
    session_ids: bool
    think_time_s: float
    cache_dir: Path
    out: Path


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass(frozen=True, slots=True)
class RunningRouter:
    """Where a router answers, and the pid of its process (a supervisor's children and the Redis
    it started count as its descendants)."""

    url: str
    pid: int


@contextlib.asynccontextmanager
async def running_router(spec: RouterSpec, workers: Sequence[str], model: str, probe_interval_s: float,
                         venvs: dict[str, Path], log_dir: Path,
                         time_scale: float = 1.0) -> AsyncIterator[RunningRouter]:
    """Start ``spec``'s router in front of ``workers``; yields where to send requests.
    ``probe_interval_s`` (wall seconds) is how often kvroute scrapes the replicas' metrics;
    ``time_scale`` (the replicas' speed) turns kvroute's flow-control durations into wall seconds."""
    proc: Proc | None = None
    try:
        if spec.family == KVROUTE:
            config = log_dir / "kvroute.toml"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(kvroute_config(probe_interval_s, time_scale))
            launch = kvroute_launch(sys.executable, spec, workers, free_port(), config)
        else:
            ports = Ports(free_port(), free_port())
            launch = peer_launch(spec, venvs[spec.family], workers, ports, closed_port=free_port())
        proc = await Proc.start("router", launch.argv, log_dir, env=launch.env)
        await wait_serving(launch, proc, model)
        yield RunningRouter(launch.url, proc.process.pid)
    finally:
        if proc is not None:
            await proc.stop()


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-")


async def quality_run(spec: RouterSpec, opts: Options,
                      venvs: dict[str, Path]) -> tuple[PolicyRun, dict[str, Any]]:
    """Every step through ``spec`` on fresh replicas: the session steps, with stayed shares from the
    placement log, or the open loop's rates."""
    log_dir = opts.out / "logs" / "quality" / _slug(spec.label)
    sim, urls = await start_sim(log_dir, opts.preset, opts.replicas, opts.speed, opts.sim_opts)
    try:
        model = await discover_model(urls[0])
        captured: dict[float, Sequence[RequestRecord]] = {}

        def on_tick(load: float, elapsed: float, records: Sequence[RequestRecord]) -> None:
            captured[load] = records

        workload: KeyedWorkload | SharedPrefixWorkload
        if opts.rates:
            workload = SharedPrefixWorkload(seed=opts.seed)
        else:
            agents = AgentWorkload(AgentWorkloadConfig(think_time_s=opts.think_time_s), opts.seed)
            workload = KeyedWorkload(agents, opts.session_ids)
        plan = StepPlan(opts.steps, opts.duration_s, opts.drain_s, poll_interval_s=1.0, rates=opts.rates)
        # By default one probe per model second, as a fleet running in real time would be probed.
        async with running_router(spec, urls, model, opts.probe_model_s / opts.speed, venvs,
                                  log_dir, opts.speed) as router:
            # kvroute's own /metrics hold its queue's wait and shed counts; the peers' queues are
            # seen from the client only (their 429 / 503 / 408 answers).
            own = router.url + "/metrics" if spec.family == KVROUTE else None
            target = HttpTarget(router.url, model, tuple(u + "/metrics" for u in urls), "openai",
                                opts.speed, router_metrics_url=own)
            run = await run_policy(target, workload, spec.label, plan, on_tick)
        if opts.rates:  # no sessions: nothing stays or moves
            return run, {}
        raw = await fetch_json(urls[0] + "/peers/placements")
        where = placement_map(Placement(str(s), int(r), str(rep)) for s, r, rep in raw)  # type: ignore[union-attr]
        attribution: dict[str, Any] = {}
        for step in run.steps:
            records = list(captured.get(step.sessions, ()))
            attribution[str(step.sessions)] = dataclasses.asdict(attribute(records, where))
            step.stayed_pct = stayed_share(records)
        return run, attribution
    finally:
        await sim.stop()


@dataclass(frozen=True, slots=True)
class CostTarget:
    """Where one router-cost target sends requests, and whose CPU time counts as the router's."""

    label: str
    urls: list[str]
    router_pids: list[int]


async def cost_part(opts: Options, venvs: dict[str, Path],
                    on_round: Callable[[list[CostResult]], None]) -> None:
    """Every router of ``opts.cost_routers`` runs at once in front of one set of replicas (idle
    while another is measured), and the targets take turns in short windows, round after round in
    alternating order: whatever else the machine is doing then weighs on every target alike."""
    log_dir = opts.out / "logs" / "cost"
    sim, urls = await start_sim(log_dir, opts.preset, opts.replicas, opts.cost_speed, opts.sim_opts)
    try:
        model = await discover_model(urls[0])
        async with contextlib.AsyncExitStack() as stack:
            targets = [CostTarget(DIRECT, urls, [])]
            for spec in opts.cost_routers:
                router = await stack.enter_async_context(running_router(
                    spec, urls, model, COST_PROBE_INTERVAL_S, venvs, log_dir / _slug(spec.label),
                    opts.cost_speed))
                targets.append(CostTarget(spec.label, [router.url], [router.pid]))
            for r in range(opts.cost_rounds):
                results: list[CostResult] = []
                for target in targets if r % 2 == 0 else targets[::-1]:
                    meters = {"replicas": [sim.process.pid], "client": [os.getpid()]}
                    if target.router_pids:
                        meters["router"] = target.router_pids
                    for stream in (False, True):
                        results.append(await run_cost(target.label, target.urls, model, opts.cost_plan,
                                                      stream=stream, seed=opts.seed, meters=meters))
                        _cost_line(r, results[-1])
                on_round(results)
    finally:
        await sim.stop()


def _cost_line(round_index: int, c: CostResult) -> None:
    _log(f"cost round {round_index + 1} {c.label:<34} {'stream' if c.stream else 'whole ':<6} "
         f"{c.requests_per_s:8.0f} req/s  p50 {c.p50_ms or 0:7.1f} ms  p99 {c.p99_ms or 0:7.1f} ms  "
         f"errors {c.errors}  cpu/req: "
         + "  ".join(f"{g} {c.cpu_ms_per_request(g) or 0:.2f} ms" for g in c.cpu_s)
         + (f"  first: {c.first_error}" if c.first_error else ""))


def _step_line(label: str, run: PolicyRun, att: dict[str, Any]) -> None:
    for s in run.steps:
        if s.rate is not None:
            _log(f"{label:<34} {s.rate:g} req/s: {s.requests:>4} requests, TTFT p50 "
                 f"{s.ttfb_p50_s or 0:6.2f} s p95 {s.ttfb_p95_s or 0:6.2f} s, completed "
                 f"{s.completed_per_s or 0:5.2f} req/s, hits {s.prefix_hit_pct or 0:5.1f}%, "
                 f"preemptions {s.preemptions}, shed {s.shed}, errors {s.errors}")
            continue
        a = att.get(str(s.sessions), {})
        _log(f"{label:<34} {s.sessions:>3} sessions: {s.requests:>4} requests, TTFB p50 "
             f"{s.ttfb_p50_s or 0:6.2f} s p95 {s.ttfb_p95_s or 0:6.2f} s, "
             f"{s.output_tokens_per_min:7.0f} tok/min, "
             f"hits {s.prefix_hit_pct or 0:5.1f}%, stayed {s.stayed_pct or 0:5.1f}%, "
             f"preemptions {s.preemptions}, shed {s.shed}, errors {s.errors}, "
             f"log missing {a.get('missing', 0)} disagreed {a.get('disagreed', 0)}, "
             f"per replica {sorted(a.get('per_replica', {}).values(), reverse=True)}")


async def run_all(opts: Options) -> dict[str, Any]:
    """The whole comparison; returns what ``peers.json`` holds."""
    families = {s.family for s in (*opts.routers, *opts.cost_routers)} - {KVROUTE}
    venvs = {f: ensure_peer(opts.cache_dir, f, PEER_VERSIONS[f]) for f in sorted(families)}
    started = time.monotonic()
    meta: dict[str, Any] = {
        "preset": opts.preset, "replicas": opts.replicas, "speed": opts.speed, "steps": list(opts.steps),
        "rates": list(opts.rates),
        "duration_s": opts.duration_s, "drain_s": opts.drain_s, "seed": opts.seed,
        "kvroute_probe_interval_model_s": opts.probe_model_s, "session_ids": opts.session_ids,
        "cost_speed": opts.cost_speed, "cost_plan": dataclasses.asdict(opts.cost_plan),
        "workload": dataclasses.asdict(SharedPrefixWorkload(seed=opts.seed).config if opts.rates
                                       else AgentWorkloadConfig(think_time_s=opts.think_time_s)),
        "peer_versions": dict(PEER_VERSIONS),
        "routers": [{"label": s.label, "settings": dict(s.settings)} for s in opts.routers],
        "cpus": os.cpu_count(), "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    quality = BenchResult(dict(meta))
    attribution: dict[str, Any] = {}
    rounds: list[list[CostResult]] = []

    def document() -> dict[str, Any]:
        meta["wall_s"] = round(time.monotonic() - started, 1)
        return {"meta": meta, "quality": quality.as_dict(), "attribution": attribution,
                "cost": [dataclasses.asdict(c) for c in median_of(rounds)],
                "cost_rounds": [[dataclasses.asdict(c) for c in one] for one in rounds]}

    def checkpoint() -> None:
        # A long run on a shared machine can die half-way: keep what is measured so far.
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "peers.partial.json").write_bytes(orjson.dumps(document(), option=orjson.OPT_INDENT_2))

    for spec in opts.routers:
        t0 = time.monotonic()
        load_before = os.getloadavg()[0]
        run, att = await quality_run(spec, opts, venvs)
        # The replicas run in real time: other work on the machine slows them, so keep the load.
        att["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        quality.runs.append(run)
        attribution[spec.label] = att
        _step_line(spec.label, run, att)
        _log(f"{spec.label}: {time.monotonic() - t0:.0f} s, load average {att['load_average']}")
        checkpoint()
    if opts.cost_routers:
        def add_round(results: list[CostResult]) -> None:
            rounds.append(results)
            checkpoint()

        await cost_part(opts, venvs, add_round)
    return document()


def write_outputs(doc: dict[str, Any], out: Path, plots_dir: Path | None) -> str:
    """``peers.json``, ``peers.md`` (both tables) and the plots; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    quality = BenchResult.from_dict(doc["quality"])
    costs = [CostResult(**c) for c in doc["cost"]]
    policies = quality.policies()
    base = next((p for p in policies if p.startswith(KVROUTE)), policies[0] if policies else "")
    cost_base = next((c.label for c in costs if c.label.startswith(KVROUTE)), "")
    meta = doc["meta"]
    text = ""
    if quality.open_loop():
        text += "### Shared-prefix open loop\n\n" + markdown_table(quality) + "\n"
    elif quality.runs:
        text += f"### Routing quality (ratios to {base})\n\n" + quality_tables(quality, base) + "\n"
    if costs:
        text += f"### Router cost (ratios to {cost_base})\n\n" + cost_markdown(costs, cost_base) + "\n"
    if quality.runs and not quality.open_loop():
        text += "### Every step\n\n" + quality_markdown(quality, base)
    (out / "peers.md").write_text(text)
    plan = meta["cost_plan"]
    title = (f"Router cost: {plan['prompt_tokens']}-token prompts, {plan['max_tokens']} output tokens, "
             f"{plan['clients']} clients, {meta['cpus']} cores shared")
    # The plots are of session steps; the open loop has its table only.
    plotted = BenchResult(dict(meta)) if quality.open_loop() else quality
    write_plots(plotted, costs, plots_dir or out, cost_title=title)
    return text


def _routers(text: str, speed: float = 1.0) -> tuple[RouterSpec, ...]:
    if text in ("", "none"):
        return ()
    if text == "all":
        return DEFAULT_ROUTERS
    if text == "flow":
        return flow_routers(speed)
    return tuple(parse_router(t) for t in text.split(",") if t.strip())


def parse_args(argv: Sequence[str] | None = None) -> tuple[Options, Path | None, Path | None]:
    """Options from the command line, where to write the plots (None: the output directory), and
    the results file to report on instead of running (``--report``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="a4000-qwen3-4b")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--speed", type=float, default=10.0, help="model seconds per wall second (quality part)")
    p.add_argument("--steps", default="4,8,16,32", help="concurrent sessions per step")
    p.add_argument("--rates", default="",
                   help="quality part: the shared-prefix open loop at these arrival rates (requests per "
                        "model second) instead of agent sessions")
    p.add_argument("--duration", type=float, default=150.0, help="model seconds per step")
    p.add_argument("--drain", type=float, default=60.0,
                   help="model seconds to let a step's requests in flight finish")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routers", default="all",
                   help="quality part: FAMILY:POLICY[+NAME=VALUE...] list (settings: kvroute --set, "
                        "a peer's --NAME VALUE), 'all' (kvroute first), 'flow' (the flow-control A/B: "
                        "docs/flow-control.md) or 'none'")
    p.add_argument("--cost-routers", default="all,kvroute:auto:2",
                   help="cost part: as --routers, plus kvroute:auto:N for `kvroute serve --processes N`")
    p.add_argument("--cost-clients", type=int, default=64)
    p.add_argument("--cost-seconds", type=float, default=2.0,
                   help="measured wall seconds per target and mode")
    p.add_argument("--cost-warmup", type=float, default=0.5)
    p.add_argument("--cost-rounds", type=int, default=4,
                   help="rounds over all targets; each figure is the median over rounds")
    p.add_argument("--cost-speed", type=float, default=100.0,
                   help="replica speed in the cost part (fast, so the routers are what differs)")
    p.add_argument("--probe-interval", type=float, default=1.0,
                   help="kvroute's probe interval in the quality part, in model seconds")
    p.add_argument("--sim-opt", action="append", default=[], metavar="NAME=VALUE",
                   help="simulator setting for every replica, repeatable")
    p.add_argument("--think-time", type=float, default=AgentWorkloadConfig().think_time_s,
                   help="mean tool pause between a session's rounds, model seconds (0: none)")
    p.add_argument("--no-session-id", action="store_true",
                   help="quality part: send no session header (clients that do not name their session)")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-cost", action="store_true")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the peers' venvs live")
    p.add_argument("--out", type=Path, default=Path("peers-bench"))
    p.add_argument("--plots-dir", type=Path, default=None)
    p.add_argument("--report", type=Path, default=None, metavar="PEERS_JSON",
                   help="only rebuild the tables and plots of an earlier run (into --out)")
    a = p.parse_args(argv)
    try:
        steps = tuple(int(v) for v in a.steps.split(",") if v.strip())
        rates = tuple(float(v) for v in a.rates.split(",") if v.strip())
        cost_text = ",".join(t for t in a.cost_routers.split(",") if t != "all")
        cost_routers = ((DEFAULT_ROUTERS if "all" in a.cost_routers.split(",") else ())
                        + _routers(cost_text or "none"))
        opts = Options(
            preset=a.preset, replicas=a.replicas, speed=a.speed, steps=steps, rates=rates,
            duration_s=a.duration,
            drain_s=a.drain, seed=a.seed, routers=() if a.skip_quality else _routers(a.routers, a.speed),
            cost_routers=() if a.skip_cost else cost_routers,
            cost_plan=CostPlan(clients=a.cost_clients, duration_s=a.cost_seconds, warmup_s=a.cost_warmup),
            cost_speed=a.cost_speed, cost_rounds=max(1, a.cost_rounds),
            probe_model_s=a.probe_interval, sim_opts=tuple(a.sim_opt), session_ids=not a.no_session_id,
            think_time_s=a.think_time,
            cache_dir=a.cache_dir, out=a.out)
    except ValueError as exc:
        p.error(str(exc))
    if not steps or any(n < 1 for n in steps):
        p.error("--steps: positive integers")
    if any(not 0 < r < float("inf") for r in rates):
        p.error("--rates: positive requests per second")
    if a.speed <= 0 or a.cost_speed <= 0 or a.probe_interval <= 0 or a.duration <= 0 or a.drain < 0:
        p.error("--speed, --cost-speed, --probe-interval and --duration must be > 0, --drain >= 0")
    if a.think_time < 0:
        p.error("--think-time must be >= 0")
    return opts, a.plots_dir, a.report


def main(argv: Sequence[str] | None = None) -> None:
    """Run the comparison and print both tables."""
    opts, plots_dir, report = parse_args(argv)
    if report is not None:
        print(write_outputs(orjson.loads(report.read_bytes()), opts.out, plots_dir))
        return
    doc = run_event_loop(run_all(opts))
    print(write_outputs(doc, opts.out, plots_dir))
    _log(f"done in {doc['meta']['wall_s']:.0f} s; wrote {opts.out / 'peers.json'}, {opts.out / 'peers.md'}")


if __name__ == "__main__":
    main()
