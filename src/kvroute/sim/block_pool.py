"""KV block pool like vLLM's: fixed blocks, reference counts, hash index, LRU free list.

Each block holds ``block_size`` tokens.  A block's content is indexed by chained hashes at a finer
granularity, the *match unit* (``prefix_match_unit`` tokens; equal to the block size for dense
models, which makes this exactly vLLM's full-block index).  A block with reference count 0 stays
in the index on the free list until it is reused; the free list is an LRU queue evicted from its
head, and blocks freed together are appended tail-first so a sequence's last blocks go first.

``evictions`` counts blocks whose indexed content was dropped.  Between two equal readings no
indexed unit has left or changed block (``register`` only adds), so a run of cached units found
earlier is still cached, in the same blocks: callers can extend it instead of walking it again.

With an ``events`` list (vLLM's ``enable_kv_cache_events``), each block whose indexed content is
evicted appends one ``Removed`` of its unit hashes there, as vLLM's block pool does per evicted
block; ``register`` says whether it indexed the unit so that the caller can report what was stored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

from kvroute.fleet.kv_event_wire import MEDIUM_GPU, ExternalBlockHash, KvEvent, Removed

# The KV-cache group of the attention blocks in the events (the only group of a dense model).
ATTENTION_GROUP = 0


class BlockPool:
    """``num_blocks`` blocks; allocation, sharing, freeing and the hash index."""

    __slots__ = ("_cached", "_events", "_free", "_hashes", "_refs", "block_size", "evictions", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int, events: list[KvEvent] | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hashes: list[list[int]] = [[] for _ in range(num_blocks)]
        self._cached: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evictions = 0
        self._events = events

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, unit_hash: int) -> int | None:
        """The block holding the unit with this chained hash, if cached."""
        return self._cached.get(unit_hash)

    def match(self, unit_hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest leading run of ``unit_hashes`` that is cached, one per unit."""
        # map/index keep the walk in C: prompts run to thousands of units and a request at the
        # head of the waiting queue is looked up again on every step until it fits.
        blocks = list(map(self._cached.get, unit_hashes))
        if None in blocks:
            del blocks[blocks.index(None):]
        return blocks  # type: ignore[return-value]

    def num_free_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are on the free list (touching them takes them off it)."""
        return list(map(self._refs.__getitem__, blocks)).count(0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Share cached blocks with one more sequence."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free list, evicting their cached content."""
        if n > len(self._free):
            raise RuntimeError(f"allocating {n} blocks with {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            b, _none = self._free.popitem(last=False)
            hashes = self._hashes[b]
            if hashes:
                dropped = [h for h in hashes if self._cached.get(h) == b]
                for h in dropped:
                    del self._cached[h]
                self._hashes[b] = []
                self.evictions += 1
                if self._events is not None and dropped:
                    gone = cast(list[ExternalBlockHash], dropped)
                    self._events.append(Removed(gone, ATTENTION_GROUP, MEDIUM_GPU))
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced blocks join the free list tail-first."""
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    def register(self, block: int, unit_hash: int) -> bool:
        """Index a completed unit of ``block``; a unit already cached elsewhere keeps that block
        (False: nothing new was indexed)."""
        if unit_hash in self._cached:
            return False
        self._cached[unit_hash] = block
        self._hashes[block].append(unit_hash)
        return True

    def reset_index(self) -> None:
        """Forget every indexed unit (vLLM's ``reset_prefix_cache``); blocks and references stay."""
        self._cached.clear()
        self._hashes = [[] for _ in range(self.num_blocks)]
        self.evictions += 1

