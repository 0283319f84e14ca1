"""How full an approximate worker's cache is, and what it has pushed out, from the tokens the
routers had it compute.

Where a worker publishes no KV events the router knows only what it sent there.  The engine's
prefix cache is a pool of ``kv_tokens`` (its KV size) reused least recently used first: every
token it computes (a prompt's uncached part, every token it generates) takes a slot, and once the
pool is full the slot freed longest ago is reused.  So what a worker last served before the last
``kv_tokens`` it computed is most likely gone, whatever the prefix index still lists; and a worker
that has computed ``kv_tokens`` since it registered has a full cache, where a cold prefill evicts
as many cached tokens as it adds.

``CacheFill`` counts, per worker and registration epoch, the tokens the routers had it compute
(the prefill each decision predicted, from this instance and from the prefix records other
instances publish, and the tokens this instance saw it generate), by whole second as the index
stamps its entries.  ``horizon`` is the first second whose entries are still taken as held;
``fill`` is how many tokens the cache holds.  An estimate, and a generous one: traffic that
bypasses the routers is not seen, and the blocks of running requests (not reusable) bring the real
horizon nearer.  Pure: the caller passes the time.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from kvroute.routing.settings import setting


@dataclass(frozen=True, slots=True)
class CacheFillSettings:
    """Whether approximate workers' caches are modelled as full and evicting (module docstring)."""

    approximate_eviction: bool = setting(
        True, "for a request with no client session id, a worker without KV events holds only what "
              "it served within its last KV size of computed tokens (least recently used first), and "
              "its cache is full once it computed that much: auto's evicted_cache_weight applies to "
              "it as to an exact worker")
    approximate_survival: bool = setting(
        True, "with approximate_eviction, auto prices a full worker's match by the share of its pool "
              "not yet computed since it last served that prefix (least recently used first: a copy "
              "a worker serves seldom is likelier gone than the index says)")


@dataclass(slots=True)
class _Count:
    epoch: float
    total: float = 0.0
    # Whole seconds, oldest first, and the total computed by the end of each: the horizon's
    # search (bisect over ``totals``), trimmed to what a pool of the KV size can still hold.
    seconds: list[int] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)


class CacheFill:
    """Tokens computed per worker and epoch, and what they say of its cache (module docstring)."""

    def __init__(self) -> None:
        self._counts: dict[str, _Count] = {}

    def computed(self, worker_id: str, epoch: float, now: float, tokens: float) -> None:
        """``worker_id`` (at ``epoch``) computes ``tokens`` more as of ``now``.  A newer epoch
        starts the count again (the engine restarted with an empty cache); an older one is
        ignored."""
        if tokens <= 0:
            return
        count = self._counts.get(worker_id)
        if count is None or epoch > count.epoch:
            count = self._counts[worker_id] = _Count(epoch)
        elif epoch < count.epoch:
            return
        count.total += tokens
        second, seconds = int(now), count.seconds
        if seconds and seconds[-1] >= second:
            # Same second, or a late remote record: it counts as of the newest second known, so
            # the totals stay in time order.
            count.totals[-1] = count.total
        else:
            seconds.append(second)
            count.totals.append(count.total)

    def horizon(self, worker_id: str, epoch: float, kv_tokens: int | None, pinned: float = 0.0) -> int | None:
        """The first whole second whose index entries ``worker_id`` still holds: it computed at
        least a pool's worth after every earlier second, the pool being ``kv_tokens`` less the
        ``pinned`` tokens of its running requests (not reusable).  None while nothing can have been
        evicted (or the KV size, or the epoch's count, is unknown)."""
        count = self._counts.get(worker_id)
        if count is None or count.epoch != epoch or not kv_tokens:
            return None
        pool = max(kv_tokens - pinned, 0.0)
        least = count.total - pool
        totals = count.totals
        if least < 0 or not totals:
            return None
        # Seconds no pool can reach any more (not even an idle worker's whole KV) go.
        gone = bisect_right(totals, count.total - kv_tokens) - 1
        if gone > 64:
            del count.seconds[:gone], totals[:gone]
        # The horizon is the second after the last one ending at most ``least`` (the first second
        # anything was computed in, when only what came before it is gone; after the newest, when
        # the running requests pin the whole KV).
        after = bisect_right(totals, least)
        return count.seconds[after] if after < len(totals) else count.seconds[-1] + 1

    def survival(self, worker_id: str, epoch: float, kv_tokens: int | None, pinned: float,
                 second: int) -> float:
        """The share of ``worker_id``'s pool (``horizon``'s) not yet computed since ``second``: how
        far a prefix it last served then is from being the least recently used, 0 at the horizon.
        1 while nothing can have been evicted."""
        count = self._counts.get(worker_id)
        if count is None or count.epoch != epoch or not kv_tokens:
            return 1.0
        pool = kv_tokens - pinned
        if count.total < pool:
            return 1.0
        before = bisect_left(count.seconds, second) - 1
        left = pool - count.total + (count.totals[before] if before >= 0 else 0.0)
        return left / pool if left > 0 else 0.0

    def fill(self, worker_id: str, epoch: float, kv_tokens: int | None) -> float | None:
        """Tokens ``worker_id``'s cache holds at ``epoch``: what it computed, up to its KV size
        (None when the size is unknown)."""
        if not kv_tokens:
            return None
        count = self._counts.get(worker_id)
        total = count.total if count is not None and count.epoch == epoch else 0.0
        return min(float(kv_tokens), total)

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet."""
        self._counts.pop(worker_id, None)
