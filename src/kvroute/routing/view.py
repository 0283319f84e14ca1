"""What one decision sees: the request, its settings, and one ``Candidate`` per worker.

The scheduler's *signal producers* fill these before any stage runs (prefix match, active
sessions, learned rates and backlog, the session's binding); filters, scorers, pickers and
explainers only read them and return values.  A stage declares the signals it reads
(``Signal``), and the scheduler produces only those a policy needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from kvroute.routing.key import RoutingKey
from kvroute.routing.settings import Blocks, BlockT, PlacementSettings
from kvroute.routing.worker import WorkerState

T = TypeVar("T")


class Signal(StrEnum):
    """Figures a stage may need beyond the worker's own load (always present)."""

    PREFIX = "prefix"  # Candidate.matched_blocks, held_tokens, exact, fresh: each worker's longest match
    SESSIONS = "sessions"  # Candidate.active_sessions: sessions recently active on each worker
    LEARNED = "learned"  # Candidate.s_per_token, realisation, backlog_tokens
    BINDING = "binding"  # View.session, View.bound: the request's session and its worker
    BOUND_SESSIONS = "bound_sessions"  # Candidate.bound_sessions: sessions bound (not expired)
    RETURNS = "returns"  # View.return_share, View.returned: whether derived sessions come back


@dataclass(slots=True)
class Candidate:
    """One worker as seen by one decision (filled by the producers; stages only read it).

    ``load`` is requests in flight there from every router instance.  ``busy`` adds what the
    engine reported beyond the routers' own requests at scrape time (direct clients, unknown
    routers), and ``engine_load`` is vLLM's data-parallel balancer score ``4 * waiting + running``
    corrected the same way.  Scraped figures lag by up to a probe interval; what the routers sent
    is never stale, so a request that finished since the scrape no longer counts (otherwise a
    conversation's next turn sees its own previous turn as load).

    ``matched_blocks`` is the longest match: in engine blocks when ``exact`` (the worker's KV events
    say what it holds), else in the approximate index's blocks; ``held_tokens`` is the prompt tokens
    that match covers either way.  ``cached_tokens`` is what the worker's whole cache holds: known
    when ``exact``, else estimated from what the routers had it compute (routing/cache_fill.py; only
    for a request with no client session id), None where neither is known: with its KV size, how
    much of that cache a cold prefill evicts.  ``fresh``: on an approximate worker whose estimated
    cache is full, the share of its pool not yet computed since it last served the match (1 where
    nothing is estimated evicted): how far that match is from being the least recently used.
    """

    worker: WorkerState
    load: int
    busy: int
    engine_load: int
    matched_blocks: int = 0
    held_tokens: float = 0.0
    exact: bool = False
    cached_tokens: float | None = None
    active_sessions: int = 0
    bound_sessions: int = 0
    s_per_token: float = 0.0
    realisation: float = 1.0
    backlog_tokens: float = 0.0
    fresh: float = 1.0

    @classmethod
    def of(cls, worker: WorkerState) -> Candidate:
        """Load figures of ``worker`` as the scheduler reads them."""
        load = worker.total_inflight
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
class View:
    """What every stage may read about the request being routed.

    ``bound`` is the worker the request's session is bound to (None without a session, without
    stickiness, or for a new session).  ``resident``: ``bound`` is where the engines' KV events say
    the session's history lives (``Scheduler._resident_home``), a fact every router instance reads
    alike, rather than only this instance's session table.  ``fleet_full``: the model's fleet is
    saturated and its policy places for the fleet's throughput (routing/saturation.py).
    ``return_share``: for a request whose session id the router derived (no client session id),
    the learned share of such sessions of its model that come back with a follow-up turn
    (routing/returns.py; None before enough are known, and for a client's session);
    ``returned``: this one has, or this request is its follow-up (longer than its first).
    ``one_kind``: the model's fleet serves no kind of session but this request's (session
    admission's book, ``FlowControl.one_kind``; False where it is off).
    """

    key: RoutingKey
    settings: Blocks
    placement: PlacementSettings
    now: float
    total_blocks: int
    block_tokens: float
    session: int | None = None
    bound: str | None = None
    resident: bool = False
    fleet_full: bool = False
    return_share: float | None = None
    returned: bool = False
    one_kind: bool = False
    _memo: dict[Callable[[View], Any], Any] = field(default_factory=dict, repr=False)

    def derived(self, fn: Callable[[View], T]) -> T:
        """``fn(self)``, computed once per decision: for figures several parts derive from the view
        alone (a policy's cost terms), never for passing values between stages."""
        memo = self._memo
        if fn in memo:
            return memo[fn]  # type: ignore[no-any-return]
        value = memo[fn] = fn(self)
        return value

    def block(self, kind: type[BlockT]) -> BlockT:
        """The request's settings block ``kind`` (``view.block(AutoSettings).stay_tokens``)."""
        return self.settings.block(kind)

    @property
    def est_tokens(self) -> int:
        """Estimated prompt tokens."""
        return self.key.est_prompt_tokens

    def matched_tokens(self, c: Candidate) -> float:
        """Prompt tokens ``c`` holds in its cache, by the exact or the approximate index."""
        return c.held_tokens

    def bound_in(self, cands: list[Candidate]) -> bool:
        """Whether the session's worker is among ``cands``."""
        bound = self.bound
        return bound is not None and any(c.worker.id == bound for c in cands)
