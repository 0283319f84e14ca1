"""Load agreement between router instances: the other instances' in-flight counts per worker.

Each instance sends a heartbeat with what it has in flight on every worker; every instance adds up
its live peers' figures into ``WorkerState.peer_inflight``, so its least-loaded comparisons count
the requests the others sent too.  A heartbeat is valid for the TTL its sender gives: a peer that
stops sending (crashed, partitioned, Redis gone) stops counting once that runs out, so a dead
instance's load never pins a worker as busy.  Expiry uses the receiver's own monotonic clock from
the moment it heard the heartbeat, so clock skew between hosts does not matter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.worker import WorkerState
from kvroute.sync.messages import LoadMessage, WorkerLoad


@dataclass(frozen=True, slots=True)
class _Peer:
    sent_at: float
    expires_at: float
    workers: Mapping[str, WorkerLoad]


class PeerLoads:
    """The latest live heartbeat of every other instance."""

    def __init__(self) -> None:
        self._peers: dict[str, _Peer] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def live(self, instance: str, now: float) -> bool:
        """Whether ``instance``'s heartbeat is still valid at ``now`` (receiver's monotonic clock)."""
        peer = self._peers.get(instance)
        return peer is not None and peer.expires_at > now

    def update(self, msg: LoadMessage, now: float, *, age_s: float = 0.0) -> None:
        """Take ``msg`` heard at ``now`` (receiver's monotonic clock).  ``age_s`` is how old it
        already was when read (catch-up reads recent heartbeats from the stream's history).
        A heartbeat older than the one held for that peer is ignored."""
        held = self._peers.get(msg.instance)
        if held is not None and msg.time < held.sent_at:
            return
        expires = now + msg.ttl_s - max(0.0, age_s)
        if expires > now:
            self._peers[msg.instance] = _Peer(msg.time, expires, msg.workers)

    def expire(self, now: float) -> int:
        """Forget peers whose heartbeat ran out; returns how many went."""
        dead = [p for p, peer in self._peers.items() if peer.expires_at <= now]
        for p in dead:
            del self._peers[p]
        return len(dead)

    def inflight(self) -> dict[str, int]:
        """Requests in flight per worker, summed over live peers."""
        totals: dict[str, int] = {}
        for peer in self._peers.values():
            for wid, load in peer.workers.items():
                totals[wid] = totals.get(wid, 0) + load.inflight
        return totals

    def epochs(self) -> dict[str, float]:
        """The newest epoch any live peer uses for each worker."""
        out: dict[str, float] = {}
        for peer in self._peers.values():
            for wid, load in peer.workers.items():
                if load.epoch > out.get(wid, -1.0):
                    out[wid] = load.epoch
        return out

    def apply_to(self, states: Iterable[WorkerState], dispatch: Dispatcher) -> None:
        """Give each worker the live peers' in-flight total (0 where none), through ``dispatch``."""
        totals = self.inflight()
        for state in states:
            dispatch.peer_load(state, totals.get(state.id, 0))
