"""``kvroute sim``'s replicas plus a placement log, in their own process.

    PYTHONPATH=benchmarks python -m peers.simfleet --preset a4000-qwen3-4b --replicas 4 \
        --port 0 --speed 10 [--sim-opt NAME=VALUE ...]

The replicas are the simulator's own (``SimReplica``, built as ``start_sim_fleet`` builds them);
the only addition is a middleware that notes which replica each agent-workload generation request
reached (see ``placements.py``) and ``GET /peers/placements`` on every replica, which returns the
whole fleet's log.  Once listening, the process prints one JSON line ``{"urls": [...]}`` on stdout,
then serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from kvroute.event_loop import run_event_loop
from kvroute.sim.presets import build_config
from kvroute.sim.server import ReplyOptions, SimReplica
from peers.placements import Placement, identify

_GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_value(raw: str) -> Any:
    """A ``--sim-opt`` value: int, float, true/false, or the text itself."""
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            continue
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return raw


def placement_middleware(log: list[Placement], replica: SimReplica) -> Any:
    """Note (session, round) -> the replica's ``host:port`` for every generation request."""

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and request.path in _GENERATION_PATHS:
            found = identify(await request.read())   # aiohttp keeps the body for the handler
            if found is not None:
                log.append(Placement(found[0], found[1], replica.url.removeprefix("http://")))
        return await handler(request)

    return record


async def start_fleet(preset: str, replicas: int, port: int, speed: float,
                      overrides: dict[str, Any]) -> tuple[list[SimReplica], list[Placement]]:
    """Start the replicas on 127.0.0.1 (``port`` 0: free ports) with one shared placement log."""
    overrides = dict(overrides)
    reply_fields = {f.name for f in dataclasses.fields(ReplyOptions)}
    reply = ReplyOptions(**{k: overrides.pop(k) for k in list(overrides) if k in reply_fields})
    config = build_config(preset, None, **overrides)
    log: list[Placement] = []

    async def placements(request: web.Request) -> web.Response:
        body = orjson.dumps([dataclasses.astuple(p) for p in log])
        return web.Response(body=body, content_type="application/json")

    fleet: list[SimReplica] = []
    try:
        for i in range(replicas):
            replica = SimReplica(i, config, served_model=config.model, speed=speed, options=reply,
                                 preset=preset)
            replica.app.router.add_get("/peers/placements", placements)
            replica.app.middlewares.append(placement_middleware(log, replica))
            fleet.append(replica)
            await replica.start("127.0.0.1", port + i if port else 0)
    except BaseException:
        await asyncio.gather(*(r.close() for r in fleet))
        raise
    return fleet, log


async def serve(preset: str, replicas: int, port: int, speed: float, overrides: dict[str, Any]) -> None:
    """Start the replicas, print their URLs as one JSON line, serve until SIGTERM/SIGINT."""
    fleet, _ = await start_fleet(preset, replicas, port, speed, overrides)
    try:
        sys.stdout.write(orjson.dumps({"urls": [r.url for r in fleet]}).decode() + "\n")
        sys.stdout.flush()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await asyncio.gather(*(r.close() for r in fleet))


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="a4000-qwen3-4b")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--port", type=int, default=0, help="first port (0: free ports)")
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--sim-opt", action="append", default=[], metavar="NAME=VALUE")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    for item in args.sim_opt:
        key, sep, raw = item.partition("=")
        if not sep:
            parser.error(f"--sim-opt expects NAME=VALUE, got {item!r}")
        overrides[key.strip().replace("-", "_")] = parse_value(raw)
    run_event_loop(serve(args.preset, args.replicas, args.port, args.speed, overrides))


if __name__ == "__main__":
    main()
