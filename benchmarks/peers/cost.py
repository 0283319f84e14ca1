"""Router cost: small requests from many concurrent clients, closed loop, requests/s and latency.

Each of ``clients`` loops sends one small chat request after another (a short unique prompt, a few
output tokens), streaming or not, to ``urls[client % len(urls)]`` — one router, several router
processes, or the replicas themselves for the direct baseline.  The replicas run fast enough that
the engine adds little, so what differs between targets is what the router costs on the same cores.
Requests that start during the warm-up are not counted; nor are those still running at the end.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from kvroute.bench.workloads import words
from kvroute.quantiles import percentile
from peers.procs import cpu_seconds


@dataclass(frozen=True, slots=True)
class CostPlan:
    """The load: concurrent clients, measured window, warm-up before it, request shape."""

    clients: int = 64
    duration_s: float = 8.0
    warmup_s: float = 1.5
    prompt_tokens: int = 64
    max_tokens: int = 16
    distinct_prompts: int = 4096

    def __post_init__(self) -> None:
        if self.clients < 1 or self.duration_s <= 0 or self.warmup_s < 0:
            raise ValueError("need clients >= 1, duration_s > 0, warmup_s >= 0")
        if self.prompt_tokens < 1 or self.max_tokens < 1 or self.distinct_prompts < 1:
            raise ValueError("prompt_tokens, max_tokens and distinct_prompts must be >= 1")


@dataclass(slots=True)
class CostResult:
    """What one target sustained."""

    label: str
    stream: bool
    requests: int
    errors: int
    duration_s: float
    requests_per_s: float
    p50_ms: float | None
    p99_ms: float | None
    first_error: str | None = None
    # CPU seconds each measured group of processes used during the window ("router", "replicas",
    # "client"): on shared cores, what a router costs per request.
    cpu_s: dict[str, float] = field(default_factory=dict)

    def cpu_ms_per_request(self, group: str) -> float | None:
        """CPU milliseconds ``group`` spent per completed request in the window."""
        used = self.cpu_s.get(group)
        return None if used is None or not self.requests else 1000.0 * used / self.requests


def request_bodies(model: str, plan: CostPlan, stream: bool, seed: int = 0) -> list[bytes]:
    """The pool of request bodies the clients cycle through, built before the clock starts."""
    rng = random.Random(f"kvroute-peers-cost:{seed}")
    bodies = []
    for i in range(plan.distinct_prompts):
        body: dict[str, object] = {
            "model": model, "stream": stream, "max_tokens": plan.max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {i}: " + words(rng, plan.prompt_tokens)}],
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        bodies.append(orjson.dumps(body))
    return bodies


async def _one(http: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> str | None:
    """Send one request and read the whole response; the error text, or None on success."""
    try:
        async with http.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                return f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            if not stream:
                data = orjson.loads(await resp.read())
                return None if data.get("choices") else f"no choices: {str(data)[:200]}"
            done = False
            async for line in resp.content:
                if line.strip() == b"data: [DONE]":
                    done = True
            return None if done else "stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


async def run_cost(label: str, urls: Sequence[str], model: str, plan: CostPlan, *, stream: bool,
                   seed: int = 0, meters: Mapping[str, Sequence[int]] | None = None) -> CostResult:
    """Run the closed loop against ``urls`` (base URLs) and summarise the measured window.
    ``meters`` names groups of process ids whose CPU time over the window is recorded."""
    if not urls:
        raise ValueError("no target URLs")
    bodies = request_bodies(model, plan, stream, seed)
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    errors: list[str] = []
    t0 = loop.time()
    start_at, end_at = t0 + plan.warmup_s, t0 + plan.warmup_s + plan.duration_s

    async def client(index: int, http: aiohttp.ClientSession) -> None:
        url = urls[index % len(urls)].rstrip("/") + "/v1/chat/completions"
        n = index
        while (began := loop.time()) < end_at:
            error = await _one(http, url, bodies[n % len(bodies)], stream)
            n += plan.clients
            ended = loop.time()
            if began < start_at or ended > end_at:
                continue
            if error is None:
                latencies.append(ended - began)
            else:
                errors.append(error)

    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=0)
    groups = dict(meters or {})
    cpu: dict[str, float] = {}

    async def meter() -> None:
        await asyncio.sleep(max(0.0, start_at - loop.time()))
        before = {name: cpu_seconds(pids) for name, pids in groups.items()}
        await asyncio.sleep(max(0.0, end_at - loop.time()))
        cpu.update({name: cpu_seconds(pids) - before[name] for name, pids in groups.items()})

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await asyncio.gather(meter(), *(client(i, http) for i in range(plan.clients)))
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    return CostResult(label, stream, len(latencies), len(errors), plan.duration_s,
                      len(latencies) / plan.duration_s,
                      None if p50 is None else p50 * 1000, None if p99 is None else p99 * 1000,
                      errors[0] if errors else None, cpu)


def _median(values: Sequence[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    return percentile(present, 50) if present else None


def median_of(rounds: Sequence[Sequence[CostResult]]) -> list[CostResult]:
    """One result per target and mode over several rounds: the median round's requests/s, p50 and
    p99; requests, errors and CPU time summed, so CPU per request is pooled over every round.
    Targets keep the order in which they first appear."""
    groups: dict[tuple[str, bool], list[CostResult]] = {}
    for one in rounds:
        for c in one:
            groups.setdefault((c.label, c.stream), []).append(c)
    out = []
    for (label, stream), results in groups.items():
        cpu: dict[str, float] = {}
        for c in results:
            for name, used in c.cpu_s.items():
                cpu[name] = cpu.get(name, 0.0) + used
        out.append(CostResult(
            label, stream, sum(c.requests for c in results), sum(c.errors for c in results),
            sum(c.duration_s for c in results), _median([c.requests_per_s for c in results]) or 0.0,
            _median([c.p50_ms for c in results]), _median([c.p99_ms for c in results]),
            next((c.first_error for c in results if c.first_error), None), cpu))
    return out
