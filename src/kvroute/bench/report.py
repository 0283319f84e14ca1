"""Reports of a benchmark: its tables (terminal and Markdown), JSON and PNG plots.

The table compares policies step by step: one row per step and a column per figure (``off → on``
with two policies), or, where that is too wide for a terminal, the same figures turned, one row
per figure and a column per step (``figure_rows``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.table import Table

from kvroute.bench.results import BenchResult, StepResult


@dataclass(frozen=True, slots=True)
class Column:
    """One figure of the table: its header, how to read it from a step, and how to print it."""

    header: str
    unit: str
    get: Callable[[StepResult], float | None]
    fmt: Callable[[float], str]


def _fixed(digits: int) -> Callable[[float], str]:
    return lambda v: f"{v:,.{digits}f}"


COLUMNS: tuple[Column, ...] = (
    Column("Sessions/h", "", lambda s: s.sessions_per_hour, _fixed(0)),
    Column("Output tokens/min", "", lambda s: s.output_tokens_per_min, _fixed(0)),
    Column("TTFB p50", " (s)", lambda s: s.ttfb_p50_s, _fixed(2)),
    Column("TTFB p95", " (s)", lambda s: s.ttfb_p95_s, _fixed(2)),
    Column("Replicas busy", "", lambda s: s.replicas_busy, _fixed(2)),
    Column("Prefix hits", " (%)", lambda s: s.prefix_hit_pct, _fixed(1)),
    Column("Stayed on replica", " (%)", lambda s: s.stayed_pct, _fixed(1)),
)


# What a session's user waits for (closed loop): shown when some session finished in the result.
SESSION_COLUMNS: tuple[Column, ...] = (
    Column("Session p50", " (s)", lambda s: s.session_p50_s, _fixed(1)),
    Column("Session p95", " (s)", lambda s: s.session_p95_s, _fixed(1)),
    Column("First-turn TTFB p95", " (s)", lambda s: s.first_ttfb_p95_s, _fixed(2)),
    Column("Continuing TTFB p95", " (s)", lambda s: s.continuing_ttfb_p95_s, _fixed(2)),
)

PREEMPTIONS = Column("Preemptions", "", lambda s: None if s.preemptions is None else float(s.preemptions),
                     _fixed(0))

# An open loop's steps are arrival rates: what it completed and how long the first token took.
OPEN_COLUMNS: tuple[Column, ...] = (
    Column("Completed", " (req/s)", lambda s: s.completed_per_s, _fixed(2)),
    Column("TTFT p50", " (s)", lambda s: s.ttfb_p50_s, _fixed(2)),
    Column("TTFT p95", " (s)", lambda s: s.ttfb_p95_s, _fixed(2)),
    Column("TTFT p99", " (s)", lambda s: s.ttfb_p99_s, _fixed(2)),
    Column("Prefix hits", " (%)", lambda s: s.prefix_hit_pct, _fixed(1)),
    PREEMPTIONS,
    Column("Shed", "", lambda s: float(s.shed), _fixed(0)),
)


def columns(result: BenchResult) -> tuple[Column, ...]:
    """The figures of ``result``'s table: the open loop's, or the closed loop's with the session
    figures when any session finished."""
    if result.open_loop():
        return OPEN_COLUMNS
    if any(step.session_p50_s is not None for run in result.runs for step in run.steps):
        return COLUMNS + SESSION_COLUMNS
    return COLUMNS


def load_header(result: BenchResult) -> str:
    """The first column's header: what a step offered."""
    return "Rate (req/s)" if result.open_loop() else "Sessions"


def _cell(col: Column, step: StepResult | None) -> str:
    if step is None:
        return "—"
    value = col.get(step)
    return "—" if value is None else col.fmt(value)


def ab_rows(result: BenchResult, off: str, on: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the A/B table: each figure as ``off → on``, one row per step."""
    cols = columns(result)
    header = [load_header(result)] + [f"{c.header} off → on{c.unit}" for c in cols]
    rows = []
    for n in result.step_sizes():
        a, b = result.step(off, n), result.step(on, n)
        rows.append([f"{n:g}"] + [f"{_cell(c, a)} → {_cell(c, b)}" for c in cols])
    return header, rows


def wide_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    """Header and rows for any number of policies: one row per step and policy, with the request
    and preemption counts that explain the overloaded steps."""
    cols = columns(result)
    if PREEMPTIONS not in cols:
        cols = (*cols, PREEMPTIONS)
    header = [load_header(result), "Policy", "Requests"] + [f"{c.header}{c.unit}" for c in cols]
    rows = []
    for n in result.step_sizes():
        for policy in result.policies():
            step = result.step(policy, n)
            requests = "—" if step is None else f"{step.requests:,}"
            rows.append([f"{n:g}", policy, requests] + [_cell(c, step) for c in cols])
    return header, rows


def table_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    """The A/B table for exactly two policies (first = off, second = on), the wide one otherwise."""
    policies = result.policies()
    if len(policies) == 2:
        return ab_rows(result, policies[0], policies[1])
    return wide_rows(result)


_REQUESTS = Column("Requests", "", lambda s: float(s.requests), _fixed(0))


def figure_rows(result: BenchResult) -> tuple[list[str], list[list[str]]]:
    """The table turned: one row per figure (``off → on`` with two policies; otherwise one row per
    figure and policy, with the request and preemption counts), one column per step."""
    policies, sizes = result.policies(), result.step_sizes()
    unit = "req/s" if result.open_loop() else "sessions"
    steps = [f"{n:g} {unit}" for n in sizes]
    if len(policies) == 2:
        off, on = policies
        return ["Figure", *steps], [
            [f"{c.header}{c.unit}"] + [f"{_cell(c, result.step(off, n))} → {_cell(c, result.step(on, n))}"
                                       for n in sizes] for c in columns(result)]
    cols = columns(result)
    cols = (_REQUESTS, *cols) if PREEMPTIONS in cols else (_REQUESTS, *cols, PREEMPTIONS)
    rows = [[f"{c.header}{c.unit}", p] + [_cell(c, result.step(p, n)) for n in sizes]
            for c in cols for p in policies]
    return ["Figure", "Policy", *steps], rows


def title(result: BenchResult) -> str:
    """One line saying what was compared."""
    policies = result.policies()
    if len(policies) == 2:
        return f"off = {policies[0]}, on = {policies[1]}"
    return "policies: " + ", ".join(policies)


def workload_line(result: BenchResult) -> str | None:
    """The workload in words, when the run recorded it (``meta["workload_description"]``)."""
    text = result.meta.get("workload_description")
    return text if isinstance(text, str) and text else None


# The columns that name a row rather than hold a number.
_LABELS = frozenset(("Sessions", "Rate (req/s)", "Policy", "Figure"))


def _rich(header: list[str], rows: list[list[str]], caption: str) -> Table:
    table = Table(title=caption, show_lines=False)
    for h in header:
        table.add_column(h, justify="left" if h in _LABELS else "right")
    for row in rows:
        table.add_row(*row)
    return table


def terminal_table(result: BenchResult, width: int) -> Table:
    """The table for a terminal ``width`` columns wide: one row per step if that fits, else the
    figures as rows (``figure_rows``)."""
    header, rows = table_rows(result)
    # Headers may wrap (at spaces); the numbers must not: each column needs its widest cell, plus
    # a space either side and a border.
    needed = 1 + sum(3 + max([len(max(h.split(), key=len))] + [len(row[i]) for row in rows])
                     for i, h in enumerate(header))
    if needed <= width:
        return _rich(header, rows, title(result))
    return _rich(*figure_rows(result), title(result))


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_table(result: BenchResult) -> str:
    """The table as GitHub Markdown, one row per step."""
    return _markdown(*table_rows(result))


def text_table(result: BenchResult, width: int = 100) -> str:
    """The Markdown table for a log or a pipe: one row per step if its lines fit ``width``, else
    the figures as rows."""
    text = markdown_table(result)
    if max(len(line) for line in text.splitlines()) <= width:
        return text
    return _markdown(*figure_rows(result))


def write_json(result: BenchResult, path: Path) -> None:
    """Write the whole result (meta and every step) as JSON."""
    path.write_bytes(orjson.dumps(result.as_dict(), option=orjson.OPT_INDENT_2))


def read_json(path: Path) -> BenchResult:
    """Read what :func:`write_json` wrote."""
    return BenchResult.from_dict(orjson.loads(path.read_bytes()))


def write_plots(result: BenchResult, out_dir: Path) -> list[Path]:
    """TTFB p50/p95 per step on a log scale and the prefix-hit share per step, one PNG each."""
    import matplotlib  # imported here: plotting is optional and slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result.step_sizes()
    xs = list(range(len(sizes)))
    paths: list[Path] = []

    def series(policy: str, get: Callable[[StepResult], float | None]) -> list[float]:
        values: list[float] = []
        for n in sizes:
            step = result.step(policy, n)
            value = None if step is None else get(step)
            values.append(float("nan") if value is None else value)
        return values

    def finish(fig: Any, ax: Any, ylabel: str, name: str) -> None:
        ax.set_xticks(xs, [f"{n:g}" for n in sizes])
        ax.set_xlabel("arrival rate (requests/s)" if result.open_loop() else "concurrent sessions")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, policy in enumerate(result.policies()):
        color = f"C{i}"
        ax.plot(xs, series(policy, lambda s: s.ttfb_p50_s), "o-", color=color, label=f"{policy} p50")
        ax.plot(xs, series(policy, lambda s: s.ttfb_p95_s), "s--", color=color, label=f"{policy} p95")
    ax.set_yscale("log")
    # Plain seconds on the log axis: "0.3", "2", "10" read faster than 3×10⁻¹.
    seconds = matplotlib.ticker.FuncFormatter(lambda v, _pos: f"{v:g}")
    ax.yaxis.set_major_formatter(seconds)
    ax.yaxis.set_minor_formatter(seconds)
    ax.set_title("Time to first byte per step")
    finish(fig, ax, "seconds (log scale)", "ttfb.png")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, policy in enumerate(result.policies()):
        ax.plot(xs, series(policy, lambda s: s.prefix_hit_pct), "o-", color=f"C{i}", label=policy)
    ax.set_ylim(0, 100)
    ax.set_title("Prefix-cache hit share per step (replicas' own counters)")
    finish(fig, ax, "prompt tokens served from cache (%)", "hits.png")
    return paths


def write_report(result: BenchResult, out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Write ``results.json``, ``results.md`` and (optionally) the plots into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    write_json(result, json_path)
    described = workload_line(result)
    md_path.write_text(f"{title(result)}\n\n" + (f"{described}\n\n" if described else "")
                       + markdown_table(result))
    written = [json_path, md_path]
    if plots:
        written += write_plots(result, out_dir)
    return written


def chat_markdown(rows: Sequence[tuple[str, str, int, float]]) -> str:
    """The growing-chat table: turn | worker | prompt tokens | time."""
    lines = ["| turn | worker | prompt tokens | time |", "|---|---|---|---|"]
    lines += [f"| {t} | {w} | {p:,} | {s:.2f} s |" for t, w, p, s in rows]
    return "\n".join(lines) + "\n"
