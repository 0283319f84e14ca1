"""The virtual-time emulation of vllm-router's ``sticky_least_loaded`` (benchmarks/peer_policies.py)
follows the peer's rules: a new session goes to the replica with the fewest sessions ever assigned
(not the least loaded one), ties by a fixed hash of the session, and a session never moves."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from routing_helpers import Clock, fleet, key, send, text

_BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.insert(0, _BENCHMARKS)

from peer_policies import SLL_SESSION_TTL_S, STICKY_LEAST_LOADED  # noqa: E402

from kvroute.routing.config import ModelSettings, RoutingConfig  # noqa: E402
from kvroute.routing.scheduler import Scheduler  # noqa: E402


def sll(clock: Clock) -> Scheduler:
    config = RoutingConfig(default=ModelSettings(policy=STICKY_LEAST_LOADED.name),
                           session_ttl_s=SLL_SESSION_TTL_S)
    return Scheduler(config, clock=clock)


def test_new_sessions_go_by_sessions_assigned_not_by_load(clock: Clock) -> None:
    s, ws = sll(clock), fleet(4)
    ws[0].inflight = 30  # load does not enter the rule
    homes = [send(s, key(text(i, 4_000), session=f"s{i}"), ws) for i in range(8)]
    assert Counter(homes) == {"w0": 2, "w1": 2, "w2": 2, "w3": 2}
    clock.advance(3000)  # idle but not expired: still counted
    assert Counter(send(s, key(text(100 + i, 4_000), session=f"t{i}"), ws) for i in range(4)) == \
        {"w0": 1, "w1": 1, "w2": 1, "w3": 1}


def test_a_session_never_moves_and_ties_are_fixed_per_session(clock: Clock) -> None:
    s, ws = sll(clock), fleet(4)
    home = send(s, key(text(1, 4_000), session="a"), ws)
    next(w for w in ws if w.id == home).inflight = 100
    for turn in range(5):
        assert send(s, key(text(1, 4_000) + text(2 + turn, 2_000), session="a"), ws) == home
    again = sll(Clock())
    assert send(again, key(text(1, 4_000), session="a"), fleet(4)) == home
