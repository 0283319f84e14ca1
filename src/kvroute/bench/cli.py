"""``kvroute bench`` and ``kvroute demo``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kvroute.bench.http_ab import BenchSetupError, HttpBenchSpec, SimSpec, run_http_bench, run_http_chat
from kvroute.bench.report import chat_markdown, terminal_table, text_table, title, workload_line, write_report
from kvroute.bench.results import BenchResult, RequestRecord, StepResult
from kvroute.bench.runner import StepCallback, StepPlan
from kvroute.bench.trace import TraceError, TraceWorkload, write_trace
from kvroute.bench.workloads import (
    AgentWorkload,
    AgentWorkloadConfig,
    GrowingChatConfig,
    SharedPrefixConfig,
    SharedPrefixWorkload,
    Workload,
    growing_chat,
)
from kvroute.quantiles import percentile


def _int_list(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}",
                                 param_hint=name) from None
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter("expected positive integers", param_hint=name)
    return values


def _rate_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}",
                                 param_hint="--rates") from None
    if not values or any(not 0.0 < v < float("inf") for v in values):
        raise typer.BadParameter("expected positive requests per second", param_hint="--rates")
    return values


def _policies(text: str) -> list[str]:
    from kvroute.routing.config import policy_names

    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in policy_names()]
    if not names or unknown:
        raise typer.BadParameter(f"unknown policy {', '.join(unknown) or '(none)'}; "
                                 f"choose from {', '.join(policy_names())}", param_hint="--policies")
    return names


def _overrides(items: Sequence[str], name: str) -> dict[str, Any]:
    """``NAME=VALUE`` pairs; values parsed as int, float, true/false or kept as text."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"expected NAME=VALUE, got {item!r}", param_hint=name)
        value: Any = raw.strip()
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
        if raw.strip().lower() in ("true", "false"):
            value = raw.strip().lower() == "true"
        out[key.strip().replace("-", "_")] = value
    return out


class _Progress:
    """Rich progress bars: one per policy and step, advancing with the step's clock; ``unit`` names
    the steps' load ("sessions", or "req/s" for an open loop)."""

    def __init__(self, console: Console, duration_s: float, enabled: bool, unit: str = "sessions") -> None:
        self.duration_s = duration_s
        self.unit = unit
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(), console=console, disable=not enabled, transient=False,
        )
        self._tasks: dict[tuple[str, float], TaskID] = {}

    def _task(self, policy: str, load: float) -> TaskID:
        key = (policy, load)
        if key not in self._tasks:
            self._tasks[key] = self.progress.add_task(f"{policy:>12} · {load:>3g} {self.unit}",
                                                      total=self.duration_s, stats="")
        return self._tasks[key]

    def for_policy(self, policy: str) -> StepCallback:
        def tick(load: float, elapsed: float, records: Sequence[RequestRecord]) -> None:
            task = self._task(policy, load)
            ttfbs = [r.ttfb_s for r in records if r.ttfb_s is not None]
            p50 = percentile(ttfbs, 50)
            stats = f"{len(records):>5} requests" + (f" · TTFB p50 {p50:.2f} s" if p50 is not None else "")
            self.progress.update(task, completed=elapsed, stats=stats)
        return tick

    def step_done(self, step: StepResult) -> None:
        task = self._task(step.policy, step.load)
        p50 = step.ttfb_p50_s
        stats = f"{step.requests:>5} requests" + (f" · TTFB p50 {p50:.2f} s" if p50 is not None else "")
        self.progress.update(task, completed=self.duration_s, stats=stats)


def print_result(console: Console, result: BenchResult, out: Path, plots: bool, *,
                 describe: bool = True) -> None:
    """The result's table as the terminal's width allows (Markdown when not a terminal), the
    workload in words (``describe``: unless already printed), then the files written."""
    described = workload_line(result) if describe else None
    if console.is_terminal:
        console.print(terminal_table(result, console.width))
        if described:
            console.print(described, markup=False, highlight=False)
    else:
        text = f"{title(result)}\n\n" + (f"{described}\n\n" if described else "") + text_table(result)
        console.print(text, markup=False, highlight=False)
    written = write_report(result, out, plots=plots)
    console.print(f"[dim]{title(result)}; wrote {', '.join(str(p) for p in written)}[/dim]")


def _agent_workload(trace: Path | None, seed: int, cfg: AgentWorkloadConfig) -> Workload:
    if trace is None:
        return AgentWorkload(cfg, seed)
    try:
        return TraceWorkload.from_path(trace)
    except (OSError, TraceError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--trace") from None


def bench(
    target: Annotated[str | None, typer.Option(
        help="Measure this endpoint as it is (a router or engine already running).")] = None,
    replica: Annotated[list[str] | None, typer.Option(
        help="Replica URL (repeatable): a kvroute router per policy is started in front.")] = None,
    sim: Annotated[str, typer.Option(
        help="Preset of the simulated replicas started when neither --target nor --replica is given.")]
        = "a4000-qwen3-4b",
    replicas: Annotated[int, typer.Option(min=1, help="Simulated replicas.")] = 4,
    speed: Annotated[float, typer.Option(min=0.01, help="Simulated seconds per wall second.")] = 1.0,
    sim_opt: Annotated[list[str] | None, typer.Option(
        help="Simulator setting NAME=VALUE (engine, cost or reply fields), repeatable.")] = None,
    virtual: Annotated[bool, typer.Option(
        "--virtual", help="Virtual time: engine models + the real scheduler, deterministic.")] = False,
    policies: Annotated[str, typer.Option(help="Comma-separated router policies to compare.")]
        = "least-loaded,auto",
    policy_opt: Annotated[list[str] | None, typer.Option(
        help="ModelSettings field NAME=VALUE for every policy (e.g. overflow=4), repeatable.")] = None,
    steps: Annotated[str, typer.Option(help="Concurrent sessions per step.")] = "4,8,16,24,32",
    duration: Annotated[float, typer.Option(
        min=0.1, help="Seconds per step (simulated seconds with --speed or --virtual).")] = 180.0,
    drain_timeout: Annotated[float, typer.Option(
        min=0.0, help="After a step's window, wait this long for requests in flight.")] = 120.0,
    poll_interval: Annotated[float, typer.Option(min=0.01, help="Seconds between busy-replica polls.")] = 1.0,
    scrape_interval: Annotated[float, typer.Option(
        min=0.01, help="The router's probe interval (how stale its load view is), simulated seconds.")] = 1.0,
    seed: Annotated[int, typer.Option(help="Workload seed: the same seed, the same prompts.")] = 0,
    workload: Annotated[str, typer.Option(
        help="agent (agent sessions), shared-prefix (open loop, llm-d's shape: give --rates) "
             "or chat (the growing-chat table).")] = "agent",
    rates: Annotated[str | None, typer.Option(
        help="Open loop (--workload shared-prefix): arrival rate per step, requests/s "
             "(simulated seconds with --speed or --virtual), instead of --steps.")] = None,
    trace: Annotated[Path | None, typer.Option(help="Replay sessions from a JSONL trace.")] = None,
    write_trace_to: Annotated[Path | None, typer.Option(
        "--write-trace", help="Write --trace-sessions sessions of the workload to this JSONL file and exit.")]
        = None,
    trace_sessions: Annotated[int, typer.Option(min=1, help="Sessions to write with --write-trace.")] = 100,
    system_tokens: Annotated[int | None, typer.Option(
        min=0, help="Shared system prompt (tokens; default 3500 agent, 6000 shared-prefix).")] = None,
    first_tokens: Annotated[int, typer.Option(min=0, help="First message, unique per session.")] = 7000,
    rounds: Annotated[int, typer.Option(min=0, help="Follow-up rounds after the first message.")] = 5,
    round_tokens: Annotated[int, typer.Option(min=0, help="New tokens per follow-up round.")] = 400,
    max_output_tokens: Annotated[int, typer.Option(min=1, help="Longest answer per round.")] = 256,
    min_output_tokens: Annotated[int | None, typer.Option(
        min=1, help="Shortest answer per round (default: the longest).")] = None,
    system_prompts: Annotated[int, typer.Option(min=1, help="Distinct system prompts sessions share.")] = 1,
    jitter: Annotated[float, typer.Option(min=0.0, max=0.99, help="Relative size variation.")] = 0.1,
    think_time: Annotated[float, typer.Option(
        min=0.0, help="Mean pause between a response and the session's next request (s).")] = 3.0,
    groups: Annotated[int, typer.Option(
        min=1, help="Shared prefix: groups, each with its own system prompt.")] = 14,
    questions: Annotated[int, typer.Option(min=1, help="Shared prefix: questions per group.")] = 32,
    question_tokens: Annotated[int, typer.Option(min=1, help="Shared prefix: tokens per question.")] = 150,
    output_tokens: Annotated[int, typer.Option(min=1, help="Shared prefix: tokens per answer.")] = 200,
    chat_tokens: Annotated[int, typer.Option(min=1, help="Growing chat: first prompt (tokens).")] = 5600,
    chat_turn_tokens: Annotated[int, typer.Option(min=2, help="Growing chat: tokens per turn.")] = 190,
    chat_turns: Annotated[int, typer.Option(min=1, help="Growing chat: turns.")] = 5,
    api: Annotated[str, typer.Option(help="openai (/v1/chat/completions) or anthropic (/v1/messages).")]
        = "openai",
    model: Annotated[str | None, typer.Option(help="Model name (default: the first the target lists).")]
        = None,
    metrics_url: Annotated[list[str] | None, typer.Option(
        help="With --target: a replica's /metrics URL for hit share and busy replicas, repeatable.")] = None,
    time_scale: Annotated[float, typer.Option(
        min=0.001, help="With --target/--replica: the target's seconds per wall second (its --speed).")]
        = 1.0,
    out: Annotated[Path, typer.Option(help="Directory for results.json, results.md and plots.")]
        = Path("kvroute-bench"),
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Write PNG plots.")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bars.")] = False,
) -> None:
    """Benchmark of router policies: closed-loop agent sessions, the open-loop shared-prefix
    workload, or a growing chat."""
    console = Console()
    if api not in ("openai", "anthropic"):
        raise typer.BadParameter("expected openai or anthropic", param_hint="--api")
    if workload not in ("agent", "shared-prefix", "chat"):
        raise typer.BadParameter("expected agent, shared-prefix or chat", param_hint="--workload")
    if (workload == "shared-prefix") != (rates is not None):
        raise typer.BadParameter("--rates goes with --workload shared-prefix (and it needs them)",
                                 param_hint="--rates")
    if target is not None and replica:
        raise typer.BadParameter("give --target or --replica, not both", param_hint="--target")
    try:
        agent_system = AgentWorkloadConfig().system_tokens if system_tokens is None else system_tokens
        agent_cfg = AgentWorkloadConfig(agent_system, first_tokens, rounds, round_tokens, max_output_tokens,
                                        min_output_tokens or max_output_tokens, system_prompts, jitter,
                                        think_time)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if write_trace_to is not None:
        gen = AgentWorkload(agent_cfg, seed)
        lines = write_trace(write_trace_to, (gen.session(i) for i in range(trace_sessions)))
        console.print(f"wrote {lines} requests of {trace_sessions} sessions to {write_trace_to}")
        return
    names = _policies(policies) if target is None else [policies if "," not in policies else "target"]
    step_sizes = _int_list(steps, "--steps")
    policy_fields = _overrides(policy_opt or [], "--policy-opt")
    sim_fields = _overrides(sim_opt or [], "--sim-opt")
    meta: dict[str, Any] = {
        "workload": workload, "seed": seed, "steps": list(step_sizes), "duration_s": duration,
        "policies": names, "policy_options": policy_fields, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if workload == "chat":
        chat_cfg = GrowingChatConfig(chat_tokens, chat_turn_tokens, chat_turns)
        _run_chat(console, names, chat_cfg, seed, target, replica or [], sim, replicas, speed, sim_fields,
                  model, api, time_scale, out)
        return
    rate_steps = _rate_list(rates) if rates is not None else ()
    wl: Workload | SharedPrefixWorkload
    if rate_steps:
        try:
            shared_system = SharedPrefixConfig().system_tokens if system_tokens is None else system_tokens
            shared_cfg = SharedPrefixConfig(groups, shared_system, questions, question_tokens, output_tokens)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        wl = SharedPrefixWorkload(shared_cfg, seed)
        meta.update(workload_config=asdict(shared_cfg), rates=list(rate_steps))
    else:
        wl = _agent_workload(trace, seed, agent_cfg)
        meta["workload_config"] = asdict(agent_cfg) if trace is None else {"trace": str(trace)}
        meta["workload_description"] = (agent_cfg.describe(seed) if trace is None
                                        else f"Agent sessions replayed from {trace}.")
    progress = _Progress(console, duration, enabled=not quiet, unit="req/s" if rate_steps else "sessions")
    if virtual:
        if target is not None or replica:
            raise typer.BadParameter("--virtual simulates its own fleet; drop --target/--replica")
        from kvroute.bench.cluster import ClusterConfig, run_virtual_bench, run_virtual_open_bench

        try:
            cluster = ClusterConfig(sim, replicas, sim_fields, policy_fields, {}, scrape_interval)
            cluster.engine_config()
        except (KeyError, TypeError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--sim/--sim-opt") from None
        meta.update(mode="virtual", preset=sim, replicas=replicas, scrape_interval_s=scrape_interval,
                    engine_options=sim_fields)
        with progress.progress:
            if isinstance(wl, SharedPrefixWorkload):
                result = run_virtual_open_bench(cluster, names, wl, rate_steps, duration, meta,
                                                poll_interval_s=poll_interval,
                                                drain_timeout_s=drain_timeout, on_step=progress.step_done)
            else:
                result = run_virtual_bench(cluster, names, wl, step_sizes, duration, meta,
                                           poll_interval_s=poll_interval, drain_timeout_s=drain_timeout,
                                           on_step=progress.step_done)
        print_result(console, result, out, plots)
        return

    if policy_fields:
        raise typer.BadParameter("--policy-opt applies to --virtual runs; configure routers in kvroute.toml")
    spec = _http_spec(target, replica or [], sim, replicas, speed, sim_fields, model, api, time_scale,
                      metrics_url or [], scrape_interval)
    meta.update(mode="http", target=target, replicas_urls=replica or [],
                preset=sim if spec.sim else None, speed=speed if spec.sim else time_scale,
                caches_reset_between_policies=spec.sim is not None)
    if replica and len(names) > 1:
        console.print("[yellow]note: given replicas keep their caches between policies; each policy after "
                      "the first starts warm. Use simulated replicas for a fair A/B.[/yellow]")
    plan = StepPlan(step_sizes, duration, drain_timeout, poll_interval, rates=rate_steps)
    try:
        with progress.progress:
            result = asyncio.run(run_http_bench(spec, names, wl, plan, meta, progress.for_policy))
    except BenchSetupError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    print_result(console, result, out, plots)


def _http_spec(target: str | None, replica: list[str], sim: str, replicas: int, speed: float,
               sim_fields: dict[str, Any], model: str | None, api: str, time_scale: float,
               metrics_urls: list[str], scrape_interval: float) -> HttpBenchSpec:

    sim_spec = None if target is not None or replica else SimSpec(sim, replicas, speed, sim_fields)
    return HttpBenchSpec(sim=sim_spec, replicas=tuple(replica), target=target,
                         metrics_urls=tuple(metrics_urls), model=model,
                         api="anthropic" if api == "anthropic" else "openai",
                         time_scale=time_scale, probe_interval_s=scrape_interval)


def _run_chat(console: Console, names: list[str], cfg: GrowingChatConfig, seed: int, target: str | None,
              replica: list[str], sim: str, replicas: int, speed: float, sim_fields: dict[str, Any],
              model: str | None, api: str, time_scale: float, out: Path) -> None:

    spec = _http_spec(target, replica, sim, replicas, speed, sim_fields, model, api, time_scale, [], 1.0)
    steps = growing_chat(cfg, seed)
    out.mkdir(parents=True, exist_ok=True)
    text = []
    for name in names:
        try:
            rows = asyncio.run(run_http_chat(spec, name, steps))
        except BenchSetupError as exc:
            console.print(f"[red]{exc}[/red]")
            raise typer.Exit(1) from None
        table = chat_markdown([(r.label, r.worker, r.prompt_tokens, r.seconds) for r in rows])
        text.append(f"policy: {name}\n\n{table}")
        console.print(f"[bold]policy {name}[/bold]")
        console.print(table)
    (out / "chat.md").write_text("\n".join(text))
    console.print(f"[dim]wrote {out / 'chat.md'}[/dim]")


def demo_meta(cfg: AgentWorkloadConfig, seed: int, *, replicas: int, speed: float, steps: Sequence[int],
              duration_s: float, policies: list[str]) -> dict[str, Any]:
    """What ``kvroute demo`` records in results.json: its fleet, steps, and the workload it ran
    (its settings and the words its table is printed with)."""
    return {"mode": "demo", "preset": "a4000-qwen3-4b", "replicas": replicas, "speed": speed, "seed": seed,
            "steps": list(steps), "duration_s": duration_s, "policies": policies,
            "caches_reset_between_policies": True, "workload": "agent", "workload_config": asdict(cfg),
            "workload_description": cfg.describe(seed)}


def demo(
    duration: Annotated[float, typer.Option(min=1.0, help="Simulated seconds per step.")] = 120.0,
    steps: Annotated[str, typer.Option(help="Concurrent sessions per step.")] = "4,8,16",
    speed: Annotated[float, typer.Option(min=0.1, help="Simulated seconds per wall second.")] = 10.0,
    replicas: Annotated[int, typer.Option(min=1, help="Simulated replicas.")] = 4,
    policies: Annotated[str, typer.Option(help="The policies to compare (off,on).")] = "least-loaded,auto",
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("kvroute-demo"),
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bars.")] = False,
) -> None:
    """Simulated a4000-qwen3-4b replicas and the router in one process: a short agent A/B over HTTP."""

    console = Console()
    names = _policies(policies)
    step_sizes = _int_list(steps, "--steps")
    cfg = AgentWorkloadConfig()
    wl = AgentWorkload(cfg, seed)
    spec = HttpBenchSpec(sim=SimSpec("a4000-qwen3-4b", replicas, speed), probe_interval_s=1.0)
    plan = StepPlan(step_sizes, duration, drain_timeout_s=120.0, poll_interval_s=1.0)
    meta = demo_meta(cfg, seed, replicas=replicas, speed=speed, steps=step_sizes, duration_s=duration,
                     policies=names)
    console.print(f"kvroute demo: {replicas} simulated a4000-qwen3-4b replicas at {speed:g}x speed, "
                  f"policies {' vs '.join(names)}, steps {', '.join(map(str, step_sizes))} sessions, "
                  f"{duration:g} simulated seconds each", markup=False, highlight=False)
    console.print(meta["workload_description"], markup=False, highlight=False)
    progress = _Progress(console, duration, enabled=not quiet)
    try:
        with progress.progress:
            result = asyncio.run(run_http_bench(spec, names, wl, plan, meta, progress.for_policy))
    except BenchSetupError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    print_result(console, result, out, plots=True, describe=False)

