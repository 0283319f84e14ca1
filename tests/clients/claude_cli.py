"""Finding (or installing from npm) the real Claude Code CLI, and running it against a router.

The CLI is looked for in ``$KVROUTE_CLAUDE_BIN``, on ``PATH``, then in the npm cache folder that
``.ci/run`` installs it into (``$KVROUTE_NPM_CACHE``, default ``~/.cache/kvroute-ci/npm``).  When
it is in none of them and ``npm`` exists, it is installed there (``npm install``, the npm
registry; about 10 s and 380 MB, once per machine).  Only a machine without ``npm`` skips.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The version the test was written against; ``KVROUTE_CLAUDE_CODE_VERSION=latest`` tries today's.
CLAUDE_CODE_VERSION = os.environ.get("KVROUTE_CLAUDE_CODE_VERSION", "2.1.332")
NPM_PACKAGE = "@anthropic-ai/claude-code"
SKIP_PREFIX = "CLAUDE CODE CLI NOT AVAILABLE"
# One turn of `claude -p` against simulated replicas takes a few seconds; this only bounds a hang.
TURN_TIMEOUT_S = 120.0


def npm_cache() -> Path:
    """Where ``.ci/run`` and this module install the CLI (kept between runs)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvroute-ci" / "npm"
    return Path(os.environ.get("KVROUTE_NPM_CACHE", default))


def find_claude() -> Path | None:
    """The ``claude`` executable, without installing anything."""
    explicit = os.environ.get("KVROUTE_CLAUDE_BIN")
    if explicit:
        return Path(explicit)
    on_path = shutil.which("claude")
    if on_path:
        return Path(on_path)
    cached = npm_cache() / "node_modules" / ".bin" / "claude"
    return cached if cached.exists() else None


def install_claude() -> Path:
    """``npm install`` the pinned CLI into the cache folder; raises with npm's output on failure."""
    prefix = npm_cache()
    prefix.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                           f"{NPM_PACKAGE}@{CLAUDE_CODE_VERSION}"],
                          capture_output=True, text=True, timeout=600, check=False)
    binary = prefix / "node_modules" / ".bin" / "claude"
    if done.returncode != 0 or not binary.exists():
        raise RuntimeError(f"npm install {NPM_PACKAGE} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return binary


@dataclass(frozen=True)
class Turn:
    """What one ``claude -p`` run printed."""

    returncode: int
    stdout: str
    stderr: str


async def run_claude(binary: Path, args: list[str], *, base_url: str, home: Path, cwd: Path,
                     api_key: str = "sk-ant-kvroute-test") -> Turn:
    """Run the CLI in print mode against ``base_url`` with a throwaway HOME and ``api_key`` (as
    ``ANTHROPIC_API_KEY``: sent as ``x-api-key``).

    Telemetry, auto-update and every other non-essential request are switched off, so the only
    traffic is to the router; the timeout bounds a hang.
    """
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    proc = await asyncio.create_subprocess_exec(str(binary), *args, cwd=cwd, env=env,
                                                stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), TURN_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return Turn(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))


if __name__ == "__main__":
    # `.ci/run` calls this before the tests, so that the test itself finds the CLI ready.
    print(find_claude() or install_claude())
