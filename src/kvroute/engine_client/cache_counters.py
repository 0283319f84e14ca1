"""Prefix-cache hit and query counters, read from an engine's or a kvroute router's ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from kvroute.engine_client.http import Target, request
from kvroute.fleet import metric_names as names
from kvroute.prometheus_text import MetricsParseError, Sample, first_total, parse_exposition

# An engine's own counters (vLLM v1, then older names), then a kvroute router's re-export of its
# workers' counters (summed over the ``worker`` label).
_HITS = (*names.PREFIX_HITS, names.ROUTER_WORKER_PREFIX_HITS)
_QUERIES = (*names.PREFIX_QUERIES, names.ROUTER_WORKER_PREFIX_QUERIES)


@dataclass(frozen=True, slots=True)
class PrefixCacheReading:
    """Cumulative prefix-cache hits and queries (tokens) at one moment, and where they came from."""

    hits: float
    queries: float
    source: str

    @property
    def rate(self) -> float | None:
        """Hits per query since the engine started; None before the first query."""
        return self.hits / self.queries if self.queries > 0 else None


@dataclass(frozen=True, slots=True)
class CounterChange:
    """How the counters moved between two readings."""

    before: PrefixCacheReading
    after: PrefixCacheReading

    @property
    def hits(self) -> float:
        """Hits added in between (tokens)."""
        return self.after.hits - self.before.hits

    @property
    def queries(self) -> float:
        """Queries added in between (tokens)."""
        return self.after.queries - self.before.queries

    @property
    def rate(self) -> float | None:
        """Hit rate of the interval alone; None if nothing was queried (or the engine restarted)."""
        return self.hits / self.queries if self.queries > 0 and self.hits >= 0 else None

    def as_dict(self) -> dict[str, object]:
        """The JSON form used by ``--json``."""
        return {"source": self.after.source, "hits": self.hits, "queries": self.queries,
                "rate": self.rate, "rate_before": self.before.rate, "rate_after": self.after.rate}


def counters_from_samples(samples: list[Sample]) -> PrefixCacheReading | None:
    """The first family of counters present (engine names before the router's); None if none."""
    for hits_name, queries_name in zip(_HITS, _QUERIES, strict=True):
        hits = first_total(samples, (hits_name,))
        queries = first_total(samples, (queries_name,))
        if hits is not None and queries is not None:
            return PrefixCacheReading(hits[1], queries[1], f"{hits_name} / {queries_name}")
    return None


async def read_counters(session: aiohttp.ClientSession, target: Target) -> PrefixCacheReading | None:
    """The prefix-cache counters from ``/metrics`` now; None if they cannot be read."""
    reply = await request(session, "GET", target.url("/metrics"), timeout_s=target.timeout_s,
                          headers=target.headers())
    if reply.status != 200:
        return None
    try:
        return counters_from_samples(parse_exposition(reply.body.decode("utf-8", "replace")))
    except MetricsParseError:
        return None
