"""Produce the README's dashboard screenshot from a run with realistic traffic.

    python tests/dashboard/make_screenshot.py --out docs/img/dashboard.png

Starts simulated a4000-qwen3-4b replicas and a router with the dashboard, runs agent-like sessions
(a shared system prompt, growing histories, pauses between turns) for ``--seconds``, then opens the
page in Debian's chromium and saves a screenshot.  Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from pathlib import Path

import aiohttp
from dashboard_browser import open_dashboard
from dashboard_traffic import run_session

from kvroute.router_settings import Settings
from kvroute.server.app import start_router
from kvroute.server.dashboard import setup_dashboard
from kvroute.sim.server import start_sim_fleet


async def agents(url: str, model: str, slots: int, until: float, seed: int) -> None:
    """Keep ``slots`` conversations going until ``until``: each ends after a random number of turns
    and a new one takes its slot."""
    rng = random.Random(seed)
    counter = iter(range(10**6))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:
        async def slot() -> None:
            while time.monotonic() < until:
                await run_session(client, url, model, next(counter), turns=rng.randint(6, 18),
                                  system_words=rng.choice((1500, 3000)), turn_words=rng.randint(100, 400),
                                  max_tokens=rng.randint(32, 96), deadline=until,
                                  pause_s=rng.uniform(0.5, 2.5))
        await asyncio.gather(*(slot() for _ in range(slots)))


async def main(args: argparse.Namespace) -> None:
    fleet = await start_sim_fleet(args.preset, args.replicas, speed=args.speed)
    router = await start_router(Settings.from_dict({"workers": fleet.urls}), setup=[setup_dashboard])
    try:
        await agents(router.url, fleet.replicas[0].served_model, args.sessions,
                     time.monotonic() + args.seconds, seed=1)
        # Leave a few requests in flight so the running/in-flight columns are not all zero.
        tail = asyncio.create_task(agents(router.url, fleet.replicas[0].served_model, args.sessions,
                                          time.monotonic() + 30, seed=2))
        await asyncio.sleep(3)
        await open_dashboard(router.url, Path(args.out), width=args.width, height=args.height)
        tail.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tail
    finally:
        await router.close()
        await fleet.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="test-output/dashboard.png")
    parser.add_argument("--preset", default="a4000-qwen3-4b")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--speed", type=float, default=2.0)
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--height", type=int, default=900)
    asyncio.run(main(parser.parse_args()))
