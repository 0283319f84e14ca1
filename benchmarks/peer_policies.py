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

It is one more policy in kvroute's registry (its stages below, read from the same per-decision
view), so the cluster records prefixes and session bindings as usual; the session table's count of
bound sessions is the peer's "sessions assigned" (with the TTL set to the peer's 2 hours by
:func:`cluster_for`).
"""

from __future__ import annotations

import dataclasses

import xxhash

from kvroute.bench.cluster import ClusterConfig, VirtualCluster
from kvroute.routing import filters, pickers
from kvroute.routing.decision import DecisionKind
from kvroute.routing.policies import POLICIES, register
from kvroute.routing.stages import Policy, Scorer
from kvroute.routing.view import Candidate, Signal, View

PEER_POLICIES = ("vllm-sll",)
SLL_SESSION_TTL_S = 7200.0


def _bound_here(view: View, cands: list[Candidate]) -> list[float]:
    # Whatever its load: the peer never moves a session for load.
    return [0.0 if c.worker.id == view.bound else 1.0 for c in cands]


def _sessions_assigned(view: View, cands: list[Candidate]) -> list[float]:
    return [float(c.bound_sessions) for c in cands]


def _rendezvous(view: View, cands: list[Candidate]) -> list[float]:
    tie = (view.key.session_id or view.key.prefix.decode("utf-8", "replace")).encode()
    return [-float(xxhash.xxh3_64_intdigest(tie + b":" + c.worker.url.encode())) for c in cands]


def _explain(view: View, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
    c = cands[i]
    if view.bound is not None and c.worker.id == view.bound:
        kind = DecisionKind.STICKY
    else:
        kind = DecisionKind.COLD if view.session is not None else DecisionKind.BALANCE
    return kind, f"[SLL] {kind.value} {c.worker.id}"


STICKY_LEAST_LOADED = Policy(
    "vllm-sll", (filters.ready,),
    (Scorer("bound_here", _bound_here, frozenset({Signal.BINDING})),
     Scorer("sessions_assigned", _sessions_assigned, frozenset({Signal.BOUND_SESSIONS})),
     Scorer("rendezvous", _rendezvous)),
    pickers.lowest, _explain, summary="vllm-router 0.1.17's sticky_least_loaded (emulated)")
"""The session's replica while healthy; else the fewest sessions assigned, ties by rendezvous hash."""

if STICKY_LEAST_LOADED.name not in POLICIES:
    register(STICKY_LEAST_LOADED)


def cluster_for(config: ClusterConfig, policy: str) -> VirtualCluster:
    """A virtual cluster routing with ``policy``: a kvroute policy name or one of PEER_POLICIES
    (which also takes the peer's 2-hour session expiry)."""
    if policy in PEER_POLICIES:
        config = dataclasses.replace(config, routing={"session_ttl_s": SLL_SESSION_TTL_S, **config.routing})
    return VirtualCluster(config, policy)
