"""CPU per request of the listening side alone (``server/front.py``): parsing, queueing, the
handler call and writing a small answer, without routing or an upstream.  The figure
bench_router_overhead.py cannot isolate on a busy machine, where its per-request CPU varies by
tens of percent from run to run.

A ``FrontServer`` with a handler that answers at once runs in a child process; this process sends
it ``--requests`` pipelined requests shaped like an SDK's chat request (11 headers, a 1.2 KB JSON
body) on ``--connections`` keep-alive connections, and reads the child's CPU time (user + system)
from /proc before and after.  Run it for two versions back to back with their own PYTHONPATH:

    PYTHONPATH=/path/to/base/src python benchmarks/bench_front_parse.py
    PYTHONPATH=src python benchmarks/bench_front_parse.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

SERVER = r"""
import asyncio, sys
from kvroute.server.front import FrontServer

async def handle(request, writer):
    writer.respond(200, b"content-type: application/json\r\n", b'{"ok":true}')

async def main():
    server = FrontServer(handle, max_body_bytes=32 * 1024 * 1024)
    port = await server.start("127.0.0.1", 0)
    print(port, flush=True)
    await asyncio.Event().wait()

try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
asyncio.run(main())
"""

BODY = orjson.dumps({"model": "qwen3-4b", "max_tokens": 16, "stream": True, "messages": [
    {"role": "system", "content": "You are a helpful assistant. " * 10},
    {"role": "user", "content": "tell me something about routing and caches. " * 20}]})
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\naccept-encoding: gzip, deflate\r\n"
           b"connection: keep-alive\r\naccept: application/json\r\ncontent-type: application/json\r\n"
           b"user-agent: OpenAI/Python 1.54.0\r\nx-stainless-lang: python\r\nx-stainless-os: Linux\r\n"
           b"x-stainless-runtime: CPython\r\nauthorization: Bearer sk-xxxxxxxxxxxxxxxxxxxxxxxx\r\n"
           b"content-length: %d\r\n\r\n" % len(BODY) + BODY)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def client(port: int, requests: int, batch: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    answer_end = b'{"ok":true}'
    sent = 0
    while sent < requests:
        n = min(batch, requests - sent)
        writer.write(REQUEST * n)
        sent += n
        seen = 0
        buf = b""
        while seen < n:
            buf += await reader.read(1 << 20)
            seen = buf.count(answer_end)
    writer.close()


async def run(args: argparse.Namespace) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    try:
        per_conn = args.requests // args.connections
        await asyncio.gather(*(client(port, 500, args.batch) for _ in range(args.connections)))  # warm up
        figures = []
        for _ in range(args.rounds):
            cpu = cpu_seconds(proc.pid)
            start = time.perf_counter()
            await asyncio.gather(*(client(port, per_conn, args.batch) for _ in range(args.connections)))
            wall = time.perf_counter() - start
            figures.append((cpu_seconds(proc.pid) - cpu) / (per_conn * args.connections) * 1e6)
            print(f"round: {figures[-1]:.1f} µs of server CPU per request ({wall:.1f} s)", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(10)
    figures.sort()
    print(f"front CPU per request: median {figures[len(figures) // 2]:.1f} µs, min {figures[0]:.1f} µs "
          f"({args.rounds} rounds of {per_conn * args.connections} requests, {args.connections} connections, "
          f"{args.batch} pipelined)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40000)
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="requests pipelined at a time per connection")
    p.add_argument("--rounds", type=int, default=5)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
