"""A bounded, light soak of `kvroute serve` in front of `kvroute sim` replicas: does the router's
memory level off?  (issue 24: RSS rose ~0.35 MB per 30 s over 5 minutes without levelling.)

A few client loops send a steady mix (chat and Anthropic messages, streamed and not, /health,
/v1/models; a tenth of the requests on a new connection) for ``--minutes``; the router's RSS is
sampled every ``--sample-s`` and printed with the requests served so far.  ``--fresh`` is the
share of requests whose prompt is new text (the prefix index and the session table then grow
until their own bounds, which is what they are for); 0 repeats a fixed set of conversations.

``--tracemalloc`` runs the same router (``start_router`` with the dashboard, on uvloop, as
``kvroute serve`` does) in a child process with tracemalloc on, which writes a snapshot at every
sample; at the end the Python allocations that grew most between the first sample after the
warm-up and the last are printed, by line.  (tracemalloc slows the router and adds its own
memory: RSS figures are only comparable between runs of the same mode.)

    python benchmarks/soak.py --minutes 5
    python benchmarks/soak.py --minutes 3 --rate 0 --tracemalloc
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # developer tooling, not in the wheel
from bench_router_overhead import free_ports
from chaos import KVROUTE, MODEL, rss_kib, wait_ready

from kvroute_dev.raw_http import exchange, post

WORDS = ("the", "router", "keeps", "each", "conversation", "on", "the", "replica", "that", "holds", "its",
         "prefix", "so", "that", "the", "engine", "reuses", "the", "cached", "blocks", "instead", "of",
         "computing", "the", "prompt", "again")


class Load:
    """Steady traffic from ``clients`` loops; counts what came back."""

    def __init__(self, url: str, clients: int, fresh: float, seed: int, rate: float) -> None:
        self.url = url
        self.clients = clients
        # Each loop waits for its turn: ``rate`` requests per second in all (0: as fast as answered).
        self.interval = clients / rate if rate > 0 else 0.0
        self.fresh = fresh
        self.rng = random.Random(seed)
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.errors = 0
        # 64 conversations of up to 8 turns; a finished one starts over (the same text, unless fresh).
        self.conversations: list[list[dict[str, str]]] = [[] for _ in range(64)]

    def _prompt(self, conv: list[dict[str, str]], i: int) -> list[dict[str, str]]:
        if len(conv) >= 16:
            conv.clear()
        fresh = self.rng.random() < self.fresh
        words = (self.rng.sample(WORDS, 12) if fresh else WORDS[(len(conv) + i) % 8:][:12])
        conv.append({"role": "user", "content": f"conversation {i}: " + " ".join(words)})
        conv.append({"role": "assistant", "content": "noted"})
        return conv[:-1]

    def _request(self) -> tuple[str, str, bytes | None]:
        roll = self.rng.random()
        if roll < 0.05:
            return "GET", "/health", None
        if roll < 0.1:
            return "GET", "/v1/models", None
        i = self.rng.randrange(len(self.conversations))
        messages = self._prompt(self.conversations[i], i)
        stream = self.rng.random() < 0.6
        if roll < 0.55:
            doc: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "stream": stream, "messages": messages}
            return "POST", "/v1/chat/completions", orjson.dumps(doc)
        doc = {"model": MODEL, "max_tokens": 16, "stream": stream, "messages": messages,
               "metadata": {"user_id": f"session-{i}"}}
        return "POST", "/v1/messages", orjson.dumps(doc)

    def _count(self, status: int) -> None:
        self.sent += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1

    async def _client(self, session: aiohttp.ClientSession, until: float) -> None:
        turn = time.monotonic()
        while time.monotonic() < until:
            turn += self.interval
            if (wait := turn - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            method, path, body = self._request()
            try:
                if self.rng.random() < 0.1:  # a new connection, as a short-lived client would
                    data = (post(path.encode(), body) if body is not None
                            else f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                    conv = await exchange(self.url, data, count=1, timeout=30)
                    self._count(conv.answers[0].status if conv.answers else 0)
                    continue
                async with session.request(method, self.url + path, data=body,
                                           headers={"content-type": "application/json"}) as resp:
                    await resp.read()
                    self._count(resp.status)
            except (aiohttp.ClientError, OSError, TimeoutError):
                self.errors += 1
                await asyncio.sleep(0.1)

    async def run(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, until) for _ in range(self.clients)))


async def _ready(url: str, path: str) -> None:
    while True:
        with contextlib.suppress(RuntimeError):
            await wait_ready(url, path)
            return


# --- the router under tracemalloc (a child process) -----------------------------------------------

async def _traced_router(port: int, workers: list[str], snapshots: Path, sample_s: float) -> None:
    from kvroute.router_settings import Settings, parse_worker_spec
    from kvroute.server.app import start_router
    from kvroute.server.dashboard import setup_dashboard

    settings = Settings.load(overrides={"port": port}).replace(
        workers=tuple(parse_worker_spec(u) for u in workers))
    running = await start_router(settings, host="127.0.0.1", port=port, setup=(setup_dashboard,))
    n = 0
    try:
        while True:
            await asyncio.sleep(sample_s)
            part = snapshots / f"{n:04d}.part"
            tracemalloc.take_snapshot().dump(str(part))
            part.rename(part.with_suffix(".snap"))  # whole snapshots only, if the router is stopped
            n += 1
    finally:
        await running.close()


def traced_router_main(argv: list[str]) -> None:
    """``soak.py _traced PORT SNAPSHOT_DIR SAMPLE_S WORKER...``: the child of ``--tracemalloc``."""
    from kvroute.event_loop import run_event_loop

    port, snapshots, sample_s, *workers = argv
    tracemalloc.start(8)
    run_event_loop(_traced_router(int(port), workers, Path(snapshots), float(sample_s)))


def print_growth(snapshots: Path, first: int, top: int) -> None:
    """The allocations that grew most from snapshot ``first`` to the last, by line and by stack."""
    files = sorted(snapshots.glob("*.snap"))
    if len(files) <= first + 1:
        print("not enough tracemalloc snapshots to compare")
        return
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__),
              tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    old = tracemalloc.Snapshot.load(str(files[first])).filter_traces(ignore)
    new = tracemalloc.Snapshot.load(str(files[-1])).filter_traces(ignore)
    total_old = sum(s.size for s in old.statistics("filename"))
    total_new = sum(s.size for s in new.statistics("filename"))
    print(f"## tracemalloc: snapshot {first} -> {len(files) - 1}: traced Python memory "
          f"{total_old / 2**20:.2f} -> {total_new / 2**20:.2f} MiB ({(total_new - total_old) / 2**20:+.2f})")
    for stat in new.compare_to(old, "lineno")[:top]:
        print(f"{stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  {stat.traceback[0]}")
    print("### largest growth by stack")
    for stat in new.compare_to(old, "traceback")[:5]:
        print(f"{stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks")
        for frame in stat.traceback.format()[-12:]:
            print("    " + frame)


async def main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="kvroute-soak-"))
    sim_port = free_ports(args.replicas)
    sim = subprocess.Popen(
        [*KVROUTE, "sim", "--preset", "a4000-qwen3-4b", "--replicas", str(args.replicas), "--port",
         str(sim_port), "--speed", str(args.speed)],
        stdout=subprocess.DEVNULL, stderr=open(logs / "sim.log", "w"))  # noqa: SIM115
    workers = [f"http://127.0.0.1:{sim_port + i}" for i in range(args.replicas)]
    port = free_ports(1)
    snapshots = logs / "snapshots"
    snapshots.mkdir()
    if args.tracemalloc:
        cmd = [sys.executable, __file__, "_traced", str(port), str(snapshots), str(args.sample_s), *workers]
    else:
        cmd = [*KVROUTE, "serve", *[a for u in workers for a in ("--worker", u)], "--port", str(port),
               "--log-level", "warning"]
    router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(logs / "router.log", "w"),  # noqa: SIM115
                              env={**os.environ, "KVROUTE_ADMIN_TOKEN": ""})
    url = f"http://127.0.0.1:{port}"
    print(f"cpus={os.cpu_count()} load average {os.getloadavg()[0]:.2f}; {args.clients} clients at "
          f"{args.rate:g} requests/s, {args.minutes:g} min, fresh prompts {args.fresh:.0%}, tracemalloc "
          f"{args.tracemalloc}; logs in {logs}")
    try:
        async with asyncio.timeout(300):  # a loaded machine, a router under tracemalloc: slow starts
            for u in workers:
                await _ready(u, "/health")
            await _ready(url, "/ready")
        load = Load(url, args.clients, args.fresh, args.seed, args.rate)
        running = asyncio.create_task(load.run(args.minutes * 60))
        start = time.monotonic()
        print(f"{'min':>6} {'RSS MiB':>8} {'growth':>8} {'requests':>9} {'req/s':>6}")
        base: int | None = None
        last_sent, last_t = 0, start
        while not running.done():
            await asyncio.wait({running}, timeout=args.sample_s)
            now = time.monotonic()
            rss = rss_kib(router.pid)[0]
            base = rss if base is None else base
            rate = (load.sent - last_sent) / max(now - last_t, 1e-9)
            last_sent, last_t = load.sent, now
            print(f"{(now - start) / 60:6.1f} {rss / 1024:8.2f} {(rss - base) / 1024:+8.2f} {load.sent:9d} "
                  f"{rate:6.1f}", flush=True)
        await running
        print(f"statuses {dict(sorted(load.statuses.items()))}, client errors {load.errors}")
    finally:
        router.terminate()
        router.wait(60)
        sim.terminate()
        sim.wait(30)
    if args.tracemalloc:
        print_growth(snapshots, args.warmup_samples, args.top)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=4, help="client loops (default 4)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second in all (default 20; 0: "
                   "as fast as they are answered)")
    p.add_argument("--fresh", type=float, default=0.0, help="share of prompts that are new text (default 0)")
    p.add_argument("--sample-s", type=float, default=30.0, help="RSS sample period (default 30 s)")
    p.add_argument("--tracemalloc", action="store_true", help="trace the router's allocations")
    p.add_argument("--warmup-samples", type=int, default=1,
                   help="snapshots skipped before comparing (default 1)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--speed", type=float, default=20.0, help="simulated replicas' speed-up (default 20)")
    p.add_argument("--seed", type=int, default=24)
    return p.parse_args()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_traced":
        traced_router_main(sys.argv[2:])
    else:
        asyncio.run(main(parse_args()))
