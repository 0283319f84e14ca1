"""A burst of 10x the fleet's capacity at `kvroute serve` with flow control on and its limits set,
then two tenants offered 10:1 while the fleet is saturated (issue 15; docs/flow-control.md).

Processes as in a deployment: 4 simulated replicas (`kvroute sim`), the router (`kvroute serve
--set flow_control=true --set flow_max_queued=... --set flow_queue_ttl_s=...`) and this client.

* burst:   ``--factor`` x the fleet's sequence slots requests at once (connections opened
           first, then every request written together), ``--rounds`` times.  Per round: answers
           by status and code; the rejected answers' latency p50 / p99 / max (write to last
           byte, on this client), the share carrying Retry-After and its values, 5xx,
           accepted requests lost (not rejected, but not a complete 200 with a finished answer),
           and the router process's CPU time over the round per request (what sets the
           latency of the last of a burst read one after another on one core).
* tenants: closed loops of tenant ``a`` (10 x the fleet's slots) and ``b`` (1 x), each with
           ``x-kvroute-tenant``, for ``--seconds``; each tenant's share of the tokens served
           (prompt + completion tokens from the answers' usage, completed after a warm-up).
           ``tenants-off`` (not run by default): the same against a router with flow control off.

    python benchmarks/burst.py
    python benchmarks/burst.py --max-num-seqs 8 --factor 10 --max-queued 64 --ttl 30 --rounds 2
    python benchmarks/burst.py --sections tenants-off --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # developer tooling, not in the wheel
from bench_router_overhead import free_ports
from chaos import wait_ready

from kvroute.quantiles import percentile
from kvroute_dev.raw_http import Conversation, connect, post, read

KVROUTE = [sys.executable, "-c", "from kvroute.cli import main; main()"]
MODEL = "qwen3-4b"


@dataclass
class Outcome:
    status: int
    latency_s: float
    code: str = ""
    retry_after: str | None = None
    complete: bool = False
    tokens: int = 0
    done_at: float = 0.0


def body(i: int, prompt_words: int, max_tokens: int) -> bytes:
    text = f"request {i}: " + " ".join(f"w{(i * 7 + j) % 5000}" for j in range(prompt_words))
    return orjson.dumps({"model": MODEL, "max_tokens": max_tokens,
                         "messages": [{"role": "user", "content": text}]})


def judge(conv: Conversation, started: float) -> Outcome:
    """What one answer was: status, latency, the overload code and Retry-After, whether a 200
    carried a complete, finished answer, and its tokens (usage)."""
    now = time.perf_counter()
    if not conv.answers:
        return Outcome(0, now - started)
    a = conv.answers[0]
    retry = a.headers.get(b"retry-after")
    out = Outcome(a.status, now - started, retry_after=retry.decode() if retry else None, done_at=now)
    try:
        doc: Any = orjson.loads(a.body)
    except orjson.JSONDecodeError:
        return out
    if a.status == 200:
        choice = (doc.get("choices") or [{}])[0]
        usage = doc.get("usage") or {}
        out.complete = a.complete and bool(choice.get("finish_reason")) and \
            isinstance((choice.get("message") or {}).get("content"), str)
        out.tokens = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
    elif isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        out.code = str(doc["error"].get("code") or doc["error"].get("type") or "")
    return out


async def burst_round(url: str, n: int, args: argparse.Namespace, offset: int) -> tuple[
        list[Outcome], list[Outcome]]:
    """``n`` requests written at once on connections opened beforehand; and, once the burst is in,
    ``--probes`` single requests one after another on one more connection (each rejection's
    latency without 300 others being parsed ahead of it)."""
    conns = await asyncio.gather(*(connect(url) for _ in range(n)))
    requests = [post(b"/v1/chat/completions", body(offset + i, args.prompt_words, args.max_tokens))
                for i in range(n)]
    go = asyncio.Event()

    async def one(i: int) -> Outcome:
        reader, writer = conns[i]
        await go.wait()
        started = time.perf_counter()
        writer.write(requests[i])
        try:
            conv = await read(reader, count=1, timeout=args.ttl + 120)
        except TimeoutError:
            return Outcome(-1, time.perf_counter() - started)
        finally:
            writer.close()
        return judge(conv, started)

    async def probes() -> list[Outcome]:
        reader, writer = await connect(url)
        await go.wait()
        await asyncio.sleep(args.probe_after)
        out = []
        try:
            for i in range(args.probes):
                started = time.perf_counter()
                writer.write(post(b"/v1/chat/completions",
                                  body(offset + n + i, args.prompt_words, args.max_tokens)))
                out.append(judge(await read(reader, count=1, timeout=args.ttl + 120), started))
        finally:
            writer.close()
        return out

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    probing = asyncio.create_task(probes())
    await asyncio.sleep(0.2)  # every task waits on the event
    go.set()
    return list(await asyncio.gather(*tasks)), await probing


def cpu_s(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1000:.1f}" if values else "-"


def _counts(counter: collections.Counter[str]) -> str:
    return ", ".join(f"{k}: {n}" for k, n in sorted(counter.items(), key=lambda kv: (len(kv[0]), kv[0])))


def report_burst(rounds: list[list[Outcome]], cpu: list[float], slots: int, args: argparse.Namespace) -> None:
    print(f"\n### Burst: {len(rounds[0])} requests at once = {args.factor} x {slots} sequence slots "
          f"(flow_max_queued={args.max_queued}, flow_queue_ttl_s={args.ttl})\n")
    print("| Round | Served 200 | Rejected (by code) | Rejected latency p50 / p99 / max (ms) | "
          "With Retry-After | Retry-After values (s) | 5xx | Accepted lost | Router CPU per request (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, outs in enumerate(rounds, 1):
        rejected = [o for o in outs if o.status in (429, 529)]
        lat = [o.latency_s for o in rejected]
        codes = collections.Counter(o.code for o in rejected)
        with_retry = sum(1 for o in rejected if o.retry_after is not None)
        values = collections.Counter(o.retry_after or "" for o in rejected if o.retry_after is not None)
        fivexx = sum(1 for o in outs if o.status >= 500)
        lost = sum(1 for o in outs if o.status not in (429, 529) and not (o.status == 200 and o.complete))
        served = sum(1 for o in outs if o.status == 200 and o.complete)
        share = f"{100 * with_retry / len(rejected):.0f} %" if rejected else "-"
        print(f"| {i} | {served} | {len(rejected)} ({_counts(codes)}) "
              f"| {ms(lat, 50)} / {ms(lat, 99)} / {max(lat) * 1000 if lat else 0:.1f} | {share} "
              f"| {_counts(values)} | {fivexx} | {lost} | {1000 * cpu[i - 1] / len(outs):.2f} |")
        by_code: dict[str, list[float]] = collections.defaultdict(list)
        for o in rejected:
            by_code[o.code].append(o.latency_s)
        for code, values_s in sorted(by_code.items()):
            print(f"|   | {code} | {len(values_s)} | {ms(values_s, 50)} / {ms(values_s, 99)} / "
                  f"{max(values_s) * 1000:.1f} | | | | | |")


async def tenants(url: str, slots: int, args: argparse.Namespace) -> None:
    """Closed loops: tenant a with 10 x slots clients, b with 1 x slots, back to back."""
    loops = {"a": 10 * slots, "b": slots}
    outcomes: dict[str, list[Outcome]] = {t: [] for t in loops}
    stop_at = time.perf_counter() + args.warmup + args.seconds
    counter = iter(range(10**9))

    async def client(tenant: str) -> None:
        reader, writer = await connect(url)
        try:
            while time.perf_counter() < stop_at:
                i = next(counter)
                started = time.perf_counter()
                request = body(10**6 + i, args.prompt_words, args.max_tokens)
                writer.write(post(b"/v1/chat/completions", request,
                                  b"x-kvroute-tenant: " + tenant.encode() + b"\r\n"))
                conv = await read(reader, count=1, timeout=args.ttl + 120)
                out = judge(conv, started)
                outcomes[tenant].append(out)
                if out.status in (429, 529):  # as a client would: wait as told
                    await asyncio.sleep(float(out.retry_after or 1))
                elif out.status != 200:
                    break
        finally:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(t) for t, n in loops.items() for _ in range(n)))
    window = (t0 + args.warmup, t0 + args.warmup + args.seconds)
    served = {t: sum(o.tokens for o in outs if o.status == 200 and window[0] <= o.done_at <= window[1])
              for t, outs in outcomes.items()}
    requests = {t: sum(1 for o in outs if o.status == 200 and window[0] <= o.done_at <= window[1])
                for t, outs in outcomes.items()}
    shed = {t: sum(1 for o in outs if o.status in (429, 529)) for t, outs in outcomes.items()}
    total = sum(served.values()) or 1
    print(f"\n### Two tenants offered 10:1 ({loops['a']} and {loops['b']} closed-loop clients), "
          f"{args.seconds:.0f} s after a {args.warmup:.0f} s warm-up\n")
    print("| Tenant | Clients | Requests served | Tokens served | Share of tokens | Shed |")
    print("|---|---|---|---|---|---|")
    for t in loops:
        print(f"| {t} | {loops[t]} | {requests[t]} | {served[t]:,} | {100 * served[t] / total:.1f} % "
              f"| {shed[t]} |")


async def metric_lines(url: str, prefix: bytes) -> list[str]:
    reader, writer = await connect(url)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        conv = await read(reader, count=1)
    finally:
        writer.close()
    return [line.decode() for line in conv.answers[0].body.splitlines() if line.startswith(prefix)]


def start_router(workers: list[str], logs: Path, name: str, settings: dict[str, object]) -> tuple[
        subprocess.Popen[bytes], str]:
    port = free_ports(1)
    sets = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen([*KVROUTE, "serve", *[a for u in workers for a in ("--worker", u)],
                             "--port", str(port), "--log-level", "warning", *sets],
                            stdout=subprocess.DEVNULL, stderr=open(logs / f"router-{name}.log", "w"),  # noqa: SIM115
                            env={**os.environ, "KVROUTE_ADMIN_TOKEN": ""})
    return proc, f"http://127.0.0.1:{port}"


async def main(args: argparse.Namespace) -> None:
    logs = Path(tempfile.mkdtemp(prefix="kvroute-burst-"))
    sim_port = free_ports(args.replicas)
    sim = subprocess.Popen(
        [*KVROUTE, "sim", "--preset", "a4000-qwen3-4b", "--replicas", str(args.replicas), "--port",
         str(sim_port), "--speed", str(args.speed), "--max-num-seqs", str(args.max_num_seqs),
         "--output-tokens-min", str(args.max_tokens), "--output-tokens-max", str(args.max_tokens),
         "--log-level", "WARNING"],
        stdout=subprocess.DEVNULL, stderr=open(logs / "sim.log", "w"))  # noqa: SIM115
    workers = [f"http://127.0.0.1:{sim_port + i}" for i in range(args.replicas)]
    slots = args.replicas * args.max_num_seqs
    print(f"cpus={os.cpu_count()} load average {os.getloadavg()[0]:.2f}; {args.replicas} x a4000-qwen3-4b "
          f"(max_num_seqs {args.max_num_seqs}, speed {args.speed}); logs in {logs}")
    routers: list[subprocess.Popen[bytes]] = []
    try:
        for url in workers:
            await wait_ready(url, "/health")
        if "burst" in args.sections:
            proc, url = start_router(workers, logs, "burst", {
                "flow_control": "true", "flow_max_queued": args.max_queued, "flow_queue_ttl_s": args.ttl})
            routers.append(proc)
            await wait_ready(url)
            await asyncio.sleep(2.0)  # the probe has read every replica's max_num_seqs and KV size
            rounds: list[list[Outcome]] = []
            probed: list[list[Outcome]] = []
            cpu: list[float] = []
            for r in range(args.rounds):
                before = cpu_s(proc.pid)
                burst, probes = await burst_round(url, args.factor * slots, args, r * 100_000)
                cpu.append(cpu_s(proc.pid) - before)
                rounds.append(burst)
                probed.append(probes)
                await asyncio.sleep(1.0)
            report_burst(rounds, cpu, slots, args)
            print(f"\n{args.probes} single requests, one after another, {args.probe_after} s "
                  "into each burst:\n")
            print("| Round | Answers | Rejected latency p50 / p99 / max (ms) | With Retry-After | "
                  "Retry-After values (s) |")
            print("|---|---|---|---|---|")
            for i, outs in enumerate(probed, 1):
                rejected = [o for o in outs if o.status in (429, 529)]
                lat = [o.latency_s for o in rejected]
                statuses = _counts(collections.Counter(str(o.status) for o in outs))
                print(f"| {i} | {statuses} | {ms(lat, 50)} / {ms(lat, 99)} / "
                      f"{max(lat) * 1000 if lat else 0:.1f} | "
                      f"{sum(1 for o in rejected if o.retry_after)} of {len(rejected)} | "
                      f"{_counts(collections.Counter(o.retry_after or '' for o in rejected))} |")
            for line in await metric_lines(url, b"kvroute_shed_total"):
                print("   ", line)
        for section in ("tenants", "tenants-off"):
            if section not in args.sections:
                continue
            on = section == "tenants"
            proc, url = start_router(workers, logs, section, {
                "flow_control": str(on).lower(), "flow_max_queued": 16 * slots, "flow_queue_ttl_s": args.ttl})
            routers.append(proc)
            await wait_ready(url)
            await asyncio.sleep(2.0)
            print(f"\nflow_control={str(on).lower()}:")
            await tenants(url, slots, args)
            for line in await metric_lines(url, b"kvroute_tenant_tokens_total"):
                print("   ", line)
    finally:
        for proc in [*routers, sim]:
            proc.terminate()
            proc.wait(30)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", type=lambda s: s.split(","), default=["burst", "tenants"])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequence slots per replica (default 8)")
    p.add_argument("--factor", type=int, default=10, help="burst size in fleet slots (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="bursts, one after the other (default 2)")
    p.add_argument("--max-queued", type=int, default=64, help="flow_max_queued (default 64)")
    p.add_argument("--ttl", type=float, default=30.0, help="flow_queue_ttl_s (default 30)")
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--speed", type=float, default=2.0, help="simulated replicas' speed-up (default 2)")
    p.add_argument("--probes", type=int, default=50, help="single requests during each burst (default 50)")
    p.add_argument("--probe-after", type=float, default=0.2, help="seconds into the burst (default 0.2)")
    p.add_argument("--seconds", type=float, default=30.0, help="tenants: measured seconds (default 30)")
    p.add_argument("--warmup", type=float, default=5.0, help="tenants: warm-up seconds (default 5)")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
