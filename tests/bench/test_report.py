"""Reports: the A/B table (off → on), the wide table, JSON round trip and the plots."""

from __future__ import annotations

from pathlib import Path

from kvroute.bench.report import (
    chat_markdown,
    figure_rows,
    markdown_table,
    read_json,
    terminal_table,
    text_table,
    write_report,
)
from kvroute.bench.results import BenchResult, PolicyRun, StepResult


def step(policy: str, sessions: int, p50: float, hits: float | None) -> StepResult:
    return StepResult(policy=policy, sessions=sessions, duration_s=180.0, requests=40, errors=0,
                      sessions_completed=9, sessions_per_hour=180.0, output_tokens_per_min=5886.4,
                      ttfb_p50_s=p50, ttfb_p95_s=p50 * 3, replicas_busy=2.714, prefix_hit_pct=hits,
                      stayed_pct=100.0)


def result(policies: list[str]) -> BenchResult:
    runs = [PolicyRun(p, [step(p, 4, 2.05 - i, 56.2 + 30 * i), step(p, 8, 2.33, None)])
            for i, p in enumerate(policies)]
    return BenchResult({"seed": 0}, runs)


def test_two_policies_render_the_ab_table() -> None:
    md = markdown_table(result(["least-loaded", "session"]))
    lines = md.splitlines()
    assert lines[0] == ("| Sessions | Sessions/h off → on | Output tokens/min off → on "
                        "| TTFB p50 off → on (s) | TTFB p95 off → on (s) | Replicas busy off → on "
                        "| Prefix hits off → on (%) "
                        "| Stayed on replica off → on (%) |")
    assert lines[2] == ("| 4 | 180 → 180 | 5,886 → 5,886 | 2.05 → 1.05 | 6.15 → 3.15 | 2.71 → 2.71 "
                        "| 56.2 → 86.2 | 100.0 → 100.0 |")
    assert "| — → — |" in lines[3]  # no hit share measured at 8 sessions


def test_more_policies_render_one_row_per_policy_and_step() -> None:
    md = markdown_table(result(["least-loaded", "session", "auto"]))
    rows = md.splitlines()[2:]
    assert len(rows) == 6
    assert rows[2].startswith("| 4 | auto | 40 |")


def test_report_files_round_trip(tmp_path: Path) -> None:
    res = result(["least-loaded", "auto"])
    written = write_report(res, tmp_path)
    names = sorted(p.name for p in written)
    assert names == ["hits.png", "results.json", "results.md", "ttfb.png"]
    assert read_json(tmp_path / "results.json") == res
    for png in ("hits.png", "ttfb.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_table_like_seed_one() -> None:
    md = chat_markdown([("1 (cold)", "A", 5629, 6.3), ("2", "A", 5818, 0.54)])
    assert md.splitlines()[2] == "| 1 (cold) | A | 5,629 | 6.30 s |"


def test_session_columns_appear_once_a_session_finished() -> None:
    res = result(["least-loaded", "session"])
    res.runs[1].steps[0].session_p50_s, res.runs[1].steps[0].continuing_ttfb_p95_s = 61.25, 0.4
    lines = markdown_table(res).splitlines()
    assert lines[0].endswith("| Session p50 off → on (s) | Session p95 off → on (s) "
                             "| First-turn TTFB p95 off → on (s) | Continuing TTFB p95 off → on (s) |")
    assert lines[2].endswith("| — → 61.2 | — → — | — → — | — → 0.40 |")


def test_open_loop_table_is_by_rate() -> None:
    steps = [StepResult(policy="prefix", sessions=0, duration_s=180.0, requests=360, errors=0,
                        sessions_completed=0, sessions_per_hour=0.0, output_tokens_per_min=23000.0,
                        ttfb_p50_s=0.08, ttfb_p95_s=1.25, replicas_busy=3.5, prefix_hit_pct=79.3,
                        stayed_pct=None, preemptions=0, ttfb_p99_s=2.5, shed=3, rate=rate,
                        completed_per_s=1.94)
             for rate in (2.0, 4.5)]
    md = markdown_table(BenchResult({}, [PolicyRun("prefix", steps)]))
    lines = md.splitlines()
    assert lines[0] == ("| Rate (req/s) | Policy | Requests | Completed (req/s) | TTFT p50 (s) "
                        "| TTFT p95 (s) | TTFT p99 (s) | Prefix hits (%) | Preemptions | Shed |")
    assert lines[2] == "| 2 | prefix | 360 | 1.94 | 0.08 | 1.25 | 2.50 | 79.3 | 0 | 3 |"
    assert lines[3].startswith("| 4.5 | prefix |")


def demo_like(policies: list[str]) -> BenchResult:
    """Three steps with every closed-loop figure, session ones included (the demo's widest table)."""
    runs = []
    for i, p in enumerate(policies):
        steps = [step(p, n, 2.05 - i, 56.2 + 30 * i) for n in (4, 8, 16)]
        for s in steps:
            s.session_p50_s, s.session_p95_s = 123.4, 456.7
            s.first_ttfb_p95_s, s.continuing_ttfb_p95_s = 12.5, 3.25
        runs.append(PolicyRun(p, steps))
    return BenchResult({"seed": 0}, runs)


def rendered(table, width: int) -> list[str]:
    from rich.console import Console

    console = Console(width=width, record=True, force_terminal=True, color_system=None)
    console.print(table)
    return console.export_text().splitlines()


def test_a_wide_table_is_turned_to_fit_a_terminal() -> None:
    res = demo_like(["least-loaded", "auto"])
    lines = rendered(terminal_table(res, 100), 100)
    assert max(len(line) for line in lines) <= 100
    assert "Figure" in lines[2] and "4 sessions" in lines[2] and "16 sessions" in lines[2]
    session_row = next(line for line in lines if "Session p95 (s)" in line)
    assert session_row.count("456.7 → 456.7") == 3
    # A terminal wide enough gets one row per step.
    wide = rendered(terminal_table(res, 250), 250)
    assert "Figure" not in "\n".join(wide) and max(len(line) for line in wide) <= 250
    assert [line.split()[1] for line in wide if line.startswith("│ ")] == ["4", "8", "16"]
    # The same for a pipe: Markdown, turned when a row per step would pass 100 characters.
    assert max(len(line) for line in text_table(res).splitlines()) <= 100
    assert text_table(result(["a", "b"]), width=250) == markdown_table(result(["a", "b"]))


def test_turned_table_of_more_policies_has_a_row_per_figure_and_policy() -> None:
    header, rows = figure_rows(demo_like(["least-loaded", "session", "auto"]))
    assert header == ["Figure", "Policy", "4 sessions", "8 sessions", "16 sessions"]
    assert rows[0] == ["Requests", "least-loaded", "40", "40", "40"]
    assert [r[1] for r in rows[:3]] == ["least-loaded", "session", "auto"]
    assert rows[-1][0] == "Preemptions"
