"""Sick replicas behind the router: the figures of docs/reliability.md, "Sick replicas".

Three scenarios, each against three simulated replicas and a real router over loopback HTTP:

* ``hang``: one replica hangs every request before its first byte (``--fault hang``): how many
  failed attempts before its breaker opens, the slowest request, failed requests;
* ``hang:0.1``: it hangs one request in ten: the slowest request against the first-byte deadline
  plus one retry, failed requests;
* ``kill``: 20 concurrent streams, then one replica (a separate ``kvroute sim`` process) is killed
  with SIGKILL: failed requests that had not started streaming (the goal: none), and those cut
  mid-stream (a stream already under way cannot move: its client gets an error event).

    PYTHONPATH=src python3 benchmarks/chaos_upstream.py [--requests 300] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import RunningRouter, start_router
from kvroute.sim.faults import Fault
from kvroute.sim.server import start_sim_fleet

PRESET = "a4000-qwen3-4b"
MODEL = "qwen3-4b"
SPEED = 20.0
FLOOR_S = 1.0  # first_byte_floor_s: the simulated replicas answer in milliseconds


@dataclass
class Figures:
    scenario: str
    requests: int
    failed: int
    failed_not_started: int
    max_s: float
    p99_s: float
    deadline_s: float
    first_byte_timeouts: int
    breaker_opened: bool
    sent_after_open: int | None


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"request {i}: " + "tell me about the sea. " * 60}]


async def _stream(http: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> tuple[bool, bool, float]:
    """One streamed chat request: (completed, the client got bytes, seconds)."""
    body = {"model": MODEL, "messages": _messages(i), "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    got = False
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return False, False, time.perf_counter() - t0
            async for chunk in resp.content.iter_any():
                got = got or bool(chunk)
                if b'"error"' in chunk:
                    return False, got, time.perf_counter() - t0
            return True, got, time.perf_counter() - t0
    except aiohttp.ClientError:
        return False, got, time.perf_counter() - t0


async def _first_byte_timeouts(http: aiohttp.ClientSession, r: RunningRouter) -> int:
    async with http.get(r.url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith('kvroute_failures_total{reason="first_byte_timeout"}'):
                return int(float(line.split()[-1]))
    return 0


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


async def hang(rate: float, requests: int, concurrency: int) -> Figures:
    """One replica of three hangs ``rate`` of its requests before the first byte."""
    fleet = await start_sim_fleet(PRESET, 3, speed=SPEED)
    fleet.replicas[0].faults.set(Fault("hang", rate=rate))
    settings = Settings(workers=tuple(WorkerSpec(u) for u in fleet.urls), policy="round-robin",
                        first_byte_floor_s=FLOOR_S, probe_interval_s=0.5, breaker_cooldown_s=600.0,
                        breaker_max_cooldown_s=600.0)
    r = await start_router(settings)
    victim = next(rec for rec in r.registry.records() if rec.state.url == fleet.urls[0])
    sent_at_open: int | None = None

    def sent_there() -> int:
        # Attempts the router sent to the victim (decisions committed, by kind).
        kinds = r.router.dispatch.scheduler.stats()["workers"].get(victim.id, {})
        return sum(v for k, v in kinds.items()
                   if k in ("sticky", "overflow", "prefix_hit", "cold", "balance"))

    async def watch() -> None:
        # The breaker opens inside the router's own event loop: noting the count within a
        # millisecond of it is exact enough (an attempt takes longer than that to be decided).
        nonlocal sent_at_open
        while sent_at_open is None:
            if victim.breaker.state.value != "closed":
                sent_at_open = sent_there()
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    try:
        async with aiohttp.ClientSession() as http:
            sem = asyncio.Semaphore(concurrency)

            async def one(i: int) -> tuple[bool, bool, float]:
                async with sem:
                    return await _stream(http, r.url, i, 16)

            results = await asyncio.gather(*(one(i) for i in range(requests)))
            timeouts = await _first_byte_timeouts(http, r)
            sent = sent_there()
    finally:
        watcher.cancel()
        await r.close()
        await fleet.close()
    times = [t for _, _, t in results]
    return Figures(f"hang:{rate:g} 1 of 3, conc {concurrency}", requests,
                   sum(1 for ok, _, _ in results if not ok),
                   sum(1 for ok, got, _ in results if not ok and not got), max(times), _p99(times),
                   FLOOR_S, timeouts, victim.breaker.ejections["failures"] > 0,
                   None if sent_at_open is None else sent - sent_at_open)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def kill(concurrent: int) -> Figures:
    """``concurrent`` streams over three replica processes; one is killed with SIGKILL mid-way."""
    ports = [_free_port() for _ in range(3)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), "src") if p)}
    procs = [subprocess.Popen(
        [sys.executable, "-c", "from kvroute.cli import main; main()", "sim", "--preset", PRESET,
         "--port", str(port), "--speed", "5", "--log-level", "WARNING"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    r: RunningRouter | None = None
    try:
        async with aiohttp.ClientSession() as http:
            for url in urls:  # wait for the processes to listen
                for _ in range(200):
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(url + "/health") as resp:
                            if resp.status == 200:
                                break
                    await asyncio.sleep(0.05)
            settings = Settings(workers=tuple(WorkerSpec(u) for u in urls), first_byte_floor_s=30.0,
                                probe_interval_s=0.5)
            r = await start_router(settings)
            victim = next(rec for rec in r.registry.records() if rec.state.url == urls[0])
            tasks = [asyncio.create_task(_stream(http, r.url, 5000 + i, 128)) for i in range(concurrent)]
            for _ in range(500):
                if victim.state.inflight >= 3:
                    break
                await asyncio.sleep(0.01)
            inflight_at_kill = victim.state.inflight
            procs[0].send_signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
    finally:
        if r is not None:
            await r.close()
        for p in procs:
            p.kill()
            p.wait()
    times = [t for _, _, t in results]
    print(f"  (killed replica had {inflight_at_kill} of the requests in flight)", file=sys.stderr)
    return Figures(f"kill -9 under {concurrent} streams", concurrent,
                   sum(1 for ok, _, _ in results if not ok),
                   sum(1 for ok, got, _ in results if not ok and not got), max(times), _p99(times), 30.0,
                   0, False, None)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # One at a time, every failure there is counted before the next request is sent; with
    # concurrency, the attempts already under way when the breaker opens fail too (and are retried).
    figures = [await hang(1.0, 30, 1), await hang(1.0, 60, args.concurrency),
               await hang(0.1, args.requests, args.concurrency), await kill(20)]
    if args.json:
        print(json.dumps([asdict(f) for f in figures], indent=2))
        return
    print(f"{'scenario':28} {'requests':>8} {'failed':>6} {'failed, not started':>19} {'max s':>6} "
          f"{'p99 s':>6} {'deadline s':>10} {'fb timeouts':>11} {'sent after open':>15}")
    for f in figures:
        opened: Any = f.sent_after_open if f.breaker_opened else "-"
        print(f"{f.scenario:28} {f.requests:8d} {f.failed:6d} {f.failed_not_started:19d} {f.max_s:6.2f} "
              f"{f.p99_s:6.2f} {f.deadline_s:10.1f} {f.first_byte_timeouts:11d} {opened!s:>15}")


if __name__ == "__main__":
    asyncio.run(main())
