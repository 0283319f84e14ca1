"""The outcome of one routing decision, explained."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class DecisionKind(StrEnum):
    """Why a worker was chosen; used verbatim as the ``kind`` metric label."""

    STICKY = "sticky"  # session bound to this worker and it is not overloaded
    OVERFLOW = "overflow"  # session bound elsewhere, that worker was past its threshold
    PREFIX_HIT = "prefix_hit"  # cached prefix won the tie-break within the slack
    COLD = "cold"  # no affinity: placed on the least-loaded candidate
    BALANCE = "balance"  # a load-only policy (round-robin, p2c, least-loaded) chose
    NO_WORKER = "no_worker"  # nothing can serve the request


# Not frozen: a frozen dataclass of this many fields costs ~8 µs per construction (one
# object.__setattr__ per field), a tenth of a small request's routing.  Treat it as a value.
@dataclass(slots=True)
class Decision:
    """Where a request goes and why.

    ``worker_id`` is None only with ``DecisionKind.NO_WORKER``.  ``matched_blocks`` is the prefix
    match on the chosen worker (in index blocks), ``total_blocks`` how many blocks the request has.
    ``loads`` holds each candidate's load as the scheduler saw it, for the log line and debugging.
    ``block_hashes`` is what the caller hands back to ``Scheduler.commit`` so hashing happens once.
    ``worker_epoch`` is the chosen worker's epoch as the decision saw it (what ownership is stamped
    with), ``session`` the 64-bit hash the session table keys on, and ``prefill_tokens`` the
    estimated prompt tokens the chosen worker does not hold.  ``scores`` are the policy's
    scorers' values for the chosen worker (what the picker compared); ``considered`` how many
    workers the decision looked at (fewer than offered when a large fleet was pruned).
    ``predicted_ttft_s`` is the predicted time to first token on the chosen worker (the policy's own
    prediction, or the learned prefill speed over its backlog and the uncached prompt): what the
    proxy's first-byte deadline scales.  ``exact``: the chosen worker's match came from its KV
    events (``matched_blocks`` and ``total_blocks`` are then engine blocks); ``held_tokens`` is the
    prompt tokens the index said the chosen worker holds (what cache realisation compares with).
    ``rank`` is the data-parallel rank of the chosen worker the request is pinned to (vLLM's
    ``X-data-parallel-rank``): set where its state is exact and it publishes several ranks' events,
    else None (its engine's own balancer picks).  ``one_shot``: the policy judged the request a
    one-shot that sends no later turn (``Policy.one_shot``): its session is bound but not counted
    as active on its worker.  ``token_hashes``: the request's own block hashes where it is cacheable
    (the exact index counts those blocks in use on the chosen worker until ``Scheduler.released``).
    """

    worker_id: str | None
    kind: DecisionKind
    policy: str
    reason: str
    matched_blocks: int = 0
    total_blocks: int = 0
    est_tokens: int = 0
    loads: tuple[tuple[str, int], ...] = ()
    block_hashes: tuple[int, ...] = field(default=(), repr=False)
    session_id: str | None = None
    worker_epoch: float = 0.0
    session: int | None = None
    prefill_tokens: int = 0
    scores: tuple[float, ...] = ()
    considered: int = 0
    predicted_ttft_s: float = 0.0
    exact: bool = False
    held_tokens: float = 0.0
    rank: int | None = None
    one_shot: bool = False
    token_hashes: tuple[int, ...] = field(default=(), repr=False)
