"""Peer routers' policies emulated on kvroute's Scheduler, for the virtual-time A/B only.

``vllm-sll`` is vllm-router 0.1.17's ``sticky_least_loaded`` (``src/policies/sticky_least_loaded.rs``
in vllm-project/router), rule for rule:

* a request whose session is known goes to that session's replica, whatever its load, as long as
  the replica is healthy (it never moves a session for load);
* a new session goes to the healthy replica with the fewest *sessions assigned to it* — a count
  that only falls when a session is idle for 2 hours (``VLLM_ROUTER_SLL_SESSION_EXPIRATION_IN_S``)
  or the client calls ``finish_session`` (the benchmarks never do) — not requests in flight,
  tokens or engine metrics;
* ties between equally counted replicas go to the highest rendezvous hash of ``session:url``
  (vllm-router's FBI hash; xxh3 here: either is a fixed pseudo-random order per session);
* a request without a session goes to the fewest-sessions replica too, without being recorded.

It runs through the same ``decide``/``commit`` contract as every kvroute policy, so the cluster
records prefixes and session bindings as usual; the binding table's count of bound sessions is the
policy's "active sessions" (with the TTL set to the peer's 2 hours by :func:`install`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

import xxhash

from kvroute.routing.decision import Decision, DecisionKind
from kvroute.routing.key import EST_BYTES_PER_TOKEN, RoutingKey
from kvroute.routing.scheduler import Scheduler, session_hash
from kvroute.routing.worker import WorkerState
from kvroute.sim.cluster import ClusterConfig, VirtualCluster

PEER_POLICIES = ("vllm-sll",)
SLL_SESSION_TTL_S = 7200.0


class StickyLeastLoaded(Scheduler):
    """vllm-router's ``sticky_least_loaded`` behind kvroute's Scheduler interface."""

    def decide(self, key: RoutingKey, workers: Sequence[WorkerState],
               exclude: Collection[str] = ()) -> Decision:
        now = self._clock()
        cands = [w for w in workers if w.id not in exclude and w.healthy and not w.draining]
        hashes = self.hashes(key)
        session = session_hash(key)
        if not cands:
            return Decision(None, DecisionKind.NO_WORKER, "vllm-sll", "[SLL] no healthy worker",
                            total_blocks=len(hashes), est_tokens=key.est_prompt_tokens,
                            block_hashes=hashes, session_id=key.session_id, session=session)
        bound = self._sessions.get(session, now) if session is not None else None
        chosen = next((w for w in cands if w.id == bound), None)
        kind = DecisionKind.STICKY
        if chosen is None:
            kind = DecisionKind.COLD
            counts = [self._sessions.bound(w.id) for w in cands]
            least = min(counts)
            tie = (key.session_id or key.prefix.decode("utf-8", "replace")).encode()
            chosen = max((w for w, n in zip(cands, counts, strict=True) if n == least),
                         key=lambda w: xxhash.xxh3_64_intdigest(tie + b":" + w.url.encode()))
            if session is None:
                kind = DecisionKind.BALANCE
        slots = self._index.slots_of([(chosen.id, chosen.epoch)])
        matched = max(self._index.match(hashes, slots, now).values(), default=0)
        held = min(key.est_prompt_tokens, matched * self.config.block_bytes / EST_BYTES_PER_TOKEN)
        return Decision(
            worker_id=chosen.id, kind=kind, policy="vllm-sll", reason=f"[SLL] {kind.value} {chosen.id}",
            matched_blocks=matched, total_blocks=len(hashes), est_tokens=key.est_prompt_tokens,
            loads=tuple((w.id, w.total_inflight) for w in cands), block_hashes=hashes,
            session_id=key.session_id, worker_epoch=chosen.epoch, session=session,
            prefill_tokens=max(0, round(key.est_prompt_tokens - held)))


def cluster_for(config: ClusterConfig, policy: str) -> VirtualCluster:
    """A virtual cluster routing with ``policy``: a kvroute policy name or one of PEER_POLICIES."""
    if policy not in PEER_POLICIES:
        return VirtualCluster(config, policy)
    cluster = VirtualCluster(config, "session")
    routing = config.routing_config("session")
    cluster.scheduler = StickyLeastLoaded(replace(routing, session_ttl_s=SLL_SESSION_TTL_S),
                                          clock=cluster._clock)
    for w in cluster.workers:
        cluster.scheduler.on_worker_epoch(w.id, w.epoch)
    cluster.policy = policy
    return cluster
