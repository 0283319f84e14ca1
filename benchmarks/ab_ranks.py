"""Data-parallel ranks over HTTP: one simulated vLLM server of ``--data-parallel-size`` engine ranks
behind ``kvroute serve``, multi-turn conversations, with the router picking each request's rank
from the ranks' KV events (``ranks``) against vLLM's own balancer (``balancer``: no KV events, so
the router sends no rank and the server balances by queue length, as without kvroute).

    python benchmarks/ab_ranks.py --speed 5                 # 2 ranks, 16 conversations, seeds 0-2
    python benchmarks/ab_ranks.py --speed 5 --shared-system --warm --conversations 96
    python benchmarks/ab_ranks.py --ranks 4 --conversations 32 --seeds 0-4

``--shared-system``: every conversation starts with one system prompt; ``--warm``: one request of
it goes first (a health check, a canary), so that one rank holds it before the conversations start.
The router and the engines share this process's CPU: at a high ``--speed`` its own work (the KV
events) shows in the wall-clock latencies as model seconds, so compare latencies at a low speed.

Each (variant, seed) runs a fresh server and router in this process (wall clock, model time
``--speed`` times faster).  Reported, mean and range over the seeds: the engines' prefix-cache hit
share (their ``prompt_tokens_cached`` / ``prompt_tokens`` summed over the ranks), and the latency
of a turn (whole answer, wall seconds times ``--speed``: model seconds) at p50 / p95.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.fleet.kv_event_wire import KVEventsConfig
from kvroute.router_settings import Settings, parse_worker_spec
from kvroute.server.app import start_router
from kvroute.sim.server import start_sim_fleet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # developer tooling, not in the wheel
from kvroute_dev.ports import free_ports

WORDS = [w + " " for w in ("cat", "sea", "map", "oak", "red", "sky", "tin", "elm", "fox", "ivy", "jam",
                            "owl")]


def prose(words: int, rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(words))


async def conversation(http: aiohttp.ClientSession, url: str, model: str, rng: random.Random,
                       turns: int, system: str, speed: float, latencies: list[float]) -> None:
    messages = [{"role": "system", "content": system}]
    await asyncio.sleep(rng.uniform(0.0, 2.0) / speed)
    for _ in range(turns):
        messages.append({"role": "user", "content": prose(rng.randint(40, 160), rng)})
        start = time.monotonic()
        body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 64}
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            reply = await resp.json()
        latencies.append((time.monotonic() - start) * speed)
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        await asyncio.sleep(rng.uniform(0.5, 3.0) / speed)   # the user reads and types


async def run_one(variant: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    ranks = args.ranks
    events = None
    if variant == "ranks":
        base = free_ports(2 * ranks)
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{base}",
                                replay_endpoint=f"tcp://*:{base + ranks}")
    fleet = await start_sim_fleet(args.preset, 1, speed=args.speed, kv_events=events,
                                  data_parallel_size=ranks, seed=seed)
    settings = Settings.from_dict({"probe_interval_s": 0.2, "kv_events_ranks": ranks,
                                   "kv_events_endpoint": "" if events is None else "tcp://{host}:5557"})
    router = await start_router(settings.replace(workers=(parse_worker_spec(fleet.urls[0]),)))
    try:
        if events is not None:
            deadline = time.monotonic() + 20
            while router.scheduler.cache_mode(router.registry.states()[0].id) != "exact":
                assert time.monotonic() < deadline, "the router never read the ranks' events"
                await asyncio.sleep(0.05)
        model = fleet.replicas[0].config.model
        rng = random.Random(seed)
        shared = prose(args.system_words, rng)
        latencies: list[float] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            if args.warm:
                # One request of the shared system prompt first, as a health check or a canary
                # would: one rank holds the prefix before the conversations start.
                warm = {"model": model, "messages": [{"role": "system", "content": shared},
                                                     {"role": "user", "content": "ping"}], "max_tokens": 1}
                async with http.post(router.url + "/v1/chat/completions", json=warm) as resp:
                    assert resp.status == 200, await resp.text()
                await asyncio.sleep(0.5)
            convs = []
            for _ in range(args.conversations):
                own = random.Random(rng.random())
                system = shared if args.shared_system else prose(args.system_words, own)
                convs.append(conversation(http, router.url, model, own, args.turns, system, args.speed,
                                          latencies))
            await asyncio.gather(*convs)
        stats = [r.engine.snapshot().stats for r in fleet.replicas[0].ranks]
        prompt = sum(s.prompt_tokens for s in stats)
        cached = sum(s.prompt_tokens_cached for s in stats)
        q = statistics.quantiles(latencies, n=20)
        return {"hits": 100.0 * cached / prompt if prompt else 0.0, "p50": statistics.median(latencies),
                "p95": q[18], "per_rank": float(min(s.prompt_tokens for s in stats))}
    finally:
        await router.close()
        await fleet.close()


def cell(values: list[float], digits: int) -> str:
    mean = statistics.mean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="a4000-qwen3-4b")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=600)
    p.add_argument("--speed", type=float, default=20.0)
    p.add_argument("--shared-system", action="store_true",
                   help="every conversation starts with the same system prompt")
    p.add_argument("--warm", action="store_true",
                   help="one request of the shared system prompt before the conversations")
    p.add_argument("--seeds", default="0-2")
    args = p.parse_args()
    lo, _, hi = args.seeds.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    print(f"1 x {args.preset} x {args.ranks} data-parallel ranks, {args.conversations} conversations x "
          f"{args.turns} turns, {'one shared' if args.shared_system else 'own'} system prompt of "
          f"{args.system_words} words, seeds {args.seeds}, speed {args.speed}\n")
    print("| Variant | Prefix hits (%) | Turn latency p50 (model s) | p95 | Least prompt tokens on a rank |")
    print("|---|---|---|---|---|")
    for variant in ("balancer", "ranks"):
        rows = [asyncio.run(run_one(variant, seed, args)) for seed in seeds]
        print(f"| {variant} | {cell([r['hits'] for r in rows], 1)} | {cell([r['p50'] for r in rows], 2)} "
              f"| {cell([r['p95'] for r in rows], 2)} | {cell([r['per_rank'] for r in rows], 0)} |",
              flush=True)


if __name__ == "__main__":
    main()
