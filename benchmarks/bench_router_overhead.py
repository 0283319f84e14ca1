"""What the router itself costs: time to first byte and requests/s through `kvroute serve` against
a direct connection to the same simulated replicas, at several numbers of concurrent streams.

Three processes, as in a deployment: the replicas (`kvroute sim`, fast enough that the engine adds
little), the router (`kvroute serve`, uvloop, decision logging on at the default INFO level) and
this load generator.  Each level runs direct then routed, alternating, ``--rounds`` times; the
figures are medians over every request of a target at that level.

    python benchmarks/bench_router_overhead.py                 # 1, 16, 64 streams
    python benchmarks/bench_router_overhead.py --json out.json --requests 800

``--plain`` sends non-streaming requests (``"stream": false``).  ``--baseline-src DIR`` also starts
a second router from another checkout's ``src`` (e.g. main's, from ``git archive``) in front of the
same replicas, and each round runs direct, then both routers in turn (taking turns going first), so
the machine's other load falls on both alike; the table then has a row per router, and the median
over rounds of the router CPU per request beside the total, followed by the ratio of each router's
CPU per request to the baseline's in the same round (median and range over the rounds).
``--variant ARGS`` (repeatable) adds a router from this checkout started with more ``kvroute serve``
flags, e.g. what the access log costs:

    python benchmarks/bench_router_overhead.py --variant=--access-log \
        --variant="--access-log --log-format json" --variant="--otlp-endpoint {sink}"

``{sink}`` in a variant is the URL of an OTLP/HTTP endpoint this script serves (it accepts and drops
every export), so that tracing's cost can be measured without a collector.

``--alias NAME`` also starts a router with ``--model-alias NAME=qwen3-4b`` and sends it requests
for ``NAME``: what renaming the request and its answer costs.  ``--exact`` makes the replicas
publish KV-cache events and adds a router that routes on them (exact mode: every request tokenized
by a replica's ``/tokenize``), beside one that ignores them; ``--prompt-bytes`` sets the prompt's
size (900 by default); with ``--conversation`` each client holds one conversation that grows by a
short turn per request (a 32 KB conversation's next turn: ``--exact --conversation
--prompt-bytes 32768``).  ``--local-tokenizer DIR`` (with ``--exact``) adds a third exact router
that tokenizes in the router (the setting ``tokenizer``: DIR's tokenizer.json and chat template)
instead of asking a replica's ``/tokenize``; the simulator's pseudo-tokens are not a real
tokenizer's, so that router's blocks never match the replicas' events: what it measures is the
cost of tokenizing, not of routing on the matches.

``--instructions`` runs every router under valgrind's callgrind and prints the instructions each
ran per request (all rounds, and each round), less what it runs per second idle, and the last
window's split by shared object: exact counts of the router's own user-space work, which the
machine's other load does not change (the kernel's work for it is not counted).  The routers run
~50x slower, so their probes are slowed to one an hour and the canary is off (``--set
canary=false``): what runs by the clock would otherwise count ~50x per request.  Side by side:

    python benchmarks/bench_router_overhead.py --instructions --plain --levels 16 --requests 3200 \
        --rounds 4 --log-level warning --baseline-src /path/to/other/checkout/src
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from kvroute.prometheus_text import parse_exposition

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # developer tooling, not in the wheel
from kvroute_dev.ports import free_ports

KVROUTE = [sys.executable, "-c", "from kvroute.cli import main; main()"]
MODEL = "qwen3-4b"


@dataclass
class Run:
    """One target at one concurrency level; ``router_cpu_s`` is the router process's CPU time
    (user + system) while it ran, which the machine's other load does not inflate."""

    target: str
    concurrency: int
    requests: int
    seconds: float
    ttfb_ms: list[float]
    router_cpu_s: float = 0.0
    round_cpu_us: list[float] = field(default_factory=list)  # router CPU per request, each round
    instructions: int = 0  # the router's, with --instructions
    round_instructions: list[float] = field(default_factory=list)  # per request, each round

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def pct(self, q: float) -> float:
        data = sorted(self.ttfb_ms)
        return data[min(len(data) - 1, int(q * len(data)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_ready(http: aiohttp.ClientSession, url: str, path: str, tries: int = 600) -> None:
    for _ in range(tries):
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + path) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url}{path} never became ready")


PROMPT_BYTES = 900
CONVERSATION = False


def body(i: int, max_tokens: int, stream: bool, model: str = MODEL) -> bytes:
    filler = "tell me something about routing and caches. "
    prompt = f"request {i}: " + filler * max(1, PROMPT_BYTES // len(filler))
    return orjson.dumps({"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                         "messages": [{"role": "user", "content": prompt}]})


async def one(http: aiohttp.ClientSession, url: str, data: bytes) -> float:
    start = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", data=data,
                         headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        await resp.content.readany()
        ttfb = time.perf_counter() - start
        async for _ in resp.content.iter_any():
            pass
    return ttfb * 1000


async def load(http: aiohttp.ClientSession, target: str, urls: list[str], concurrency: int, requests: int,
               max_tokens: int, offset: int, stream: bool = True, model: str = MODEL) -> Run:
    """Closed loop: ``concurrency`` clients, each sending its next request when the last ends."""
    ttfbs: list[float] = []
    counter = iter(range(requests))

    async def client() -> None:
        history: list[dict[str, str]] = []
        for i in counter:
            if not CONVERSATION:
                data = body(offset + i, max_tokens, stream, model)
            else:
                # One conversation per client: its long first message, then a short turn each time.
                if not history:
                    first = orjson.loads(body(offset + i, max_tokens, stream, model))["messages"]
                    history.extend(first)
                else:
                    history.extend([{"role": "assistant", "content": "noted."},
                                    {"role": "user", "content": f"and turn {i}?"}])
                data = orjson.dumps({"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                                     "stream": stream, "messages": history})
            ttfbs.append(await one(http, urls[i % len(urls)], data))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return Run(target, concurrency, requests, time.perf_counter() - start, ttfbs)


def event_lag(metrics: str) -> tuple[float, float]:
    """Upper bounds of the p50 and p99 KV-event lag: the first histogram buckets (summed over the
    workers) holding half and 99 % of the batches."""
    buckets: dict[float, float] = {}
    for sample in parse_exposition(metrics, ["kvroute_kv_events_lag_seconds_bucket"]):
        bound = float(sample.labels["le"])
        buckets[bound] = buckets.get(bound, 0.0) + sample.value
    if not buckets or not buckets[math.inf]:
        return math.nan, math.nan
    total = buckets[math.inf]
    ordered = sorted(buckets.items())
    p50 = next(b for b, n in ordered if n >= 0.5 * total)
    p99 = next(b for b, n in ordered if n >= 0.99 * total)
    return p50, p99


def tokenize_times(metrics: str) -> tuple[float, float, str]:
    """Upper bounds of the p50 and p99 of ``kvroute_tokenize_seconds`` (bucket bounds, every path
    summed) and the requests by path and outcome, from an exact router's /metrics."""
    buckets: dict[float, float] = {}
    for sample in parse_exposition(metrics, ["kvroute_tokenize_seconds_bucket"]):
        bound = float(sample.labels["le"])
        buckets[bound] = buckets.get(bound, 0.0) + sample.value
    paths = ", ".join(f"{s.labels['path']} {s.labels['outcome']} {s.value:.0f}"
                      for s in parse_exposition(metrics, ["kvroute_tokenize_total"]) if s.value)
    if not buckets or not buckets[math.inf]:
        return math.nan, math.nan, paths
    total = buckets[math.inf]
    ordered = sorted(buckets.items())
    p50 = next(b for b, n in ordered if n >= 0.5 * total)
    p99 = next(b for b, n in ordered if n >= 0.99 * total)
    return p50, p99, paths


def exact_table(results: list[tuple[Run, list[Run]]], tokenizing: dict[str, tuple[float, float, str]]) -> str:
    """The exact routers beside the plain one: added TTFB p50/p99 over direct, router CPU per
    request (median of rounds) and the time tokenizing took (all requests of the run)."""
    lines = ["| streams | router | added TTFB p50 (ms) | added TTFB p99 (ms) | router CPU per request, "
             "median of rounds (µs) | tokenizing p50 / p99 (ms, bucket bounds) | tokenized by |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for direct, routed_runs in results:
        d50, d99 = statistics.median(direct.ttfb_ms), direct.pct(0.99)
        for routed in routed_runs:
            if routed.target not in ("router", "router+exact", "router+exact+local"):
                continue
            p50, p99, paths = tokenizing.get(routed.target, (math.nan, math.nan, ""))
            lines.append(
                f"| {direct.concurrency} | {routed.target} | {statistics.median(routed.ttfb_ms) - d50:+.2f} "
                f"| {routed.pct(0.99) - d99:+.2f} | {statistics.median(routed.round_cpu_us):.0f} "
                f"| {p50 * 1000:.2f} / {p99 * 1000:.2f} | {paths} |")
    return "\n".join(lines)


def merge(runs: list[Run]) -> Run:
    return Run(runs[0].target, runs[0].concurrency, sum(r.requests for r in runs),
               sum(r.seconds for r in runs), [t for r in runs for t in r.ttfb_ms],
               sum(r.router_cpu_s for r in runs), [r.router_cpu_s / r.requests * 1e6 for r in runs],
               sum(r.instructions for r in runs), [r.instructions / r.requests for r in runs])


def table(results: list[tuple[Run, list[Run]]]) -> str:
    lines = [
        "| streams | router | TTFB p50 direct / router (ms) | added p50 (ms) | TTFB p95 direct / router (ms) "
        "| req/s direct / router | req/s ratio | router CPU per request (µs) | median of rounds (µs) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for direct, routed_runs in results:
        d50 = statistics.median(direct.ttfb_ms)
        for routed in routed_runs:
            r50 = statistics.median(routed.ttfb_ms)
            lines.append(
                f"| {direct.concurrency} | {routed.target} | {d50:.2f} / {r50:.2f} | {r50 - d50:+.2f} "
                f"| {direct.pct(0.95):.2f} / {routed.pct(0.95):.2f} "
                f"| {direct.rps:.0f} / {routed.rps:.0f} | {routed.rps / direct.rps:.2f} "
                f"| {routed.router_cpu_s / routed.requests * 1e6:.0f} "
                f"| {statistics.median(routed.round_cpu_us):.0f} |"
            )
    return "\n".join(lines)


def start_router(name: str, src: str | None, worker_args: list[str], port: int, log_level: str,
                 logs: Path, env: dict[str, str], extra: list[str] | None = None,
                 callgrind: bool = False) -> subprocess.Popen[bytes]:
    """``kvroute serve`` from this checkout, or from ``src`` (another checkout's ``src``) when given;
    ``extra``: more flags; ``callgrind``: under valgrind's callgrind, counting nothing until told
    (`Instructions`)."""
    if src is not None:
        env = {**env, "PYTHONPATH": os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])}
    log_name = "".join(c if c.isalnum() else "_" for c in name)
    wrap = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={logs}/callgrind.{log_name}.%p"] if callgrind else []
    return subprocess.Popen(
        [*wrap, *KVROUTE, "serve", *worker_args, "--port", str(port), "--log-level", log_level,
         *(extra or [])],
        stdout=subprocess.DEVNULL, stderr=open(logs / f"{log_name}.log", "w"), env=env)


class Instructions:
    """The instructions a router under callgrind runs between ``start`` and ``stop``: exact, the
    same whatever else the machine does (valgrind counts the process's own user-space
    instructions, not the kernel's work on its behalf).  Instrumenting slows the router ~50x, so
    only the measured windows are instrumented."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started = 0.0
        self.idle_per_s: dict[int, float] = {}

    async def idle(self, pid: int, seconds: float) -> None:
        """What the router runs per second while no request comes (its probes, the canary's
        rounds: timers, which a router slowed ~50x runs as often per second but ~50x as often per
        request), to take from each window's count."""
        self.start(pid)
        await asyncio.sleep(seconds)
        self.idle_per_s[pid] = self.stop(pid, net=False) / (time.perf_counter() - self.started)

    @staticmethod
    def _control(pid: int, *flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, str(pid)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    def start(self, pid: int) -> None:
        self._control(pid, "--instr=on")
        self._control(pid, "--zero")
        self.started = time.perf_counter()

    def by_object(self, pid: int) -> list[tuple[str, int]]:
        """The router's last window's instructions by shared object (the interpreter, uvloop,
        httptools, orjson, libc...), most first: ``callgrind_annotate``'s functions, summed."""
        dump = max(self.logs.glob(f"callgrind.*.{pid}.*"), key=lambda f: f.stat().st_mtime)
        text = subprocess.run(["callgrind_annotate", "--threshold=100", str(dump)], check=True,
                              capture_output=True, text=True).stdout
        totals: dict[str, int] = {}
        for line in text.splitlines():
            count, _, rest = line.strip().partition(" ")
            if not count[:1].isdigit() or "PROGRAM TOTALS" in rest:
                continue
            where = rest.rsplit("[", 1)
            name = os.path.basename(where[1].rstrip("]")) if len(where) == 2 else "(inlined, no object)"
            totals[name] = totals.get(name, 0) + int(count.replace(",", ""))
        return sorted(totals.items(), key=lambda kv: -kv[1])

    def stop(self, pid: int, net: bool = True) -> int:
        """Instructions since ``start``; ``net``: less the idle rate over the window."""
        seconds = time.perf_counter() - self.started
        before = set(self.logs.glob(f"callgrind.*.{pid}*"))
        self._control(pid, "--dump")
        self._control(pid, "--instr=off")
        (dump,) = set(self.logs.glob(f"callgrind.*.{pid}*")) - before
        for line in dump.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1]) - round(self.idle_per_s.get(pid, 0.0) * seconds if net else 0)
        raise RuntimeError(f"no totals in {dump}")


async def otlp_sink() -> tuple[web.AppRunner, str]:
    """An OTLP/HTTP traces endpoint that accepts every export and keeps nothing."""
    async def accept(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", accept)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def main(args: argparse.Namespace) -> None:
    replicas = args.replicas
    sim_port = free_ports(replicas)
    logs = Path(tempfile.mkdtemp(prefix="kvroute-bench-"))
    env = {**os.environ, "KVROUTE_ADMIN_TOKEN": ""}
    global PROMPT_BYTES, CONVERSATION
    PROMPT_BYTES, CONVERSATION = args.prompt_bytes, args.conversation
    events = ["--kv-events-config", orjson.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*"}).decode()] if args.exact else []
    if args.exact:
        env["KVROUTE_KV_EVENTS_ENDPOINT"] = ""  # the plain router: no events, approximate index
    sim = subprocess.Popen(
        [*KVROUTE, "sim", "--preset", "a4000-qwen3-4b", "--replicas", str(replicas), "--port", str(sim_port),
         "--speed", str(args.speed), "--max-num-seqs", "256", *events],
        stdout=subprocess.DEVNULL, stderr=open(logs / "sim.log", "w"), env=env)  # noqa: SIM115
    sim_urls = [f"http://127.0.0.1:{sim_port + i}" for i in range(replicas)]
    worker_args = [a for u in sim_urls for a in ("--worker", u)]
    wanted: list[tuple[str, str | None, list[str]]] = (
        [("baseline", args.baseline_src, [])] if args.baseline_src else [])
    wanted.append(("router", None, []))
    # The model each router is asked for: an aliased name on the alias router, else the served one.
    asked = {name: MODEL for name, _, _ in wanted}
    if args.alias:
        wanted.append(("router+alias", None, ["--model-alias", f"{args.alias}={MODEL}"]))
        asked["router+alias"] = args.alias
    if args.exact:
        wanted.append(("router+exact", None, []))
    if args.local_tokenizer:
        if not args.exact:
            raise SystemExit("--local-tokenizer needs --exact")
        folder = orjson.dumps(args.local_tokenizer).decode()  # --set reads TOML: a quoted string
        wanted.append(("router+exact+local", None, ["--set", f"tokenizer={folder}"]))
    sink = await otlp_sink() if any("{sink}" in v for v in args.variant) else None
    for variant in args.variant:
        flags = variant.replace("{sink}", sink[1] if sink else "").split()
        wanted.append((f"router {variant}", None, flags))
    routers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    for name, src, flags in wanted:
        port = free_ports(1)
        # The exact router subscribes where the replicas' /server_info says they publish.
        router_env = {k: v for k, v in env.items() if k != "KVROUTE_KV_EVENTS_ENDPOINT"} \
            if name.startswith("router+exact") else env
        if args.instructions:
            # What runs by the clock (the probes after the first round, the canary's rounds) is no
            # request's cost, and a router slowed ~50x would run it ~50x as often per request.
            router_env = {**router_env, "KVROUTE_PROBE_INTERVAL_S": "3600"}
            flags = [*flags, "--set", "canary=false"]
        routers[name] = (start_router(name, src, worker_args, port, args.log_level, logs, router_env, flags,
                                      args.instructions),
                         f"http://127.0.0.1:{port}")
    load_before = f"{os.getloadavg()[0]:.2f}"
    lag = (math.nan, math.nan)
    tokenizing: dict[str, tuple[float, float, str]] = {}
    stream = not args.plain
    counter = Instructions(logs) if args.instructions else None
    try:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            for url in sim_urls:
                await wait_ready(http, url, "/health")
            for _, url in routers.values():
                # Under callgrind a router starts ~50x slower: on a loaded machine past 30 s.
                await wait_ready(http, url, "/ready", 6000 if counter else 600)
            await load(http, "warmup", [*sim_urls, *(url for _, url in routers.values())], 8, 200,
                       args.max_tokens, 10**6, stream)
            if counter:
                for proc, _ in routers.values():
                    await counter.idle(proc.pid, 5.0)
            results = []
            offset = 0
            for level in args.levels:
                runs: dict[str, list[Run]] = {"direct": [], **{name: [] for name in routers}}
                per_round = max(level * 4, args.requests // args.rounds)
                for n in range(args.rounds):
                    # The routers take turns going first, so neither always follows the other.
                    order = list(routers.items())[::-1 if n % 2 else 1]
                    targets = [("direct", sim_urls, None),
                               *((name, [url], proc) for name, (proc, url) in order)]
                    for target, urls, proc in targets:
                        cpu = cpu_seconds(proc.pid) if proc else 0.0
                        if proc and counter:
                            counter.start(proc.pid)
                        run = await load(http, target, urls, level, per_round, args.max_tokens, offset,
                                         stream, asked.get(target, MODEL))
                        run.router_cpu_s = cpu_seconds(proc.pid) - cpu if proc else 0.0
                        if proc and counter:
                            run.instructions = counter.stop(proc.pid)
                        runs[target].append(run)
                        offset += per_round
                results.append((merge(runs["direct"]), [merge(runs[name]) for name in routers]))
                print(f"{level:>3} streams done", file=sys.stderr)
            if args.exact:
                async with http.get(routers["router+exact"][1] + "/metrics") as resp:
                    lag = event_lag(await resp.text())
                for name in ("router+exact", "router+exact+local"):
                    if name in routers:
                        async with http.get(routers[name][1] + "/metrics") as resp:
                            tokenizing[name] = tokenize_times(await resp.text())
    finally:
        procs = [proc for proc, _ in routers.values()] + [sim]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        if sink is not None:
            await sink[0].cleanup()
    print(f"replicas={replicas} speed={args.speed} max_tokens={args.max_tokens} rounds={args.rounds} "
          f"stream={stream} cpus={os.cpu_count()} "
          f"load average before/after: {load_before} / {os.getloadavg()[0]:.2f}")
    print(table(results))
    for direct, routed_runs in results:
        by_name = {run.target: run for run in routed_runs}
        base = by_name.get("baseline")
        if base is None:
            continue
        for run in routed_runs:
            if run is base:
                continue
            # The same round's CPU of both routers: the machine's load at that moment fell on both.
            ratios = [new / old for new, old in zip(run.round_cpu_us, base.round_cpu_us, strict=True) if old]
            if ratios:
                spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
                print(f"{direct.concurrency} streams, {run.target} / baseline router CPU per request, "
                      f"per round: median {statistics.median(ratios):.2f} ({spread})")
            if run.instructions:
                ratio = run.instructions / run.requests / (base.instructions / base.requests)
                print(f"{direct.concurrency} streams, {run.target} / baseline instructions per request: "
                      f"{ratio:.3f}")
    if counter:
        for name, (proc, _) in routers.items():
            print(f"{name}: {counter.idle_per_s[proc.pid]:,.0f} instructions per second idle "
                  f"(taken from each window's count below)")
            split = counter.by_object(proc.pid)
            whole = sum(n for _, n in split)
            print(f"{name}, last window by object: " + ", ".join(
                f"{obj} {n / whole:.1%}" for obj, n in split[:8]))
        for direct, routed_runs in results:
            for run in routed_runs:
                rounds = ", ".join(f"{n:,.0f}" for n in run.round_instructions)
                print(f"{direct.concurrency} streams, {run.target}: {run.instructions / run.requests:,.0f} "
                      f"instructions per request (rounds: {rounds})")
    if args.exact:
        print(f"KV event lag (engine batch timestamp to the router's index), from the exact router's "
              f"kvroute_kv_events_lag_seconds: p50 <= {lag[0]} s, p99 <= {lag[1]} s (bucket bounds)")
        print(exact_table(results, tokenizing))
    if args.json:
        doc = [{"direct": asdict(d) | {"rps": d.rps}, **{r.target: asdict(r) | {"rps": r.rps} for r in rs}}
               for d, rs in results]
        Path(args.json).write_bytes(orjson.dumps(doc))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64],
                   help="concurrent streams per level (default 1,16,64)")
    p.add_argument("--requests", type=int, default=600, help="requests per target per level (default 600)")
    p.add_argument("--rounds", type=int, default=3, help="direct/router alternations per level (default 3)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--speed", type=float, default=1000.0, help="simulator speed factor (default 1000)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--log-level", default="info", help="router log level (default info: decision lines on)")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--plain", action="store_true", help="non-streaming requests")
    p.add_argument("--exact", action="store_true",
                   help="the replicas publish KV events; a second router routes on them (exact mode, "
                        "each request tokenized by a replica's /tokenize), beside one that ignores them")
    p.add_argument("--local-tokenizer", metavar="DIR",
                   help="with --exact: a third exact router tokenizing locally from this model folder "
                        "(e.g. ~/.cache/kvroute-vllm/model/SmolLM2-135M-Instruct)")
    p.add_argument("--prompt-bytes", type=int, default=900, help="bytes of each prompt (default 900)")
    p.add_argument("--conversation", action="store_true",
                   help="each client holds one conversation: its first prompt, then a short turn a request")
    p.add_argument("--baseline-src", help="also run a router from this checkout's src, side by side")
    p.add_argument("--alias", help="also run a router with --model-alias ALIAS=qwen3-4b, asked for ALIAS")
    p.add_argument("--instructions", action="store_true",
                   help="run the routers under valgrind's callgrind and report the instructions each "
                        "runs per request (exact, load-independent; TTFB and CPU are then meaningless)")
    p.add_argument("--variant", action="append", default=[],
                   help="also run a router from this checkout with these serve flags (repeatable)")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
