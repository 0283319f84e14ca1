"""``auto``, the default policy: each candidate's predicted time to first token, lowest wins.

Everything ``auto`` adds to the shared pipeline lives here: its settings, its cost, how much of a
cached prefix it counts on, the load a worker's sessions will bring, its guard against piles
behind a shared head, and its log line.

**The cost.**  ``s_per_token * (queue + uncached)`` is the predicted time to first token: the
prompt tokens the worker is not expected to hold at admission, behind a queue of the router's
backlog estimate (weighted up by ``eviction_weight`` as the engine fails to keep what the index
predicts), the requests in flight and the engine's waiting queue, priced in prefill-token
equivalents.  To rank workers the cost adds ``prefill_penalty`` times the uncached prefill (the
delay it causes every request queued behind it) and the turns the other sessions active there will
send (``active_session_tokens`` each).  The session's own worker is credited ``stay_tokens`` so that
noise does not move it; with a numeric ``overflow`` it is never kept past that many in flight.

**Cache survival.**  The index knows what each worker *served*; the engine keeps it only while its
KV cache has room.  Past the fleet's cache (sessions x context above the fleet's KV) a session's
blocks are freed when its turn ends and re-used by the prefills queued behind it, so by its next
turn the index's match is mostly gone.  The engines say so themselves: the hit share they report
falls below what the index predicted; ``Candidate.realisation`` is that ratio, and the match is
discounted by it as far as ``realisation_weight`` trusts it.

**Session load.**  A request's own queue is what delays it now; a new session also joins the
worker for every later turn, next to the sessions already living there.  Counting those sessions as
a cost rather than filtering on them keeps what is known exactly (the work queued now) in charge:
"active" only means "sent a request within ``session_active_s``", and a hard filter on it sent
whole bursts of new sessions to the workers whose previous sessions happened to have finished
(docs/routing.md).  A turn whose history the engines' KV events place on one worker
(``View.resident``) is priced without that term: each router instance counts only the sessions
it routed itself, so behind a load balancer with no shared session table the instances' counts
differ by more than the turn's cached history is worth, and they moved it about between them.
Staying or moving is then left to the queue (mostly the engines' scraped load, which every
instance reads alike), the cached history (their events) and ``stay_tokens``; with one instance
too, so that it decides as several do.  ``balanced_sessions`` stays, with ``session_spread`` = 2,
as a loose guard so that a long head cached on one worker does not collect every new session.

**The cache a copy evicts.**  Where a worker's cache is full — known from its KV events, or
estimated from the tokens the routers had it compute (routing/cache_fill.py) — a cold prefill
there pushes out as many cached tokens as it adds.  When another worker
already holds that part of the prompt, the prefill is a second copy, and what it pushes out is
prefill later requests pay again: a request the client named no session for is charged
``evicted_cache_weight`` x those tokens, so a prompt shared by many requests stays on its holders
instead of being copied onto every replica whose queue is shorter (each copy evicting the other
shared prompts in turn).  A client's session is left to stickiness, which already prices its move.

**A copy served seldom.**  Where a group of requests sharing a prompt is held by two workers, the
one serving fewer of them uses its copy less often; on a full cache that copy is the least
recently used, and the engine evicts it while the index still lists it (docs/saturation.md, "Traced
per request").  So for a request with no client session id a full approximate worker's match is
counted in the cost's prefill term only as far as the share of its pool not yet computed since
it last served that match (``Candidate.fresh``, routing/cache_fill.py): the holder serving a group
most keeps it, and the other's copy ages out unless the queue ahead says otherwise.  Not in the
prediction or the prefill the router counts: that fed back through the fill estimate and the
pinned tokens onto every holder's horizon, and hot groups could no longer spread (4x-5x collapsed
in virtual time); nor in the copy charge (one seed at 5x then thrashed).

**When the fleet is full** (``View.fleet_full``, routing/saturation.py) no replica can start a
request at once, so a shorter queue is no longer worth a cold prefill: that prefill is the fleet's
work, and it evicts a prefix whose next request then goes cold too.  The cost becomes the fleet's:
the prefill the request adds (its uncached tokens, weighted like above) plus the decode
interference of the requests in flight there — no backlog, waiting queue or session load, which
only say when *this* request starts.  In place of the prompt-size slack, consistent hashing with
bounded loads (``bounded_load``): a replica takes the request only while it would carry at most
``fleet_load_bound`` x the fleet's mean load, so a prefix stays on its holder, and a hot prefix
gets a second replica only once its holder is that far above the mean.

**One-shots.**  The guards above (the slack or bounded load, and ``balanced_sessions``) keep new
*conversations* from piling behind a head one worker holds.  A request whose session id the router
derived, of a model whose derived sessions mostly never come back with a follow-up turn (fewer than
``one_shot_return_share`` of them, learned in routing/returns.py), and which has not come back
itself, is a one-shot (a question under a shared system prompt): it joins no conversation, so the
guards protect nothing, and only move it off its prefix's holder onto a cold worker whose copy of
the prefix evicts another.  It is placed by the cost alone, without the session term (it sends no
later turns beside the sessions living there).  For the same reason it is no session living there
for the others (``POLICY.one_shot``: bound, not counted active on its worker).  Counted, a shared
system prompt's questions (about 60 a minute at 1 request/s) made the replicas they went to
count up to 27 sessions more than the one they used least, and the agents' turns on the same
fleet moved onto that one replica, whose cache could not keep their histories (docs/saturation.md,
"One-shots are no sessions living on a replica").  Agents that send no session id come back, so
their share stays high and their guards stay.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from kvroute.routing import filters, pickers, scorers
from kvroute.routing.decision import DecisionKind
from kvroute.routing.explain import blocks, bound_kind, session_tag
from kvroute.routing.learning import LearningSettings
from kvroute.routing.saturation import SaturationSettings
from kvroute.routing.settings import check_non_negative, setting
from kvroute.routing.stages import Filter, Key, Policy, Pruning, Scorer
from kvroute.routing.view import Candidate, Signal, View

# Read by every decision's explanation; a member read from its enum class costs ~900
# instructions on Python 3.11 (scheduler.py).
_STICKY, _OVERFLOW = DecisionKind.STICKY, DecisionKind.OVERFLOW
_PREFIX_HIT, _COLD = DecisionKind.PREFIX_HIT, DecisionKind.COLD


@dataclass(frozen=True, slots=True)
class AutoSettings:
    """The tunables of ``auto`` (see the module's docstring and docs/routing.md)."""

    inflight_tokens: float = setting(
        256.0, "token-equivalents of delay per request in flight on a worker (decode interference, "
               "and a load signal when the engine reports nothing)")
    waiting_tokens: float = setting(
        8192.0, "token-equivalents per request the engine reports waiting (out of slots or KV blocks)")
    backlog_weight: float = setting(
        1.0, "weight of the router's estimate of prefill work still queued on a worker (0 disables)")
    eviction_weight: float = setting(
        1.0, "extra weight on that backlog as the worker's cache fails to keep what the index "
             "predicts (times 1 - realisation)")
    stay_tokens: float = setting(
        512.0, "a session stays on its worker unless another is predicted faster by more than this "
               "many tokens of prefill")
    prefill_penalty: float = setting(
        1.0, "extra weight on uncached tokens: prefill sent anywhere delays every request queued "
             "behind it")
    realisation_weight: float = setting(
        1.0, "how far the engine-reported hit share discounts the index's matches (0: trust the index, "
             "1: scale matches by the reported/predicted hit ratio)")
    session_spread: int | None = setting(
        2, "new sessions go to workers with at most this many more active sessions than the least "
           "(none: off)", optional=True)
    active_session_tokens: float = setting(
        8192.0, "token-equivalents of future load per other session active on a worker (0 disables)")
    # 12: shared-prefix groups at 1-5x the base rate, seeds 0-3 (docs/saturation.md); 3 and 7
    # still let hot groups spread at 3-4x.  Not for clients' sessions: at 16-24 agent sessions
    # without pauses it cost 5-17 % of the output.
    evicted_cache_weight: float = setting(
        12.0, "weight on the cached tokens a request with no client session id would evict by "
              "copying a prefix another worker holds into a worker whose cache is full (known from "
              "KV events, or estimated: approximate_eviction): each is a prefill later requests "
              "are likely to pay again (0 disables)")

    one_shot_return_share: float = setting(
        0.1, "while fewer than this share of a model's conversations without a session id come back "
             "with a follow-up turn within 60 s (learned per model, routing/returns.py), a request "
             "of one that never came back is placed by the cost alone: no prompt-size slack, "
             "bounded load or session spread (0 disables)")

    def __post_init__(self) -> None:
        check_non_negative(self, "inflight_tokens", "waiting_tokens", "backlog_weight", "eviction_weight",
                           "stay_tokens", "prefill_penalty", "realisation_weight", "active_session_tokens",
                           "evicted_cache_weight")
        if self.realisation_weight > 1:
            raise ValueError("realisation_weight must be between 0 and 1")
        if not 0 <= self.one_shot_return_share <= 1:
            raise ValueError("one_shot_return_share must be between 0 and 1")
        if self.session_spread is not None and (isinstance(self.session_spread, bool)
                                                or self.session_spread < 0):
            raise ValueError("session_spread must be non-negative or None")


@dataclass(slots=True)
class _Prices:
    """One decision's terms of the cost, read from its view once (the scorer runs per worker)."""

    s: AutoSettings
    est: int
    trust: float
    per_session: float
    bound: str | None
    # The candidates the cost was last computed for and their predictions (what the explainer
    # compares), so that each is computed once per decision.
    priced: list[Candidate] | None = None
    predictions: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, view: View) -> _Prices:
        s = view.block(AutoSettings)
        # Not for a turn whose history the engines say lives on its worker: the sessions active
        # elsewhere are what this instance happened to route, which differs between instances.
        # Nor for a one-shot: it sends no later turns to sit beside the sessions living there.
        per_session = s.active_session_tokens if view.session is not None and not view.resident \
            and not one_shot(view) else 0.0
        return cls(s, view.est_tokens, s.realisation_weight, per_session, view.bound)

    def held(self, c: Candidate) -> float:
        """Prompt tokens ``c`` is expected to serve from cache: the index's match, scaled by the
        worker's cache realisation as far as ``realisation_weight`` trusts it; where the worker's
        state is exact, the truth replaces the survival model."""
        if c.exact:
            return c.held_tokens
        return c.held_tokens * (1.0 - self.trust * (1.0 - c.realisation))

    def queue_and_held(self, c: Candidate) -> tuple[float, float]:
        """Prefill-token equivalents queued ahead of a new request on ``c``, and ``held(c)`` (one
        call per candidate: the scorer runs for every worker of every decision)."""
        s, realisation = self.s, c.realisation
        backlog = s.backlog_weight * c.backlog_tokens * (1.0 + s.eviction_weight * (1.0 - realisation))
        queue = backlog + s.inflight_tokens * c.busy + s.waiting_tokens * (c.worker.waiting or 0)
        return queue, self.held(c)

    def predicted(self, c: Candidate) -> float:
        """Predicted time to first token on ``c``, in seconds."""
        queue, held = self.queue_and_held(c)
        return c.s_per_token * (queue + self.est - held)

    def predicted_all(self, cands: list[Candidate]) -> list[float]:
        """``predicted`` of each of ``cands`` (computed by the cost already when it priced them)."""
        if cands is self.priced:
            return self.predictions
        return [self.predicted(c) for c in cands]


def evicted_tokens(c: Candidate, uncached: float) -> float:
    """Cached tokens a prefill of ``uncached`` tokens on ``c`` pushes out of its cache: what would
    not fit beside what the cache holds (0 where the worker's cache or its size is not known)."""
    cached, size = c.cached_tokens, c.worker.kv_tokens
    if cached is None or size is None:
        return 0.0
    over = cached + uncached - size
    return 0.0 if over <= 0 else min(over, uncached)


def copied_evicting(c: Candidate, uncached: float, copied: float) -> float:
    """Of the ``copied`` prompt tokens another worker already holds and ``c`` would compute again,
    those that push cached tokens out of ``c``'s full cache (a copy of a prefix that costs
    another's)."""
    return min(copied, evicted_tokens(c, uncached)) if copied > 0 else 0.0


def expected_held_tokens(view: View, c: Candidate) -> float:
    """Prompt tokens ``c`` is expected to serve from cache (what the backlog adds the rest of)."""
    return view.derived(_Prices.of).held(c)


def _costs(view: View, cands: list[Candidate]) -> list[float]:
    p = view.derived(_Prices.of)
    s, est, bound = p.s, float(p.est), p.bound
    cap = view.placement.overflow if view.placement.overflow != "auto" else None
    full = view.fleet_full
    evict = 0.0 if view.key.client_session else s.evicted_cache_weight
    best_held = max([p.held(c) for c in cands], default=0.0) if evict else 0.0
    out: list[float] = []
    predictions: list[float] = []
    # ``_Prices.queue_and_held`` written out: this loop runs for every worker of every decision,
    # and the terms must stay the very same floating-point operations.  The sessions term is the
    # future load of the other sessions active there (none for a request without a session: it
    # joins nobody's conversation).
    backlog_weight, eviction_weight, trust = s.backlog_weight, s.eviction_weight, p.trust
    inflight_tokens, waiting_tokens, per_session = s.inflight_tokens, s.waiting_tokens, p.per_session
    weight, stay = 1.0 + s.prefill_penalty, s.stay_tokens
    for c in cands:
        spt = c.s_per_token
        if full:  # the fleet's cost: the prefill it adds, and decode interference
            uncached = est - p.held(c)
            queue = inflight_tokens * c.busy
        else:
            realisation = c.realisation
            queue = backlog_weight * c.backlog_tokens * (1.0 + eviction_weight * (1.0 - realisation)) + \
                inflight_tokens * c.busy + waiting_tokens * (c.worker.waiting or 0)
            held = c.held_tokens if c.exact else c.held_tokens * (1.0 - trust * (1.0 - realisation))
            uncached = est - held
            predictions.append(spt * (queue + est - held))  # as ``predicted`` computes it
            if per_session:
                others = c.active_sessions - (1 if c.worker.id == bound else 0)
                queue += per_session * others if others > 0 else 0.0
        if evict:
            queue += evict * copied_evicting(c, uncached, best_held - (est - uncached))
        if c.fresh < 1.0:  # a copy served least recently there: priced as the prefill it may be
            uncached = est - (est - uncached) * c.fresh
        cost = spt * (queue + weight * uncached)
        if c.worker.id == bound:
            if cap is not None and c.load > cap:
                cost = math.inf
            else:
                cost -= spt * stay
        out.append(cost)
    if not full:
        p.priced, p.predictions = cands, predictions
    return out


predicted_ttft = Scorer("predicted_ttft", _costs,
                        frozenset({Signal.PREFIX, Signal.LEARNED, Signal.SESSIONS, Signal.BINDING}))
"""auto's cost of each candidate, in seconds (the module's docstring says what it counts)."""


def predicted_ttft_s(view: View, c: Candidate) -> float:
    """auto's predicted time to first token on ``c`` (what the proxy's first-byte deadline scales)."""
    return view.derived(_Prices.of).predicted(c)


def load_bound(view: View, cands: list[Candidate]) -> int:
    """The most requests a candidate may carry, this one included, while the fleet is full:
    ``fleet_load_bound`` x the mean over ``cands`` with this request added, rounded up."""
    total = sum(c.busy for c in cands) + 1
    return math.ceil(view.block(SaturationSettings).fleet_load_bound * total / len(cands))


def one_shot(view: View) -> bool:
    """Whether the request is a one-shot's: its session id was derived by the router, it never came
    back with a follow-up turn, and too few of its model's derived sessions do
    (``one_shot_return_share``).  Such a request joins no conversation, so the guards against piling
    conversations behind a shared head protect nothing; they only move it off the replica holding
    its prefix onto a cold one, whose copy evicts another prefix."""
    share = view.return_share
    return share is not None and not view.returned and share < view.block(AutoSettings).one_shot_return_share


def _room(view: View, cands: list[Candidate]) -> list[Candidate]:
    if not view.fleet_full:
        return filters.load_within_slack.keep(view, cands)
    limit = load_bound(view, cands)
    # A later turn of a session the client names stays on its replica past the bound where the
    # fleet serves that kind alone: its sessions pause in turn, so the holder above the mean now
    # is below it a tool call later, and the turn moved elsewhere goes cold and evicts there
    # (agents with pauses at 24 / 32 / 48 sessions: 20,960 / 20,981 / 20,885 tokens/min against
    # 20,523 / 20,053 / 20,171).  With another kind served it would crowd that kind out
    # (docs/saturation.md, "The ceiling with pauses").
    stays = view.bound if view.one_kind and view.key.client_session else None
    # The least busy always passes (its load + 1 is within any bound >= 1 x the mean).
    return [c for c in cands if c.busy + 1 <= limit or c.worker.id == stays]


def _room_guard(view: View, cands: list[Candidate]) -> list[Candidate]:
    return cands if one_shot(view) else _room(view, cands)


room_guard = Filter("room_guard", _room_guard, frozenset({Signal.BINDING, Signal.RETURNS}))
"""With room in the fleet, the prompt-size slack (``load_within_slack``); when it is full, the
bounded load: candidates that would carry at most ``fleet_load_bound`` x the mean load, and the
replica a later turn of a session the client names is bound to where the fleet serves one kind
(``View.one_kind``).  Neither for a one-shot (``one_shot``)."""


def _spread(view: View, cands: list[Candidate]) -> list[Candidate]:
    spread = view.block(AutoSettings).session_spread
    if view.session is None or spread is None or len(cands) < 2 or view.bound_in(cands):
        return cands
    least = min([c.active_sessions for c in cands])  # a list: a generator resumes once per item
    return [c for c in cands if c.active_sessions <= least + spread]


def _balanced_sessions(view: View, cands: list[Candidate]) -> list[Candidate]:
    return cands if one_shot(view) else _spread(view, cands)


balanced_sessions = Filter("balanced_sessions", _balanced_sessions,
                           frozenset({Signal.SESSIONS, Signal.BINDING, Signal.RETURNS}))
"""A session being placed goes where active sessions are within ``session_spread`` of the fewest
(only for a session with no usable binding, and not for a one-shot's)."""


def _guards_moved(view: View, cands: list[Candidate], c: Candidate) -> bool:
    """Whether the guards a one-shot skips would have ruled ``c`` out."""
    return not any(x is c for x in _spread(view, _room(view, cands)))


def explain(view: View, cands: list[Candidate], i: int) -> tuple[DecisionKind, str]:
    """Sticky, overflow, prefix hit or cold, with the predictions compared."""
    c = cands[i]
    predictions = view.derived(_Prices.of).predicted_all(cands)
    alt: Candidate | None = None
    alt_s = math.inf
    for j, x in enumerate(cands):
        if j != i and (p := predictions[j]) < alt_s:
            alt, alt_s = x, p
    versus = f" vs {alt_s:.3f}s on {alt.worker.id}" if alt is not None else ""
    figures = (f"predicted {predictions[i]:.3f}s{versus}; keeps {blocks(view, c)}, "
               f"busy={c.busy}, ~{view.est_tokens} tokens")
    if view.fleet_full:
        figures += f"; fleet saturated: placed for the fleet, load bound {load_bound(view, cands)}"
    if one_shot(view) and _guards_moved(view, cands, c):
        figures += (f"; one-shot (derived sessions coming back {100 * (view.return_share or 0.0):.0f} %): "
                    f"placed by the cost alone, outside the load and session guards")
    kind = bound_kind(view, c)
    if kind is _STICKY:
        return kind, f"[AUTO] sticky: {session_tag(view)} stays on {c.worker.id} ({figures})"
    if kind is _OVERFLOW:
        # What the session's own worker was predicted at, and why: the figures a move is judged by.
        left = next((j for j, x in enumerate(cands) if x.worker.id == view.bound), None)
        if left is not None:
            b = cands[left]
            figures += (f"; {b.worker.id} predicted {predictions[left]:.3f}s, keeps {blocks(view, b)}, "
                        f"busy={b.busy}, waiting={b.worker.waiting or 0}")
        return kind, f"[AUTO] overflow: {session_tag(view)} {view.bound} -> {c.worker.id} ({figures})"
    who = f" new session {session_tag(view)}" if view.session is not None else ""
    if c.matched_blocks:
        return _PREFIX_HIT, f"[AUTO] hit:{who} {c.worker.id} ({figures})"
    return _COLD, f"[AUTO] cold:{who} {c.worker.id} ({figures})"


def _floor(view: View, busy: int) -> Key | None:
    """The least scores of a worker holding none of the prompt at ``busy``: nothing queued but its
    in-flight requests, the whole prompt to prefill (``predicted_ttft``), no match
    (``deepest_match``), nothing in flight (``inflight``).  Only with one prefill rate for every
    worker (``learn_rate`` off)."""
    learning = view.block(LearningSettings)
    if learning.learn_rate:
        return None
    s = view.block(AutoSettings)
    tokens = s.inflight_tokens * busy + (1.0 + s.prefill_penalty) * view.est_tokens
    return (learning.prefill_s_per_token * tokens, 0.0, 0.0)


def _kept(view: View, cands: list[Candidate], least: int) -> list[bool] | None:
    """Which of ``cands`` ``room_guard`` and ``balanced_sessions`` keep whatever the rest of the
    fleet: every one for a bound session's turn (both let it through); for a placement, those within
    the slack of ``least`` with at most ``session_spread`` active sessions — known only once one of
    those within the slack has none, the fewest there can be; every one for a one-shot (neither
    guard applies)."""
    if view.bound_in(cands) or one_shot(view):
        return [True] * len(cands)
    limit = least + view.placement.slack_for(view.est_tokens)
    spread = view.block(AutoSettings).session_spread
    if view.session is None or spread is None:
        return [c.busy <= limit for c in cands]
    if all(c.active_sessions for c in cands if c.busy <= limit):
        return None
    return [c.busy <= limit and c.active_sessions <= spread for c in cands]


def _within(view: View) -> int:
    """How far above the least busy a placement may go: the prompt-size slack, and no bound for a
    one-shot (``one_shot``: the cost alone decides, so only the floor prunes)."""
    return sys.maxsize if one_shot(view) else view.placement.slack_for(view.est_tokens)


PRUNING = Pruning("busy", _within, _floor, _kept)
"""A new placement goes within the prompt-size slack of the least busy (``room_guard`` with room),
to the cheapest of the workers holding part of the prompt and the least busy ones, unless a worker
holding nothing could be cheaper still; a bound session's turn stays unless a worker beats the cost
of staying.  Not used while the fleet is full (every worker is compared with the mean load)."""

POLICY = Policy("auto", (*filters.BASE, room_guard, balanced_sessions),
                (predicted_ttft, scorers.deepest_match, scorers.inflight), pickers.lowest, explain,
                held=expected_held_tokens, settings=(AutoSettings,), pruning=PRUNING,
                predict=predicted_ttft_s, one_shot=one_shot,
                summary="the lowest predicted time to first token (cache, queue, sessions)")
