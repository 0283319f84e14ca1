"""``kvroute demo`` as a user runs it in a 100-column terminal (a short run): its table fits, it
names the workload in words, and results.json says the same."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import orjson

from kvroute.bench.workloads import AgentWorkloadConfig

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_demo_table_fits_100_columns_and_names_its_workload(tmp_path: Path) -> None:
    # FORCE_COLOR makes rich treat the pipe as a terminal of COLUMNS columns, as a user's is.
    env = {**os.environ, "COLUMNS": "100", "FORCE_COLOR": "1"}
    args = [sys.executable, "-c", "from kvroute.cli import main; main()", "demo", "--duration", "10",
            "--steps", "2,4,8", "--speed", "100", "--replicas", "2", "--seed", "3", "--quiet",
            "--out", str(tmp_path)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, done.stderr
    lines = _ANSI.sub("", done.stdout).splitlines()
    assert max(len(line) for line in lines) <= 100
    text = " ".join(" ".join(lines).split())
    described = AgentWorkloadConfig().describe(3)
    assert described.startswith("Agent sessions (seed 3): a system prompt every session shares "
                                "(3,500 tokens)")
    assert described in text
    assert "seed 2" not in text
    header = next(line for line in lines if "Figure" in line)
    assert all(f"{n} sessions" in header for n in (2, 4, 8))
    assert any(line.startswith("│ TTFB p50 (s)") and line.count("→") == 3 for line in lines)
    meta = orjson.loads((tmp_path / "results.json").read_bytes())["meta"]
    assert meta["seed"] == 3 and meta["workload"] == "agent"
    assert meta["workload_config"] == asdict(AgentWorkloadConfig())
    assert meta["workload_description"] == described
    assert described in (tmp_path / "results.md").read_text()
