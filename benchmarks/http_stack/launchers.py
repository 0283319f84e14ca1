"""Command lines of the two ASGI servers the HTTP-stack prototype ran behind (granian, uvicorn), as
bench.py and probes.py both start them: everything but the application, which comes last."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
APP = "asgi_router:app"


def granian(bindir: Path, port: str) -> list[str]:
    """granian, one worker on uvloop, HTTP/1 only (``port`` may be a ``{port}`` template)."""
    return [str(bindir / "granian"), "--interface", "asgi", "--loop", "uvloop", "--workers", "1",
            "--host", "127.0.0.1", "--port", port, "--no-ws", "--log-level", "warning",
            "--working-dir", str(HERE)]


def uvicorn(bindir: Path, port: str) -> list[str]:
    """uvicorn on uvloop with httptools, no access log."""
    return [str(bindir / "uvicorn"), "--loop", "uvloop", "--http", "httptools", "--ws", "none",
            "--no-access-log", "--log-level", "warning", "--host", "127.0.0.1", "--port", port,
            "--app-dir", str(HERE)]
