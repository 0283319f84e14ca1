"""Reports: the A/B table (off → on), the wide table, JSON round trip and the plots."""

from __future__ import annotations

from pathlib import Path

from kvroute.bench.report import chat_markdown, markdown_table, read_json, write_report
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


def test_two_policies_render_seed_two_table() -> None:
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
