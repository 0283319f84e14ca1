"""Hostile clients against `kvroute serve` (issue 17, listening side): the long version of
tests/server/test_front_fuzz.py and test_front_limits.py, printing the figures of
docs/reliability.md.

Processes as in a deployment: simulated replicas (`kvroute sim`), the router (`kvroute serve`, a
fresh one per section so that its memory is measured cleanly) and this client.

* fuzz:      N requests (default 20,000): mutated raw requests (each followed by a well-formed
             GET /health on the same connection), random JSON bodies on every inference route,
             bodies nested 200-1,100 levels deep; counts router 5xx (answers without
             x-kvroute-worker), hangs (no answer and no close within 30 s), well-formed requests
             left unanswered, and kvroute_failures_total{reason="internal"}.
* header:    one 300 MB header value; the answer and the router's RSS growth.
* idle:      1,100 idle connections to a router started with a 1,024 open-file soft limit (hard
             20,000: it raises its own; hard 1,024: it cannot, and closes idle connections at its
             cap), then GET /health latency on new connections.
* shutdown:  SIGTERM with 10 streams longer than shutdown_timeout_s: error events, truncations,
             exit status.
* trailers:  (issue 24) a chunked body followed by a 100 MB trailer, four at once, 10,000
             trailer fields, a 200 KB trailer, a 50 MB chunk extension: the answers, the router's
             RSS growth and peak, and the slowest /health answered meanwhile.
* slow:      (issue 24) 400 clients dripping a body one byte every 3 s against
             max_connections = 300 for 60 s, staying away once cut (as in the campaign), then
             again reconnecting at once (a connection flood), while a complete POST (chat and
             messages in turn) and a GET /health go out every second: what each got, how long it
             took, what became of the drippers, the router's RSS.

    python benchmarks/chaos.py                          # everything (about 5-7 minutes on 2 cores)
    python benchmarks/chaos.py --fuzz 2000 --sections fuzz,header
    python benchmarks/chaos.py --sections trailers,slow
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # developer tooling, not in the wheel
from bench_router_overhead import free_ports

from kvroute_dev.raw_http import HEALTH, Conversation, exchange, mutate, post, read

KVROUTE = [sys.executable, "-c", "from kvroute.cli import main; main()"]
MODEL = "qwen3-4b"
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
          "/v1/responses", "/v1/embeddings"]


# --- processes ---------------------------------------------------------------------------------

def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB: resident now, and the peak so far."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def _limit_files(soft: int, hard: int) -> Callable[[], None]:
    def apply() -> None:  # in the child, before exec: what `prlimit --nofile=SOFT:HARD` does
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return apply


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


async def wait_ready(url: str, path: str = "/ready") -> None:
    for _ in range(600):
        with contextlib.suppress(OSError, TimeoutError):
            conv = await exchange(url, b"GET " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n\r\n", count=1,
                                  timeout=2)
            if conv.answers and conv.answers[0].status == 200:
                return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url}{path} never became ready")


async def start_router(workers: list[str], logs: Path, name: str, env: dict[str, str] | None = None,
                       nofile: tuple[int, int] | None = None) -> Router:
    port = free_ports(1)
    log = logs / f"router-{name}.log"
    args = [*KVROUTE, "serve", *[a for u in workers for a in ("--worker", u)], "--port", str(port),
            "--log-level", "info"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "w"),  # noqa: SIM115
                            env={**os.environ, "KVROUTE_ADMIN_TOKEN": "", **(env or {})},
                            preexec_fn=_limit_files(*nofile) if nofile else None)
    router = Router(proc, f"http://127.0.0.1:{port}", log)
    await wait_ready(router.url)
    return router


def stop(router: Router) -> int:
    if router.proc.poll() is None:
        router.proc.terminate()
    return router.proc.wait(60)


# --- raw HTTP ------------------------------------------------------------------------------------

# --- fuzz ----------------------------------------------------------------------------------------

BASES = [
    post(b"/v1/chat/completions", orjson.dumps({"model": MODEL, "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "hi"}]})),
    post(b"/v1/messages", orjson.dumps({"model": MODEL, "max_tokens": 4, "stream": True,
                                       "messages": [{"role": "user", "content": "hi"}]})),
    post(b"/v1/chat/completions", orjson.dumps({"model": MODEL, "max_tokens": 4, "stream": True,
                                               "messages": [{"role": "user", "content": "hi"}]}),
         b"expect: 100-continue\r\n"),
    b"GET /v1/models HTTP/1.1\r\nhost: x\r\nanthropic-version: 2023-06-01\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (b'{"model":"qwen3-4b",', b'"prompt":"abcdef",',
                                                        b'"max_tokens":2}')) + b"0\r\n\r\n",
    HEALTH,
    b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n",
]
TOKENS = [b"\r\n", b"\n", b"\r", b"\x00", b" ", b":", b"%", b"%00", b"%2F", b"\xff", b"\r\n\r\n",
          b"transfer-encoding: chunked\r\n", b"content-length: 99999999\r\n", b"content-length: -1\r\n",
          b"upgrade: h2c\r\nconnection: upgrade\r\n", b"expect: 100-continue\r\n", b"x" * 70000,
          b"GET / HTTP/1.1\r\n\r\n", b"HTTP/1.1", b"\t", b"{", b"}", b"[" * 300, b"0\r\n\r\n",
          b"".join(b"x-h%d: v\r\n" % i for i in range(200))]
NAMES = ["model", "messages", "role", "content", "type", "text", "tools", "input", "prompt", "system",
         "image_url", "url", "tool_use", "id", "name", "arguments", "function", "tool_calls", "stream",
         "max_tokens", "metadata", "user_id", "source", "data", "instructions", "cache_salt"]


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1 << 70, 3.5, 10**6])
    if kind in (3, 4, 5):
        return rng.choice(["", "hi", MODEL, "user", "assistant", "text", "image_url", "tool_use", "\x00",
                           "é" * 10, "{\"session_id\": 1}"])
    if kind in (6, 7):
        return {rng.choice(NAMES): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def random_body(rng: random.Random, deep: bool) -> bytes:
    doc: dict[str, Any] = {"model": MODEL if rng.random() < 0.8 else random_json(rng), "max_tokens": 4}
    for name in rng.sample(NAMES, rng.randint(0, 5)):
        doc[name] = random_json(rng)
    if rng.random() < 0.5:
        doc["messages"] = [{"role": "user", "content": random_json(rng)} for _ in range(rng.randint(1, 3))]
    if deep:
        target = rng.choice(["tools", "messages", "input", "system", "metadata", "prompt"])
        depth = rng.randint(200, 1100)
        doc[target] = "@@deep@@"
        nested = b"[" + b'{"a":' * depth + b"1" + b"}" * depth + b"]"
        return json.dumps(doc).encode().replace(b'"@@deep@@"', nested)
    return json.dumps(doc).encode()  # integers beyond 64 bits included


async def fuzz(url: str, count: int, seed: int, concurrency: int) -> dict[str, Any]:
    rng = random.Random(seed)
    tally: collections.Counter[str] = collections.Counter()
    statuses: collections.Counter[int] = collections.Counter()
    gate = asyncio.Semaphore(concurrency)

    def record(conv: Conversation) -> None:
        for a in conv.answers:
            statuses[a.status] += 1
            if a.status >= 500 and b"x-kvroute-worker" not in a.headers:
                tally["router_5xx"] += 1
            if not a.complete:
                tally["cut_short"] += 1

    async def attempt(data: bytes, count: int | None = None) -> Conversation | None:
        """One exchange within the concurrency gate, counted (None: it hung or never connected)."""
        async with gate:
            try:
                conv = await exchange(url, data, count=count, timeout=30)
            except TimeoutError:
                tally["hangs"] += 1
                return None
            except OSError:
                tally["connect_errors"] += 1
                return None
        tally["requests"] += 1
        record(conv)
        return conv

    async def raw_case(base: bytes, data: bytes) -> None:
        conv = await attempt(data + HEALTH)
        if conv is None:
            return
        if not conv.answers:
            tally["unanswered"] += 1
        if data == base and len(conv.answers) != 2:
            tally["wellformed_unanswered"] += 1

    async def body_case(path: str, body: bytes) -> None:
        conv = await attempt(post(path.encode(), body), count=1)
        if conv is not None and not conv.answers:
            tally["wellformed_unanswered"] += 1

    cases = []
    for i in range(count):
        roll = rng.random()
        if roll < 0.5:
            base = rng.choice(BASES)
            cases.append(raw_case(base, base if i % 10 == 0 else mutate(rng, base, TOKENS)))
        else:
            cases.append(body_case(rng.choice(ROUTES), random_body(rng, deep=roll > 0.9)))
    start = time.perf_counter()
    await asyncio.gather(*cases)
    return {"tally": dict(tally), "statuses": dict(sorted(statuses.items())),
            "seconds": time.perf_counter() - start}


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def section_fuzz(workers: list[str], logs: Path, args: argparse.Namespace) -> None:
    # Short client timeouts: a mutation that leaves a request incomplete is answered 408 after them.
    env = {"KVROUTE_HEADER_TIMEOUT_S": "1", "KVROUTE_BODY_TIMEOUT_S": "1", "KVROUTE_KEEPALIVE_TIMEOUT_S": "1"}
    router = await start_router(workers, logs, "fuzz", env)
    try:
        before = rss_kib(router.proc.pid)
        result = await fuzz(router.url, args.fuzz, args.seed, args.concurrency)
        after = rss_kib(router.proc.pid)
        metrics = await exchange(router.url, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n", count=1, timeout=30)
        text = metrics.answers[0].body.decode()
        internal = metric(text, 'kvroute_failures_total{reason="internal"}')
        health = await exchange(router.url, HEALTH, count=1, timeout=30)
    finally:
        code = stop(router)
    t = result["tally"]
    print(f"## fuzz: {t.get('requests', 0)} requests in {result['seconds']:.0f} s (seed {args.seed}, "
          f"{args.concurrency} connections at a time)")
    print(f"router 5xx: {t.get('router_5xx', 0)}   hangs: {t.get('hangs', 0)}   well-formed unanswered: "
          f"{t.get('wellformed_unanswered', 0)}   connections with no answer: {t.get('unanswered', 0)}   "
          f"answers cut short: {t.get('cut_short', 0)}   connect errors: {t.get('connect_errors', 0)}")
    print(f"statuses: {result['statuses']}")
    print(f"kvroute_failures_total{{reason=\"internal\"}}: {internal:g}   /health after: "
          f"{health.answers[0].status}   router RSS {before[0] / 1024:.0f} -> {after[0] / 1024:.0f} MiB   "
          f"exit status {code}")
    tracebacks = router.log_text().count("Traceback")
    print(f"tracebacks in the router log: {tracebacks}")


# --- header --------------------------------------------------------------------------------------

def send_big_header(url: str, size: int) -> tuple[int, bytes]:
    """Send a request whose one header value is ``size`` bytes; returns (bytes sent, reply)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(30)
    sent = 0
    chunk = b"a" * (1 << 20)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
        while sent < size:
            sock.sendall(chunk)
            sent += len(chunk)
        sock.sendall(b"\r\n\r\n")
    except OSError:
        pass  # the router stopped reading: expected
    reply = b""
    with contextlib.suppress(OSError):
        while True:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    sock.close()
    return sent, reply


async def section_header(workers: list[str], logs: Path, args: argparse.Namespace) -> None:
    router = await start_router(workers, logs, "header")
    try:
        for _ in range(20):  # let start-up settle
            await exchange(router.url, HEALTH, count=1, timeout=30)
        before = rss_kib(router.proc.pid)
        sent, reply = await asyncio.to_thread(send_big_header, router.url, args.header_mb << 20)
        await asyncio.sleep(2.5)  # past the lingering close
        after = rss_kib(router.proc.pid)
        health = await exchange(router.url, HEALTH, count=1, timeout=30)
    finally:
        stop(router)
    status = reply.split(b"\r\n", 1)[0].decode(errors="replace")
    print(f"## header: one {args.header_mb} MB header value")
    print(f"answer: {status!r} after the client had sent {sent / (1 << 20):.0f} MiB   "
          f"router RSS {before[0] / 1024:.1f} -> {after[0] / 1024:.1f} MiB (growth "
          f"{(after[0] - before[0]) / 1024:.2f} MiB), peak growth {(after[1] - before[1]) / 1024:.2f} MiB   "
          f"/health after: {health.answers[0].status}")


# --- idle ----------------------------------------------------------------------------------------

async def section_idle(workers: list[str], logs: Path, args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.idle + 200
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    for hard_limit in (20000, 1024):
        router = await start_router(workers, logs, f"idle-{hard_limit}", nofile=(1024, hard_limit))
        host, port = router.url.removeprefix("http://").split(":")
        idle: list[socket.socket] = []
        try:
            for _ in range(args.idle):
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect((host, int(port)))
                idle.append(s)
            await asyncio.sleep(1.0)
            times = []
            statuses = []
            for _ in range(20):
                start = time.perf_counter()
                conv = await exchange(router.url, HEALTH, count=1, timeout=10)
                times.append((time.perf_counter() - start) * 1000)
                statuses.append(conv.answers[0].status if conv.answers else 0)
            open_idle = 0
            for s in idle:
                try:
                    open_idle += s.recv(1) != b""
                except BlockingIOError:
                    open_idle += 1
                except OSError:
                    pass
            line = next((ln for ln in router.log_text().splitlines() if "client connections" in ln), "")
        finally:
            for s in idle:
                s.close()
            stop(router)
        times.sort()
        print(f"## idle: {args.idle} idle connections, router started with nofile 1024:{hard_limit}")
        print(f"router log: {line.split(': ', 1)[-1]}")
        print(f"GET /health on a new connection, 20 times: statuses {sorted(set(statuses))}, median "
              f"{times[len(times) // 2]:.1f} ms, max {times[-1]:.1f} ms   idle connections still open: "
              f"{open_idle}/{args.idle}")


# --- trailers and chunk extensions ----------------------------------------------------------------

CHUNKED_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
SMALL_CHAT = orjson.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})


def send_chunked(url: str, before: bytes, filler: bytes, size: int, after: bytes) -> tuple[int, bytes, float]:
    """Send ``before``, then ``size`` bytes of ``filler`` repeated (in writes of at most 1 MiB), then
    ``after``; returns (filler bytes sent before the router stopped reading, its reply, seconds
    to the reply)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(30)
    sent = 0
    chunk = filler * max(1, (1 << 20) // len(filler))
    start = time.perf_counter()
    try:
        sock.sendall(before)
        while sent < size:
            part = chunk[:size - sent]
            sock.sendall(part)
            sent += len(part)
        sock.sendall(after)
    except OSError:
        pass  # the router stopped reading: expected
    reply = b""
    with contextlib.suppress(OSError):
        while True:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    took = time.perf_counter() - start
    sock.close()
    return sent, reply, took


async def slowest_health(url: str, stop: asyncio.Event) -> float:
    """Ask /health every 50 ms until ``stop``; the slowest answer in ms (inf: one went unanswered)."""
    worst = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        conv = await exchange(url, HEALTH, count=1, timeout=30)
        took = (time.perf_counter() - start) * 1000 if conv.statuses == [200] else float("inf")
        worst = max(worst, took)
        await asyncio.sleep(0.05)
    return worst


async def section_trailers(workers: list[str], logs: Path, args: argparse.Namespace) -> None:
    mib = 1 << 20
    body = b"%x\r\n%s\r\n" % (len(SMALL_CHAT), SMALL_CHAT)
    cases = [  # (what, before, filler, filler bytes, after, at once)
        (f"one {args.trailer_mb} MB trailer", CHUNKED_HEAD + body + b"0\r\nx-big: ", b"a",
         args.trailer_mb * mib, b"\r\n\r\n", 1),
        (f"four {args.trailer_mb} MB trailers at once", CHUNKED_HEAD + body + b"0\r\nx-big: ", b"a",
         args.trailer_mb * mib, b"\r\n\r\n", 4),
        ("10,000 trailer fields", CHUNKED_HEAD + body + b"0\r\n",
         b"".join(b"x-t%05d: v\r\n" % i for i in range(10000)), 130000, b"\r\n", 1),
        ("a 200 KB trailer", CHUNKED_HEAD + body + b"0\r\nx-big: ", b"a", 200 * 1024, b"\r\n\r\n", 1),
        (f"a {args.extension_mb} MB chunk extension", CHUNKED_HEAD + b"%x;e=" % len(SMALL_CHAT), b"a",
         args.extension_mb * mib, b"\r\n%s\r\n0\r\n\r\n" % SMALL_CHAT, 1),
    ]
    print("## trailers and chunk extensions (a fresh router per case)")
    for what, before, filler, size, after, parallel in cases:
        router = await start_router(workers, logs, "trailers")
        try:
            for _ in range(20):  # let start-up settle
                await exchange(router.url, HEALTH, count=1, timeout=30)
            start_rss = rss_kib(router.proc.pid)
            stop_health = asyncio.Event()
            health = asyncio.create_task(slowest_health(router.url, stop_health))
            results = await asyncio.gather(*(asyncio.to_thread(send_chunked, router.url, before, filler, size,
                                                               after) for _ in range(parallel)))
            await asyncio.sleep(2.5)  # past the lingering close
            stop_health.set()
            worst = await health
            end_rss = rss_kib(router.proc.pid)
            after_health = await exchange(router.url, HEALTH, count=1, timeout=30)
        finally:
            stop(router)
        statuses = sorted({r[1].split(b"\r\n", 1)[0].decode(errors="replace") for r in results})
        print(f"{what}: {statuses}, answered after {max(r[2] for r in results):.2f} s with "
              f"{max(r[0] for r in results) / mib:.1f} MiB of filler sent   router RSS "
              f"{start_rss[0] / 1024:.1f} -> {end_rss[0] / 1024:.1f} MiB (growth "
              f"{(end_rss[0] - start_rss[0]) / 1024:.2f}), peak growth "
              f"{(end_rss[1] - start_rss[1]) / 1024:.2f} MiB   slowest /health meanwhile {worst:.1f} ms   "
              f"/health after: {after_health.statuses}")


# --- slow bodies -----------------------------------------------------------------------------------

async def section_slow(workers: list[str], logs: Path, args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.drippers + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, args.drippers + 200), hard))
    for reconnect in (False, True):
        await slow_round(workers, logs, args, reconnect)


async def slow_round(workers: list[str], logs: Path, args: argparse.Namespace, reconnect: bool) -> None:
    """Drippers that stay away once cut (the campaign's), or that reconnect at once (a flood)."""
    env = {"KVROUTE_MAX_CONNECTIONS": str(args.slow_cap)}
    router = await start_router(workers, logs, "slow", env)
    stop_at = time.monotonic() + args.slow_seconds
    fates: collections.Counter[str] = collections.Counter()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\n"

    async def dripper(i: int) -> None:
        await asyncio.sleep(i * 0.01)  # 400 connections over 4 s
        while time.monotonic() < stop_at and (reconnect or not fates[f"dripper {i}"]):
            fates[f"dripper {i}"] += 1
            try:
                reader, writer = await asyncio.open_connection(*router.url.removeprefix("http://").split(":"))
            except OSError:
                fates["connect failed"] += 1
                await asyncio.sleep(1)
                continue
            fates["connections"] += 1
            try:
                writer.write(head)
                while time.monotonic() < stop_at:
                    writer.write(b"{")
                    with contextlib.suppress(TimeoutError):
                        data = await asyncio.wait_for(reader.read(65536), args.drip_s)
                        status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"
                        fates[f"cut: {status}"] += 1
                        break
            except ConnectionError:
                fates["cut: reset"] += 1
            finally:
                writer.close()

    outcomes: dict[str, collections.Counter[str]] = {"post": collections.Counter(),
                                                     "health": collections.Counter()}
    times: dict[str, list[float]] = {"post": [], "health": []}
    body = orjson.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})

    async def probe(kind: str, data: bytes) -> None:
        start = time.perf_counter()
        try:
            conv = await exchange(router.url, data, count=1, timeout=30)
        except TimeoutError:
            outcomes[kind]["hang"] += 1
            return
        except OSError:
            outcomes[kind]["connect failed"] += 1
            return
        times[kind].append((time.perf_counter() - start) * 1000)
        outcomes[kind][str(conv.statuses[0]) if conv.answers else "no answer"] += 1

    try:
        for _ in range(20):  # let start-up settle
            await exchange(router.url, HEALTH, count=1, timeout=30)
        before = rss_kib(router.proc.pid)
        drippers = [asyncio.create_task(dripper(i)) for i in range(args.drippers)]
        await asyncio.sleep(5)  # every dripper connected
        probes = []
        n = 0
        while time.monotonic() < stop_at:
            path = b"/v1/messages" if n % 2 else b"/v1/chat/completions"
            probes.append(asyncio.create_task(probe("post", post(path, body))))
            probes.append(asyncio.create_task(probe("health", HEALTH)))
            n += 1
            await asyncio.sleep(1)
        await asyncio.gather(*probes, *drippers)
        during = rss_kib(router.proc.pid)
        await asyncio.sleep(5)  # past the lingering closes
        after = rss_kib(router.proc.pid)
    finally:
        stop(router)
    for i in range(args.drippers):
        del fates[f"dripper {i}"]
    print(f"## slow bodies: {args.drippers} clients dripping one byte every {args.drip_s:g} s "
          f"({'reconnecting at once' if reconnect else 'staying away'} when cut) against max_connections = "
          f"{args.slow_cap}, {args.slow_seconds:g} s")
    for kind in ("post", "health"):
        t = sorted(times[kind]) or [float("nan")]
        print(f"{'complete POST' if kind == 'post' else 'GET /health'} every second: "
              f"{dict(sorted(outcomes[kind].items()))}, median {t[len(t) // 2]:.1f} ms, max {t[-1]:.1f} ms")
    print(f"drippers: {dict(sorted(fates.items()))}")
    print(f"router RSS {before[0] / 1024:.1f} MiB before, {during[0] / 1024:.1f} MiB as they stopped, "
          f"{after[0] / 1024:.1f} MiB 5 s later; peak {during[1] / 1024:.1f} MiB")


# --- shutdown ------------------------------------------------------------------------------------

async def section_shutdown(workers: list[str], logs: Path, args: argparse.Namespace) -> None:
    env = {"KVROUTE_SHUTDOWN_TIMEOUT_S": str(args.shutdown_timeout)}
    router = await start_router(workers, logs, "shutdown", env)
    host, port = router.url.removeprefix("http://").split(":")
    conns = []
    try:
        for i in range(args.streams):
            path = "/v1/messages" if i % 2 else "/v1/chat/completions"
            doc = {"model": MODEL, "max_tokens": 8000, "ignore_eos": True, "stream": True,
                   "messages": [{"role": "user", "content": f"stream {i}: count slowly"}]}
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(post(path.encode(), orjson.dumps(doc)))
            conv = Conversation()
            conv.feed(await asyncio.wait_for(reader.read(65536), 30))
            conns.append((path, reader, writer, conv))
        start = time.perf_counter()
        router.proc.send_signal(signal.SIGTERM)
        for _, reader, _, conv in conns:
            await read(reader, conv, timeout=60)
        code = await asyncio.to_thread(router.proc.wait, 60)
        took = time.perf_counter() - start
    finally:
        for _, _, writer, _ in conns:
            writer.close()
        stop(router)
    error_events = truncated = 0
    for path, _, _, conv in conns:
        answer = conv.answers[0] if conv.answers else None
        if answer is None or not answer.complete or not answer.body.endswith(b"\n\n"):
            truncated += 1
            continue
        last = answer.body[:-2].rsplit(b"\n\n", 1)[-1]
        wanted = b"event: error\ndata: " if path == "/v1/messages" else b"data: {\"error\""
        error_events += last.startswith(wanted)
    cut_line = next((ln for ln in router.log_text().splitlines() if "request(s) cut" in ln), "")
    print(f"## shutdown: SIGTERM with {args.streams} streams longer than shutdown_timeout_s = "
          f"{args.shutdown_timeout:g}")
    print(f"error events: {error_events}/{args.streams}   truncated: {truncated}   exit status {code}   "
          f"exited {took:.1f} s after the signal")
    print(f"router log: {cut_line.split(': ', 1)[-1]}")


async def main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="kvroute-chaos-"))
    sim_port = free_ports(args.replicas)
    sim = subprocess.Popen(
        [*KVROUTE, "sim", "--preset", "a4000-qwen3-4b", "--replicas", str(args.replicas), "--port",
         str(sim_port), "--speed", str(args.speed), "--max-num-seqs", "256"],
        stdout=subprocess.DEVNULL, stderr=open(logs / "sim.log", "w"))  # noqa: SIM115
    workers = [f"http://127.0.0.1:{sim_port + i}" for i in range(args.replicas)]
    sections = {"fuzz": section_fuzz, "header": section_header, "idle": section_idle,
                "shutdown": section_shutdown, "trailers": section_trailers, "slow": section_slow}
    print(f"cpus={os.cpu_count()} load average {os.getloadavg()[0]:.2f}; logs in {logs}")
    try:
        for url in workers:
            await wait_ready(url, "/health")
        for name in args.sections:
            await sections[name](workers, logs, args)
    finally:
        sim.terminate()
        sim.wait(30)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", type=lambda s: s.split(","),
                   default=["fuzz", "header", "idle", "shutdown", "trailers", "slow"])
    p.add_argument("--fuzz", type=int, default=20000, help="fuzzed requests (default 20000)")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--concurrency", type=int, default=64, help="fuzz connections at a time (default 64)")
    p.add_argument("--header-mb", type=int, default=300, help="size of the header value (default 300 MB)")
    p.add_argument("--idle", type=int, default=1100, help="idle connections (default 1100)")
    p.add_argument("--streams", type=int, default=10, help="streams cut at shutdown (default 10)")
    p.add_argument("--shutdown-timeout", type=float, default=2.0, help="shutdown_timeout_s (default 2)")
    p.add_argument("--trailer-mb", type=int, default=100, help="size of the big trailer (default 100 MB)")
    p.add_argument("--extension-mb", type=int, default=50, help="size of the chunk extension (default 50 MB)")
    p.add_argument("--drippers", type=int, default=400, help="slow-body clients (default 400)")
    p.add_argument("--drip-s", type=float, default=3.0, help="seconds between their bytes (default 3)")
    p.add_argument("--slow-cap", type=int, default=300, help="max_connections for them (default 300)")
    p.add_argument("--slow-seconds", type=float, default=60.0, help="how long they drip (default 60)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--speed", type=float, default=20.0, help="simulated replicas' speed-up (default 20)")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
