"""Where should a Claude Code subagent's conversation go: with its parent, or placed on its own?

    python benchmarks/subagents.py                       # both placements, 3 seeds (~4 min on 2 cores)
    python benchmarks/subagents.py --parents 2 --seeds 1

Claude Code sends a subagent's requests with its parent's ``X-Claude-Code-Session-Id`` plus
``x-claude-code-agent-id``; the subagent has its own, smaller head (2.1.332: ~3.3 KB of system
text and ~21 KB of tools against the parent's ~6.9 KB and ~32 KB), so it shares nothing with its
parent's prompt beyond a few hundred bytes.  ``parent`` keys it by the parent's session id
(``[requests] agent_headers = []``): every subagent follows its parent to one replica.  ``own``
(the default) appends the agent id: each subagent is a new conversation, placed like any other.

Each parent session: a first turn, then ``--subagents`` subagents at once, each ``--turns`` turns
(a tool result of ~3 KB appended per turn), then two more parent turns carrying their results.
The parents start at random times within ``--stagger`` model seconds, on four simulated
a4000-qwen3-4b replicas behind one router (``auto``).  Reported per placement: TTFB p50/p95 of
subagent and of parent requests, and the time each parent waited for its subagents (p50, max), all
in model seconds; the engines' own prefix-cache hit share.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp
import orjson

from kvroute.router_settings import Settings, parse_worker_spec
from kvroute.server.app import start_router
from kvroute.sim.server import SimFleet, start_sim_fleet

MODEL = "qwen3-4b"
WORDS = ("cache", "prefix", "replica", "token", "engine", "router", "session", "block", "queue", "prefill",
         "decode", "agent", "tool", "result", "system", "user", "assistant", "file", "function", "test")


def words(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Run:
    """One placement's run: the fleet, the router, the timings."""

    def __init__(self, url: str, speed: float, seed: int) -> None:
        self.url = url
        self.speed = speed
        self.rng = random.Random(seed)
        head_rng = random.Random(1234)   # one Claude Code version: every session shares these heads
        self.parent_system = words(head_rng, 6900)
        self.parent_tools = [{"name": f"P{i}", "description": words(head_rng, 2600),
                              "input_schema": {"type": "object"}} for i in range(12)]
        self.agent_system = words(head_rng, 3300)
        self.agent_tools = [{"name": f"A{i}", "description": words(head_rng, 2600),
                             "input_schema": {"type": "object"}} for i in range(8)]
        self.ttfb: dict[str, list[float]] = {"subagent": [], "parent": []}
        self.waits: list[float] = []

    async def send(self, http: aiohttp.ClientSession, kind: str, headers: dict[str, str], system: str,
                   tools: list[dict[str, Any]], messages: list[dict[str, Any]]) -> str:
        body = {"model": MODEL, "max_tokens": 256, "stream": True, "system": system, "tools": tools,
                "messages": messages}
        start = time.perf_counter()
        async with http.post(self.url + "/v1/messages", data=orjson.dumps(body),
                             headers={"content-type": "application/json", **headers}) as resp:
            raw = await resp.content.readany()
            self.ttfb[kind].append((time.perf_counter() - start) * self.speed)
            raw += await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {raw[:300]!r}")
        text = []
        for line in raw.split(b"\n"):
            if line.startswith(b"data: ") and b"text_delta" in line:
                text.append(orjson.loads(line[6:])["delta"]["text"])
        return "".join(text)

    async def subagent(self, http: aiohttp.ClientSession, sid: str, turns: int) -> None:
        headers = {"x-claude-code-session-id": sid, "x-claude-code-agent-id": uuid.uuid4().hex[:17]}
        messages: list[dict[str, Any]] = [{"role": "user", "content": words(self.rng, 1500)}]
        for _ in range(turns):
            reply = await self.send(http, "subagent", headers, self.agent_system, self.agent_tools, messages)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": words(self.rng, 3000)}]

    async def parent(self, http: aiohttp.ClientSession, subagents: int, turns: int, start_s: float) -> None:
        await asyncio.sleep(start_s / self.speed)
        sid = str(uuid.uuid4())
        headers = {"x-claude-code-session-id": sid}
        messages: list[dict[str, Any]] = [{"role": "user", "content": words(self.rng, 2000)}]
        for _ in range(3):
            reply = await self.send(http, "parent", headers, self.parent_system, self.parent_tools, messages)
            messages += [{"role": "assistant", "content": reply}]
            if len(messages) == 2:
                start = time.perf_counter()
                await asyncio.gather(*(self.subagent(http, sid, turns) for _ in range(subagents)))
                self.waits.append((time.perf_counter() - start) * self.speed)
            messages += [{"role": "user", "content": words(self.rng, 2000)}]


async def one(placement: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    fleet: SimFleet = await start_sim_fleet("a4000-qwen3-4b", 4, speed=args.speed, seed=seed)
    requests: dict[str, Any] = {"agent_headers": []} if placement == "parent" else {}
    # The fleet guard's canary off: its questions would count in the engines' hit share measured here.
    settings = Settings.from_dict({"probe_interval_s": 1.0 / args.speed, "requests": requests,
                                   "routing": {"canary": False}}).replace(
        workers=tuple(parse_worker_spec(u) for u in fleet.urls))
    router = await start_router(settings)
    run = Run(router.url, args.speed, seed)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            starts = [run.rng.uniform(0, args.stagger) for _ in range(args.parents)]
            await asyncio.gather(*(run.parent(http, args.subagents, args.turns, s) for s in starts))
        stats = [r.engine.stats for r in fleet.replicas]
        hit = sum(s.prompt_tokens_cached for s in stats) / max(1, sum(s.prompt_tokens for s in stats))
    finally:
        await router.close()
        await fleet.close()
    return {"sub_p50": quantile(run.ttfb["subagent"], 0.5), "sub_p95": quantile(run.ttfb["subagent"], 0.95),
            "parent_p50": quantile(run.ttfb["parent"], 0.5), "parent_p95": quantile(run.ttfb["parent"], 0.95),
            "wait_p50": statistics.median(run.waits), "wait_max": max(run.waits), "hit_pct": 100 * hit}


async def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parents", type=int, default=4)
    p.add_argument("--subagents", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--speed", type=float, default=10.0)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--stagger", type=float, default=20.0,
                   help="parents start at uniform random times within this many model seconds")
    args = p.parse_args(argv)
    cols = ("sub_p50", "sub_p95", "parent_p50", "parent_p95", "wait_p50", "wait_max", "hit_pct")
    print(f"{args.parents} parents x {args.subagents} subagents x {args.turns} turns, starts within "
          f"{args.stagger:g} s, speed {args.speed:g}")
    print("| placement | seed | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    means: dict[str, list[dict[str, float]]] = {"parent": [], "own": []}
    for seed in range(args.seeds):
        for placement in ("parent", "own"):
            row = await one(placement, args, seed)
            means[placement].append(row)
            print(f"| {placement} | {seed} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |", flush=True)
    for placement, rows in means.items():
        print(f"| {placement} | mean | " + " | ".join(f"{statistics.fmean(r[c] for r in rows):.2f}"
                                                    for c in cols) + " |")


if __name__ == "__main__":
    asyncio.run(main())
