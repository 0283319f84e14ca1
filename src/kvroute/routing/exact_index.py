"""The token-exact cache index: what each replica really holds, from its engine's KV-cache events.

An engine that publishes KV events (vLLM's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``) tells which blocks of token ids it holds.  The engine's own block hash is
not reproducible (its algorithm and seed are the engine's), so each stored block is re-hashed with
the router's own chain (``routing/hashing.py``, ``token_block_hashes``) from the event's token ids,
and the engine's hash is kept only as the key to apply a later removal ("dual key", as llm-d).

A worker has one event *source* per data-parallel rank (vLLM's ``--data-parallel-size``: one API
server, several engines, each its own cache).  The router picks the rank too (vLLM's header
``X-data-parallel-rank``), so a worker's match is the best of its ranks' matches, and
``pick_rank`` chooses the rank a request is sent to.  Right after routing, the chosen worker (the
chosen rank, where one was picked) gets *speculative* entries for the request's blocks (the
engine's events arrive only once it has computed them), dropped after ``speculative_ttl_s``
unless the events confirm them.

What a request will find is not quite what a worker holds when it is routed: before the engine
schedules it, the prompts sent there earlier and not computed yet allocate blocks, each evicting the
least recently used free block.  So the index also keeps, per source, the order the engine frees
blocks in (stored; let go when the last of this router's requests using them ends, an answer first,
then its prompt tail first, as vLLM frees a sequence), which blocks this router's requests use
(``speculate`` to ``released``) and which prompts are not answered yet, and ``match`` with the
cache's ``room`` ends a match at the first block predicted evicted.

Mode per worker: ``exact`` while each of its sources is synchronised (a replay answered, or events
arriving) and no events are overdue (``expect``: a request that adds blocks got its first token,
and nothing arrived within ``stale_s``); else ``approximate`` — the caller falls back to the
approximate prefix index, which keeps recording beside this one.  A lost stretch of events
(a sequence gap that replay could not fill, an engine restart) clears the source: it then knows
less than the engine holds, never more.

Pure: no I/O, times are the caller's clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, count
from typing import Literal

from kvroute.routing.hashing import token_block_hashes

EngineHash = int | bytes | tuple[int, int | bytes]  # (group, hash) where the group is named
Mode = Literal["exact", "approximate"]


@dataclass(slots=True)
class _Source:
    """One engine event stream (a worker's data-parallel rank)."""

    slot: int
    own: dict[EngineHash, int] = field(default_factory=dict)  # engine hash -> own hash
    # Engine hashes stored more than once (vLLM keeps duplicate blocks of one hash): extra copies,
    # so that evicting one copy leaves the block held.
    copies: dict[EngineHash, int] = field(default_factory=dict)
    synced: bool = False
    block_size: int | None = None
    # Speculative entries of requests sent to this rank (own hash -> expiry).
    speculative: dict[int, float] = field(default_factory=dict)
    # The blocks held (own hashes), least recently used first: stored, or let go by the last of
    # this router's requests using them, as the engine's free list orders them for eviction.
    recency: OrderedDict[int, None] = field(default_factory=OrderedDict)
    # Own hash -> this router's requests in flight on the rank using the block (not evictable).
    busy: dict[int, int] = field(default_factory=dict)
    # Own hash -> the block stored next in its chain, and the blocks stored continuing a block in
    # use (a request's answer as it is generated: in use by that request until it ends).
    after: dict[int, int] = field(default_factory=dict)
    trailing: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Lengths:
    """One request in flight: its prompt and answer lengths in tokens (the answer's None where the
    request does not fix it), and whether its first token came."""

    prompt: int
    answer: int | None
    answered: bool = False


@dataclass(slots=True)
class _Worker:
    sources: dict[int, _Source] = field(default_factory=dict)  # rank -> source
    # Speculative entries of requests sent to no rank in particular (the engine's balancer picks
    # one): counted on every rank.
    speculative: dict[int, float] = field(default_factory=dict)  # own hash -> expiry
    expect_since: float | None = None
    last_event: float | None = None
    # The own hashes of this router's requests sent there and not answered yet (how many of each):
    # the blocks of theirs it has not stored yet it allocates, evicting, before a request sent now
    # is scheduled.
    unanswered: dict[tuple[int, ...], int] = field(default_factory=dict)
    # The same requests until they end, with their prompt and answer lengths in tokens (the answer's
    # None where the request does not fix it), and how many of them have no fixed answer: while any
    # has, the order they end in cannot be told.
    lengths: dict[tuple[int, ...], list[_Lengths]] = field(default_factory=dict)
    unknown: int = 0


@dataclass(frozen=True, slots=True)
class Applied:
    """What applying one batch of events did: blocks added and removed, blocks that could not be
    placed (their parent was unknown: events were lost before), whether a clear happened."""

    stored: int = 0
    removed: int = 0
    orphans: int = 0
    cleared: bool = False


class ExactIndex:
    """Own block hash -> which sources (worker ranks) hold it, fed by the engines' events."""

    def __init__(self, speculative_ttl_s: float = 2.0, stale_s: float = 5.0,
                 max_blocks: int = 4_000_000) -> None:
        self.speculative_ttl_s = speculative_ttl_s
        self.stale_s = stale_s
        self.max_blocks = max_blocks
        self._held: dict[int, dict[int, int]] = {}  # own hash -> {source slot: refcount}
        self._workers: dict[str, _Worker] = {}
        self._slot_owner: dict[int, str] = {}
        self._next_slot = 0
        self._blocks = 0

    def __len__(self) -> int:
        return self._blocks

    # --- sources ---------------------------------------------------------------------------------

    def _source(self, worker_id: str, rank: int) -> _Source:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker()
        src = w.sources.get(rank)
        if src is None:
            src = w.sources[rank] = _Source(self._next_slot)
            self._slot_owner[self._next_slot] = worker_id
            self._next_slot += 1
        return src

    def attach(self, worker_id: str, ranks: Iterable[int]) -> None:
        """``worker_id`` publishes events on ``ranks`` (not synchronised until ``synced``)."""
        for rank in ranks:
            self._source(worker_id, rank)

    def detach(self, worker_id: str) -> None:
        """Forget ``worker_id`` entirely (it left the fleet, or its events were turned off)."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        for src in w.sources.values():
            self._drop(src)
            del self._slot_owner[src.slot]

    def attached(self) -> bool:
        """Whether any worker has event sources (``attach``): without, no worker's state is exact."""
        return bool(self._workers)

    def publishes(self, worker_id: str) -> bool:
        """Whether ``worker_id`` has event sources (synchronised or not)."""
        w = self._workers.get(worker_id)
        return w is not None and bool(w.sources)

    def synced(self, worker_id: str, rank: int, now: float) -> None:
        """The rank's stream is live: its replay was answered or its events arrive in sequence."""
        src = self._source(worker_id, rank)
        src.synced = True
        self._workers[worker_id].last_event = now

    def lost(self, worker_id: str, rank: int) -> None:
        """The rank's stream is down or its events were lost beyond replay: it is cleared (it would
        otherwise claim blocks the engine may have evicted meanwhile) and not synchronised."""
        src = self._source(worker_id, rank)
        self._drop(src)
        src.synced = False

    def _drop(self, src: _Source) -> None:
        held = self._held
        for own in src.own.values():
            self._unhold(held, own, src)
        src.own.clear()
        src.copies.clear()
        src.recency.clear()
        src.after.clear()
        src.trailing.clear()

    def _unhold(self, held: dict[int, dict[int, int]], own: int, src: _Source) -> None:
        owners = held.get(own)
        if owners is None:
            return
        slot = src.slot
        n = owners.get(slot, 0) - 1
        if n > 0:
            owners[slot] = n
            return
        if slot in owners:
            del owners[slot]
            self._blocks -= 1
            src.recency.pop(own, None)
            src.after.pop(own, None)
            src.trailing.discard(own)
        if not owners:
            del held[own]

    # --- events ----------------------------------------------------------------------------------

    def stored(self, worker_id: str, rank: int, engine_hashes: Sequence[EngineHash],
               parent: EngineHash | None, token_ids: Sequence[int], block_size: int,
               extras: Sequence[bytes | None] | None, now: float) -> Applied:
        """The rank stored ``engine_hashes`` (consecutive full blocks of ``token_ids``, the first
        one following ``parent``).  ``extras`` holds each block's extra keys (LoRA, multimodal
        hashes, cache salt) encoded, or None: a block with extra keys never matches a plain prompt.
        Blocks whose parent is unknown cannot be re-hashed (events were lost): counted, skipped."""
        src = self._source(worker_id, rank)
        self._heard(worker_id, now)
        if block_size <= 0 or len(token_ids) < block_size * len(engine_hashes):
            return Applied(orphans=len(engine_hashes))
        src.block_size = block_size
        prev: int | None = None
        if parent is not None:
            prev = src.own.get(parent)
            if prev is None:
                return Applied(orphans=len(engine_hashes))
        owns = token_block_hashes(token_ids[:block_size * len(engine_hashes)], block_size, prev, extras)
        held, slot, added, recency = self._held, src.slot, 0, src.recency
        after, trailing, busy = src.after, src.trailing, src.busy
        for engine_hash, own in zip(engine_hashes, owns, strict=True):
            old = src.own.get(engine_hash)
            if old == own:
                src.copies[engine_hash] = src.copies.get(engine_hash, 0) + 1
                prev = own
                continue
            if old is not None:
                self._unhold(held, old, src)
            src.own[engine_hash] = own
            recency[own] = None
            recency.move_to_end(own)
            if prev is not None:
                after[prev] = own
                if (prev in busy or prev in trailing) and own not in busy:
                    trailing.add(own)
            prev = own
            owners = held.get(own)
            if owners is None:
                owners = held[own] = {}
            if slot in owners:
                owners[slot] += 1
            else:
                owners[slot] = 1
                self._blocks += 1
                added += 1
        if self._blocks > self.max_blocks:
            # Removals went missing (the engine cannot hold this many): the picture is wrong.
            self._drop(src)
            return Applied(stored=added, cleared=True)
        return Applied(stored=added)

    def removed(self, worker_id: str, rank: int, engine_hashes: Sequence[EngineHash], now: float) -> Applied:
        """The rank evicted ``engine_hashes`` (unknown ones are ignored: stored before we listened)."""
        src = self._source(worker_id, rank)
        self._heard(worker_id, now)
        held, n = self._held, 0
        copies = src.copies
        for engine_hash in engine_hashes:
            extra = copies.get(engine_hash)
            if extra:
                if extra > 1:
                    copies[engine_hash] = extra - 1
                else:
                    del copies[engine_hash]
                continue
            own = src.own.pop(engine_hash, None)
            if own is not None:
                self._unhold(held, own, src)
                n += 1
        return Applied(removed=n)

    def cleared(self, worker_id: str, rank: int, now: float) -> Applied:
        """The rank's whole prefix cache was cleared (reset, or the engine restarted)."""
        src = self._source(worker_id, rank)
        self._heard(worker_id, now)
        n = len(src.own)
        self._drop(src)
        return Applied(removed=n, cleared=True)

    def _heard(self, worker_id: str, now: float) -> None:
        w = self._workers[worker_id]
        w.last_event = now
        w.expect_since = None

    # --- what routing reads and writes -------------------------------------------------------------

    def expect(self, worker_id: str, now: float) -> None:
        """Events are due from ``worker_id`` (a request adding blocks there got its first token):
        if none arrives within ``stale_s`` the worker is approximate until one does."""
        w = self._workers.get(worker_id)
        if w is not None and w.expect_since is None:
            w.expect_since = now

    def mode(self, worker_id: str, now: float) -> Mode:
        """``exact`` while every source of the worker is synchronised and no events are overdue."""
        w = self._workers.get(worker_id)
        if w is None or not w.sources or not all(s.synced for s in w.sources.values()):
            return "approximate"
        if w.expect_since is not None and now - w.expect_since > self.stale_s:
            return "approximate"
        return "exact"

    def block_size(self, worker_id: str) -> int | None:
        """The engine's block size in tokens, as its events said (None before its first store)."""
        w = self._workers.get(worker_id)
        if w is None:
            return None
        for src in w.sources.values():
            if src.block_size is not None:
                return src.block_size
        return None

    def readable(self, worker_id: str, now: float, block_size: int | None = None) -> bool:
        """Whether ``worker_id``'s match on a request's token hashes of ``block_size``-token blocks
        is read here rather than from the approximate index: its mode is ``exact`` and its engine's
        block size is ``block_size`` or not told yet (it stored nothing, so it truly holds nothing).
        With ``block_size`` None: exact, and its block size told (a worker whose tokenization a
        request's token hashes can be computed for)."""
        w = self._workers.get(worker_id)
        if w is None or not w.sources:
            return False
        told: int | None = None
        for src in w.sources.values():
            if not src.synced:
                return False
            if told is None:
                told = src.block_size
        if w.expect_since is not None and now - w.expect_since > self.stale_s:
            return False
        if block_size is None:
            return told is not None
        return told is None or told == block_size

    def speculate(self, worker_id: str, hashes: Sequence[int], now: float, wait_s: float = 0.0,
                  rank: int | None = None, prompt_tokens: int = 0, answer_tokens: int | None = None) -> None:
        """``worker_id`` (its data-parallel ``rank``, or whichever its engine picks when None) was
        just sent a prompt of these own block hashes, predicted to be computed in ``wait_s``: count
        them as held until the engine's events confirm them, for ``wait_s`` +
        ``speculative_ttl_s`` at most.  Until ``released`` they are in use (not evictable), and
        until ``answered`` (or ``released``) those its engine has not stored are to be allocated.
        ``prompt_tokens`` and ``answer_tokens`` (None: the request does not fix its answer's
        length) tell when it will end, and so when a request queued behind it finds room."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        key = tuple(hashes)
        w.unanswered[key] = w.unanswered.get(key, 0) + 1
        if answer_tokens is None or prompt_tokens <= 0:
            answer_tokens = None
            w.unknown += 1
        w.lengths.setdefault(key, []).append(_Lengths(prompt_tokens, answer_tokens))
        src = w.sources.get(rank) if rank is not None else None
        spec = src.speculative if src is not None else w.speculative
        if spec:
            for h in [h for h, until in spec.items() if until <= now]:
                del spec[h]
        until = now + max(0.0, wait_s) + self.speculative_ttl_s
        for h in hashes:
            spec[h] = until
        for src in self._sources_of(w, rank):
            busy, recency = src.busy, src.recency
            for h in hashes:
                busy[h] = busy.get(h, 0) + 1
                # A block in use leaves the engine's free list: walks for what it evicts skip it.
                if h in recency:
                    recency.move_to_end(h)

    def answered(self, worker_id: str, hashes: Sequence[int]) -> None:
        """The request of ``hashes`` ``speculate`` was told of got its first token: its prompt is
        computed."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        key = tuple(hashes)
        n = w.unanswered.get(key, 0)
        if n > 1:
            w.unanswered[key] = n - 1
        else:
            w.unanswered.pop(key, None)
        for entry in w.lengths.get(key, ()):
            if not entry.answered:
                entry.answered = True
                break

    def released(self, worker_id: str, hashes: Sequence[int], rank: int | None = None,
                 answered: bool = True) -> None:
        """The request ``speculate`` was told of ended (``answered``: after its first token): its
        blocks, and the answer's blocks stored after them, are no longer in use by it.  Those no
        other request in flight uses become evictable, after every block let go before, the last
        block first (an engine frees a sequence's blocks tail first: its head outlives its tail)."""
        w = self._workers.get(worker_id)
        if w is None:
            return
        if not answered:
            self.answered(worker_id, hashes)
        key = tuple(hashes)
        entries = w.lengths.get(key)
        if entries:
            if entries.pop().answer is None:
                w.unknown -= 1
            if not entries:
                del w.lengths[key]
        for src in self._sources_of(w, rank):
            busy, recency, after, trailing = src.busy, src.recency, src.after, src.trailing
            tail: list[int] = []
            nxt = after.get(hashes[-1]) if hashes else None
            while nxt is not None and nxt in trailing:
                tail.append(nxt)
                nxt = after.get(nxt)
            for h in reversed(tail):
                trailing.discard(h)
                recency.move_to_end(h)
            for h in reversed(hashes):
                trailing.discard(h)
                n = busy.get(h, 0) - 1
                if n > 0:
                    busy[h] = n
                    continue
                busy.pop(h, None)
                if h in recency:
                    recency.move_to_end(h)

    @staticmethod
    def _sources_of(w: _Worker, rank: int | None) -> list[_Source]:
        """The sources a request sent to ``rank`` (None: the engine's balancer picks) may use."""
        if rank is None:
            return list(w.sources.values())
        src = w.sources.get(rank)
        return [src] if src is not None else []

    def _evicted(self, w: _Worker, src: _Source, room: int, grown: int = 0) -> set[int]:
        """The held blocks of ``src`` its engine evicts for the prompts this router sent there and it
        has not computed yet (the blocks of each it has not stored: a prompt is computed in order,
        so they are its last ones) and ``grown`` blocks more, where ``room`` blocks of its cache
        are not partly filled by a request: those beyond the blocks no cached content occupies,
        from the least recently used block no request of this router has in flight."""
        if not w.unanswered and not grown:
            return set()
        held, slot = self._held, src.slot
        allocate = 0
        for hashes, n in w.unanswered.items():
            left = 0
            for h in reversed(hashes):
                owners = held.get(h)
                if owners is not None and slot in owners:
                    break
                left += 1
            allocate += n * left
        k = allocate + grown - max(0, room - len(src.own))
        out: set[int] = set()
        if k <= 0:
            return out
        busy, trailing = src.busy, src.trailing
        for h in src.recency:
            if h not in busy and h not in trailing:
                out.add(h)
                if len(out) >= k:
                    break
        return out

    def _grown(self, w: _Worker, src: _Source, hashes: Sequence[int], depth: int, room: int) -> int:
        """Blocks the answers running on ``src`` allocate while a request of ``hashes``, finding
        its first ``depth`` blocks there, waits at the head of its engine's queue for room.

        An engine admits a request when the free blocks, less those of its own cached prefix (taken
        off the free list by sharing them), hold its uncached blocks; short of that it waits while
        every running sequence grows a block each ``block_size`` tokens of its answer, from the
        head of the free list, until enough of them end.  Each of this router's requests there
        ends when its answer has its fixed length: its tokens done are its prompt, and where
        answered the blocks of its answer the events told (half a block more); at its end it frees
        its blocks no other request uses.  Where any request there has no fixed answer length, the
        wait cannot be told: none is counted."""
        bs = src.block_size
        if w.unknown or not w.lengths or bs is None:
            return 0
        busy, trailing, after = src.busy, src.trailing, src.after
        free = room - len(busy) - len(trailing) - depth + _leading(busy, hashes, depth, 0)
        short = len(hashes) - depth + 1 - free
        if short <= 0:
            return 0
        keys: list[tuple[tuple[int, ...], int]] = []  # (own hashes, requests of them)
        ends: list[tuple[int, int, int, int]] = []  # (tokens left, tokens done, tokens in all, key)
        for key, entries in w.lengths.items():
            if not key or key[-1] not in busy:
                continue  # sent to another rank
            told = -1  # tokens done by its answer's blocks told
            for entry in entries:
                total = entry.prompt + (entry.answer or 0)
                done = entry.prompt
                if entry.answered:
                    if told < 0:
                        nxt, told = after.get(key[-1]), 0
                        while nxt is not None and nxt in trailing:
                            told += 1
                            nxt = after.get(nxt)
                        told = (len(key) + told) * bs + bs // 2
                    done = min(total, max(done + 1, told))
                ends.append((total - done, done, total, len(keys)))
            keys.append((key, len(entries)))
        if not ends:
            return 0
        ends.sort()
        steps, freed = ends[-1][0], 0
        for left, _, total, i in ends:
            # At its end it frees its blocks no other request in flight uses: those past the
            # blocks others share (a prefix: a block's hash names all the blocks before it).
            key, alone = keys[i]
            freed += -(-total // bs) - _leading(busy, key, len(key), alone)
            if freed >= short:
                steps = left
                break
        return sum(-(-(done + min(steps, left)) // bs) - -(-done // bs) for left, done, _, _ in ends)

    def _depth(self, hashes: Sequence[int], w: _Worker, src: _Source, now: float,
               gone: Collection[int] = ()) -> int:
        """Leading blocks of ``hashes`` the rank ``src`` holds, counting live speculative entries;
        ``gone``: held blocks it is predicted to evict first."""
        held, slot, spec, own_spec = self._held, src.slot, w.speculative, src.speculative
        d = 0
        for h in hashes:
            owners = held.get(h)
            if owners is not None and slot in owners:
                if h in gone:
                    break
                d += 1
                continue
            until = spec.get(h)
            if until is None and own_spec:
                until = own_spec.get(h)
            if until is not None and until > now:
                d += 1
                continue
            break
        return d

    def match(self, hashes: Sequence[int], worker_ids: Collection[str], now: float,
              room: Mapping[str, int] | None = None) -> dict[str, int]:
        """Leading blocks of ``hashes`` each of ``worker_ids`` holds (the best over its ranks: the
        request can be sent to that rank), counting its live speculative entries.  With ``room``
        (per worker, the blocks of its cache no request in flight fills partly): less what its
        engine evicts before a request sent now is scheduled (``_evicted``)."""
        out: dict[str, int] = {}
        full = len(hashes)
        for wid in worker_ids:
            w = self._workers.get(wid)
            best = 0
            if w is not None:
                blocks = room.get(wid) if room is not None else None
                for src in w.sources.values():
                    gone = self._evicted(w, src, blocks) if blocks is not None else ()
                    d = self._depth(hashes, w, src, now, gone)
                    if blocks is not None and d:
                        grown = self._grown(w, src, hashes, d, blocks)
                        if grown:  # more of the same walk: the blocks gone before are gone again
                            gone = self._evicted(w, src, blocks, grown)
                            if not gone.isdisjoint(hashes[:d]):
                                d = next(compress(count(), map(gone.__contains__, hashes)))
                    if d > best:
                        best = d
                        if best == full:
                            break
            out[wid] = best
        return out

    def ranks(self, worker_id: str) -> int:
        """How many data-parallel ranks ``worker_id`` publishes events of."""
        w = self._workers.get(worker_id)
        return len(w.sources) if w is not None else 0

    def rank_figures(self, hashes: Sequence[int], worker_id: str, now: float) -> dict[int, tuple[int, int]]:
        """Per rank of ``worker_id``: the leading blocks of ``hashes`` it holds (as ``match``) and
        the blocks its engine reports holding in all (what ``pick_rank`` compares)."""
        w = self._workers.get(worker_id)
        if w is None:
            return {}
        return {rank: (self._depth(hashes, w, src, now), len(src.own)) for rank, src in w.sources.items()}

    def holders(self, first: int, now: float) -> set[str]:
        """Workers holding the block ``first``, by their events or a live speculative entry: every
        worker whose match of a prompt starting with ``first`` is not empty (for pruning a large
        fleet)."""
        owners = self._held.get(first)
        out = {self._slot_owner[slot] for slot in owners} if owners else set()
        for wid, w in self._workers.items():
            until = w.speculative.get(first)
            if until is not None and until > now:
                out.add(wid)
                continue
            for src in w.sources.values():
                until = src.speculative.get(first)
                if until is not None and until > now:
                    out.add(wid)
                    break
        return out

    def resident_blocks(self, worker_id: str) -> int:
        """Blocks the worker's engine reports holding, over its ranks (its cache's fill)."""
        w = self._workers.get(worker_id)
        return sum(len(src.own) for src in w.sources.values()) if w is not None else 0

    def stats(self, worker_id: str) -> dict[str, int]:
        """Blocks held per rank and live speculative entries, for ``/admin/workers``."""
        w = self._workers.get(worker_id)
        if w is None:
            return {}
        out = {f"rank{rank}_blocks": len(src.own) for rank, src in sorted(w.sources.items())}
        out["speculative"] = len(w.speculative) + sum(len(src.speculative) for src in w.sources.values())
        return out


def _leading(counts: Mapping[int, int], hashes: Sequence[int], end: int, above: int) -> int:
    """How many of the first ``end`` blocks of ``hashes`` have a count over ``above`` in ``counts``:
    a leading run, as a block's own hash names every block before it (whatever uses a block uses
    its prefix), so it is found by bisection."""
    lo, hi = 0, end
    while lo < hi:
        mid = (lo + hi) // 2
        if counts.get(hashes[mid], 0) > above:
            lo = mid + 1
        else:
            hi = mid
    return lo


def pick_rank(figures: Mapping[int, tuple[int, int]], inflight: Mapping[int, int], slack: int) -> int:
    """The data-parallel rank a request goes to, from each rank's (match, resident blocks) as
    ``ExactIndex.rank_figures`` tells them and this router's requests in flight there: among the
    ranks carrying at most ``slack`` more in flight than the freest (the placement's prompt-size
    slack, as between workers: a prefix many requests share must not pile them all on the rank that
    computed it first), the one holding the longest match; ties (no match anywhere, say) to the
    fewest in flight, then to the emptier cache (a new conversation goes where it evicts least),
    then to the lowest rank."""
    least = min(inflight.get(rank, 0) for rank in figures)
    limit = least + slack
    return min((rank for rank in figures if inflight.get(rank, 0) <= limit),
               key=lambda rank: (-figures[rank][0], inflight.get(rank, 0), figures[rank][1], rank))
