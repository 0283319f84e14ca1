"""The ``kvroute`` command's own surface, as a user's terminal shows it: ``--version`` and the help
of each command at 80 columns (a real process each time)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest

KVROUTE = [sys.executable, "-c", "from kvroute.cli import main; main()"]


def run(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50"}
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True, timeout=60, env=env)


def test_version_comes_from_the_package_metadata() -> None:
    done = run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvroute {version('kvroute')}"


def test_serve_help_is_grouped_and_keeps_its_brackets() -> None:
    done = run("serve", "--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "[routing]" in text and "[models.NAME]" in text  # not eaten as markup
    for section in ("Fleet:", "Listening:", "Routing:", "Keys and tokens:", "Logs and tracing:"):
        assert re.search(rf"^{section}$", text, re.MULTILINE), section
    assert "--help-settings" in text
    # The per-model settings moved out of it: one of them appears only in --help-settings.
    assert "learn_floor_relax" not in text
    assert len(text.splitlines()) < 90
    assert max(len(line) for line in text.splitlines()) <= 80


def test_help_settings_lists_every_routing_setting_by_group() -> None:
    from kvroute.router_settings import settings_groups
    from kvroute.routing.config import setting_infos

    done = run("serve", "--help-settings")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for info in setting_infos(settings_groups()):
        assert re.search(rf"^  {info.name} = ", text, re.MULTILINE), info.name
    assert '  flow_control = "auto": ' in text and "  sticky = true: " in text
    headings = [line for line in text.splitlines() if re.match(r"^[A-Z]\w+: ", line)]
    assert [h.split(":")[0] for h in headings] == ["Placement", "Cache", "Overload", "Guard", "Listener"]
    assert "least-loaded: the lowest 4 x waiting + running" in text
    assert max(len(line) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("command", ["sim", "serve", "bench", "demo", "doctor", "canary"])
def test_no_option_name_is_cut_at_80_columns(command: str) -> None:
    done = run(command, "--help")
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout
    if command == "sim":
        for name in ("--enable-prefix-caching", "--no-enable-prefix-caching", "--num-gpu-blocks-override",
                     "--max-num-batched-tokens"):
            assert name in done.stdout


def test_canary_help_says_which_model_it_asks() -> None:
    done = run("canary", "--help")
    flat = " ".join(done.stdout.split())
    assert "Model to ask ." not in flat
    assert "Model to ask (default: the first model /v1/models lists)." in flat
