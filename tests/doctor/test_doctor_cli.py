"""``kvroute doctor`` as a command: readable report, --json, exit status."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson
import typer
from typer.testing import CliRunner

from kvroute.cli import app
from kvroute.sim.server import start_sim_fleet

FIXTURES = Path(__file__).parent / "fixtures"
runner = CliRunner()


def test_log_alone_readable_report_and_exit_status() -> None:
    result = runner.invoke(app, ["doctor", "--log", str(FIXTURES / "hybrid_caching_off.log")],
                           env={"COLUMNS": "140"})
    assert result.exit_code == 1, result.output
    assert "Prefix caching is off (vLLM's default for hybrid models)" in result.output
    assert "fix: --enable-prefix-caching --mamba-cache-mode align" in result.output
    assert "log line 9 config dump" in result.output


def test_healthy_log_exits_zero_and_json_is_complete() -> None:
    result = runner.invoke(app, ["doctor", "--json", "--context-tokens", "3000", "--sessions", "40",
                                 "--log", str(FIXTURES / "hybrid_align_unit32.log")])
    assert result.exit_code == 0, result.output
    doc = orjson.loads(result.output)
    assert doc["worst"] == "info"
    [target] = doc["targets"]
    assert target["kind"] == "log"
    assert target["facts"]["prefix_match_unit"] == {"value": 32,
                                                    "source": "log line 2 non-default args prefix_match_unit"}
    by_code = {f["code"]: f for f in target["findings"]}
    assert by_code["kv-capacity"]["severity"] == "ok"  # 40 × 3,000 fits in 203,200
    assert set(by_code["fp8-kv-cache"]) == {"severity", "code", "title", "detail", "fix", "evidence"}


def test_bad_usage_is_a_clear_error() -> None:
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 2
    assert "give at least one URL or --log FILE" in result.output
    two_logs = ["--log", str(FIXTURES / "dense_caching_on.log")] * 2
    result = runner.invoke(app, ["doctor", "http://127.0.0.1:9", *two_logs])
    assert result.exit_code == 2
    assert "one log per URL" in result.output
    result = runner.invoke(app, ["doctor", "--log", str(FIXTURES / "missing.log")])
    assert result.exit_code == 2


def test_unreachable_engine_is_an_error_finding() -> None:
    result = runner.invoke(app, ["doctor", "--json", "--timeout", "2", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    doc = orjson.loads(result.output)
    assert doc["targets"][0]["findings"][0]["code"] == "unreachable"


async def test_cli_against_a_simulated_replica_with_probe() -> None:
    fleet = await start_sim_fleet("hybrid-27b", 1, speed=200.0, enable_prefix_caching=True,
                                  mamba_cache_mode="align")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from kvroute.cli import main; main()", "doctor", "--probe", "--json",
            fleet.urls[0], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        await fleet.close()
    assert proc.returncode == 0, err.decode()  # warnings only
    doc = orjson.loads(out)
    assert doc["worst"] == "warning"
    target = doc["targets"][0]
    assert [s["label"] for s in target["probe"]] == ["cold", "repeat", "turn 2", "turn 3"]
    codes = {f["code"] for f in target["findings"]}
    assert {"match-unit-coarse", "probe-repeat-hit", "probe-conversation-partial"} <= codes


def test_registered_in_the_kvroute_app() -> None:
    names = {c.name for c in app.registered_commands}
    assert {"doctor", "canary"} <= names
    assert isinstance(app, typer.Typer)
