"""Waiting for a ``kvroute serve`` subprocess, shared by the tests that run the real command."""

from __future__ import annotations

import asyncio

import aiohttp


async def wait_ready(http: aiohttp.ClientSession, url: str, proc: asyncio.subprocess.Process) -> None:
    """Return once the router at ``url`` answers ``/ready`` with 200; fail with its stderr if the
    process exits first, or after 30 s."""
    for _ in range(600):
        if proc.returncode is not None:
            err = (await proc.stderr.read()).decode() if proc.stderr is not None else ""
            raise AssertionError(f"kvroute serve exited with {proc.returncode}: {err}")
        try:
            async with http.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never became ready")
