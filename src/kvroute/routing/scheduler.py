"""The scheduler: request key + worker states -> decision, and what it learns afterwards.

Pure: no I/O, the clock injected (wall-clock seconds, because epochs and entry times travel between
router instances).  ``decide`` only reads the ``WorkerState``s; the dispatcher (routing/dispatch.py)
keeps their load figures current.  Not thread-safe: one scheduler per event loop.

A decision runs in two halves.  The *signal producers* here fill one ``Candidate`` per worker with
the figures the policy's stages declare they need (prefix match, active or bound sessions, learned
rates and backlog, the session's binding); then the policy's filters, scorers, picker and explainer
(routing/stages.py, routing/policies/) read them and return values.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import xxhash

from kvroute.routing.cache_fill import CacheFill, CacheFillSettings
from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.decision import Decision, DecisionKind
from kvroute.routing.exact_index import ExactIndex, Mode, pick_rank
from kvroute.routing.filters import seq_slots
from kvroute.routing.hashing import block_hashes, stored_positions
from kvroute.routing.key import EST_BYTES_PER_TOKEN, RoutingKey
from kvroute.routing.learning import LearningSettings, WorkerLearning
from kvroute.routing.loadbook import LoadBook
from kvroute.routing.policies import policy_named
from kvroute.routing.prefix_index import PrefixIndex
from kvroute.routing.returns import ReturnShare
from kvroute.routing.saturation import SaturationSettings
from kvroute.routing.sessions import SessionTable
from kvroute.routing.stages import PickerState, Policy, Pruning
from kvroute.routing.sync_record import PrefixRecord, SessionRecord, SyncRecord, WorkerEpochRecord
from kvroute.routing.view import Candidate, Signal, View
from kvroute.routing.worker import WorkerState

# The signals every decision asks about, bound once: on Python 3.11 reading a member from its
# enum class (``Signal.PREFIX``) costs ~900 instructions (docs/benchmarks.md, "2026-12-07:
# instructions per request").
_BINDING, _RETURNS, _PREFIX, _LEARNED = Signal.BINDING, Signal.RETURNS, Signal.PREFIX, Signal.LEARNED
_SESSIONS, _BOUND_SESSIONS = Signal.SESSIONS, Signal.BOUND_SESSIONS

# How many of the least busy workers the pruning of a large fleet prices, beyond the bound worker
# and the prompt's holders, when those do not settle the decision.
_PRICED = 8


def session_hash(key: RoutingKey) -> int | None:
    """The 64-bit key of a request's session in the table (None without a session id)."""
    if key.session_id is None:
        return None
    return xxhash.xxh3_64_intdigest(key.cache_scope + b"\x00session\x00" + key.session_id.encode())


class Scheduler:
    """Routing decisions for one router instance.

    ``decide`` picks a worker; ``commit`` records what the decision implies once the request is
    really sent (prefix ownership, session binding, the backlog it adds) and returns the facts to
    publish to other instances; ``apply_remote`` applies such a fact.  The ``on_*`` hooks keep the
    learned figures and the index in step with the fleet.

    ``publishes``: whether anyone hears those facts (another instance's bus).  Where nobody does
    (one router instance, the virtual-time cluster), ``commit`` makes none and returns an empty
    list: everything else it records is the same.
    """

    def __init__(self, config: RoutingConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config or RoutingConfig()
        self._clock = clock
        # Each commit's facts are two frozen records (~11,000 instructions a request): made only
        # for a listener (docs/benchmarks.md, "2026-12-08: more instructions per request").
        self.publishes = True
        self._index = PrefixIndex(self.config.index_max_blocks, self.config.index_max_age_s)
        self.exact = ExactIndex(self.config.kv_speculative_ttl_s, self.config.kv_events_stale_s)
        self._fill = CacheFill()
        self._sessions = SessionTable(self.config.session_ttl_s, self.config.session_max)
        self._returns: dict[str, ReturnShare] = {}  # per model: whether derived sessions come back
        self._picker = PickerState(rng=random.Random(self.config.seed))
        self._learning: dict[str, WorkerLearning] = {}
        # The learning settings each worker's figures are kept under: its model's (the model of the
        # last request sent there; the default model's before any).
        self._learning_as: dict[str, LearningSettings] = {}
        self._counts: dict[str, dict[str, int]] = {}
        self._memo_key: RoutingKey | None = None
        # The pruning's walk of the approximate index for the decision under way (reset when it
        # ends): (hashes, time, {slot: deepest match}), and whether its candidates carry their
        # signals already.
        self._walk: tuple[tuple[int, ...], float, dict[int, int]] | None = None
        self._filled = False
        # The exact depths ``_resident_home`` read for the decision under way (reset when it
        # ends): (token hashes, time, {worker: depth} of the exact workers holding its first block).
        self._resident: tuple[tuple[int, ...], float, dict[str, int]] | None = None
        self._memo_hashes: tuple[int, ...] = ()
        self._hash_bytes = self.config.max_hash_bytes if self.config.hash_beyond_window else (
            self.config.window_blocks * self.config.block_bytes)
        self._block_tokens = self.config.block_bytes / EST_BYTES_PER_TOKEN

    # --- deciding ------------------------------------------------------------------------------

    def hashes(self, key: RoutingKey) -> tuple[int, ...]:
        """The request's cumulative block hashes (memoised for the last key: retries re-decide)."""
        if key is not self._memo_key:
            self._memo_hashes = block_hashes(key.cache_scope, key.prefix, self.config.block_bytes,
                                             self._hash_bytes)
            self._memo_key = key
        return self._memo_hashes

    def decide(self, key: RoutingKey, workers: Sequence[WorkerState],
               exclude: Collection[str] = (), book: LoadBook | None = None, *,
               fleet_full: bool = False, one_kind: bool = False) -> Decision:
        """Where to send ``key`` among ``workers`` (``WorkerState``s), skipping ``exclude`` ids.

        With ``book`` (the dispatcher's, filed with these workers' loads) a fleet larger than
        ``prune_above`` is decided over the workers the policy's ``Pruning`` says can win.
        ``fleet_full``: the model's fleet is saturated (routing/saturation.py); with
        ``fleet_full_placement = "fleet"`` the policy then places for the fleet (``View.fleet_full``).
        ``one_kind``: the fleet serves no kind of session but ``key``'s (``View.one_kind``).
        """
        try:
            return self._decide(key, workers, exclude, book, fleet_full, one_kind)
        finally:  # the pruning's walk of the index and the exact depths hold for this decision only
            self._walk, self._filled, self._resident = None, False, None

    def foresee(self, key: RoutingKey, workers: Sequence[WorkerState], book: LoadBook | None = None, *,
                fleet_full: bool = False, one_kind: bool = False) -> Decision:
        """``decide`` for a request that is not being sent (flow control's order of a queued
        request): the pickers' turn and random source are left as they were, so that asking where a
        request would go does not move where the next ones go."""
        saved = self._picker
        rng = random.Random()
        rng.setstate(saved.rng.getstate())
        self._picker = PickerState(saved.turn, rng)
        try:
            return self.decide(key, workers, (), book, fleet_full=fleet_full, one_kind=one_kind)
        finally:
            self._picker = saved

    def _decide(self, key: RoutingKey, workers: Sequence[WorkerState], exclude: Collection[str],
                book: LoadBook | None, fleet_full: bool, one_kind: bool) -> Decision:
        now = self._clock()
        cfg = self.config.settings_for(key.model)
        placement = cfg.placement
        policy = policy_named(placement.policy)
        needs = policy.needs
        hashes = self.hashes(key)
        view = View(key, cfg, placement, now, len(hashes), self._block_tokens,
                    fleet_full=fleet_full and cfg.block(SaturationSettings).fleet_full_placement == "fleet",
                    one_kind=one_kind)
        if _BINDING in needs and placement.sticky and key.session_id is not None:
            view.session = session_hash(key)
            assert view.session is not None
            view.bound = self._sessions.get(view.session, now)
            if key.token_hashes:
                home = self._resident_home(key, workers, now)
                if home is not None:
                    # The engines' own state outranks this instance's binding, which another
                    # instance may have moved since (it holds less of the history than ``home``).
                    view.bound, view.resident = home, True
        if _RETURNS in needs and key.session_id is not None and not key.client_session:
            returns = self._returns.get(key.model)
            if returns is not None:
                view.return_share = returns.share(now)
                session = view.session if view.session is not None else session_hash(key)
                assert session is not None
                view.returned = returns.returned(session, key.est_prompt_tokens)
        offered = len(workers)
        pruned = None
        # Placing for a full fleet compares every worker with the fleet's mean load: no pruning.
        if book is not None and policy.pruning is not None and offered > self.config.prune_above \
                and not view.fleet_full:
            pruned = self._prune(policy, policy.pruning, view, hashes, workers, exclude, book)
        if pruned is not None:
            cands = pruned
        else:
            of = Candidate.of
            cands = [of(w) for w in workers if w.id not in exclude] if exclude else [of(w) for w in workers]
        considered = len(cands)
        filled = self._filled  # the pruning priced its candidates already
        if not filled:
            self._sessions_of(needs, view, cands)
        for stage in policy.filters:
            kept = stage.keep(view, cands)
            if not kept:
                return self._nobody(key, policy, hashes, view, stage.name, offered)
            cands = kept
        if not filled:
            self._figures_of(needs, view, hashes, cands)
        scores = [scorer.score(view, cands) for scorer in policy.scorers]
        keys = list(zip(*scores, strict=True)) if scores else [()] * len(cands)
        i = policy.picker(self._picker, keys)
        chosen = cands[i]
        if _PREFIX not in needs:
            self._match(key, hashes, [chosen], now)  # for the log line, the metrics and the backlog
        rank = self._rank(view, chosen) if chosen.exact else None
        kind, reason = policy.explain(view, cands, i)
        if rank is not None:
            reason += f" rank={rank}"
        prefill = max(0, round(key.est_prompt_tokens - policy.held(view, chosen)))
        total = len(key.token_hashes) if chosen.exact else len(hashes)
        return Decision(
            worker_id=chosen.worker.id, kind=kind, policy=policy.name, reason=reason,
            matched_blocks=chosen.matched_blocks, total_blocks=total, est_tokens=key.est_prompt_tokens,
            loads=tuple([(c.worker.id, c.load) for c in cands]), block_hashes=hashes,
            session_id=key.session_id, worker_epoch=chosen.worker.epoch, session=view.session,
            prefill_tokens=prefill, scores=keys[i], considered=considered,
            predicted_ttft_s=self.predicted_ttft(policy, view, chosen, prefill),
            exact=chosen.exact, held_tokens=chosen.held_tokens, rank=rank,
            one_shot=policy.one_shot is not None and policy.one_shot(view),
            token_hashes=key.token_hashes if key.cacheable else (),
        )

    def _rank(self, view: View, c: Candidate) -> int | None:
        """The data-parallel rank the request goes to on ``c``, whose state is exact (None where it
        publishes the events of one rank only): ``pick_rank``.  ``c``'s match becomes that rank's
        (what the decision, its prefill and its log line then say)."""
        exact, wid = self.exact, c.worker.id
        if exact.ranks(wid) < 2:
            return None
        key = view.key
        figures = exact.rank_figures(key.token_hashes, wid, view.now)
        rank = pick_rank(figures, c.worker.rank_inflight, view.placement.slack_for(view.est_tokens))
        depth = figures[rank][0]
        if depth != c.matched_blocks:
            c.matched_blocks = depth
            c.held_tokens = min(float(key.est_prompt_tokens), float(depth * key.token_block))
        return rank

    def _resident_home(self, key: RoutingKey, workers: Sequence[WorkerState], now: float) -> str | None:
        """The worker a session's history lives on by the engines' own cache state: the one exact
        worker holding at least half of the prompt and more of it than any other (a conversation's
        history, not a head many sessions share).  Every router instance subscribed to the engines
        reads the same answer within the event lag, whichever of them placed the session and
        whatever its own session table says."""
        readable, block = self.exact.readable, key.token_block
        holders = self.exact.holders(key.token_hashes[0], now)
        held = self.exact.match(key.token_hashes, [w for w in holders if readable(w, now, block)], now)
        self._resident = (key.token_hashes, now, held)  # ``_match`` reads the same depths
        model = key.model
        depths = sorted(((held[w.id], w.id) for w in workers
                         if w.id in held and w.ready and w.serves(model)), reverse=True)
        if not depths:
            return None
        best, home = depths[0]
        runner_up = depths[1][0] if len(depths) > 1 else 0
        if 2 * best >= len(key.token_hashes) and best > runner_up:
            return home
        return None

    def bound_worker(self, key: RoutingKey) -> str | None:
        """The replica ``key``'s session is bound to in the session table (by this router instance
        or, through Redis, another), None without a session or a live binding."""
        session = session_hash(key)
        return None if session is None else self._sessions.get(session, self._clock())

    def holder(self, key: RoutingKey, workers: Sequence[WorkerState]) -> tuple[str | None, float]:
        """The ready worker serving ``key``'s model whose indexed match of the prompt is deepest,
        and the prompt tokens it holds by the index ((None, 0) when none holds any): what late
        binding waits for, whatever the workers' load."""
        model = key.model
        cands = [Candidate.of(w) for w in workers if w.ready and w.serves(model)]
        self._match(key, self.hashes(key), cands, self._clock())
        best = max(cands, key=lambda c: c.held_tokens, default=None)
        if best is None or not best.matched_blocks:
            return None, 0.0
        return best.worker.id, best.held_tokens

    def predicted_ttft(self, policy: Policy, view: View, c: Candidate, prefill_tokens: int) -> float:
        """Predicted seconds to the first token on the chosen candidate ``c``: the policy's own
        prediction when it has one (``auto``), else the prefill of the backlog ahead and the
        uncached prompt at the worker's learned drain speed."""
        if _LEARNED not in policy.needs:
            self._learned([c], view.block(LearningSettings), view.now)
        if policy.predict is not None:
            return policy.predict(view, c)
        learned = self._learning.get(c.worker.id)
        settings = view.block(LearningSettings)
        rate = learned.drain_rate(settings) if learned is not None else settings.prefill_s_per_token
        return rate * (c.backlog_tokens + prefill_tokens)

    # --- signal producers ------------------------------------------------------------------------

    def _sessions_of(self, needs: frozenset[Signal], view: View, cands: list[Candidate]) -> None:
        """Signal.SESSIONS and Signal.BOUND_SESSIONS (what filters may read)."""
        if _SESSIONS in needs:
            active = self._sessions.active(view.now, view.placement.session_active_s)
            for c in cands:
                c.active_sessions = active.get(c.worker.id, 0)
        if _BOUND_SESSIONS in needs:
            for c in cands:
                c.bound_sessions = self._sessions.bound(c.worker.id)

    def _figures_of(self, needs: frozenset[Signal], view: View, hashes: tuple[int, ...],
                    cands: list[Candidate]) -> None:
        """Signal.PREFIX and Signal.LEARNED, for the candidates the filters kept."""
        if _PREFIX in needs:
            self._match(view.key, hashes, cands, view.now)
        if _LEARNED in needs:
            self._learned(cands, view.block(LearningSettings), view.now)

    def _match(self, key: RoutingKey, hashes: tuple[int, ...], cands: list[Candidate], now: float) -> None:
        """Signal.PREFIX: each candidate's longest match and the prompt tokens it covers — from the
        worker's KV events where they are exact and the request's tokens are known, else from the
        approximate index (for a request with no client session id, only what the worker is
        estimated to hold still, how full its cache is, and how close to eviction its match is:
        routing/cache_fill.py)."""
        est = float(key.est_prompt_tokens)
        exact = self.exact
        ids: list[str] = []
        if key.token_hashes:
            readable, block = exact.readable, key.token_block
            ids = [c.worker.id for c in cands if readable(c.worker.id, now, block)]
        if len(ids) < len(cands):
            slots = self._index.slots_of([(c.worker.id, c.worker.epoch) for c in cands])
            since = self._estimated_fill(key, slots, cands)
            block_tokens = self._block_tokens
            walk = self._walk
            # The full workers whose matches are priced by how recently they served them, and
            # (asked of the index only then) each one's stamp of its match.
            aging = since if since and self.config.settings_for(key.model).block(
                CacheFillSettings).approximate_survival else None
            stamps: dict[int, int] | None = {} if aging else None
            if not since and walk is not None and walk[0] is hashes and walk[1] == now:
                found = {slot: walk[2][slot] for slot in slots if slot in walk[2]}
            else:
                found = self._index.match(hashes, slots, now, since, stamps)
            for slot, depth in found.items():
                c = cands[slots[slot]]
                c.matched_blocks = depth
                c.held_tokens = min(est, depth * block_tokens)
                if aging and stamps is not None and slot in aging:  # the least recently served goes first
                    w = c.worker
                    c.fresh = self._fill.survival(w.id, w.epoch, w.kv_tokens, w.inflight_tokens, stamps[slot])
        if ids:
            resident = self._resident
            room = self._room(key, cands, ids)
            if resident is not None and resident[0] is key.token_hashes and resident[1] == now:
                # Every readable worker not holding the first block matches nothing; those whose
                # queue evicts are matched again with what it evicts.
                depths = {wid: resident[2].get(wid, 0) for wid in ids}
                queued = [wid for wid in ids if depths[wid] and wid in room]
                if queued:
                    depths.update(exact.match(key.token_hashes, queued, now, room))
            else:
                depths = exact.match(key.token_hashes, ids, now, room)
            block = key.token_block
            for c in cands:
                held = depths.get(c.worker.id)
                if held is not None:
                    c.exact = True
                    c.matched_blocks = held
                    c.held_tokens = min(est, float(held * block))
                    c.cached_tokens = float(exact.resident_blocks(c.worker.id) * block)

    @staticmethod
    def _room(key: RoutingKey, cands: list[Candidate], ids: Collection[str]) -> dict[str, int]:
        """Per exact worker of ``ids`` whose KV cache size is known: its blocks less one per request
        in flight there (the partly filled block each holds, which caches nothing): the room
        ``ExactIndex.match`` tells what the prompts not computed there yet evict by."""
        block = key.token_block
        return {c.worker.id: c.worker.kv_tokens // block - c.load for c in cands
                if c.worker.kv_tokens and c.worker.id in ids}

    def _estimated_fill(self, key: RoutingKey, slots: dict[int, int],
                        cands: list[Candidate]) -> dict[int, int] | None:
        """For a request with no client session id (where ``approximate_eviction`` is on): each
        candidate's estimated cache fill (``Candidate.cached_tokens``; an exact worker's is then
        replaced by the truth), and the first second whose index entries each slot still holds,
        for those that evicted any.  A client's session is left to the cache-survival discount,
        learnt from its own turns."""
        if key.client_session or \
                not self.config.settings_for(key.model).block(CacheFillSettings).approximate_eviction:
            return None
        fill = self._fill
        since: dict[int, int] = {}
        for c in cands:
            w = c.worker
            c.cached_tokens = fill.fill(w.id, w.epoch, w.kv_tokens)
        for slot, i in slots.items():
            w = cands[i].worker
            horizon = fill.horizon(w.id, w.epoch, w.kv_tokens, w.inflight_tokens)
            if horizon is not None:
                since[slot] = horizon
        return since

    def _learned(self, cands: list[Candidate], settings: LearningSettings, now: float) -> None:
        """Signal.LEARNED: prefill rate, cache realisation and backlog of each candidate."""
        learning = self._learning
        default = settings.prefill_s_per_token
        # ``WorkerLearning.cost_rate`` and ``drain_rate`` written out (this runs for every candidate).
        learn_rate, learn_speed = settings.learn_rate, settings.learn_prefill_speed
        for c in cands:
            learned = learning.get(c.worker.id)
            if learned is None:
                c.s_per_token = default
                continue
            rate = (learned.rate if learn_rate else None) or default
            fastest = learned.fastest if learn_speed else None
            c.s_per_token = rate
            c.realisation = learned.realisation(now)
            c.backlog_tokens = learned.drain(now, fastest if fastest is not None and fastest < rate else rate,
                                             c.load)

    def _prune(self, policy: Policy, rule: Pruning, view: View, hashes: tuple[int, ...],
               workers: Sequence[WorkerState], exclude: Collection[str],
               book: LoadBook) -> list[Candidate] | None:
        """The few workers of a large fleet that can win under ``policy`` (in fleet order), or None
        when that cannot be told from the book: then every worker is looked at.

        With a ``floor``: the bound worker and every worker holding part of the prompt are priced
        first, then (unless those settle it) the least busy pruned; the best price among those the
        filters surely keep bounds what any other worker must beat, and a worker holding nothing
        cannot beat it once the floor of its figure is above it (docs/design.md, "Large fleets").
        Candidates returned from there carry every signal the policy needs (``_filled``)."""
        book.follow(workers)
        model, placement = view.key.model, view.placement
        need = view.key.est_prompt_tokens + view.key.max_tokens

        def accept(w: WorkerState) -> bool:
            # The hard and the soft filters (``filters.BASE``): the soft ones keep only the workers
            # passing them once any worker does, and the few found here are such workers.
            return w.ready and w.serves(model) and w.id not in exclude and (
                w.max_model_len is None or need <= w.max_model_len) and \
                Candidate.of(w).busy < seq_slots(w, placement)

        buckets = book.busy if rule.by == "busy" else book.engine_load
        bound = book.named(view.bound) if view.bound is not None else None
        if bound is not None and not accept(bound):
            bound = None
        floor = rule.floor
        within = rule.within(view)
        if floor is None or floor(view, 0) is None or rule.kept is None:
            if bound is not None:
                return None
            return self._pruned(book.lowest(buckets, within, accept))

        def accepted() -> Iterator[tuple[int, int, WorkerState]]:
            for figure, bucket in buckets.ascending():
                for i, w in bucket.items():
                    if accept(w):
                        yield figure, i, w

        # The least busy of all (where the slack counts from), then a few more when needed.
        ascending = accepted()
        least, i, w = next(ascending, (None, 0, None))
        if least is None or w is None:
            return None
        pruned: dict[int, WorkerState] = {}
        if bound is not None:
            pruned[book.position(bound)] = bound
        least_busy = {i: w}
        if bound is None:
            pruned[i] = w
        walk = self._index.depths(hashes, view.now)
        self._walk = (hashes, view.now, walk)
        held_by: Collection[str] = self._index.named(walk).keys()
        if view.key.token_hashes:
            held_by = set(held_by) | self.exact.holders(view.key.token_hashes[0], view.now)
        for wid in held_by:
            w = book.named(wid)
            if w is not None and accept(w):
                pruned[book.position(w)] = w
        needs, kept_of = policy.needs, rule.kept
        priced: dict[int, Candidate] = {}
        best: tuple[float, ...] | None = None

        def price(batch: dict[int, WorkerState]) -> None:
            """Candidates for ``batch`` with their signals; ``best`` lowered by those surely kept."""
            nonlocal best
            cands = self._pruned(batch) or []
            self._sessions_of(needs, view, cands)
            self._figures_of(needs, view, hashes, cands)
            if not cands:
                return
            for c in cands:
                priced[book.position(c.worker)] = c
            # Which are surely kept is told from everything priced so far (the bound worker is).
            kept = kept_of(view, list(priced.values()), least)
            if kept is None:
                return
            scores = zip(*(scorer.score(view, cands) for scorer in policy.scorers), strict=True)
            for x, keep in zip(scores, kept[-len(cands):], strict=True):
                if keep and (best is None or x < best):
                    best = x

        price(pruned)
        lowest = floor(view, least)
        if best is None or lowest is None or lowest < best:
            top = least + within
            for figure, i, w in ascending:
                if bound is None and figure > top:
                    break
                least_busy[i] = w
                if len(least_busy) >= _PRICED:
                    break
            price({i: w for i, w in least_busy.items() if i not in priced})
        if best is None or best[0] == math.inf:
            return None if bound is not None else self._pruned(book.lowest(buckets, within, accept))
        # Busier workers, while one holding nothing there could still beat the best so far.
        ceiling = math.inf if bound is not None else least + within
        for figure, bucket in buckets.ascending():
            low = floor(view, figure)
            if figure > ceiling or low is None or not low < best:
                break
            price({i: w for i, w in bucket.items() if i not in priced and accept(w)})
        self._filled = True
        return [priced[i] for i in sorted(priced)]

    @staticmethod
    def _pruned(pruned: dict[int, WorkerState]) -> list[Candidate] | None:
        """Candidates of ``few`` in fleet order, or None when there are none (the soft filters
        then fall back to the whole fleet, if it has anyone at all)."""
        if not pruned:
            return None
        return [Candidate.of(pruned[i]) for i in sorted(pruned)]

    def _nobody(self, key: RoutingKey, policy: Policy, hashes: tuple[int, ...], view: View,
                stage: str, offered: int) -> Decision:
        reason = f"[{policy.name.upper()}] no worker: none of {offered} passed {stage} (model {key.model!r})"
        return Decision(worker_id=None, kind=DecisionKind.NO_WORKER, policy=policy.name, reason=reason,
                        total_blocks=len(hashes), est_tokens=key.est_prompt_tokens, block_hashes=hashes,
                        session_id=key.session_id, session=view.session)

    # --- after the decision ----------------------------------------------------------------------

    def commit(self, key: RoutingKey, decision: Decision) -> list[SyncRecord]:
        """Record what sending ``key`` as ``decision`` says: the chosen worker now holds the prefix
        blocks and the session lives there.  Returns the facts to publish to other instances (none
        unless ``publishes``)."""
        worker = decision.worker_id
        if worker is None:
            return []
        now = self._clock()
        cfg = self.config.settings_for(key.model)
        records: list[SyncRecord] = []
        publishes = self.publishes
        counts = self._counts.setdefault(worker, {})
        kind = decision.kind.value
        counts[kind] = counts.get(kind, 0) + 1
        if key.cacheable and decision.block_hashes:
            n = len(decision.block_hashes)
            hs = decision.block_hashes
            stored = tuple(hs[i] for i in stored_positions(
                n, self.config.window_blocks, self.config.anchors_per_octave, self.config.tail_blocks))
            if self._index.record(stored, worker, decision.worker_epoch, now) and publishes:
                records.append(PrefixRecord(worker, decision.worker_epoch, now, stored,
                                            decision.prefill_tokens))
        if decision.token_hashes:
            self.exact.speculate(worker, decision.token_hashes, now, decision.predicted_ttft_s, decision.rank,
                                 key.est_prompt_tokens, key.answer_tokens)
        self._fill.computed(worker, decision.worker_epoch, now, decision.prefill_tokens)
        if key.cacheable:
            settings = cfg.block(LearningSettings)
            learned = self._learn(worker, settings)
            est = key.est_prompt_tokens
            spt = learned.drain_rate(settings)
            # The index's own prediction (not the discounted one): realisation compares the engine's
            # report with it, and must not feed back on itself.
            indexed = decision.held_tokens
            hit = indexed / est if est else None
            learned.on_sent(now, spt, decision.prefill_tokens, hit, indexed)
        if decision.session is not None:
            active = not decision.one_shot
            self._sessions.bind(decision.session, worker, now, active)
            if publishes:
                records.append(SessionRecord(decision.session, worker, now, active))
        if key.session_id is not None and not key.client_session:
            session = decision.session if decision.session is not None else session_hash(key)
            assert session is not None
            returns = self._returns.get(key.model)
            if returns is None:
                returns = self._returns[key.model] = ReturnShare()
            returns.seen(session, key.est_prompt_tokens, now)
        return records

    def apply_remote(self, record: SyncRecord) -> None:
        """Apply a fact published by another router instance.  A prefix record's prefill joins the
        worker's backlog less what the worker has prefilled since it was sent, at the same drain
        rate as local requests: facts replayed on catch-up or after an outage add no backlog."""
        if isinstance(record, PrefixRecord):
            self._fill.computed(record.worker_id, record.epoch, record.time, record.prefill_tokens)
            if self._index.record(record.hashes, record.worker_id, record.epoch, record.time) and \
                    record.prefill_tokens:
                learned = self._learn(record.worker_id)
                now = self._clock()
                spt = learned.drain_rate(self._learning_settings(record.worker_id))
                left = record.prefill_tokens - max(0.0, now - record.time) / spt
                if left > 0:
                    learned.add_backlog(now, spt, left)
        elif isinstance(record, SessionRecord):
            self._sessions.bind(record.session, record.worker_id, record.time, record.active)
        else:
            self.on_worker_epoch(record.worker_id, record.epoch)

    def on_worker_epoch(self, worker_id: str, epoch: float) -> list[SyncRecord]:
        """A worker (re)registered at ``epoch``: what it owned before no longer matches, and its
        queue is empty.  Returns the fact to publish when the epoch is news to this instance."""
        known = self._index.epoch_of(worker_id)
        if known is not None and epoch <= known:
            return []
        self._index.register(worker_id, epoch)
        learned = self._learning.get(worker_id)
        if learned is not None:
            learned.new_epoch()
        return [WorkerEpochRecord(worker_id, epoch)]

    def on_first_byte(self, decision: Decision) -> None:
        """The chosen worker answered ``decision``'s request: it has computed the prompt, so where
        that added blocks its KV events are due (or its exact state goes stale)."""
        worker = decision.worker_id
        if worker is not None and decision.token_hashes:
            self.exact.answered(worker, decision.token_hashes)
        if decision.exact and worker is not None and decision.matched_blocks < decision.total_blocks:
            self.exact.expect(worker, self._clock())

    def exact_worker(self, model: str, workers: Sequence[WorkerState]) -> WorkerState | None:
        """The least loaded ready worker of ``model`` whose cache state is exact and whose block
        size is known (``block_size``): where a request's tokens are worth computing, and who to ask."""
        if not self.exact.attached():  # asked of every request: without KV events, no worker walk
            return None
        readable, now = self.exact.readable, self._clock()
        best = None
        for w in workers:
            if not (w.ready and w.serves(model) and readable(w.id, now, self.block_size(w))):
                continue
            if best is None or w.total_inflight < best.total_inflight:
                best = w
        return best

    def block_size(self, worker: WorkerState) -> int | None:
        """The block a request's tokens are hashed by for ``worker``: what its KV events said,
        else, before its first store, what its metrics say (None when neither has).  The events
        win where the two differ: they carry the block their hashes cover, where the metrics say
        how the engine was configured, which need not be it (a hybrid model's engine resizes its
        attention block to fit its Mamba state's page).  A wrong guess costs the first turns their
        exactness only: a worker whose events tell another block is not read for those hashes."""
        told = self.exact.block_size(worker.id)
        return told if told is not None else worker.block_size

    def cache_mode(self, worker_id: str) -> Mode:
        """``exact`` where ``worker_id``'s KV events say what it holds, else ``approximate``."""
        return self.exact.mode(worker_id, self._clock())

    def on_worker_removed(self, worker_id: str) -> None:
        """A worker left the fleet: forget its prefixes, sessions and learned figures."""
        self._index.remove_worker(worker_id)
        self.exact.detach(worker_id)
        self._sessions.drop_worker(worker_id)
        self._learning.pop(worker_id, None)
        self._learning_as.pop(worker_id, None)
        self._fill.forget(worker_id)
        self._counts.pop(worker_id, None)

    def on_finished(self, worker_id: str, *, prompt_tokens: int | None = None,
                    cached_tokens: int | None = None, ttft_s: float | None = None,
                    output_tokens: int | None = None, decision: Decision | None = None) -> None:
        """A request on ``worker_id`` (sent as ``decision``) finished; learn from what the engine
        reported (any may be None).  What it computed beyond the prefill the decision counted —
        a prefix it no longer held, the tokens it generated — took cache space too."""
        self._learn(worker_id).on_finished(self._clock(), prompt_tokens, cached_tokens, ttft_s)
        if decision is None:
            return
        more = float(output_tokens or 0)
        if prompt_tokens is not None and cached_tokens is not None:
            more += max(0, prompt_tokens - cached_tokens - decision.prefill_tokens)
        self._fill.computed(worker_id, decision.worker_epoch, self._clock(), more)

    def released(self, decision: Decision, answered: bool) -> None:
        """The request sent as ``decision`` ended, however (``answered``: its first byte came): the
        blocks it used on its worker are evictable there once no other request of this router uses
        them, and a prefill it never finished is no longer ahead of later requests."""
        if decision.worker_id is not None and decision.token_hashes:
            self.exact.released(decision.worker_id, decision.token_hashes, decision.rank, answered)

    def return_share(self, model: str) -> float | None:
        """The learned share of ``model``'s derived sessions that come back with a follow-up turn
        (routing/returns.py; None before enough are known)."""
        returns = self._returns.get(model)
        return None if returns is None else returns.share(self._clock())

    def learned(self, worker_id: str) -> WorkerLearning | None:
        """What has been learned about ``worker_id`` so far (None before its first request);
        read-only for callers: only the dispatch path teaches it."""
        return self._learning.get(worker_id)

    def realisation(self, worker_id: str) -> float:
        """The cache realisation routing counts on for ``worker_id`` now (faded since the engine's
        last reports: ``WorkerLearning.realisation``; 1.0 before anything is learned)."""
        learned = self._learning.get(worker_id)
        return 1.0 if learned is None else learned.realisation(self._clock())

    def prefill_s_per_token(self, worker_id: str) -> float:
        """Seconds per uncached token ``worker_id`` prefills at, as learnt from the engine's reports
        (the configured figure until enough samples arrived)."""
        settings = self._learning_settings(worker_id)
        learned = self._learning.get(worker_id)
        return learned.drain_rate(settings) if learned is not None else settings.prefill_s_per_token

    def _learning_settings(self, worker_id: str) -> LearningSettings:
        """The learning settings ``worker_id``'s figures are kept under: those of the model of the
        last request sent there (a worker serving two models with different ones follows the
        latest), the default model's before any."""
        found = self._learning_as.get(worker_id)
        return found if found is not None else self.config.default.block(LearningSettings)

    def _learn(self, worker_id: str, settings: LearningSettings | None = None) -> WorkerLearning:
        """``worker_id``'s learned figures, learnt as its learning settings say; ``settings``: those
        of the model of a request sent there now, which the figures' weights then follow."""
        learned = self._learning.get(worker_id)
        if settings is None:
            settings = self._learning_settings(worker_id)
        elif self._learning_as.get(worker_id) is not settings:
            self._learning_as[worker_id] = settings
            if learned is not None:
                fresh = WorkerLearning.from_settings(settings)
                learned.alpha, learned.min_samples = fresh.alpha, fresh.min_samples
                learned.floor_min_tokens, learned.floor_pull = fresh.floor_min_tokens, fresh.floor_pull
                learned.floor_relax, learned.realisation_fade_s = fresh.floor_relax, fresh.realisation_fade_s
        if learned is None:
            learned = self._learning[worker_id] = WorkerLearning.from_settings(settings)
        return learned

    # --- introspection -------------------------------------------------------------------------

    def settings_for(self, model: str) -> ModelSettings:
        """The settings requests for ``model`` are routed with."""
        return self.config.settings_for(model)

    def stats(self) -> dict[str, Any]:
        """Index and session-table sizes, per model the learned share of derived sessions that come
        back, and per worker: decisions by kind, bound sessions and
        learned figures (for metrics and the dashboard)."""
        now = self._clock()
        workers: dict[str, dict[str, Any]] = {}
        for wid in sorted(set(self._counts) | set(self._learning)):
            learned = self._learning.get(wid)
            entry: dict[str, Any] = {kind.value: self._counts.get(wid, {}).get(kind.value, 0)
                                     for kind in DecisionKind if kind is not DecisionKind.NO_WORKER}
            entry["sessions"] = self._sessions.bound(wid)
            entry["cache_mode"] = self.exact.mode(wid, now)
            if learned is not None:
                spt = learned.drain_rate(self._learning_settings(wid))
                entry["prefill_s_per_token"] = spt
                entry["learned_s_per_token"] = learned.rate
                entry["fastest_s_per_token"] = learned.fastest
                entry["cache_realisation"] = learned.realisation(now)
                entry["backlog_tokens"] = round(learned.drain(now, spt))
            workers[wid] = entry
        return {
            "index_blocks": len(self._index),
            "index_max_blocks": self._index.max_blocks,
            "sessions": len(self._sessions),
            "session_max": self._sessions.max_entries,
            "return_share": {model: returns.share(now) for model, returns in sorted(self._returns.items())},
            "workers": workers,
        }
