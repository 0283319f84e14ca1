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
    ``busy`` adds what the engine reported beyond the routers' own requests at scrape time (direct
    clients, unknown routers), and ``engine_load`` is vLLM's data-parallel balancer score
    ``4 * waiting + running`` corrected the same way.  Scraped figures lag by up to a probe
    interval; what the routers sent is never stale, so a request that finished since the scrape
    no longer counts (otherwise a conversation's next turn sees its own previous turn as load).
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
    # Prompt tokens the cost expects the engine to still hold at admission (None: the index's match).
    held_tokens: float | None = None

    @classmethod
    def of(cls, worker: WorkerState) -> Candidate:
        """Load figures of ``worker`` as the scheduler reads them."""
        load = worker.inflight + worker.peer_inflight
        running, waiting = worker.running, worker.waiting
        if running is None and waiting is None:
            return cls(worker, load, load, load)
        r, w = running or 0, waiting or 0
        seen = worker.scraped_inflight
        external = r + w - seen
        busy = load + external if external > 0 else load
        score = load + 4 * w + r - seen
        return cls(worker, load, busy, score if score > load else load)


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

    def expected_held(self, c: Candidate) -> float:
        """Prompt tokens ``c`` is expected to still hold when the request is admitted: what the
        cost predicted, else the index's match."""
        return self.matched_tokens(c) if c.held_tokens is None else c.held_tokens
