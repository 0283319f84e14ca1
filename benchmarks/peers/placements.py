"""Which replica served each round of each agent session, as the replicas themselves saw it.

Peer routers do not say where they sent a request (kvroute's ``x-kvroute-worker`` has no
counterpart), so the replicas log it.  The agent workload writes the session id into the first
message (``Task <uuid>:``) and numbers each follow-up (``Tool result <n>:``); both survive any
router unchanged, whatever headers it forwards or however it re-serialises the JSON body.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvroute.bench.results import RequestRecord

_SESSION = re.compile(rb"Task ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}):")
_ROUND = re.compile(rb"Tool result (\d+):")


@dataclass(frozen=True, slots=True)
class Placement:
    """Round ``round`` of session ``session_id`` reached ``replica`` (``host:port``)."""

    session_id: str
    round: int
    replica: str


def identify(body: bytes) -> tuple[str, int] | None:
    """The (session id, round) an agent-workload request body carries; None for any other body."""
    session = _SESSION.search(body)
    if session is None:
        return None
    rounds = _ROUND.findall(body)
    return session.group(1).decode(), int(rounds[-1]) if rounds else 0


def placement_map(placements: Iterable[Placement]) -> dict[tuple[str, int], str]:
    """``(session, round) -> replica``; when a round reached several replicas (a retry after a
    failure), the last one is where it was served."""
    return {(p.session_id, p.round): p.replica for p in placements}


@dataclass(frozen=True, slots=True)
class Attribution:
    """How the replicas' log matched a step's client records."""

    attributed: int      # records given a replica from the log
    missing: int         # records the log does not know (failed before reaching a replica)
    disagreed: int       # records whose router-reported worker differs from the log
    per_replica: dict[str, int]   # attributed records per replica: how evenly the router spread


def attribute(records: Sequence[RequestRecord], where: Mapping[tuple[str, int], str]) -> Attribution:
    """Set each record's ``worker`` to the replica that served it according to the log.

    A record that already names a worker (kvroute's ``x-kvroute-worker``, a ``host:port`` like the
    log's) is counted as a disagreement if the two differ; the log wins either way, so that every
    router's stayed share is computed from the same source.
    """
    attributed = missing = disagreed = 0
    per_replica: dict[str, int] = {}
    for rec in records:
        if rec.session_id is None or rec.shed:  # a shed request reached no replica
            continue
        replica = where.get((rec.session_id, rec.round))
        if replica is None:
            missing += 1
            continue
        if rec.worker is not None and rec.worker != replica:
            disagreed += 1
        rec.worker = replica
        attributed += 1
        per_replica[replica] = per_replica.get(replica, 0) + 1
    return Attribution(attributed, missing, disagreed, dict(sorted(per_replica.items())))
