"""The scheduler's read-only view of one replica. Owned and mutated by the fleet registry (or the
virtual-time cluster); the routing core only reads it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerState:
    """One replica as the router currently sees it.

    ``epoch`` is the registration time (or the engine's process start time): cached-prefix entries
    stamped with an older epoch no longer match.  Load figures come from two sources: ``inflight``
    is what this router instance has sent and not yet seen finish (always known, never stale);
    ``running``/``waiting``/``kv_usage`` are scraped from the engine's ``/metrics`` and are ``None``
    for engines that do not expose vLLM metrics.  ``peer_inflight`` is what other router instances
    report having in flight there (shared through Redis).  Scraped figures lag by up to a probe
    interval, so they only add the load the router cannot see itself (``scraped_inflight``).
    """

    id: str
    url: str
    models: frozenset[str] = frozenset()
    epoch: float = 0.0
    healthy: bool = True
    draining: bool = False
    # Out of rotation by the registry's circuit breaker or latency-outlier ejection (also while a
    # half-open breaker's one trial request is under way); /health answering does not clear it.
    ejected: bool = False
    # Why the fleet guard keeps this replica out of rotation (e.g. "canary", "doctor"): one entry
    # per guard check that failed, so clearing one does not undo another, nor an admin drain.
    guard_holds: frozenset[str] = frozenset()
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    inflight: int = 0
    peer_inflight: int = 0
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    # The engine's KV cache in tokens (num_gpu_blocks x block_size), when known; and the KV tokens
    # what this router has sent there and not seen finish adds (the prompt the worker was not
    # predicted to hold, plus max_tokens).
    kv_tokens: int | None = None
    inflight_tokens: int = 0
    # The engine's block size as its metrics say (``cache_config_info``), when known: what a
    # prompt's tokens are hashed by before its KV events tell theirs (Scheduler.block_size).
    block_size: int | None = None
    # Router in-flight (own + peers) when running/waiting were scraped: the engine's figures minus
    # this are load from elsewhere; our own share is always taken fresh from the in-flight counts.
    scraped_inflight: int = 0
    # This router's requests in flight per data-parallel rank they were pinned to (those of
    # decisions that picked a rank; the rest of ``inflight`` went where the engine balanced them).
    rank_inflight: dict[int, int] = field(default_factory=dict)

    @property
    def total_inflight(self) -> int:
        """Requests in flight on this worker from every router instance we know of."""
        return self.inflight + self.peer_inflight

    @property
    def ready(self) -> bool:
        """Whether new requests may be sent here: healthy, not draining, not ejected, not held out
        by the fleet guard."""
        return self.healthy and not self.draining and not self.ejected and not self.guard_holds

    def serves(self, model: str) -> bool:
        """Whether this worker serves ``model`` (an empty model list means not yet known: accept)."""
        return not self.models or model in self.models
