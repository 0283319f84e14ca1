"""Flow control makes the same decisions in both clocks: one trace replayed through the
virtual-time cluster (bench/cluster.py) and over HTTP (a real router in front of real simulated
replicas on loopback), with the fleet saturated — two replicas of one sequence slot each, five
two-round sessions arriving at once.  Compared: which requests wait at the gate, the order the
queue grants them in, and the replica each is routed to.

The trace is deterministic over HTTP because every decision is forced by an event whose timing is
unambiguous: a replica of one slot is admissible only when its request ends, the ends are at least
0.5 model seconds apart (0.25 s of wall time at speed 2; checked on the virtual run), and a
session's second round arrives as its first ends.  The trace also tells the orders apart: replayed
with ``flow_order = "fifo"`` the virtual run grants differently, so an edge that queued in arrival
order while the other used the cache order fails the comparison.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import aiohttp

from kvroute.bench.cluster import ClusterConfig, VirtualCluster
from kvroute.bench.workloads import Message, PlannedRequest, SessionScript, words
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.flow import TicketState

MODEL = "qwen3-4b"
SPEED = 2.0
# The gate alone: the sessions' first turns do not wait at the door from the start (the scenario
# is built for the gate's order).
NO_DOOR = {"flow_session_fill_unsaturated": 0.0}
# (first prompt tokens, first answer tokens, second answer tokens) per session; chosen so that no
# two request ends fall within 0.5 model seconds of each other and the two orders differ.
SESSIONS = ((800, 68, 48), (1600, 26, 47), (2400, 11, 22), (2000, 86, 47), (800, 63, 44))
MIN_GAP_S = 0.5


@dataclass(frozen=True)
class Trace:
    """The sessions as a finite workload (one loop per session in the cluster)."""

    scripts: tuple[SessionScript, ...]

    @property
    def size(self) -> int:
        return len(self.scripts)

    def session(self, index: int) -> SessionScript:
        return self.scripts[index]


def trace() -> Trace:
    rng = random.Random(5)
    scripts = []
    for i, (prompt, first_out, second_out) in enumerate(SESSIONS):
        sid = f"s{i}"
        system = words(rng, 200)
        ask = Message("user", words(rng, prompt))
        first = PlannedRequest(sid, 0, system, (ask,), first_out)
        follow = (ask, Message("assistant", words(rng, first_out)), Message("user", words(rng, 80)))
        scripts.append(SessionScript(sid, (first, PlannedRequest(sid, 1, system, follow, second_out))))
    return Trace(tuple(scripts))


@dataclass
class Decisions:
    """What the gate decided, recorded on the dispatcher both edges call."""

    waited: set[str]  # "session/round" of the requests queued at arrival
    sends: list[tuple[str, str]]  # ("session/round", replica) in the order they were routed
    arrivals: int = 0


def record(dispatch: Dispatcher, replica_name: Callable[[str], str]) -> Decisions:
    """Wrap the dispatcher's ``admit`` and ``sent`` (the real ones still run) to record decisions."""
    out = Decisions(set(), [])
    rounds: dict[str | None, int] = {}
    admit, sent = dispatch.admit, dispatch.sent

    def admitting(key: Any, workers: Any, on_decided: Any = None) -> Any:
        ticket = admit(key, workers, on_decided)
        out.arrivals += 1
        if ticket.state is TicketState.QUEUED:
            out.waited.add(f"{key.session_id}/{rounds.get(key.session_id, 0)}")
        assert ticket.state is not TicketState.SHED
        return ticket

    def sending(key: Any, decision: Any, state: Any) -> Any:
        n = rounds.get(key.session_id, 0)
        rounds[key.session_id] = n + 1
        out.sends.append((f"{key.session_id}/{n}", replica_name(state.id)))
        return sent(key, decision, state)

    dispatch.admit = admitting  # type: ignore[method-assign]
    dispatch.sent = sending  # type: ignore[method-assign]
    return out


def virtual(order: str) -> tuple[Decisions, list[float]]:
    """The trace in virtual time; also the times at which requests ended."""
    config = ClusterConfig(replicas=2, engine={"max_num_seqs": 1},
                           policy={"flow_control": True, "flow_order": order, **NO_DOOR})
    cluster = VirtualCluster(config, "auto")
    decisions = record(cluster.dispatch, lambda wid: wid)
    result = cluster.run(trace(), [len(SESSIONS)], 600.0)
    assert result.steps[0].errors == 0
    ends = sorted(r.end_s for r in cluster.last_records if r.end_s is not None)
    assert len(ends) == 2 * len(SESSIONS)
    return decisions, ends


def test_the_trace_is_unambiguous_and_tells_the_orders_apart() -> None:
    cache, ends = virtual("cache")
    assert min(b - a for a, b in pairwise(ends)) >= MIN_GAP_S
    assert cache.waited  # the fleet is saturated: requests wait at the gate
    fifo, _ = virtual("fifo")
    assert fifo.sends != cache.sends


async def test_the_queue_decides_the_same_in_virtual_time_and_over_http(sim_fleet, router, http) -> None:
    expected, _ = virtual("cache")
    fleet = await sim_fleet(2, speed=SPEED, max_num_seqs=1)
    # The probe reads the engines every 0.1 s meanwhile: a read that a request's end overtakes must
    # not hold the next request back (the virtual clock reads in no time).
    r = await router(fleet.urls, routing={"policy": "auto", "flow_control": True, "flow_order": "cache",
                                          **NO_DOOR})
    states = r.router.registry.states()
    names = {s.url.rstrip("/"): f"replica-{i}" for i, s in enumerate(states)}
    by_id = {s.id: names[s.url.rstrip("/")] for s in states}
    for _ in range(1000):
        if all(s.max_num_seqs == 1 and s.kv_tokens is not None for s in states):
            break
        await asyncio.sleep(0.01)
    got = record(r.router.dispatch, by_id.__getitem__)

    async def session(script: SessionScript) -> None:
        for req in script.requests:  # the next round as soon as the previous one ended
            async with http.post(r.url + "/v1/chat/completions", json=req.openai_body(MODEL),
                                 headers=req.headers(), timeout=aiohttp.ClientTimeout(total=60)) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()

    loops = []
    for i, script in enumerate(trace().scripts):
        # Arrival order as in the cluster: each session reaches the gate before the next starts.
        loops.append(asyncio.create_task(session(script)))
        for _ in range(500):
            if got.arrivals > i:
                break
            await asyncio.sleep(0.002)
    await asyncio.gather(*loops)
    assert got.waited == expected.waited
    assert got.sends == expected.sends
