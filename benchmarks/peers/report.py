"""Tables (every figure also as a ratio to kvroute) and plots of a peers run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvroute.bench.results import BenchResult, StepResult
from peers.cost import CostResult

DIRECT = "direct to replicas"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return ""
    return f" (×{value / base:.2f})"


def _num(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _vs(step: StepResult, ref: StepResult | None, get: Callable[[StepResult], float | None],
        digits: int) -> str:
    """``get(step)``, and its ratio to ``get(ref)`` when there is a reference step."""
    value = get(step)
    return _num(value, digits) + ("" if ref is None else _ratio(value, get(ref)))


def _wait(step: StepResult) -> str:
    if step.queue_wait_p50_s is None or step.queue_wait_p95_s is None:
        return "—"
    return f"{step.queue_wait_p50_s:.2f} / {step.queue_wait_p95_s:.2f}"


def _shed(step: StepResult) -> str:
    """Overload answers the client got; the router's own count after it when it differs (kvroute's
    /metrics also count requests shed after the step's driver stopped waiting for them)."""
    if step.router_shed is None or step.router_shed == step.shed:
        return str(step.shed)
    return f"{step.shed} (router {step.router_shed})"


def quality_markdown(result: BenchResult, base: str) -> str:
    """One row per step and router: TTFB p50/p95/p99 and output tokens/min with their ratio to
    ``base`` (times: above 1 is slower than kvroute; throughput: below 1 is less), the
    prefix-cache hit share, the share of follow-ups served by their session's previous replica,
    the engines' preemptions, the router queue's wait p50 / p95 (kvroute with flow control: every
    admitted request, zero for those admitted at once), and the requests shed and failed."""
    header = ["Sessions", "Router", "Requests", "TTFB p50 (s)", "TTFB p95 (s)", "TTFB p99 (s)",
              "Output tokens/min", "Prefix hits (%)", "Stayed on replica (%)", "Preemptions",
              "Queue wait p50 / p95 (s)", "Shed", "Errors"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for n in result.step_sizes():
        ref = result.step(base, n)
        for policy in result.policies():
            s = result.step(policy, n)
            if s is None:
                continue
            vs = None if policy == base else ref
            lines.append("| " + " | ".join([
                str(n), policy, f"{s.requests:,}",
                _vs(s, vs, lambda x: x.ttfb_p50_s, 2), _vs(s, vs, lambda x: x.ttfb_p95_s, 2),
                _vs(s, vs, lambda x: x.ttfb_p99_s, 2), _vs(s, vs, lambda x: x.output_tokens_per_min, 0),
                _num(s.prefix_hit_pct, 1), _num(s.stayed_pct, 1),
                "—" if s.preemptions is None else str(s.preemptions), _wait(s), _shed(s), str(s.errors),
            ]) + " |")
    return "\n".join(lines) + "\n"


def step_table(result: BenchResult, base: str, get: Callable[[StepResult], float | None], digits: int,
               *, ratio: bool = True) -> str:
    """One figure for every router (rows) at every step (columns), with its ratio to ``base``."""
    sizes = result.step_sizes()
    lines = ["| Router | " + " | ".join(f"{n} sessions" for n in sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    for policy in result.policies():
        cells = []
        for n in sizes:
            s = result.step(policy, n)
            ref = result.step(base, n) if ratio and policy != base else None
            cells.append("—" if s is None else _vs(s, ref, get, digits))
        name = f"**{policy}**" if policy == base else policy
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def quality_tables(result: BenchResult, base: str) -> str:
    """The routing-quality figures as one compact table each (routers × steps)."""
    parts = [
        ("TTFB p50 (s)", lambda s: s.ttfb_p50_s, 2, True),
        ("TTFB p95 (s)", lambda s: s.ttfb_p95_s, 2, True),
        ("Output tokens/min", lambda s: s.output_tokens_per_min, 0, True),
        ("Prefix-cache hits (% of prompt tokens, replicas' counters)", lambda s: s.prefix_hit_pct, 1, False),
        ("Follow-ups served by their session's previous replica (%)", lambda s: s.stayed_pct, 1, False),
    ]
    return "\n".join(f"**{title}**\n\n" + step_table(result, base, get, digits, ratio=ratio)
                     for title, get, digits, ratio in parts)


def cost_markdown(costs: Sequence[CostResult], base: str) -> str:
    """One row per target, non-streaming then streaming: requests/s (ratio to ``base``), p50/p99
    latency, and the CPU the router process(es) used per request (ratio to ``base``)."""
    by_key = {(c.label, c.stream): c for c in costs}
    labels: list[str] = []
    for c in costs:
        if c.label not in labels:
            labels.append(c.label)
    mode = ["req/s", "p50 (ms)", "p99 (ms)", "router CPU (ms/req)"]
    header = ["Target", *(f"Non-streaming {m}" for m in mode), *(f"Streaming {m}" for m in mode), "Errors"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in labels:
        cells = [label]
        errors = 0
        for stream in (False, True):
            c, ref = by_key.get((label, stream)), by_key.get((base, stream))
            if c is None:
                cells += ["—"] * len(mode)
                continue
            errors += c.errors
            if label == base:
                ref = None
            cpu = c.cpu_ms_per_request("router")
            ref_cpu = None if ref is None else ref.cpu_ms_per_request("router")
            cells += [_num(c.requests_per_s, 0) + ("" if ref is None else _ratio(c.requests_per_s,
                                                                                 ref.requests_per_s)),
                      _num(c.p50_ms, 1), _num(c.p99_ms, 1), _num(cpu, 2) + _ratio(cpu, ref_cpu)]
        cells.append(str(errors))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _series(result: BenchResult, policy: str, get: Callable[[StepResult], float | None]) -> list[float]:
    out = []
    for n in result.step_sizes():
        s = result.step(policy, n)
        value = None if s is None else get(s)
        out.append(float("nan") if value is None else value)
    return out


def _style(i: int, policy: str) -> dict[str, Any]:
    # kvroute stands out: thick black line; peers: one colour each, dashed for sglang-router.
    if policy.startswith("kvroute"):
        return {"color": "black", "linewidth": 2.6, "marker": "o", "zorder": 5}
    return {"color": f"C{i % 10}", "linewidth": 1.2, "marker": ".",
            "linestyle": "--" if policy.startswith("sglang") else "-"}


def write_plots(result: BenchResult, costs: Sequence[CostResult], out_dir: Path, *, cost_title: str,
                prefix: str = "peers_") -> list[Path]:
    """``<prefix>ttfb.png`` (TTFB p50 and p95 per step), ``<prefix>quality.png`` (output tokens/min,
    hit share, stayed share) and ``<prefix>cost.png`` (requests/s per target)."""
    import matplotlib  # imported here: plotting is optional and slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = result.step_sizes()
    xs = list(range(len(sizes)))
    paths: list[Path] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out_dir / f"{prefix}{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    def panels(specs: Sequence[tuple[str, Callable[[StepResult], float | None], bool]], name: str) -> None:
        fig, axes = plt.subplots(1, len(specs), figsize=(5.2 * len(specs), 4.4))
        for ax, (title, get, log) in zip(axes, specs, strict=True):
            for i, policy in enumerate(result.policies()):
                ax.plot(xs, _series(result, policy, get), label=policy, **_style(i, policy))
            if log:
                ax.set_yscale("log")
            ax.set_title(title)
            ax.set_xticks(xs, [str(n) for n in sizes])
            ax.set_xlabel("concurrent sessions")
            ax.grid(True, which="both", alpha=0.3)
        axes[-1].legend(fontsize=7, loc="best")
        save(fig, name)

    if sizes:
        panels([("TTFB p50 (s, log)", lambda s: s.ttfb_p50_s, True),
                ("TTFB p95 (s, log)", lambda s: s.ttfb_p95_s, True)], "ttfb")
        panels([("Output tokens/min", lambda s: s.output_tokens_per_min, False),
                ("Prefix-cache hits (%)", lambda s: s.prefix_hit_pct, False),
                ("Follow-ups on their replica (%)", lambda s: s.stayed_pct, False)], "quality")
    if costs:
        labels: list[str] = []
        for c in costs:
            if c.label not in labels:
                labels.append(c.label)
        by_key = {(c.label, c.stream): c for c in costs}
        fig, ax = plt.subplots(figsize=(10, 4.6))
        width = 0.4
        for k, stream in enumerate((False, True)):
            values = [by_key[(lab, stream)].requests_per_s if (lab, stream) in by_key else 0.0
                      for lab in labels]
            ax.bar([i + (k - 0.5) * width for i in range(len(labels))], values, width,
                   label="streaming" if stream else "non-streaming", color=f"C{k}")
        ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("requests/s")
        ax.set_title(cost_title)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
        save(fig, "cost")
    return paths
