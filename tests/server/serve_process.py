"""Waiting for a ``kvroute serve`` subprocess, shared by the tests that run the real command."""

from __future__ import annotations

import asyncio
import subprocess

import aiohttp


async def wait_ready(http: aiohttp.ClientSession, url: str,
                     proc: asyncio.subprocess.Process | subprocess.Popen[bytes],
                     path: str = "/ready") -> None:
    """Return once the server at ``url`` answers ``path`` with 200; fail (with its stderr, for an
    asyncio process) if the process exits first, or after 30 s."""
    for _ in range(600):
        code = proc.poll() if isinstance(proc, subprocess.Popen) else proc.returncode
        if code is not None:
            err = ""
            if isinstance(proc, asyncio.subprocess.Process) and proc.stderr is not None:
                err = (await proc.stderr.read()).decode()
            raise AssertionError(f"the process serving {url} exited with {code}: {err}")
        try:
            async with http.get(url + path) as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never became ready")
