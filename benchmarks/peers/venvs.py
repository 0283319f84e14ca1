"""One virtual environment per peer router, created once and kept in a cache directory.

The peers are Rust binaries shipped as Python wheels; each gets its own environment so that their
dependencies never meet kvroute's.  An environment counts as ready when the pinned version's
``.dist-info`` is present; otherwise it is (re)built with ``python -m venv`` and ``pip install``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def default_cache() -> Path:
    """``$KVROUTE_PEERS_HOME``, else ``$XDG_CACHE_HOME/kvroute-peers``, else ``~/.cache/kvroute-peers``."""
    explicit = os.environ.get("KVROUTE_PEERS_HOME")
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvroute-peers"


DEFAULT_CACHE = default_cache()


class PeerInstallError(RuntimeError):
    """A peer router could not be installed."""


def installed(venv: Path, package: str, version: str) -> bool:
    """Whether ``package==version`` is installed in ``venv``."""
    dist = f"{package.replace('-', '_')}-{version}.dist-info"
    return any(venv.glob(f"lib/python*/site-packages/{dist}"))


def ensure_peer(cache: Path, package: str, version: str) -> Path:
    """The environment of ``package==version`` under ``cache``, installing it if needed."""
    venv = cache / package
    if installed(venv, package, version):
        return venv
    cache.mkdir(parents=True, exist_ok=True)
    steps = ([sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              f"{package}=={version}"])
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise PeerInstallError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    if not installed(venv, package, version):
        raise PeerInstallError(f"{package}=={version} is not in {venv} after installing it")
    return venv
