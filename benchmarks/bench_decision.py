"""Cost of one routing decision, and memory per 100k indexed blocks.

    python benchmarks/bench_decision.py            # full grid, prints a Markdown table
    python benchmarks/bench_decision.py --quick    # fewer repetitions
    python benchmarks/bench_decision.py --json out.json

Each cell: a warm index (every worker has served a few conversations, and one worker holds the
request's earlier turn), random loads and engine figures, then ``Dispatcher.route`` on a fresh
``RoutingKey`` each time, so the block hashing is paid on every call, as in the server.  Two cases:

* **new**: a new conversation — a session never seen, behind the system prompt one worker holds,
  with a user message no worker holds (different on every call);
* **next**: a conversation's next turn — its session bound to the worker holding its earlier turn;
* **even**: a new conversation again, over the same workers all carrying one load (an idle fleet
  is one): each of them is within the prompt-size slack of the least busy.

``parse`` is ``parse_request`` of the chat body that produces the next turn's key; ``commit``
records it.  ``considered`` is how many workers the decisions looked at (``Decision.considered``).

``--exact``: the next turn again, with every worker's cache state exact (routing/exact_index.py):
the conversation's earlier turn stored on worker 0 by its engine's events, beside ``--running``
requests of this router running there (their prompts computed, their answers of fixed length,
``ignore_eos``) in a KV cache of eight blocks more than its engine holds (the other workers': the
a4000-qwen3-4b preset's 2,543 blocks of 16 tokens), so that the match walks what those answers
evict before the turn finds room; the turn's token hashes
are made once (the cost of tokenizing is not this table's).  Runs against an older checkout too.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

from kvroute.api.requests import parse_request
from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.decision import Decision

try:  # the dispatch path (and its pruning of large fleets); absent before the routing core's second edition
    from kvroute.routing.dispatch import Dispatcher
except ImportError:  # pragma: no cover - lets this script measure an older checkout side by side
    Dispatcher = None  # type: ignore[assignment,misc]
from kvroute.routing.hashing import block_hashes
from kvroute.routing.key import RoutingKey
from kvroute.routing.prefix_index import PrefixIndex
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

SIZES = {"8 KB": 8 << 10, "32 KB": 32 << 10, "128 KB": 128 << 10, "1 MB": 1 << 20}
WORKERS = (4, 16, 64, 512, 1000)


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    words = [f"w{rng.randrange(10_000)}" for _ in range(n // 4 + 1)]
    return " ".join(words)[:n]


def _fleet(n: int, rng: random.Random) -> list[WorkerState]:
    ws = []
    for i in range(n):
        w = WorkerState(id=f"worker-{i:03d}", url=f"http://10.0.0.{i % 250}:8000", models=frozenset({"m"}),
                        epoch=1.0, max_num_seqs=64, max_model_len=1 << 20)
        w.inflight = rng.randrange(0, 8)
        w.running, w.waiting, w.kv_usage = rng.randrange(0, 16), rng.randrange(0, 2), rng.random()
        ws.append(w)
    return ws


# What a call's time is read from: the wall clock, or with ``--cpu-time`` this process's CPU time
# (on a shared machine other jobs' load then does not count).
_clock = time.perf_counter_ns


def _timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median and p99 in microseconds."""
    samples = []
    gc.disable()
    try:
        for _ in range(reps):
            t0 = _clock()
            fn()
            samples.append((_clock() - t0) / 1000)
    finally:
        gc.enable()
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def _route_next(route: Callable[..., Decision], keys: Iterator[RoutingKey], ws: list[WorkerState],
                considered: list[int]) -> None:
    considered.append(route(next(keys), ws).considered)


def bench_cell(policy: str, size: int, n_workers: int, reps: int) -> dict[str, Any]:
    rng = random.Random(size * 1000 + n_workers)
    now = [1_700_000_000.0]
    sched = Scheduler(RoutingConfig(default=ModelSettings(policy=policy)), clock=lambda: now[0])
    route = Dispatcher(sched).route if Dispatcher is not None else sched.decide
    ws = _fleet(n_workers, rng)
    # Warm index: a few earlier conversations per worker (capped so 512 workers stay quick).
    for j in range(min(4 * n_workers, 256)):
        k = RoutingKey(model="m", prefix=_text(j, 8192).encode(), est_prompt_tokens=2048)
        sched.commit(k, sched.decide(k, [ws[j % n_workers]]))
    system = {"role": "system", "content": _text(-1, size // 2)}
    first = [system, {"role": "user", "content": _text(-3, 256)}]
    body = {"model": "m", "messages": [*first, {"role": "assistant", "content": _text(-4, 256)},
                                       {"role": "user", "content": _text(-2, size // 2 - 512)}]}
    headers = {"x-session-id": "bench"}
    # The system prompt went to worker 0 first (another conversation, no session).
    earlier = parse_request("chat", {"model": "m", "messages": [system]}, {})
    sched.commit(earlier, sched.decide(earlier, [ws[0]]))
    # The conversation's first turn: placed by the policy over the whole fleet, as in the server.
    turn = parse_request("chat", {"model": "m", "messages": first}, headers)
    sched.commit(turn, route(turn, ws))
    key = parse_request("chat", body, headers)
    nexts = [RoutingKey(model=key.model, prefix=key.prefix, session_id=key.session_id,
                        est_prompt_tokens=key.est_prompt_tokens) for _ in range(reps)]
    news = []
    for i in range(reps):
        user = {"role": "user", "content": f"{i:08d}" + body["messages"][3]["content"]}
        k = parse_request("chat", {"model": "m", "messages": [system, user]}, {"x-session-id": f"new-{i}"})
        news.append(k)
    # The same workers all carrying one load (as in an idle fleet): every one is within the slack.
    even = [dataclasses.replace(w, inflight=2, running=2, waiting=0, kv_usage=0.5) for w in ws]
    out: dict[str, Any] = {"policy": policy, "prompt_bytes": size, "workers": n_workers}
    for case, keys, fleet in (("new", news, ws), ("next", nexts, ws), ("even", news, even)):
        considered: list[int] = []
        p50, p99 = _timed(functools.partial(_route_next, route, iter(keys), fleet, considered), reps)
        out[f"{case}_us_p50"], out[f"{case}_us_p99"] = p50, p99
        out[f"{case}_considered"] = statistics.median(considered)
    out["parse_us_p50"] = _timed(lambda: parse_request("chat", body, headers), reps)[0]
    decision = sched.decide(key, ws)
    out["commit_us_p50"] = _timed(lambda: sched.commit(key, decision), reps)[0]
    out["blocks"], out["matched"] = decision.total_blocks, decision.matched_blocks
    return out


def index_memory(n_blocks: int, owners: int) -> float:
    """Bytes per indexed block with each block owned by ``owners`` workers (hash ints included)."""
    index = PrefixIndex(max_blocks=n_blocks)
    prompts = [block_hashes(b"m\x00", _text(i, 512 * 100).encode(), 512, 1 << 30)
               for i in range(n_blocks // 100)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, hashes in enumerate(prompts):
        for w in range(owners):
            index.record(hashes, f"worker-{(i + w) % 64:03d}", 1.0, 1_700_000_000.0 + i)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    # The hash ints themselves were allocated before tracing started; count them (32 bytes each).
    return used / len(index) + 32


def scheduler_memory(n_blocks: int, n_sessions: int, n_workers: int) -> float:
    """MiB a scheduler holds with ``n_blocks`` indexed blocks and ``n_sessions`` bound sessions
    over ``n_workers`` workers (index, session table with its active counts, learned figures)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    now = [1_700_000_000.0]
    sched = Scheduler(RoutingConfig(index_max_blocks=n_blocks), clock=lambda: now[0])
    dispatch = Dispatcher(sched)
    ws = _fleet(n_workers, random.Random(0))
    per_request = 64  # a 32 KB prompt: 64 blocks
    for j in range(max(n_sessions, n_blocks // per_request)):
        k = RoutingKey(model="m", prefix=(f"{j:09d}" * (per_request * 512 // 9 + 1)).encode(),
                       est_prompt_tokens=8192, session_id=f"s{j % n_sessions}")
        # Decided among four workers: what is measured is what the decisions leave behind.
        home = j % n_workers
        decision = dispatch.route(k, ws[home:home + 1])
        flight, _ = dispatch.sent(k, decision, ws[home])
        dispatch.finished(flight, ok=True, prompt_tokens=8192, cached_tokens=0)
        now[0] += 0.001
    sched.decide(k, ws)  # the active-session counts are built on the first decision
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    stats = sched.stats()
    assert stats["index_blocks"] >= n_blocks * 0.99 and stats["sessions"] == n_sessions, stats
    return used / 2**20


def bench_exact_cell(policy: str, size: int, n_workers: int, reps: int, running: int) -> dict[str, Any]:
    """A conversation's next turn of ``size`` bytes, every worker exact (the module docstring)."""
    from kvroute.routing.token_chains import TokenChains, with_tokens
    from kvroute.sim.tokenizer import token_ids

    bs, kv_blocks = 16, 2543
    rng = random.Random(size * 1000 + n_workers)
    now = [1_700_000_000.0]
    sched = Scheduler(RoutingConfig(default=ModelSettings(policy=policy)), clock=lambda: now[0])
    route = Dispatcher(sched).route if Dispatcher is not None else sched.decide
    chains = TokenChains()
    ws = _fleet(n_workers, rng)
    engine_hash = iter(range(1, 1 << 40))
    for w in ws:
        w.kv_tokens = kv_blocks * bs
        sched.exact.attach(w.id, [0])
        sched.exact.synced(w.id, 0, now[0])

    def sent(w: WorkerState, body: dict[str, Any], session: str, running: bool) -> None:
        """``body`` routed to ``w``, computed there (its events) and answered; ended unless
        ``running``."""
        key = parse_request("chat", body, {"x-session-id": session})
        toks = token_ids(json.dumps(body["messages"]).encode())
        key = with_tokens(key, toks, bs, chains)
        decision = sched.decide(key, [w])
        sched.commit(key, decision)
        n = len(toks) // bs
        sched.exact.stored(w.id, 0, [next(engine_hash) for _ in range(n)], None, toks[:n * bs], bs, None,
                           now[0])
        sched.on_first_byte(decision)
        if not running:
            sched.released(decision, answered=True)

    system = {"role": "system", "content": _text(-1, size // 2)}
    first = [system, {"role": "user", "content": _text(-3, 256)}]
    body = {"model": "m", "messages": [*first, {"role": "assistant", "content": _text(-4, 256)},
                                       {"role": "user", "content": _text(-2, size // 2 - 512)}],
            "max_tokens": 256, "ignore_eos": True}
    sent(ws[0], {"model": "m", "messages": first, "max_tokens": 256, "ignore_eos": True}, "bench", False)
    # Other conversations, running on worker 0 and let go elsewhere (a warm, full fleet).
    for j in range(max(running, 4 * n_workers if n_workers < 64 else 256)):
        w = ws[0] if j < running or n_workers == 1 else ws[1 + j % (n_workers - 1)]
        other = {"model": "m", "messages": [{"role": "user", "content": _text(j, size)}],
                 "max_tokens": 256, "ignore_eos": True}
        sent(w, other, f"other-{j}", j < running)
    ws[0].inflight = running
    # Worker 0's cache holds what its events told and eight blocks more: the turn waits for room.
    ws[0].kv_tokens = (sched.exact.resident_blocks(ws[0].id) + running + 8) * bs
    key = with_tokens(parse_request("chat", body, {"x-session-id": "bench"}),
                      token_ids(json.dumps(body["messages"]).encode()), bs, chains)
    considered: list[int] = []
    keys = iter([key] * reps)
    p50, p99 = _timed(functools.partial(_route_next, route, keys, ws, considered), reps)
    home = route(key, ws[:1])  # what worker 0 is predicted to keep of the turn when it is scheduled
    return {"prompt_bytes": size, "workers": n_workers, "next_us_p50": p50, "next_us_p99": p99,
            "blocks": len(key.token_hashes), "matched": home.matched_blocks, "exact": home.exact,
            "held": sched.exact.match(key.token_hashes, [ws[0].id], now[0])[ws[0].id]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--sizes", default=",".join(SIZES), help="prompt sizes to run (of %(default)s)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the scheduler's memory at 200k index blocks + 10k sessions")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time calls by this process's CPU time, not the wall clock (a shared machine)")
    parser.add_argument("--with-memory", action="store_true",
                        help="also the scheduler's memory at 200k index blocks + 10k sessions")
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)), help="fleet sizes to run")
    parser.add_argument("--exact", action="store_true",
                        help="only the next turn, with every worker's cache state exact (the docstring)")
    parser.add_argument("--running", type=int, default=4,
                        help="with --exact: requests running on the turn's worker (default 4: its "
                             "cache is full, the turn waits for room)")
    args = parser.parse_args()
    sizes = {label: SIZES[label] for label in args.sizes.split(",")}
    fleets = [int(n) for n in args.workers.split(",")]
    if args.cpu_time:
        global _clock
        _clock = time.process_time_ns
    reps_for = {8 << 10: 2000, 32 << 10: 2000, 128 << 10: 500, 1 << 20: 100}
    rows = []
    if args.exact:
        print("| prompt | workers | running | blocks | worker 0 holds / keeps | next p50 µs | next p99 µs |")
        print("|---|---|---|---|---|---|---|")
        for label, size in sizes.items():
            for n in fleets:
                reps = max(50, reps_for[size] // (4 if args.quick else 1))
                r = bench_exact_cell(args.policy, size, n, reps, args.running)
                print(f"| {label} | {n} | {args.running} | {r['blocks']} | {r['held']} / {r['matched']}"
                      f"{'' if r['exact'] else ' (approximate)'} | {r['next_us_p50']:.1f} | "
                      f"{r['next_us_p99']:.1f} |", flush=True)
        return
    if args.memory_only:
        print(f"scheduler with 200k index blocks + 10k sessions over 1000 workers: "
              f"{scheduler_memory(200_000, 10_000, 1000):.1f} MiB")
        return
    print("| prompt | workers | blocks | new p50 µs | new p99 µs | new considered | next p50 µs | "
          "next p99 µs | next considered | even p50 µs | even considered | parse p50 µs | commit p50 µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, size in sizes.items():
        for n in fleets:
            reps = max(50, reps_for[size] // (4 if args.quick else 1))
            r = bench_cell(args.policy, size, n, reps)
            rows.append(r)
            print(f"| {label} | {n} | {r['blocks']} | {r['new_us_p50']:.1f} | {r['new_us_p99']:.1f} | "
                  f"{r['new_considered']:g} | {r['next_us_p50']:.1f} | {r['next_us_p99']:.1f} | "
                  f"{r['next_considered']:g} | {r['even_us_p50']:.1f} | {r['even_considered']:g} | "
                  f"{r['parse_us_p50']:.1f} | {r['commit_us_p50']:.1f} |",
                  flush=True)
    if args.with_memory:
        print(f"scheduler with 200k index blocks + 10k sessions over 1000 workers: "
              f"{scheduler_memory(200_000, 10_000, 1000):.1f} MiB")
    memory = {owners: index_memory(100_000, owners) for owners in (1, 4)}
    for owners, per_block in memory.items():
        print(f"index memory, {owners} owner(s) per block: {per_block:.0f} B/block = "
              f"{per_block * 100_000 / 2**20:.1f} MiB per 100k blocks")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cells": rows, "bytes_per_block": memory}, f, indent=1)


if __name__ == "__main__":
    main()
