"""The flat prefix index: block hash -> the workers that own it, bounded in size and age.

A worker's longest match is the deepest hash of the request it owns: one dict lookup per block, no
tree.  Ownership is stamped per (worker, epoch): each registration epoch of a worker gets its own
small integer *slot*, so a worker that restarted (new epoch) matches nothing it owned before, and
its stale entries simply age out.  Entries are kept in least-recently-recorded order; the oldest
go first once ``max_blocks`` is reached, and owners older than ``max_age_s`` never match.

Memory: one entry is an ``OrderedDict`` key plus one packed int per owner (``time << 20 | slot``);
a block owned by several workers holds a ``dict`` slot -> time instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

_SLOT_BITS = 20
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_MAX_SLOTS = 1 << _SLOT_BITS


@dataclass(slots=True)
class _Registration:
    worker_id: str
    epoch: float
    slot: int


class PrefixIndex:
    """Which workers own which prefix blocks.

    Times are whole seconds of the caller's clock (wall clock: entries travel between router
    instances).  The index never reads a clock itself.
    """

    def __init__(self, max_blocks: int = 200_000, max_age_s: float = 5400.0) -> None:
        self.max_blocks = max_blocks
        self.max_age_s = max_age_s
        self._entries: OrderedDict[int, int | dict[int, int]] = OrderedDict()
        self._current: dict[str, _Registration] = {}
        self._live: dict[int, str] = {}  # slot -> worker id, for current registrations only
        self._next_slot = 0

    def __len__(self) -> int:
        return len(self._entries)

    # --- registrations -------------------------------------------------------------------------

    def slots_of(self, workers: Sequence[tuple[str, float]]) -> dict[int, int]:
        """``{slot: position}`` for the (worker id, epoch) pairs that own anything at that epoch."""
        current = self._current
        out: dict[int, int] = {}
        for i, (wid, epoch) in enumerate(workers):
            reg = current.get(wid)
            if reg is not None and reg.epoch == epoch:
                out[reg.slot] = i
        return out

    def register(self, worker_id: str, epoch: float) -> int | None:
        """Make ``epoch`` the worker's current one (an older epoch than known is refused: None)."""
        reg = self._current.get(worker_id)
        if reg is not None:
            if reg.epoch == epoch:
                return reg.slot
            if epoch < reg.epoch:
                return None
            del self._live[reg.slot]
        # Slot numbers wrap after a million registrations, skipping live ones: entries naming a
        # reused slot are by then far past the age bound or evicted by the size bound.
        slot = self._next_slot
        while slot in self._live:
            slot = (slot + 1) % _MAX_SLOTS
        self._next_slot = (slot + 1) % _MAX_SLOTS
        self._current[worker_id] = _Registration(worker_id, epoch, slot)
        self._live[slot] = worker_id
        return slot

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker: nothing it owned matches any more (entries age out lazily)."""
        reg = self._current.pop(worker_id, None)
        if reg is not None:
            del self._live[reg.slot]

    def epoch_of(self, worker_id: str) -> float | None:
        """The newest epoch known for ``worker_id``."""
        reg = self._current.get(worker_id)
        return reg.epoch if reg is not None else None

    # --- recording -----------------------------------------------------------------------------

    def record(self, hashes: Iterable[int], worker_id: str, epoch: float, now: float) -> bool:
        """Record that ``worker_id`` (at ``epoch``) owns ``hashes`` as of ``now``.

        Returns False, recording nothing, when ``epoch`` is older than the worker's known epoch.
        """
        slot = self.register(worker_id, epoch)
        if slot is None:
            return False
        t = int(now)
        packed = (t << _SLOT_BITS) | slot
        # Every new entry shares this one int object; a compiled build would box ``packed`` anew
        # for each (+32 B a block, docs/benchmarks.md).
        fresh: int | dict[int, int] = packed
        entries = self._entries
        for h in hashes:
            old = entries.get(h)
            if old is None:
                entries[h] = fresh
                continue
            entries.move_to_end(h)
            if isinstance(old, int):
                old_slot = old & _SLOT_MASK
                if old_slot == slot:
                    entries[h] = max(old, packed)  # a late remote record must not age an entry
                elif old_slot not in self._live:
                    entries[h] = packed
                else:
                    entries[h] = {old_slot: old >> _SLOT_BITS, slot: t}
            else:
                old[slot] = max(old.get(slot, t), t)
                if len(old) > len(self._live):
                    for dead in [s for s in old if s not in self._live]:
                        del old[dead]
        self._trim(now)
        return True

    def _trim(self, now: float) -> None:
        """Drop the oldest entries beyond the size bound, and leading entries past the age bound."""
        entries = self._entries
        while len(entries) > self.max_blocks:
            entries.popitem(last=False)
        cutoff = int(now - self.max_age_s)
        while entries:
            oldest = next(iter(entries.values()))
            newest = oldest >> _SLOT_BITS if isinstance(oldest, int) else max(oldest.values())
            if newest >= cutoff:
                break
            entries.popitem(last=False)

    # --- lookup --------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], slots: Mapping[int, int], now: float,
              since: Mapping[int, int] | None = None, stamps: dict[int, int] | None = None) -> dict[int, int]:
        """Deepest match per wanted slot: ``{slot: matched_blocks}`` for slots ``slots`` names.

        ``slots`` maps slot -> anything (the caller's candidate index); only those slots are looked
        for, and the walk from the deepest block stops once all of them are found.  ``since`` gives
        some slots a later cutoff than the age bound: the first whole second whose entries they
        still hold (routing/cache_fill.py).  ``stamps``, when given, receives each found slot's
        stamp at its deepest block: the last second it served the whole match.
        """
        found: dict[int, int] = {}
        if not slots or not hashes:
            return found
        want = len(slots)
        cutoff = int(now - self.max_age_s)
        get = self._entries.get
        depth = len(hashes)
        # One pass from the deepest block, counting down (measured faster than indexing).
        for h in reversed(hashes):
            entry = get(h)
            if entry is not None:
                if isinstance(entry, int):
                    slot = entry & _SLOT_MASK
                    t = entry >> _SLOT_BITS
                    if slot in slots and slot not in found and t >= cutoff and (
                            not since or t >= since.get(slot, cutoff)):
                        found[slot] = depth
                        if stamps is not None:
                            stamps[slot] = t
                        if len(found) == want:
                            break
                else:
                    for slot, t in entry.items():
                        if slot in slots and slot not in found and t >= cutoff and (
                                not since or t >= since.get(slot, cutoff)):
                            found[slot] = depth
                            if stamps is not None:
                                stamps[slot] = t
                    if len(found) == want:
                        break
            depth -= 1
        return found

    def depths(self, hashes: Sequence[int], now: float) -> dict[int, int]:
        """Deepest match of every slot owning any of ``hashes``: ``{slot: matched_blocks}``, what
        ``match`` would say of each (one walk, for pruning a large fleet: the holders of a prompt
        and their matches at once)."""
        found: dict[int, int] = {}
        cutoff = int(now - self.max_age_s)
        get = self._entries.get
        depth = len(hashes)
        for h in reversed(hashes):
            entry = get(h)
            if entry is None:
                pass
            elif isinstance(entry, int):
                slot = entry & _SLOT_MASK
                if slot not in found and entry >> _SLOT_BITS >= cutoff:
                    found[slot] = depth
            elif len(entry) > 8:  # a head shared by many workers, most of them found deeper already
                for slot in entry.keys() - found.keys():
                    if entry[slot] >= cutoff:
                        found[slot] = depth
            else:
                for slot, t in entry.items():
                    if t >= cutoff and slot not in found:
                        found[slot] = depth
            depth -= 1
        return found

    def named(self, depths: Mapping[int, int]) -> dict[str, int]:
        """``depths`` (from ``depths``) by worker id, for the slots of current registrations
        (whatever the epoch a caller knows them by): who might match, and how deep."""
        live = self._live
        return {live[slot]: d for slot, d in depths.items() if slot in live}

    def owners(self, h: int, now: float) -> dict[str, float]:
        """Live owners of one block hash and when they recorded it (for tests and debugging)."""
        entry = self._entries.get(h)
        if entry is None:
            return {}
        stamps = {entry & _SLOT_MASK: entry >> _SLOT_BITS} if isinstance(entry, int) else dict(entry)
        cutoff = int(now - self.max_age_s)
        return {self._live[s]: float(t) for s, t in stamps.items() if s in self._live and t >= cutoff}
