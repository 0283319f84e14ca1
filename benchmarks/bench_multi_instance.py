"""Share of follow-up turns that land on their conversation's worker, with several router instances.

    python benchmarks/bench_multi_instance.py                  # 1, 2 and 4 instances, Redis off/on
    python benchmarks/bench_multi_instance.py --instances 2 --conversations 20 --json out.json
    python benchmarks/bench_multi_instance.py --instances 1,8 --exact --redis off   # KV events, no Redis
    python benchmarks/bench_multi_instance.py --instances 8 --exact --redis off --moves  # why turns moved

Everything runs in this process: a fleet of simulated replicas, N router instances (each a real
aiohttp server on loopback, as ``kvroute serve`` runs it) and, for the "Redis" rows, a throwaway
``redis-server`` they share.  The client plays the load balancer: every request goes to the next
instance in turn (round-robin over all requests, the way nginx's default upstream balancing sends
them), so the consecutive turns of a conversation usually reach different instances.

Workload: ``--conversations`` chats with distinct system prompts, ``--turns`` turns each, at most
``--concurrency`` in progress at once, a random think time before each follow-up.  A follow-up "lands
home" when it is served by the worker that served its conversation's previous turn, which is where
its prefix is cached; ``cached`` is the share of follow-up prompt tokens the engines report as
prefix-cache hits.  A fresh fleet (empty caches) and a fresh Redis for every row.  The instances sign
their messages with a shared secret, as a deployment should (docs/multi-instance.md#trust-model);
``--unsigned`` runs them without one.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import random
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from kvroute.fleet.kv_event_wire import KVEventsConfig
from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import RunningRouter, start_router
from kvroute.sim.presets import PRESETS
from kvroute.sim.server import start_sim_fleet
from kvroute.sync.local_redis import LocalRedis

PRESET = "a4000-qwen3-4b"
EXACT = False
# The router's prior prefill rate (seconds per uncached token) is a real card's; a simulated card
# runs ``speed`` times faster, so the prior is scaled with it.
DEFAULT_PREFILL_S_PER_TOKEN = 1.5e-4


@dataclass
class Chat:
    """One conversation: its messages so far and the worker that served each turn."""

    index: int
    messages: list[dict[str, str]]
    workers: list[str] = field(default_factory=list)


@dataclass
class Row:
    """One configuration's outcome."""

    instances: int
    redis: bool
    requests: int
    failed: int
    follow_ups: int
    home: int
    cached_tokens: int
    follow_up_prompt_tokens: int
    seconds: float

    @property
    def home_share(self) -> float:
        return self.home / self.follow_ups if self.follow_ups else 0.0

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.follow_up_prompt_tokens if self.follow_up_prompt_tokens else 0.0


def _text(rng: random.Random, words: int) -> str:
    return " ".join(f"w{rng.randrange(100_000)}" for _ in range(words))


class RoundRobin:
    """The load balancer: each request to the next instance."""

    def __init__(self, routers: list[RunningRouter]) -> None:
        self._routers = routers
        self._next = 0

    def pick(self) -> tuple[int, RunningRouter]:
        """The next instance and its number."""
        i = self._next % len(self._routers)
        self._next += 1
        return i, self._routers[i]


def _moved(chat: Chat, turn: int, instance: int, router: RunningRouter, worker: str) -> str:
    """What ``router`` logged for a follow-up that left its conversation's worker: its newest
    decision line for ``worker`` (the request just answered, unless another of its requests to
    that worker finished meanwhile)."""
    reason = next((r.reason for r in reversed(router.router.activity.requests) if r.worker == worker), "?")
    return f"moved: chat {chat.index} turn {turn} via instance {instance} from {chat.workers[-1]}: {reason}"


async def _converse(chat: Chat, turns: int, lb: RoundRobin, http: aiohttp.ClientSession, model: str,
                    rng: random.Random, think_s: float, row: Row, moves: list[str] | None) -> None:
    for turn in range(turns):
        if turn:
            await asyncio.sleep(rng.uniform(0, think_s))
        chat.messages.append({"role": "user", "content": _text(rng, rng.randint(40, 160))})
        body = {"model": model, "messages": chat.messages, "max_tokens": rng.randint(16, 64)}
        row.requests += 1
        try:
            instance, router = lb.pick()
            async with http.post(router.url + "/v1/chat/completions", json=body) as resp:
                doc = await resp.json()
                if resp.status != 200:
                    row.failed += 1
                    return
                worker = resp.headers["x-kvroute-worker"]
        except (aiohttp.ClientError, OSError, TimeoutError):
            row.failed += 1
            return
        chat.messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
        if chat.workers:
            usage = doc.get("usage") or {}
            row.follow_ups += 1
            row.home += worker == chat.workers[-1]
            if moves is not None and worker != chat.workers[-1]:
                moves.append(_moved(chat, turn, instance, router, worker))
            row.follow_up_prompt_tokens += usage.get("prompt_tokens", 0)
            row.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        chat.workers.append(worker)


async def run_row(args: argparse.Namespace, instances: int, redis: bool, seed: int) -> Row:
    """One configuration on a fresh fleet (and a fresh Redis).  With ``--exact`` the replicas
    publish KV-cache events and every instance subscribes to them (exact mode)."""
    server = LocalRedis() if redis else None
    if server is not None:
        await asyncio.to_thread(server.start)
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*") if args.exact else None
    fleet = await start_sim_fleet(PRESET, args.replicas, speed=args.speed, max_num_batched_tokens=8192,
                                  kv_events=events)
    routers: list[RunningRouter] = []
    row = Row(instances, redis, 0, 0, 0, 0, 0, 0, 0.0)
    try:
        settings = Settings(workers=tuple(WorkerSpec(u) for u in fleet.urls), probe_interval_s=0.25,
                            redis_url=server.url if server else None,
                            sync_secret=secrets.token_hex(32) if server and not args.unsigned else None,
                            # The canary off: its questions would count in the engines' hits measured here.
                            routing={"prefill_s_per_token": DEFAULT_PREFILL_S_PER_TOKEN / args.speed,
                                     "canary": False, **args.routing})
        for _ in range(instances):
            routers.append(await start_router(settings))
        lb = RoundRobin(routers)
        rng = random.Random(seed)
        chats = [Chat(i, [{"role": "system", "content": f"Assistant {i}. " + _text(rng, args.system_words)}])
                 for i in range(args.conversations)]
        gate = asyncio.Semaphore(args.concurrency)
        moves: list[str] | None = [] if args.moves else None
        model = PRESETS[PRESET].model

        async def one(chat: Chat) -> None:
            async with gate:
                chat_rng = random.Random(seed * 1000 + chat.index)
                await _converse(chat, args.turns, lb, http, model, chat_rng, args.think_ms / 1000, row,
                                moves)

        started = time.perf_counter()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            await asyncio.gather(*(one(c) for c in chats))
        row.seconds = time.perf_counter() - started
        for line in moves or ():
            print(f"instances={instances} redis={redis} seed={seed} {line}", file=sys.stderr)
    finally:
        for r in routers:
            await r.close()
        await fleet.close()
        if server is not None:
            server.close()
    return row


def markdown(rows: list[Row]) -> str:
    """The results as a Markdown table: one line per configuration, pooled over its runs, with the
    range of the per-run shares."""
    lines = ["| instances | shared view | follow-ups on their worker (runs' range) | "
             "follow-up prompt tokens cached | requests | failed |", "|---|---|---|---|---|---|"]
    configs: dict[tuple[int, bool], list[Row]] = {}
    for r in rows:
        configs.setdefault((r.instances, r.redis), []).append(r)
    for (instances, redis), runs in configs.items():
        home, follow_ups = sum(r.home for r in runs), sum(r.follow_ups for r in runs)
        cached = sum(r.cached_tokens for r in runs) / max(1, sum(r.follow_up_prompt_tokens for r in runs))
        low, high = min(r.home_share for r in runs), max(r.home_share for r in runs)
        view = ("Redis" if redis else "none (independent)") + (", KV events" if EXACT else "")
        lines.append(f"| {instances} | {view} | **{home / max(1, follow_ups):.1%}** ({low:.0%}–{high:.0%}) | "
                     f"{cached:.1%} | {sum(r.requests for r in runs)} | {sum(r.failed for r in runs)} |")
    return "\n".join(lines)


async def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instances", default="1,2,4", help="comma-separated instance counts")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--speed", type=float, default=2.0, help="simulator speed (model time / wall time)")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--think-ms", type=float, default=3000.0, help="upper bound of the random think time")
    p.add_argument("--system-words", type=int, default=600, help="system prompt size (~1.5 tokens/word)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2, help="runs per configuration (seeds seed, seed+1, ...)")
    p.add_argument("--unsigned", action="store_true", help="no sync secret (unsigned sync messages)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--moves", action="store_true",
                   help="print the decision line of every follow-up that left its worker (stderr)")
    p.add_argument("--set", dest="routing", action="append", default=[], metavar="NAME=VALUE",
                   type=lambda kv: (kv.partition("=")[0], ast.literal_eval(kv.partition("=")[2])),
                   help="a [routing] setting of every instance (repeatable)")
    p.add_argument("--exact", action="store_true",
                   help="the replicas publish KV events and every instance routes on them (exact mode)")
    p.add_argument("--redis", default="both", choices=("both", "off", "on"),
                   help="rows with several instances: without Redis, with it, or both (default)")
    args = p.parse_args(argv)
    args.routing = dict(args.routing)
    global EXACT
    EXACT = args.exact
    shared = {"both": (False, True), "off": (False,), "on": (True,)}[args.redis]
    rows: list[Row] = []
    for n in (int(x) for x in args.instances.split(",")):
        for redis in ((False,) if n == 1 else shared):
            for rep in range(args.repeat):
                row = await run_row(args, n, redis, seed=args.seed + rep)
                print(f"instances={n} redis={redis} seed={args.seed + rep}: {row.home_share:.1%} of "
                      f"{row.follow_ups} follow-ups home, {row.cached_share:.1%} cached, "
                      f"{row.failed} failed, {row.seconds:.1f}s", file=sys.stderr)
                rows.append(row)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            shares = [{"home_share": r.home_share, "cached_share": r.cached_share} for r in rows]
            json.dump([asdict(r) | s for r, s in zip(rows, shares, strict=True)], f, indent=2)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
