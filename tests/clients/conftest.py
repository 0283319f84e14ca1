"""Real clients (the Claude Code CLI from npm) through a real router to simulated replicas.

When ``npm`` is missing the CLI cannot be had, the test is skipped, and the run ends with a banner
saying so: a green run without the main client's evidence must not pass unnoticed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from claude_cli import SKIP_PREFIX, find_claude, install_claude


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    """The Claude Code CLI: found, else installed from npm, else (no npm) a loud skip."""
    found = find_claude()
    if found is not None:
        return found
    if shutil.which("npm") is None:
        pytest.skip(f"{SKIP_PREFIX}: npm is not installed, so @anthropic-ai/claude-code cannot be")
    return install_claude()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say loudly, at the end of the run, that the real Claude Code test did not run."""
    skipped = terminalreporter.stats.get("skipped", [])
    if any(SKIP_PREFIX in str(getattr(report, "longrepr", "")) for report in skipped):
        terminalreporter.write_sep("!", "Claude Code CLI test SKIPPED: install npm (Node.js)", red=True)
