"""The shared-prefix open loop over HTTP: requests arrive at their Poisson times against a real
router in front of simulated replicas on loopback, and the step reports the open loop's figures."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from kvroute.bench.http_ab import HttpBenchSpec, SimSpec, run_http_bench
from kvroute.bench.report import read_json
from kvroute.bench.runner import StepPlan
from kvroute.bench.workloads import SharedPrefixConfig, SharedPrefixWorkload
from kvroute.cli import app

TINY = SharedPrefixConfig(groups=2, system_tokens=400, questions=3, question_tokens=30, output_tokens=8)


async def test_open_loop_step_over_http() -> None:
    workload = SharedPrefixWorkload(TINY, 2)
    spec = HttpBenchSpec(sim=SimSpec("a4000-qwen3-4b", 2, speed=20.0), probe_interval_s=0.5)
    plan = StepPlan(duration_s=20.0, drain_timeout_s=20.0, poll_interval_s=0.1, rates=(2.0,))
    result = await run_http_bench(spec, ["prefix"], workload, plan, {})
    step = result.runs[0].steps[0]
    arrivals = list(workload.arrivals(2.0, 20.0))
    assert step.rate == 2.0 and step.sessions == 0 and result.open_loop()
    assert step.requests == len(arrivals) and step.errors == 0 and step.shed == 0
    assert step.completed_per_s is not None and 0 < step.completed_per_s <= len(arrivals) / 20.0
    assert step.ttfb_p50_s is not None and step.ttfb_p95_s is not None and step.ttfb_p99_s is not None
    # Two groups' prompts on a prefix-routed fleet: most prompt tokens come from the cache.
    assert step.prefix_hit_pct is not None and step.prefix_hit_pct > 50
    assert step.session_p50_s is None and step.sessions_completed == 0


def test_cli_shared_prefix_over_http(tmp_path: Path) -> None:
    args = ["bench", "--workload", "shared-prefix", "--rates", "1,2", "--speed", "20", "--replicas", "2",
            "--duration", "10", "--groups", "2", "--system-tokens", "300", "--questions", "2",
            "--question-tokens", "20", "--output-tokens", "4", "--policies", "round-robin",
            "--quiet", "--no-plots", "--out", str(tmp_path)]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    result = read_json(tmp_path / "results.json")
    assert [s.rate for s in result.runs[0].steps] == [1.0, 2.0]
    assert result.meta["workload_config"]["system_tokens"] == 300
    assert "| Rate (req/s) | Policy | Requests | Completed (req/s) |" in (tmp_path / "results.md").read_text()
    missing = CliRunner().invoke(app, ["bench", "--workload", "shared-prefix", "--virtual"])
    assert missing.exit_code != 0 and "--rates" in missing.output
