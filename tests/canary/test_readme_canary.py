"""README.md's canary line against README.md's simulator line behind a router, with the
arguments read from README.md itself: only the ports are this test's own (free ones)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

from kvroute.router_settings import Settings, parse_worker_spec
from kvroute.server.app import start_router
from readme_commands import command

KVROUTE = [sys.executable, "-c", "from kvroute.cli import main; main()"]


async def test_the_readme_canary_passes_against_the_readme_simulator() -> None:
    sim_line, canary_line = command("kvroute", "sim"), command("kvroute", "canary")
    replicas = int(sim_line.option("--replicas"))
    sim = subprocess.Popen([*KVROUTE, "sim", *sim_line.replaced("--port", "0")],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    router = None
    try:
        assert sim.stdout is not None
        sim.stdout.readline()  # the banner
        urls = [sim.stdout.readline().strip() for _ in range(replicas)]
        assert all(u.startswith("http://127.0.0.1:") for u in urls), urls
        # `kvroute serve --worker URL ...` with its defaults, in front of the README's replicas.
        router = await start_router(Settings.load(env={}).replace(
            workers=tuple(parse_worker_spec(u) for u in urls)))
        canary = await asyncio.create_subprocess_exec(
            *KVROUTE, "canary", *canary_line.replaced("--target", router.url),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "COLUMNS": "200"})
        out, err = await asyncio.wait_for(canary.communicate(), 100)
    finally:
        if router is not None:
            await router.close()
        sim.terminate()
        sim.wait(20)
    text = out.decode() + err.decode()
    assert canary.returncode == 0, text
    assert "PASS" in text and "150 requests: 150 correct" in text, text
