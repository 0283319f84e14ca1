"""Reconnect delays, and the other instances' load with its expiry."""

from __future__ import annotations

import random

import pytest

from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState
from kvroute.sync.backoff import Backoff
from kvroute.sync.messages import LoadMessage, WorkerLoad
from kvroute.sync.peer_load import PeerLoads


def test_backoff_doubles_up_to_the_cap_with_jitter_and_resets() -> None:
    b = Backoff(base_s=0.1, cap_s=1.0, rng=random.Random(7))
    delays = [b.next_delay() for _ in range(8)]
    nominal = [min(1.0, 0.1 * 2**i) for i in range(8)]
    for d, n in zip(delays, nominal, strict=True):
        assert n / 2 <= d <= n
    assert len(set(delays)) == len(delays)  # jittered: no two instances retry in lockstep
    b.reset()
    assert b.next_delay() <= 0.1


def test_backoff_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Backoff(base_s=2.0, cap_s=1.0)


def _beat(src: str, t: float, ttl: float = 1.0, **loads: tuple[int, float]) -> LoadMessage:
    return LoadMessage(src, t, ttl, {w: WorkerLoad(n, e) for w, (n, e) in loads.items()})


def test_peer_loads_add_up_and_expire_with_their_ttl() -> None:
    peers = PeerLoads()
    peers.update(_beat("a", 10.0, ttl=1.0, w1=(2, 5.0), w2=(1, 5.0)), now=100.0)
    peers.update(_beat("b", 10.0, ttl=3.0, w1=(3, 6.0)), now=100.0)
    assert peers.inflight() == {"w1": 5, "w2": 1}
    assert peers.epochs() == {"w1": 6.0, "w2": 5.0}
    states = [WorkerState("w1", "http://x"), WorkerState("w2", "http://y"), WorkerState("w3", "http://z")]
    peers.apply_to(states, Dispatcher(Scheduler()))
    assert [s.peer_inflight for s in states] == [5, 1, 0]
    assert peers.expire(101.5) == 1  # a stopped sending: its load no longer counts
    peers.apply_to(states, Dispatcher(Scheduler()))
    assert [s.peer_inflight for s in states] == [3, 0, 0]
    assert peers.expire(103.5) == 1
    assert len(peers) == 0


def test_an_older_heartbeat_does_not_replace_a_newer_one() -> None:
    peers = PeerLoads()
    peers.update(_beat("a", 10.0, w1=(4, 1.0)), now=100.0)
    peers.update(_beat("a", 9.0, w1=(1, 1.0)), now=100.1)
    assert peers.inflight() == {"w1": 4}


def test_a_heartbeat_read_from_history_keeps_only_its_remaining_validity() -> None:
    peers = PeerLoads()
    peers.update(_beat("gone", 10.0, ttl=1.0, w1=(4, 1.0)), now=100.0, age_s=5.0)
    assert len(peers) == 0
    peers.update(_beat("live", 10.0, ttl=1.0, w1=(4, 1.0)), now=100.0, age_s=0.5)
    assert peers.expire(100.6) == 1
