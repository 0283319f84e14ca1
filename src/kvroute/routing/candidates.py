"""The per-decision working data the pipeline stages read and annotate."""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.routing.config import ModelPolicy
from kvroute.routing.key import RoutingKey
from kvroute.routing.worker import WorkerState


@dataclass(slots=True)
class Candidate:
    """One worker as seen by one decision.

    ``load`` is what the seeds compare: requests in flight there from every router instance.
    ``busy`` also trusts the engine's own count (``running + waiting``) when it is higher, and
    ``engine_load`` is vLLM's data-parallel balancer score ``4 * waiting + running``, never below
    the in-flight count (scraped figures lag; what the router itself sent is never stale).
    """

    worker: WorkerState
    load: int
    busy: int
    engine_load: int
    matched_blocks: int = 0
    active_sessions: int = 0
    s_per_token: float = 0.0
    realisation: float = 1.0
    backlog_tokens: float = 0.0
    predicted_s: float = 0.0

    @classmethod
    def of(cls, worker: WorkerState) -> Candidate:
        """Load figures of ``worker`` as the scheduler reads them."""
        load = worker.inflight + worker.peer_inflight
        running, waiting = worker.running, worker.waiting
        if running is None and waiting is None:
            return cls(worker, load, load, load)
        r, w = running or 0, waiting or 0
        busy, score = r + w, 4 * w + r
        return cls(worker, load, busy if busy > load else load, score if score > load else load)


@dataclass(slots=True)
class Context:
    """What every stage may read about the request being routed.

    ``bound`` is the worker the request's session is bound to (None without a session, without
    stickiness, or for a new session).  Stages may note figures here for the decision's log line.
    """

    key: RoutingKey
    policy: ModelPolicy
    now: float
    total_blocks: int
    block_tokens: float
    session: int | None = None
    bound: str | None = None
    slack: int = 0
    min_load: int = 0

    @property
    def est_tokens(self) -> int:
        """Estimated prompt tokens."""
        return self.key.est_prompt_tokens

    def matched_tokens(self, c: Candidate) -> float:
        """Estimated prompt tokens ``c`` holds in its cache, by the index."""
        return min(float(self.key.est_prompt_tokens), c.matched_blocks * self.block_tokens)
