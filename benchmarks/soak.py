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
memory: RSS figures are only comparable between runs of the same mode.)  Each sample the child
also records its RSS against what Python holds (traced bytes, pymalloc blocks, gc-tracked objects,
objects by type), and at the end calls ``malloc_trim(0)`` and records RSS before and after: growth
that the trim gives back was freed memory kept by the allocator, not live objects.  ``--inproc`` is
that child without tracemalloc.

    python benchmarks/soak.py --minutes 5
    python benchmarks/soak.py --minutes 3 --rate 0 --tracemalloc
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
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
    # SIGUSR1 (sent by the parent at the end): does glibc give memory back?  If RSS drops far
    # below its level while the traced Python memory stays, the growth was freed memory kept by the
    # allocator, not live objects.
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _trim_and_record, snapshots)
    n = 0
    try:
        while True:
            await asyncio.sleep(sample_s)
            _record(snapshots, f"{n:04d}")
            if tracemalloc.is_tracing():
                part = snapshots / f"{n:04d}.part"
                tracemalloc.take_snapshot().dump(str(part))
                part.rename(part.with_suffix(".snap"))  # whole snapshots only, if the router is stopped
            n += 1
    finally:
        await running.close()


def _own_rss_kib() -> int:
    return rss_kib(os.getpid())[0]


def _record(snapshots: Path, label: str) -> None:
    """One line of stats.tsv: RSS against what Python holds (traced bytes, pymalloc blocks, objects
    the collector tracks), and objects.NNNN.json: those objects counted by type, to diff later."""
    rss = _own_rss_kib()  # before the list of every object below adds its own
    heap, anon = rss_split_kib(os.getpid())
    arenas, used, free = _pymalloc_kib()
    objects = gc.get_objects()
    by_type = Counter(type(o).__qualname__ for o in objects)
    with open(snapshots / "stats.tsv", "a") as f:
        f.write(f"{label}\t{time.monotonic():.1f}\t{rss}\t{tracemalloc.get_traced_memory()[0] // 1024}\t"
                f"{sys.getallocatedblocks()}\t{len(objects)}\t{heap}\t{anon}\t{arenas}\t{used}\t{free}\n")
    (snapshots / f"objects.{label}.json").write_bytes(orjson.dumps(dict(by_type)))
    del objects


def _pymalloc_kib() -> tuple[int, int, int]:
    """pymalloc's arenas (KiB mapped), the bytes of its blocks in use and of its free blocks, from
    ``sys._debugmallocstats()`` (which writes to the C stderr: fd 2 is lent to a file meanwhile)."""
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode()

    def kib(name: str) -> int:
        line = next(line for line in text.splitlines() if name in line)
        return int(line.rsplit("=", 1)[1].replace(",", "")) // 1024

    return kib("bytes/arena"), kib("# bytes in allocated blocks"), kib("# bytes in available blocks")


def _trim_and_record(snapshots: Path) -> None:
    before = _own_rss_kib()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open(snapshots / "stats.tsv", "a") as f:
        f.write(f"trim\t{time.monotonic():.1f}\t{before}\t{_own_rss_kib()}\t"
                f"{tracemalloc.get_traced_memory()[0] // 1024}\n")


def traced_router_main(argv: list[str]) -> None:
    """``soak.py _traced TRACE PORT SNAPSHOT_DIR SAMPLE_S WORKER...``: the child of ``--tracemalloc``
    (TRACE 1) and of ``--inproc`` (TRACE 0)."""
    from kvroute.event_loop import run_event_loop

    trace, port, snapshots, sample_s, *workers = argv
    if trace == "1":
        tracemalloc.start(8)
    run_event_loop(_traced_router(int(port), workers, Path(snapshots), float(sample_s)))


def rss_split_kib(pid: int) -> tuple[int, int]:
    """Resident KiB of ``pid``'s brk heap (glibc's main arena: objects over pymalloc's 512 bytes, C
    libraries' buffers) and of its anonymous mappings (pymalloc's arenas, glibc's large blocks)."""
    heap = anon = 0
    name: str | None = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):  # a mapping's first line: range perms offset dev inode [name]
            fields = rest.split()
            name = fields[4] if len(fields) > 4 else ""
        elif head == "Rss:":
            if name == "[heap]":
                heap += int(rest.split()[0])
            elif name == "":
                anon += int(rest.split()[0])
    return heap, anon


def trim_through_gdb(pid: int) -> None:
    """Have the router call ``malloc_trim(0)`` (through gdb, if installed) and print RSS before and
    after: what the trim gives back was freed memory glibc kept, not live objects."""
    if shutil.which("gdb") is None:
        print("malloc_trim: gdb is not installed, not tried")
        return
    before = rss_kib(pid)[0]
    done = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "call (int)malloc_trim(0)"],
                          capture_output=True, text=True, timeout=120, check=False)
    if "$1 = " not in done.stdout:
        print(f"malloc_trim through gdb failed: {(done.stderr or done.stdout).strip()[-300:]}")
        return
    print(f"malloc_trim(0) through gdb: RSS {before / 1024:.2f} -> {rss_kib(pid)[0] / 1024:.2f} MiB")


def print_stats(snapshots: Path, first: int, top: int) -> None:
    """RSS against the traced Python memory at each sample, the trim's effect, and the object
    types whose count grew most from sample ``first`` to the last."""
    print("## the router's own view (RSS, traced Python memory, pymalloc blocks, gc-tracked objects)")
    print(f"{'sample':>6} {'RSS MiB':>8} {'traced MiB':>10} {'blocks':>9} {'objects':>8} {'heap':>6} "
          f"{'anon':>6} {'arenas':>6} {'in use':>6} {'free':>5}  (MiB: brk heap, anonymous mappings; "
          "pymalloc's arenas, its blocks in use and free)")
    for line in (snapshots / "stats.tsv").read_text().splitlines():
        label, _, *values = line.split("\t")
        if label == "trim":
            before, after, traced = (int(v) for v in values)
            print(f"malloc_trim(0): RSS {before / 1024:.2f} -> {after / 1024:.2f} MiB, "
                  f"traced {traced / 1024:.2f} MiB")
        else:
            rss, traced, blocks, objects, *split = (int(v) for v in values)
            print(f"{label:>6} {rss / 1024:8.2f} {traced / 1024:10.2f} {blocks:9d} {objects:8d} "
                  + " ".join(f"{v / 1024:6.2f}" for v in split))
    counts = sorted(snapshots.glob("objects.*.json"))
    if len(counts) > first + 1:
        old, new = (orjson.loads(counts[i].read_bytes()) for i in (first, -1))
        grown = sorted(((new.get(k, 0) - old.get(k, 0), k) for k in new.keys() | old.keys()), reverse=True)
        print(f"### object counts, sample {first} -> {len(counts) - 1}: " +
              ", ".join(f"{k} {d:+d}" for d, k in grown[:top] if d))


def print_trend(snapshots: Path, first: int, top: int) -> None:
    """The stacks whose traced memory grew steadily over the snapshots from ``first`` on: growth
    from ``first`` to the last, and in how many of the intervals it rose or fell.  A request in
    flight at one snapshot and gone at the next (noise the two-snapshot diff cannot tell from growth)
    rises and falls; a structure that keeps something per request or per minute only rises."""
    files = sorted(snapshots.glob("*.snap"))[first:]
    if len(files) < 3:
        return
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__),
              tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    series: dict[tracemalloc.Traceback, list[int]] = {}
    for n, f in enumerate(files):
        for stat in tracemalloc.Snapshot.load(str(f)).filter_traces(ignore).statistics("traceback"):
            series.setdefault(stat.traceback, [0] * len(files))[n] = stat.size
    rows = []
    for tb, sizes in series.items():
        steps = [b - a for a, b in itertools.pairwise(sizes)]
        rows.append((sizes[-1] - sizes[0], sum(d > 0 for d in steps), sum(d < 0 for d in steps), tb, sizes))
    rows.sort(key=lambda r: r[0], reverse=True)
    print(f"### steadiest growth by stack, snapshots {first} -> {first + len(files) - 1} "
          f"({len(files) - 1} intervals: rose / fell)")
    for growth, rose, fell, tb, sizes in [r for r in rows if r[2] <= r[1] // 4][:top]:
        print(f"{growth / 1024:+9.1f} KiB  rose {rose} fell {fell}  ({sizes[0]} -> {sizes[-1]} bytes)")
        for frame in tb.format()[-8:]:
            print("    " + frame)


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
    if args.tracemalloc or args.inproc:
        cmd = [sys.executable, __file__, "_traced", str(int(args.tracemalloc)), str(port), str(snapshots),
               str(args.sample_s), *workers]
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
        print(f"{'min':>6} {'RSS MiB':>8} {'growth':>8} {'heap':>7} {'anon':>7} {'requests':>9} {'req/s':>6}")
        base: int | None = None
        last_sent, last_t = 0, start
        while not running.done():
            await asyncio.wait({running}, timeout=args.sample_s)
            now = time.monotonic()
            rss = rss_kib(router.pid)[0]
            base = rss if base is None else base
            rate = (load.sent - last_sent) / max(now - last_t, 1e-9)
            last_sent, last_t = load.sent, now
            heap, anon = rss_split_kib(router.pid)
            print(f"{(now - start) / 60:6.1f} {rss / 1024:8.2f} {(rss - base) / 1024:+8.2f} "
                  f"{heap / 1024:7.2f} {anon / 1024:7.2f} {load.sent:9d} {rate:6.1f}", flush=True)
        await running
        print(f"statuses {dict(sorted(load.statuses.items()))}, client errors {load.errors}")
    finally:
        if (args.tracemalloc or args.inproc) and router.poll() is None:
            router.send_signal(signal.SIGUSR1)
            await asyncio.sleep(2)
        elif router.poll() is None:
            trim_through_gdb(router.pid)
        router.terminate()
        router.wait(60)
        sim.terminate()
        sim.wait(30)
    if args.tracemalloc or args.inproc:
        print_stats(snapshots, args.warmup_samples, args.top)
    if args.tracemalloc:
        print_growth(snapshots, args.warmup_samples, args.top)
        print_trend(snapshots, args.warmup_samples, 10)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=4, help="client loops (default 4)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second in all (default 20; 0: "
                   "as fast as they are answered)")
    p.add_argument("--fresh", type=float, default=0.0, help="share of prompts that are new text (default 0)")
    p.add_argument("--sample-s", type=float, default=30.0, help="RSS sample period (default 30 s)")
    p.add_argument("--tracemalloc", action="store_true", help="trace the router's allocations")
    p.add_argument("--inproc", action="store_true", help="the router in the same child as --tracemalloc, "
                   "recording its own stats and trying malloc_trim at the end, without tracing")
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
