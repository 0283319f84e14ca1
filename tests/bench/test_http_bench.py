"""A tiny end-to-end bench over HTTP: simulated replicas, the router, streaming, counters."""

from __future__ import annotations

import itertools
from pathlib import Path

from typer.testing import CliRunner

from kvroute.bench.http_ab import HttpBenchSpec, SimSpec, run_http_bench, run_http_chat
from kvroute.bench.report import read_json
from kvroute.bench.runner import StepPlan
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig, GrowingChatConfig, growing_chat
from kvroute.cli import app

TINY = AgentWorkloadConfig(system_tokens=300, first_tokens=600, rounds=2, round_tokens=60,
                           max_output_tokens=12, min_output_tokens=4, think_time_s=0.5)


async def test_ab_over_http_measures_every_column() -> None:
    spec = HttpBenchSpec(sim=SimSpec("a4000-qwen3-4b", 2, speed=20.0), probe_interval_s=0.5)
    plan = StepPlan((3,), duration_s=20.0, drain_timeout_s=20.0, poll_interval_s=0.1)
    result = await run_http_bench(spec, ["least-loaded", "session"], AgentWorkload(TINY, 5), plan, {})
    assert result.policies() == ["least-loaded", "session"]
    for run in result.runs:
        step = run.steps[0]
        assert step.errors == 0 and step.requests >= 6
        assert step.ttfb_p50_s is not None and step.ttfb_p95_s is not None
        assert step.ttfb_p50_s <= step.ttfb_p95_s
        assert step.output_tokens_per_min > 0
        assert step.replicas_busy is not None and 0 < step.replicas_busy <= 2
        assert step.prefix_hit_pct is not None and 0 < step.prefix_hit_pct < 100
        assert step.cached_tokens <= step.prompt_tokens
    assert result.step("session", 3).stayed_pct == 100.0  # type: ignore[union-attr]


async def test_growing_chat_stays_where_its_prefix_is() -> None:
    spec = HttpBenchSpec(sim=SimSpec("dense-3b", 2, speed=20.0), probe_interval_s=0.5)
    steps = growing_chat(GrowingChatConfig(first_tokens=3000, turn_tokens=100, turns=4), seed=1)
    rows = await run_http_chat(spec, "prefix", steps)
    chat = [r for r in rows if r.label != "a different conversation"]
    assert [r.worker for r in chat] == ["A"] * 4
    assert all(b.prompt_tokens > a.prompt_tokens for a, b in itertools.pairwise(chat))
    # Each follow-up found the previous turn's prompt in the replica's cache (the replica's own
    # count, not a wall-clock comparison, which a loaded machine can upset).
    assert chat[0].cached_tokens < chat[0].prompt_tokens // 2
    block = 16
    assert all(b.cached_tokens >= a.prompt_tokens - block for a, b in itertools.pairwise(chat))


def test_cli_virtual_and_http(tmp_path: Path) -> None:
    runner = CliRunner()
    common = ["--steps", "2", "--duration", "15", "--system-tokens", "200", "--first-tokens", "400",
              "--rounds", "1", "--round-tokens", "50", "--max-output-tokens", "8", "--replicas", "2",
              "--think-time", "0.5",
              "--quiet", "--no-plots"]
    virt = runner.invoke(app, ["bench", "--virtual", "--policies", "least-loaded,auto",
                               "--out", str(tmp_path / "v"), *common])
    assert virt.exit_code == 0, virt.output
    assert "off = least-loaded, on = auto" in virt.output
    assert read_json(tmp_path / "v" / "results.json").meta["mode"] == "virtual"
    http = runner.invoke(app, ["bench", "--speed", "20", "--policies", "round-robin",
                               "--out", str(tmp_path / "h"), *common])
    assert http.exit_code == 0, http.output
    assert read_json(tmp_path / "h" / "results.json").runs[0].steps[0].requests > 0
    bad = runner.invoke(app, ["bench", "--virtual", "--policies", "fastest", *common])
    assert bad.exit_code != 0 and "unknown policy" in bad.output
