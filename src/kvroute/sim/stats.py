"""Counters and histograms an engine keeps for ``/metrics`` (vLLM's meanings, tokens as units)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

# vLLM's bucket boundaries for the same histograms.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# vLLM's request-latency buckets: e2e latency and the queue (waiting) time share them.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)
# Token counts of a request's prefill (new KV computed, cached tokens excluded).
PREFILL_KV_BUCKETS: tuple[float, ...] = (
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    bounds: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            bound = mantissa * 10**exponent
            if bound > max_model_len:
                return tuple(bounds)
            bounds.append(float(bound))
        exponent += 1


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram with fixed upper bounds (``+Inf`` implied)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[int]:
        """Counts of observations ``<=`` each bound, then the total (the ``+Inf`` bucket)."""
        out: list[int] = []
        running = 0
        for c in self.counts:
            running += c
            out.append(running)
        return out

    def copy(self) -> Histogram:
        """An independent copy."""
        return replace(self, counts=list(self.counts))


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters since the engine (re)started, in tokens where vLLM counts tokens.

    ``prompt_tokens_cached`` is the prefix-cache part of ``prompt_tokens`` (both counted when a
    request's first token is out, as the ``usage`` of its reply reports them).  ``finished`` counts
    requests by vLLM's ``finished_reason`` (``stop``, ``length``, ``abort``).  The per-request
    token histograms need ``max_model_len`` for their buckets: build with :meth:`for_model_len`.
    """

    prompt_len: Histogram
    generation_len: Histogram
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    prefill_kv_computed: Histogram = field(default_factory=lambda: Histogram(PREFILL_KV_BUCKETS))

    @classmethod
    def for_model_len(cls, max_model_len: int) -> EngineStats:
        """Empty stats whose token histograms have vLLM's buckets for ``max_model_len``."""
        bounds = token_buckets(max_model_len)
        return cls(prompt_len=Histogram(bounds), generation_len=Histogram(bounds))

    def copy(self) -> EngineStats:
        """An independent copy (what ``snapshot()`` hands out)."""
        return replace(
            self, finished=dict(self.finished), ttft=self.ttft.copy(), e2e=self.e2e.copy(),
            queue_time=self.queue_time.copy(), prefill_kv_computed=self.prefill_kv_computed.copy(),
            prompt_len=self.prompt_len.copy(), generation_len=self.generation_len.copy(),
        )
