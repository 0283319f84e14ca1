"""Bytecodes per small request in ``kvroute serve``, by function and by module: the replicas,
bodies and client of bench_router_overhead.py, the router with ``sitecustomize.py`` (this folder)
counting between two signals.

    python benchmarks/opcode_probe/run.py --requests 400            # streaming
    python benchmarks/opcode_probe/run.py --requests 400 --plain    # non-streaming
    python benchmarks/opcode_probe/run.py --src /other/checkout/src ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench_router_overhead import KVROUTE, free_ports, load, start_router, wait_ready  # noqa: E402


async def main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="kvroute-opcodes-"))
    env = {**os.environ, "KVROUTE_ADMIN_TOKEN": "", "KVROUTE_OPCODE_PROBE": str(logs),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    sim_port = free_ports(args.replicas)
    sim = subprocess.Popen(
        [*KVROUTE, "sim", "--preset", "a4000-qwen3-4b", "--replicas", str(args.replicas),
         "--port", str(sim_port), "--speed", "1000", "--max-num-seqs", "256"], stdout=subprocess.DEVNULL,
        stderr=open(logs / "sim.log", "w"), env={**os.environ})  # noqa: SIM115
    urls = [f"http://127.0.0.1:{sim_port + i}" for i in range(args.replicas)]
    port = free_ports(1)
    router = start_router("router", args.src, [a for u in urls for a in ("--worker", u)], port,
                          args.log_level, logs, env)
    url = f"http://127.0.0.1:{port}"
    stream = not args.plain
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            for u in urls:
                await wait_ready(http, u, "/health")
            await wait_ready(http, url, "/ready")
            await load(http, "warmup", [url], args.concurrency, 300, args.max_tokens, 10**6, stream)
            router.send_signal(signal.SIGUSR1)
            await asyncio.sleep(0.5)
            await load(http, "router", [url], args.concurrency, args.requests, args.max_tokens, 0, stream)
            router.send_signal(signal.SIGUSR2)
            out = logs / f"opcodes.{router.pid}.txt"
            for _ in range(100):
                if out.exists() and out.stat().st_size:
                    break
                time.sleep(0.1)
            await asyncio.sleep(0.5)
    finally:
        for proc in (router, sim):
            proc.terminate()
            proc.wait(30)
    summarise(out, args.requests, args.top)


def summarise(path: Path, requests: int, top: int) -> None:
    """Per request: the functions by their own bytecodes and by inclusive ones, the modules."""
    rows = []
    for line in path.read_text().splitlines():
        own, under, calls, where = line.split(" ", 3)
        rows.append((int(own), int(under), int(calls), where))
    total = sum(r[0] for r in rows)
    print(f"{total / requests:,.0f} bytecodes per request ({requests} requests)")
    modules: Counter[str] = Counter()
    for own, _, _, where in rows:
        modules[where.split(":")[0]] += own
    print("\n| module | bytecodes per request (self) | share |\n|---|---:|---:|")
    for name, n in modules.most_common(top):
        print(f"| {name} | {n / requests:,.0f} | {n / total:.1%} |")
    for title, key in (("self", 0), ("inclusive", 1)):
        print(f"\n| function ({title}) | bytecodes per request | share | calls per request |")
        print("|---|---:|---:|---:|")
        for row in sorted(rows, key=lambda r: -r[key])[:top]:
            print(f"| {row[3]} | {row[key] / requests:,.0f} | {row[key] / total:.1%} "
                  f"| {row[2] / requests:.2f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", action="store_true", help="non-streaming requests")
    p.add_argument("--src", help="a router from this checkout's src instead")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--log-level", default="warning", help="router log level (default warning, as the peers)")
    p.add_argument("--top", type=int, default=40)
    asyncio.run(main(p.parse_args()))
