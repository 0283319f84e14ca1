"""Where a small request's time goes in the router: py-spy samples `kvroute serve` while a
closed-loop client sends small chat requests (the same replicas and bodies as
bench_router_overhead.py), then prints the functions with the largest shares of the samples.

    pip install py-spy
    python benchmarks/profile_request.py                  # streaming
    python benchmarks/profile_request.py --plain          # non-streaming
    python benchmarks/profile_request.py --src /path/to/other/checkout/src   # another checkout
    python benchmarks/profile_request.py --plain --on-cpu  # perf: on-CPU time by shared object

Two shares per function: *self*, the samples where it was the innermost frame (its own code and
the C calls it makes), and *inclusive*, the samples where it was anywhere on the stack.  py-spy
samples only while the router's thread runs (no ``--idle``), so the shares are of its CPU time.
``--raw FILE`` keeps py-spy's collapsed stacks for a flame graph.  ``--syscalls N`` counts the
router's system calls instead (``strace -c``) over N requests, per request: each write to a
socket is one.  ``--on-cpu`` samples with ``perf record -e cpu-clock`` instead and splits the
router's time *on a CPU* by shared object (the interpreter, the kernel, uvloop...): py-spy also
counts a router preempted inside a system call (each write wakes the client or a replica on a
shared machine), which makes the writes and the event loop look several times larger than the
CPU they take.  Both print the router's CPU per request over the sampled window (/proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp

# Run as a script, this directory is on the path: the benchmark's replicas, bodies and client.
from bench_router_overhead import KVROUTE, free_ports, load, start_router, wait_ready


def frame_name(frame: str) -> str:
    """``function (path/to/file.py:12)`` -> ``file.py:function``: a function, not a line."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    return f"{os.path.basename(path)}:{name}" if path else name


# The router's parts, each a test on a sample's stack (innermost frame last); a sample counts for
# the first part it matches.
PARTS: list[tuple[str, Callable[[list[str]], bool]]] = [
    ("writes to the client (system calls)", lambda f: f[-1] == "front.py:_FrontConnection.write"),
    ("writes to the worker (system calls)", lambda f: f[-1] == "upstream.py:_Connection.start"),
    ("decision log line", lambda f: any(n.endswith("._log") and n.startswith("proxy.py:") for n in f)),
    ("saturation read (Dispatcher._observe)", lambda f: "dispatch.py:Dispatcher._observe" in f),
    ("routing decision (Dispatcher.route)", lambda f: "dispatch.py:Dispatcher.route" in f),
    ("dispatcher books (sent, finished, admit)",
     lambda f: any(n in f for n in ("dispatch.py:Dispatcher.sent", "dispatch.py:Dispatcher.finished",
                                    "dispatch.py:Dispatcher.admit"))),
    ("request parsing (api/requests.py, orjson)", lambda f: "requests.py:parse_request" in f),
    ("answer checks (answer_shape.py)", lambda f: any(n.startswith("answer_shape.py:") for n in f)),
    ("listening side (front.py, reads and parsing)", lambda f: f[-1].startswith("front.py:")),
    ("upstream connection (upstream.py)", lambda f: f[-1].startswith("upstream.py:")),
    ("proxy (proxy.py)", lambda f: f[-1].startswith("proxy.py:")),
    ("event loop (uvloop, not in a Python callback)", lambda f: f[-1] == "runners.py:Runner.run"),
    ("everything else", lambda f: True),
]


def summarise(raw: str, top: int) -> str:
    """The ``top`` functions by self and by inclusive share of py-spy's collapsed stacks."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    parts: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [frame_name(f) for f in stack.split(";")]
        own[frames[-1]] += n
        parts[next(name for name, test in PARTS if test(frames))] += n
        for name in set(frames):
            inclusive[name] += n
    if not total:
        return "no samples"
    lines = [f"{total} samples", "", "| % | part |", "|---:|---|"]
    lines += [f"| {100 * parts[name] / total:.1f} | {name} |" for name, _ in PARTS]
    lines += ["", "| self % | function |", "|---:|---|"]
    lines += [f"| {100 * n / total:.1f} | `{name}` |" for name, n in own.most_common(top)]
    lines += ["", "| inclusive % | function |", "|---:|---|"]
    # The frames on every stack (the CLI, the event loop) say nothing.
    shown = [(name, n) for name, n in inclusive.most_common() if n < 0.995 * total][:top]
    lines += [f"| {100 * n / total:.1f} | `{name}` |" for name, n in shown]
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="kvroute-profile-"))
    env = {**os.environ, "KVROUTE_ADMIN_TOKEN": ""}
    sim_port = free_ports(args.replicas)
    sim = subprocess.Popen(
        [*KVROUTE, "sim", "--preset", "a4000-qwen3-4b", "--replicas", str(args.replicas), "--port",
         str(sim_port), "--speed", "1000", "--max-num-seqs", "256"],
        stdout=subprocess.DEVNULL, stderr=open(logs / "sim.log", "w"), env=env)  # noqa: SIM115
    sim_urls = [f"http://127.0.0.1:{sim_port + i}" for i in range(args.replicas)]
    port = free_ports(1)
    router = start_router("router", args.src, [a for u in sim_urls for a in ("--worker", u)], port,
                          args.log_level, logs, env)
    url = f"http://127.0.0.1:{port}"
    raw = logs / "stacks.txt"
    counts = ""
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            for sim_url in sim_urls:
                await wait_ready(http, sim_url, "/health")
            await wait_ready(http, url, "/ready")
            await load(http, "warmup", [url], 8, 400, args.max_tokens, 10**6, not args.plain)
            if args.syscalls:
                counts = await count_syscalls(http, url, router.pid, args, logs / "strace.txt")
                return
            if args.on_cpu:
                recorded = logs / "perf.data"
                spy = subprocess.Popen(
                    ["timeout", "-s", "INT", str(args.seconds), "perf", "record", "-q", "-e", "cpu-clock",
                     "-F", "999", "-p", str(router.pid), "-o", str(recorded)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            else:
                spy = subprocess.Popen(
                    ["py-spy", "record", "--format", "raw", "--rate", str(args.rate), "--duration",
                     str(args.seconds), "--pid", str(router.pid), "--output", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cpu_before = router_cpu_s(router.pid)
            served = 0
            while spy.poll() is None:
                await load(http, "router", [url], args.concurrency, args.concurrency * 20, args.max_tokens,
                           served, not args.plain)
                served += args.concurrency * 20
            cpu_after = router_cpu_s(router.pid)
            if spy.returncode and not (args.on_cpu and spy.returncode == 124):  # 124: timeout stopped perf
                raise RuntimeError(f"{'perf' if args.on_cpu else 'py-spy'} failed ({spy.returncode}); "
                                   "it needs ptrace rights (root)")
    finally:
        for proc in (router, sim):
            proc.terminate()
            proc.wait(30)
        if counts:
            print(counts)
    user, system = ((after - before) / served * 1e6
                    for before, after in zip(cpu_before, cpu_after, strict=True))
    print(f"{'non-streaming' if args.plain else 'streaming'}, {args.concurrency} clients, {served} requests "
          f"in {args.seconds} s, {args.max_tokens} tokens each, router log level {args.log_level}")
    print(f"router CPU per request (/proc, while sampled): {user:.0f} µs user + {system:.0f} µs system")
    if args.on_cpu:
        print(on_cpu_split(recorded))
        return
    text = raw.read_text()
    if args.raw:
        Path(args.raw).write_text(text)
    print(summarise(text, args.top))


def router_cpu_s(pid: int) -> tuple[float, float]:
    """The process's user and system CPU seconds so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def on_cpu_split(recorded: Path) -> str:
    """The shares of perf's on-CPU samples by shared object: the interpreter, the kernel (system
    calls, the TCP stack), uvloop, httptools, orjson...  Only time the router spent on a CPU counts
    (``cpu-clock``), unlike py-spy's samples, which count a thread preempted inside a system call."""
    report = subprocess.run(["perf", "report", "-q", "-i", str(recorded), "--sort", "dso", "--stdio"],
                            capture_output=True, text=True, check=True).stdout
    lines = ["| % of on-CPU samples | shared object |", "|---:|---|"]
    for line in report.splitlines():
        share, _, dso = line.strip().partition("%")
        if dso.strip():
            lines.append(f"| {share.strip()} | `{dso.strip()}` |")
    return "\n".join(lines)


async def count_syscalls(http: aiohttp.ClientSession, url: str, pid: int, args: argparse.Namespace,
                         out: Path) -> str:
    """The router's system calls per request over ``args.syscalls`` requests (strace -c)."""
    tracer = subprocess.Popen(["strace", "-c", "-f", "-q", "-p", str(pid), "-o", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    await asyncio.sleep(1.0)  # attached
    await load(http, "router", [url], args.concurrency, args.syscalls, args.max_tokens, 0, not args.plain)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(30)
    lines = [f"{'non-streaming' if args.plain else 'streaming'}, {args.concurrency} clients, "
             f"{args.syscalls} requests: system calls per request", "", "| calls per request | syscall |",
             "|---:|---|"]
    for line in out.read_text().splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(fields) >= 5 and fields[3].isdigit() and fields[-1] != "total":
            lines.append(f"| {int(fields[3]) / args.syscalls:.2f} | {fields[-1]} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", action="store_true", help="non-streaming requests")
    p.add_argument("--src", help="profile a router from this checkout's src instead")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--seconds", type=int, default=20, help="how long py-spy samples (default 20)")
    p.add_argument("--rate", type=int, default=250, help="samples per second (default 250)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--log-level", default="info", help="router log level (default info, as the benchmark)")
    p.add_argument("--top", type=int, default=25, help="functions listed per table (default 25)")
    p.add_argument("--raw", help="also write py-spy's collapsed stacks here")
    p.add_argument("--summarise", metavar="RAW", help="only summarise collapsed stacks written by --raw")
    p.add_argument("--on-cpu", action="store_true",
                   help="sample with perf (cpu-clock) instead of py-spy: on-CPU time by shared object")
    p.add_argument("--syscalls", type=int, default=0,
                   help="count the router's system calls (strace -c) over this many requests instead")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.summarise:
        print(summarise(Path(arguments.summarise).read_text(), arguments.top))
    else:
        asyncio.run(main(arguments))
