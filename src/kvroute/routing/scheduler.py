"""The scheduler: request key + worker states -> decision, and what it learns afterwards.

Pure: no I/O, the clock injected (wall-clock seconds, because epochs and entry times travel between
router instances).  ``decide`` only reads the ``WorkerState``s; the owner of those objects keeps
their load figures current.  Not thread-safe: one scheduler per event loop.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import xxhash

from kvroute.routing.candidates import Candidate, Context
from kvroute.routing.config import ModelPolicy, RoutingConfig
from kvroute.routing.decision import Decision, DecisionKind
from kvroute.routing.hashing import block_hashes, stored_positions
from kvroute.routing.key import EST_BYTES_PER_TOKEN, RoutingKey
from kvroute.routing.learning import WorkerLearning
from kvroute.routing.pickers import PickerState
from kvroute.routing.policies import Policy, policy_named
from kvroute.routing.prefix_index import PrefixIndex
from kvroute.routing.sessions import SessionTable
from kvroute.routing.sync_record import PrefixRecord, SessionRecord, SyncRecord, WorkerEpochRecord
from kvroute.routing.worker import WorkerState


def session_hash(key: RoutingKey) -> int | None:
    """The 64-bit key of a request's session in the table (None without a session id)."""
    if key.session_id is None:
        return None
    return xxhash.xxh3_64_intdigest(key.cache_scope + b"\x00session\x00" + key.session_id.encode())


class Scheduler:
    """Routing decisions for one router instance.

    ``decide`` picks a worker; ``commit`` records what the decision implies once the request is
    really sent (prefix ownership, session binding) and returns the facts to publish to other
    instances; ``apply_remote`` applies such a fact.  The ``on_*`` hooks keep the learned figures
    and the index in step with the fleet.
    """

    def __init__(self, config: RoutingConfig | None = None, clock: Callable[[], float] = time.time) -> None:
        self.config = config or RoutingConfig()
        self._clock = clock
        self._index = PrefixIndex(self.config.index_max_blocks, self.config.index_max_age_s)
        self._sessions = SessionTable(self.config.session_ttl_s, self.config.session_max)
        self._picker = PickerState(rng=random.Random(self.config.seed))
        self._learning: dict[str, WorkerLearning] = {}
        self._counts: dict[str, dict[str, int]] = {}
        # Each worker's own prefill rate (WorkerState.prefill_s_per_token) as last seen by decide,
        # so that commit and apply_remote, which see no WorkerState, drain backlogs at that rate.
        self._known_rates: dict[str, float | None] = {}
        self._memo_key: RoutingKey | None = None
        self._memo_hashes: tuple[int, ...] = ()
        self._hash_bytes = self.config.max_hash_bytes if self.config.hash_beyond_window else (
            self.config.window_blocks * self.config.block_bytes)

    # --- deciding ------------------------------------------------------------------------------

    def hashes(self, key: RoutingKey) -> tuple[int, ...]:
        """The request's cumulative block hashes (memoised for the last key: retries re-decide)."""
        if key is not self._memo_key:
            self._memo_hashes = block_hashes(key.cache_scope, key.prefix, self.config.block_bytes,
                                             self._hash_bytes)
            self._memo_key = key
        return self._memo_hashes

    def decide(self, key: RoutingKey, workers: Sequence[WorkerState],
               exclude: Collection[str] = ()) -> Decision:
        """Where to send ``key`` among ``workers`` (``WorkerState``s), skipping ``exclude`` ids."""
        now = self._clock()
        cfg = self.config.policy_for(key.model)
        policy = policy_named(cfg.policy)
        hashes = self.hashes(key)
        ctx = Context(key, cfg, now, len(hashes), self.config.block_bytes / EST_BYTES_PER_TOKEN)
        if policy.uses_session and cfg.sticky and key.session_id is not None:
            ctx.session = session_hash(key)
            assert ctx.session is not None
            ctx.bound = self._sessions.get(ctx.session, now)
        cands = [Candidate.of(w) for w in workers if w.id not in exclude]
        if policy.uses_session:
            active = self._sessions.active(now, cfg.session_active_s)
            for c in cands:
                c.active_sessions = active.get(c.worker.id, 0)
        for stage in policy.filters:
            kept = stage(ctx, cands)
            if not kept:
                return self._nobody(key, policy, hashes, ctx, stage.__name__, len(workers))
            cands = kept
        self._match(hashes, cands, now)
        if policy.uses_learning:
            self._annotate(cands, cfg, now)
        scores = [scorer(ctx, cands) for scorer in policy.scorers]
        keys = list(zip(*scores, strict=True)) if scores else [()] * len(cands)
        i = policy.picker(self._picker, keys)
        kind, reason = policy.explain(policy.name, ctx, cands, i)
        chosen = cands[i]
        self._known_rates[chosen.worker.id] = chosen.worker.prefill_s_per_token
        return Decision(
            worker_id=chosen.worker.id, kind=kind, policy=policy.name, reason=reason,
            matched_blocks=chosen.matched_blocks, total_blocks=len(hashes), est_tokens=key.est_prompt_tokens,
            loads=tuple((c.worker.id, c.load) for c in cands), block_hashes=hashes,
            session_id=key.session_id, worker_epoch=chosen.worker.epoch, session=ctx.session,
            prefill_tokens=max(0, round(key.est_prompt_tokens - ctx.expected_held(chosen))),
        )

    def _match(self, hashes: tuple[int, ...], cands: list[Candidate], now: float) -> None:
        slots = self._index.slots_of([(c.worker.id, c.worker.epoch) for c in cands])
        for slot, depth in self._index.match(hashes, slots, now).items():
            cands[slots[slot]].matched_blocks = depth

    def _annotate(self, cands: list[Candidate], cfg: ModelPolicy, now: float) -> None:
        learning = self._learning
        for c in cands:
            learned = learning.get(c.worker.id)
            known = c.worker.prefill_s_per_token
            if learned is None:
                c.s_per_token = known or cfg.prefill_s_per_token
                continue
            c.s_per_token = known or (learned.rate if cfg.learn_rate else None) or cfg.prefill_s_per_token
            c.realisation = learned.realised
            c.backlog_tokens = learned.backlog(now, known or self._drain_rate(learned, cfg), c.load)

    def _nobody(self, key: RoutingKey, policy: Policy, hashes: tuple[int, ...], ctx: Context,
                stage: str, offered: int) -> Decision:
        reason = f"[{policy.name.upper()}] no worker: none of {offered} passed {stage} (model {key.model!r})"
        return Decision(worker_id=None, kind=DecisionKind.NO_WORKER, policy=policy.name, reason=reason,
                        total_blocks=len(hashes), est_tokens=key.est_prompt_tokens, block_hashes=hashes,
                        session_id=key.session_id, session=ctx.session)

    # --- after the decision ----------------------------------------------------------------------

    def commit(self, key: RoutingKey, decision: Decision) -> list[SyncRecord]:
        """Record what sending ``key`` as ``decision`` says: the chosen worker now holds the prefix
        blocks and the session lives there.  Returns the facts to publish to other instances."""
        worker = decision.worker_id
        if worker is None:
            return []
        now = self._clock()
        cfg = self.config.policy_for(key.model)
        records: list[SyncRecord] = []
        counts = self._counts.setdefault(worker, {})
        counts[decision.kind.value] = counts.get(decision.kind.value, 0) + 1
        if key.cacheable and decision.block_hashes:
            n = len(decision.block_hashes)
            hs = decision.block_hashes
            stored = tuple(hs[i] for i in stored_positions(
                n, self.config.window_blocks, self.config.anchors_per_octave, self.config.tail_blocks))
            if self._index.record(stored, worker, decision.worker_epoch, now):
                records.append(PrefixRecord(worker, decision.worker_epoch, now, stored,
                                            decision.prefill_tokens))
        if key.cacheable:
            learned = self._learn(worker)
            est = key.est_prompt_tokens
            spt = self._rate(worker, learned, cfg)
            # The index's own prediction (not the discounted one): realisation compares the engine's
            # report with it, and must not feed back on itself.
            indexed = decision.matched_blocks * self.config.block_bytes / EST_BYTES_PER_TOKEN
            hit = min(est, indexed) / est if est else None
            learned.on_sent(now, spt, decision.prefill_tokens, hit)
        if decision.session is not None:
            self._sessions.bind(decision.session, worker, now)
            records.append(SessionRecord(decision.session, worker, now))
        return records

    def apply_remote(self, record: SyncRecord) -> None:
        """Apply a fact published by another router instance."""
        if isinstance(record, PrefixRecord):
            if self._index.record(record.hashes, record.worker_id, record.epoch, record.time) and \
                    record.prefill_tokens:
                learned = self._learn(record.worker_id)
                cfg = self.config.default
                spt = self._rate(record.worker_id, learned, cfg)
                learned.add_backlog(self._clock(), spt, record.prefill_tokens)
        elif isinstance(record, SessionRecord):
            self._sessions.bind(record.session, record.worker_id, record.time)
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
            learned.backlog_tokens = 0.0
        return [WorkerEpochRecord(worker_id, epoch)]

    def on_worker_removed(self, worker_id: str) -> None:
        """A worker left the fleet: forget its prefixes, sessions and learned figures."""
        self._index.remove_worker(worker_id)
        self._sessions.drop_worker(worker_id)
        self._learning.pop(worker_id, None)
        self._counts.pop(worker_id, None)
        self._known_rates.pop(worker_id, None)

    def on_finished(self, worker_id: str, *, prompt_tokens: int | None = None,
                    cached_tokens: int | None = None, ttft_s: float | None = None) -> None:
        """A request on ``worker_id`` finished; learn from what the engine reported (any may be None)."""
        self._learn(worker_id).on_finished(prompt_tokens, cached_tokens, ttft_s)

    def _rate(self, worker_id: str, learned: WorkerLearning, cfg: ModelPolicy) -> float:
        """Seconds per token at which ``worker_id``'s backlog drains: the worker's own figure, else
        the learned one (as ``_annotate`` reads it, so the backlog agrees)."""
        return self._known_rates.get(worker_id) or self._drain_rate(learned, cfg)

    @staticmethod
    def _drain_rate(learned: WorkerLearning, cfg: ModelPolicy) -> float:
        """The TTFT-based rate when enabled, else the configured one, but never slower than the
        engine's fastest prefills (``learn_prefill_speed``).  Only the backlog drains at it: costs
        keep one scale for every worker, since a per-worker figure would tilt every comparison."""
        rate = (learned.rate if cfg.learn_rate else None) or cfg.prefill_s_per_token
        fastest = learned.fastest if cfg.learn_prefill_speed else None
        return fastest if fastest is not None and fastest < rate else rate

    def _learn(self, worker_id: str) -> WorkerLearning:
        learned = self._learning.get(worker_id)
        if learned is None:
            cfg = self.config.default
            learned = self._learning[worker_id] = WorkerLearning(
                cfg.learn_alpha, cfg.learn_min_samples, cfg.learn_floor_min_tokens, cfg.learn_floor_pull,
                cfg.learn_floor_relax)
        return learned

    # --- introspection -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Index and session-table sizes, and per worker: decisions by kind, bound sessions and
        learned figures (for metrics and the dashboard)."""
        cfg = self.config.default
        now = self._clock()
        workers: dict[str, dict[str, Any]] = {}
        for wid in sorted(set(self._counts) | set(self._learning)):
            learned = self._learning.get(wid)
            entry: dict[str, Any] = {kind.value: self._counts.get(wid, {}).get(kind.value, 0)
                                     for kind in DecisionKind if kind is not DecisionKind.NO_WORKER}
            entry["sessions"] = self._sessions.bound(wid)
            if learned is not None:
                spt = self._rate(wid, learned, cfg)
                entry["prefill_s_per_token"] = spt
                entry["learned_s_per_token"] = learned.rate
                entry["fastest_s_per_token"] = learned.fastest
                entry["cache_realisation"] = learned.realised
                entry["backlog_tokens"] = round(learned.backlog(now, spt))
            workers[wid] = entry
        return {
            "index_blocks": len(self._index),
            "index_max_blocks": self._index.max_blocks,
            "sessions": len(self._sessions),
            "session_max": self._sessions.max_entries,
            "workers": workers,
        }
