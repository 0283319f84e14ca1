"""``scripts/vllm_env.sh`` finds the developer tooling from a checkout (``tools/`` is not in the
wheel) and tells an unprepared environment apart without starting anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_env.sh"


def test_check_reports_an_unprepared_home(tmp_path: Path) -> None:
    env = {**os.environ, "KVROUTE_VLLM_HOME": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run([str(SCRIPT), "check"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "NOT PREPARED" in done.stderr and str(tmp_path / "ready.json") in done.stderr


def test_usage_errors_exit_2() -> None:
    done = subprocess.run([str(SCRIPT), "nonsense"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2 and "prepare" in done.stderr
