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
* sync:      two routers sharing a Redis, with and without a sync secret, while forged messages
             arrive (issue 24): heartbeats with 5,000 in flight on two of three workers every 200 ms
             (unsigned, wrongly signed, signed by an insider, plausible from an instance that is not
             connected) and worker epochs in 2058; where requests go, the worker epochs, the
             rejections, and what a router started afterwards adopts from the history.
* stall:     one of three replicas (its own `kvroute sim` process) stopped with SIGSTOP for 60 s
             while streams flow, the router at its defaults: when its streams' clients get an error
             event, whether the other streams and new requests meanwhile are served (issue 24).
* garbage:   one of three replicas answers 200 with something that is not an answer (each sim
             fault kind in turn, a fresh router each): bad answers it sent before its breaker
             opened, garbage that reached a client, streams whose clients were told (issue 24).
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
    python benchmarks/chaos.py --sections stall,garbage   # about 3 minutes on 2 cores
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

import aiohttp
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


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the router sends until it closes the connection (or an error ends it)."""
    reply = b""
    with contextlib.suppress(OSError):
        while True:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    return reply


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
    reply = _read_to_close(sock)
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
    reply = _read_to_close(sock)
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


# --- sync ----------------------------------------------------------------------------------------

SYNC_SECRET = "chaos-sync-secret-0123456789abcdef"
FORGED_EPOCH = 2_845_000_000.0  # 2060: the campaign's epochs landed around 2058


async def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    conv = await exchange(url, b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n", count=1, timeout=30)
    return {(m.name, tuple(sorted(m.labels.items()))): m.value
            for family in text_string_to_metric_families(conv.answers[0].body.decode())
            for m in family.samples}


async def _sync_state(url: str) -> tuple[dict[str, float], dict[str, float], float]:
    """(worker epochs, rejected messages by reason, live peers) of one router."""
    m = await _metrics(url)
    epochs = {dict(k)["worker"]: v for (name, k), v in m.items() if name == "kvroute_worker_epoch"}
    rejected = {dict(k)["reason"]: v for (name, k), v in m.items() if name == "kvroute_sync_rejected_total"}
    return epochs, rejected, m.get(("kvroute_sync_peers", ()), 0.0)


async def _served(routers: list[Router], n: int, first: int, concurrency: int) -> collections.Counter[str]:
    """Where ``n`` new conversations (one request each, the routers taking turns) are served."""
    served: collections.Counter[str] = collections.Counter()
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        text = f"conversation {first + i}: " + "why? " * 200
        body = orjson.dumps({"model": MODEL, "max_tokens": 16, "ignore_eos": True,
                             "messages": [{"role": "user", "content": text}]})
        async with gate:
            conv = await exchange(routers[i % len(routers)].url, post(b"/v1/chat/completions", body), count=1,
                                  timeout=60)
        answer = conv.answers[0] if conv.answers else None
        served[answer.headers.get(b"x-kvroute-worker", b"none").decode() if answer and answer.status == 200
               else f"failed {answer.status if answer else 'no answer'}"] += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return served


async def _forge_loop(url: str, load_key: bytes, facts_key: bytes, workers: list[str],
                      epochs: dict[str, float], secret: str | None, plausible: int,
                      stop: asyncio.Event) -> None:
    """What a writer to Redis sends: every 200 ms the campaign's heartbeats, once a second epochs in
    2058.  ``secret``: also what an insider holding the secret signs, within the bounds' reach only
    (None: the routers have none)."""
    import redis.asyncio as aioredis

    from kvroute.sync.trust import Signer

    targets = workers[:2]
    client = aioredis.from_url(url)
    # A forger can name a connection as a router does: its plausible (unsigned) heartbeats then
    # pass the liveness check, and only a secret stands in their way.
    named = aioredis.from_url(url, client_name="kvroute:forger-named")
    await named.ping()
    nobody, wrong = Signer(None), Signer(b"w" * 32)
    real = Signer(None if secret is None else secret.encode())

    def beat(src: str, n: int, epoch: float | None = None) -> bytes:
        return orjson.dumps({"v": 1, "kind": "load", "src": src, "t": time.time(), "ttl": 1.0,
                             "workers": {w: [n, epoch or epochs[w]] for w in targets}})

    poison = {"v": 1, "kind": "facts", "src": "forger", "records": [
        {"type": "epoch", "worker_id": w, "epoch": FORGED_EPOCH} for w in workers]}
    rounds = 0
    try:
        while not stop.is_set():
            await client.xadd(load_key, nobody.fields(beat("forger-unsigned", 5000)))
            await client.xadd(load_key, wrong.fields(beat("forger-wrong-secret", 5000)))
            await named.xadd(load_key, nobody.fields(beat("forger-named", plausible)))
            if secret is not None:
                await client.xadd(load_key, real.fields(beat("insider", 5000)))
                await client.xadd(load_key, real.fields(beat("insider-not-connected", plausible)))
            if rounds % 5 == 0:
                await client.xadd(facts_key, nobody.fields(orjson.dumps({**poison, "t": time.time()})))
                await named.xadd(load_key, nobody.fields(beat("forger-named", 0, FORGED_EPOCH)))
                if secret is not None:
                    await client.xadd(facts_key, real.fields(orjson.dumps({**poison, "t": time.time()})))
            rounds += 1
            await asyncio.sleep(0.2)
    finally:
        await client.aclose()
        await named.aclose()


def _share(served: collections.Counter[str], targets: list[str]) -> str:
    return f"{sum(served[w] for w in targets)}/{sum(served.values())}"


async def section_sync(workers: list[str], logs: Path, args: argparse.Namespace) -> None:
    from kvroute.sync.local_redis import LocalRedis

    print(f"## sync: 2 routers, 1 Redis, {len(workers)} workers; forged messages every 200 ms while "
          f"{args.sync_requests} new conversations arrive ({args.concurrency // 8 or 1} at a time)")
    for secret in (SYNC_SECRET, None):
        redis = LocalRedis()
        redis.start()
        env = {"KVROUTE_REDIS_URL": redis.url, "KVROUTE_SYNC_SECRET": secret or ""}
        label = "with a sync secret" if secret else "without a sync secret"
        routers = [await start_router(workers, logs, f"sync-{i}-{'signed' if secret else 'unsigned'}", env)
                   for i in range(2)]
        late: Router | None = None
        stop_forging = asyncio.Event()
        try:
            for _ in range(200):
                if [(await _sync_state(r.url))[2] for r in routers] == [1, 1]:
                    break
                await asyncio.sleep(0.05)
            epochs_before, _, _ = await _sync_state(routers[0].url)
            conc = args.concurrency // 8 or 1
            baseline = await _served(routers, args.sync_requests, 0, conc)
            forger = asyncio.create_task(_forge_loop(
                redis.url, b"kvroute:sync:load", b"kvroute:sync:facts", sorted(epochs_before), epochs_before,
                secret, args.sync_plausible, stop_forging))
            await asyncio.sleep(1.0)
            forged = await _served(routers, args.sync_requests, 10_000, conc)
            states = [await _sync_state(r.url) for r in routers]
            late = await start_router(workers, logs, f"sync-late-{'signed' if secret else 'unsigned'}", env)
            late_epochs, late_rejected, _ = await _sync_state(late.url)
            stop_forging.set()
            await forger
        finally:
            stop_forging.set()
            for r in [*routers, *([late] if late else [])]:
                stop(r)
            redis.close()
        targets = sorted(epochs_before)[:2]
        rejected: collections.Counter[str] = collections.Counter()
        for _, r, _ in states:
            rejected.update({k: int(v) for k, v in r.items() if v})
        same = all(s[0] == epochs_before for s in states)
        failed = sum(v for k, v in forged.items() if k.startswith("failed"))
        print(f"{label}: to the 2 targeted workers, before forging {_share(baseline, targets)}, while "
              f"forging {_share(forged, targets)}   failed: {failed}   "
              f"epochs unchanged in both routers: {same}   a router started meanwhile adopted "
              f"{'the same epochs' if late_epochs == epochs_before else 'other epochs: ' + str(late_epochs)} "
              f"(rejected from the history: {dict((k, int(v)) for k, v in late_rejected.items() if v)})")
        print(f"  rejected by the two routers: {dict(sorted(rejected.items()))}")
# --- stall ---------------------------------------------------------------------------------------

def start_sims(logs: Path, name: str, count: int,
               speed: float) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """``count`` simulated replicas, each its own `kvroute sim` process (so one can be stopped)."""
    procs, urls = [], []
    for i in range(count):
        port = free_ports(1)
        procs.append(subprocess.Popen(
            [*KVROUTE, "sim", "--preset", "a4000-qwen3-4b", "--port", str(port), "--speed", str(speed),
             "--max-num-seqs", "256"],
            stdout=subprocess.DEVNULL, stderr=open(logs / f"sim-{name}-{i}.log", "w")))  # noqa: SIM115
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def metric_values(text: str, name: str) -> dict[str, float]:
    """Every sample of ``name`` in an exposition, by its label text (``'reason="malformed"'``)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            out[labels] = float(value)
    return out


@dataclass
class StreamSeen:
    """What one streamed request's client saw."""

    worker: str = ""
    status: int = 0
    events: int = 0
    ended: str = ""  # "done", "error" (an error event), "cut" (no proper end), "failed" (no answer)
    last_byte_at: float = 0.0
    error_at: float = 0.0
    started: float = 0.0
    finished: float = 0.0


async def watch_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> StreamSeen:
    seen = StreamSeen(started=time.perf_counter())
    buffer = b""
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            seen.status, seen.worker = resp.status, resp.headers.get("x-kvroute-worker", "")
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if event.startswith(b'data: {"error"'):
                        seen.ended, seen.error_at = "error", now
                    elif event == b"data: [DONE]":
                        seen.ended = "done"
                    else:
                        seen.events += 1
                        seen.last_byte_at = now
    except aiohttp.ClientError:
        pass
    seen.finished = time.perf_counter()
    if not seen.ended:
        seen.ended = "cut" if seen.status == 200 else "failed"
    return seen


async def section_stall(workers: list[str], logs: Path, args: argparse.Namespace) -> None:
    procs, urls = start_sims(logs, "stall", 3, args.stall_speed)
    env = {"KVROUTE_POLICY": "round-robin"}
    victim = urls[0]
    try:
        for url in urls:
            await wait_ready(url, "/health")
        router = await start_router(urls, logs, "stall", env)
        try:
            async with aiohttp.ClientSession() as http:
                # Warm-up: a finished stream on each replica, so the router knows its gap between reads
                # and the deadline is the derived one (the floor), not the ceiling used before that.
                for i in range(6):
                    await watch_stream(http, router.url, {
                        "model": MODEL, "max_tokens": 64, "stream": True,
                        "messages": [{"role": "user", "content": f"warm {i}"}]})
                long_body = {"model": MODEL, "max_tokens": args.stall_tokens, "ignore_eos": True,
                             "stream": True}
                streams = [asyncio.create_task(watch_stream(http, router.url, {
                    **long_body, "messages": [{"role": "user", "content": f"stream {i}: count slowly"}]}))
                    for i in range(args.stall_streams)]
                await asyncio.sleep(1.5)  # every stream under way
                victim_id = victim.removeprefix("http://")
                procs[0].send_signal(signal.SIGSTOP)
                stopped_at = time.perf_counter()
                newcomers = []
                while time.perf_counter() - stopped_at < args.stall_s:
                    newcomers.append(asyncio.create_task(watch_stream(http, router.url, {
                        "model": MODEL, "max_tokens": 32, "stream": True,
                        "messages": [{"role": "user", "content": f"newcomer {len(newcomers)}"}]})))
                    await asyncio.sleep(1.0)
                procs[0].send_signal(signal.SIGCONT)
                resumed_at = time.perf_counter()
                seen = await asyncio.gather(*streams)
                new_seen = await asyncio.gather(*newcomers)
                async with http.get(router.url + "/metrics") as resp:
                    text = await resp.text()
        finally:
            stop(router)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
            proc.terminate()
            proc.wait(30)
    mine = [s for s in seen if s.worker == victim_id]
    others = [s for s in seen if s.worker != victim_id]
    silences = sorted(s.error_at - max(s.last_byte_at, stopped_at) for s in mine if s.ended == "error")
    failures = metric_values(text, "kvroute_failures_total")
    breaker = metric_values(text, "kvroute_breaker_state").get(f'worker="{victim_id}"')
    hung = sum(1 for s in mine if s.ended != "error" or s.error_at >= resumed_at)
    print(f"## stall: 1 of 3 replicas stopped (SIGSTOP) for {args.stall_s:g} s with {len(seen)} streams "
          f"flowing ({len(mine)} on it), router defaults (stream_idle_floor_s 30, stream_idle_timeout_s "
          f"120, factor 50), speed {args.stall_speed:g}")
    span = f"{silences[0]:.1f}-{silences[-1]:.1f} s" if silences else "-"
    print(f"its streams: {sum(s.ended == 'error' for s in mine)}/{len(mine)} ended with an error event, "
          f"{sum(s.ended == 'cut' for s in mine)} cut, {hung} still waiting when the replica resumed; "
          f"silence before the error event: {span}")
    print(f"other streams: {sum(s.ended == 'done' for s in others)}/{len(others)} complete")
    waits = sorted(s.finished - s.started for s in new_seen)
    print(f"new streams during the stop: {len(new_seen)} sent, {sum(s.ended != 'done' for s in new_seen)} "
          f"not complete, {sum(s.worker == victim_id for s in new_seen)} answered by the stopped replica, "
          f"slowest {waits[-1]:.1f} s, median {waits[len(waits) // 2]:.2f} s")
    print("kvroute_failures_total: " + ", ".join(f"{k} {v:g}" for k, v in sorted(failures.items()) if v)
          + ("" if breaker is None else f"   its breaker state: {breaker:g} (2 = open)"))


# --- garbage -------------------------------------------------------------------------------------

GARBAGE_KINDS = [  # (label, fault, router environment)
    ("garbage (not JSON / not SSE)", {"kind": "garbage", "after_tokens": 0}, {}),
    ("garbage mid-stream", {"kind": "garbage", "after_tokens": 3}, {}),
    ("wrong_shape (no choices/content)", {"kind": "wrong_shape"}, {}),
    ("oversized 2 MiB event (limit 1 MiB)", {"kind": "oversized", "after_tokens": 3}, {}),
    ("oversized 300 KB event (limit 256 KiB)", {"kind": "oversized", "after_tokens": 3, "size": 300_000},
     {"KVROUTE_MAX_EVENT_BYTES": str(256 * 1024)}),
]
ASKS = [("/v1/chat/completions", True), ("/v1/chat/completions", False), ("/v1/messages", True),
        ("/v1/messages", False)]


def judge(path: str, stream: bool, status: int, body: bytes, limit: int) -> str:
    """What a client got: "answer", "told" (an error in the API's format, status or event),
    "garbage" (something its SDK cannot read as either)."""
    if not stream or status != 200:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return "garbage"
        if status == 200:
            return "answer" if isinstance(doc, dict) and ("choices" in doc or "content" in doc) else "garbage"
        return "told" if isinstance(doc, dict) and "error" in doc else "garbage"
    told = False
    for event in body.split(b"\n\n")[:-1]:
        if len(event) > limit:
            return "garbage"
        for line in event.split(b"\n"):
            if line.startswith(b"event: "):
                told = told or line == b"event: error"
            elif line.startswith(b"data: "):
                if line == b"data: [DONE]":
                    continue
                try:
                    doc = orjson.loads(line[6:])
                except orjson.JSONDecodeError:
                    return "garbage"
                told = told or (isinstance(doc, dict) and (doc.get("type") == "error" or "error" in doc))
            elif line:
                return "garbage"
    end = b"data: [DONE]" if path == "/v1/chat/completions" else b"event: message_stop"
    return "told" if told else "answer" if end in body else "garbage"


async def garbage_run(url: str, victim: str, count: int, concurrency: int, limit: int) -> dict[str, Any]:
    tally: collections.Counter[str] = collections.Counter()
    bad_at_open: float | None = None
    gate = asyncio.Semaphore(concurrency)

    async with aiohttp.ClientSession() as http:
        async def bad_so_far() -> tuple[float, bool]:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            ejections = metric_values(text, "kvroute_ejections_total")
            opened = sum(n for labels, n in ejections.items() if labels.endswith(f'worker="{victim}"'))
            return metric_values(text, "kvroute_failures_total").get('reason="malformed"', 0.0), opened > 0

        async def one(i: int) -> None:
            nonlocal bad_at_open
            path, stream = ASKS[i % len(ASKS)]
            body = {"model": MODEL, "max_tokens": 12, "stream": stream,
                    "messages": [{"role": "user", "content": f"request {i}: tell me about the sea"}]}
            async with gate:
                try:
                    async with http.post(url + path, json=body) as resp:
                        data = await resp.read()
                        verdict = judge(path, stream, resp.status, data, limit)
                        tally[verdict] += 1
                        tally["router_5xx"] += resp.status >= 500 and verdict != "told"
                        tally["502"] += resp.status == 502
                        tally[f"served_by_victim_{verdict}"] += resp.headers.get("x-kvroute-worker") == victim
                except aiohttp.ClientError:
                    tally["connection_error"] += 1
            if bad_at_open is None:
                bad, opened = await bad_so_far()
                if opened:
                    bad_at_open = bad

        await asyncio.gather(*(one(i) for i in range(count)))
        bad, _ = await bad_so_far()
    return {"tally": dict(tally), "bad_at_open": bad_at_open, "bad": bad}


async def section_garbage(workers: list[str], logs: Path, args: argparse.Namespace) -> None:
    victim_url = workers[0]
    victim = victim_url.removeprefix("http://")
    print(f"## garbage: 1 of {len(workers)} replicas answers 200 with no answer; round-robin, "
          f"{args.garbage} requests per kind (chat and messages, streamed and plain, in turn)")
    print("kind | concurrency | bad answers seen when a client first saw it ejected | bad answers in all | "
          "garbage reached a client | clients told (error event / 502) | answers | other 5xx")
    async with aiohttp.ClientSession() as http:
        for label, fault, env in GARBAGE_KINDS:
            limit = int(env.get("KVROUTE_MAX_EVENT_BYTES", 1 << 20))
            for concurrency in (1, args.concurrency // 4):
                async with http.post(victim_url + "/admin/fault", json=fault) as resp:
                    assert resp.status == 200, await resp.text()
                router = await start_router(workers, logs, "garbage",
                                            {"KVROUTE_POLICY": "round-robin", **env})
                try:
                    result = await garbage_run(router.url, victim, args.garbage, concurrency, limit)
                finally:
                    stop(router)
                    async with http.delete(victim_url + "/admin/fault") as resp:
                        assert resp.status == 200
                t = result["tally"]
                opened = result["bad_at_open"]
                shown = "-" if opened is None else f"{opened:g}"
                print(f"{label} | {concurrency} | {shown} | {result['bad']:g} | {t.get('garbage', 0)} | "
                      f"{t.get('told', 0)} ({t.get('502', 0)} 502) | {t.get('answer', 0)} | "
                      f"{t.get('router_5xx', 0)}")


async def main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="kvroute-chaos-"))
    sim_port = free_ports(args.replicas)
    sim = subprocess.Popen(
        [*KVROUTE, "sim", "--preset", "a4000-qwen3-4b", "--replicas", str(args.replicas), "--port",
         str(sim_port), "--speed", str(args.speed), "--max-num-seqs", "256"],
        stdout=subprocess.DEVNULL, stderr=open(logs / "sim.log", "w"))  # noqa: SIM115
    workers = [f"http://127.0.0.1:{sim_port + i}" for i in range(args.replicas)]
    sections = {"fuzz": section_fuzz, "header": section_header, "idle": section_idle,
                "shutdown": section_shutdown, "sync": section_sync, "stall": section_stall,
                "garbage": section_garbage, "trailers": section_trailers, "slow": section_slow}
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
                   default=["fuzz", "header", "idle", "shutdown", "sync", "stall", "garbage", "trailers",
                            "slow"])
    p.add_argument("--fuzz", type=int, default=20000, help="fuzzed requests (default 20000)")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--concurrency", type=int, default=64, help="fuzz connections at a time (default 64)")
    p.add_argument("--header-mb", type=int, default=300, help="size of the header value (default 300 MB)")
    p.add_argument("--idle", type=int, default=1100, help="idle connections (default 1100)")
    p.add_argument("--streams", type=int, default=10, help="streams cut at shutdown (default 10)")
    p.add_argument("--shutdown-timeout", type=float, default=2.0, help="shutdown_timeout_s (default 2)")
    p.add_argument("--sync-requests", type=int, default=300,
                   help="new conversations per phase of the sync section (default 300)")
    p.add_argument("--sync-plausible", type=int, default=256,
                   help="in flight a plausible forged heartbeat claims per worker (default 256, the "
                        "replicas' max_num_seqs)")
    p.add_argument("--stall-s", type=float, default=60.0, help="how long the replica stays stopped (60 s)")
    p.add_argument("--stall-streams", type=int, default=12, help="streams flowing when it stops (12)")
    p.add_argument("--stall-tokens", type=int, default=6000, help="their length in tokens (6000)")
    p.add_argument("--stall-speed", type=float, default=2.0,
                   help="the stall section's replicas' speed-up (2: streams outlast the stop)")
    p.add_argument("--garbage", type=int, default=120, help="requests per garbage kind (default 120)")
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
