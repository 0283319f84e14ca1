"""Time series for the dashboard's charts, binned over a shared window (pure: no I/O, no clock).

The engine's counters are cumulative, scraped about once a second.  Each increase between two
scrapes is spread over the bins that interval overlaps, so the rate does not jitter with the probe's
timing; a decrease means the engine restarted and its counters began again from zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise

from kvroute.fleet.registry import CounterSample
from kvroute.quantiles import percentile_of_sorted
from kvroute.server.activity import QueueSample

# Candidate bin widths (seconds); the smallest that keeps the chart within ``max_bins`` wins.
_BIN_LADDER = (2, 5, 10, 15, 30, 60, 120, 300, 600)


@dataclass(frozen=True, slots=True)
class Window:
    """``bins`` equal bins of ``bin_s`` seconds ending at ``end`` (aligned to the bin width)."""

    end: float
    bin_s: float
    bins: int

    @property
    def start(self) -> float:
        """When the first bin begins."""
        return self.end - self.bin_s * self.bins

    def index(self, t: float) -> int | None:
        """The bin holding time ``t``, or None when ``t`` is outside the window."""
        if t < self.start or t >= self.end:
            return None
        return min(self.bins - 1, int((t - self.start) // self.bin_s))

    def to_json(self) -> dict[str, float]:
        """A JSON-ready dict."""
        return {"start": self.start, "end": self.end, "bin_s": self.bin_s, "bins": self.bins}


def choose_window(now: float, earliest: float | None, *, span_s: float = 3600.0, min_span_s: float = 120.0,
                  max_bins: int = 60) -> Window:
    """The window the charts share: the last ``span_s`` seconds, or less when the data is younger
    (never under ``min_span_s``), so a router started a minute ago does not draw a blank hour."""
    age = span_s if earliest is None else now - earliest
    span = min(span_s, max(min_span_s, age))
    bin_s = next((b for b in _BIN_LADDER if span / b <= max_bins), _BIN_LADDER[-1])
    bins = max(1, math.ceil(span / bin_s))
    end = (math.floor(now / bin_s) + 1) * bin_s
    return Window(end=end, bin_s=float(bin_s), bins=bins)


@dataclass(frozen=True, slots=True)
class TokenSeries:
    """Prompt tokens per second in each bin, served from the prefix cache and computed, and the
    totals over the window (``hit_share`` is None when no prompt tokens were counted)."""

    cached: tuple[float, ...]
    computed: tuple[float, ...]
    cached_tokens: float
    prompt_tokens: float

    @property
    def hit_share(self) -> float | None:
        """Cached prompt tokens as a fraction of all prompt tokens in the window."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens > 0 else None

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict (rates rounded to 0.1 token/s to keep the payload small)."""
        return {
            "cached": [round(v, 1) for v in self.cached],
            "computed": [round(v, 1) for v in self.computed],
            "cached_tokens": round(self.cached_tokens),
            "prompt_tokens": round(self.prompt_tokens),
            "hit_share": self.hit_share,
        }


def token_rates(histories: Iterable[Iterable[CounterSample]], window: Window) -> TokenSeries:
    """Sum, over every worker's counter history, the prompt tokens read from cache
    (``vllm:prefix_cache_hits_total``) and computed (``vllm:prompt_tokens_total`` minus those)."""
    cached = [0.0] * window.bins
    prompt = [0.0] * window.bins
    for history in histories:
        for a, b in pairwise(history):
            if b.time <= window.start or a.time >= window.end or b.time <= a.time:
                continue
            restarted = b.prompt_tokens < a.prompt_tokens or b.prefix_hits < a.prefix_hits
            d_prompt = b.prompt_tokens if restarted else b.prompt_tokens - a.prompt_tokens
            d_hits = b.prefix_hits if restarted else b.prefix_hits - a.prefix_hits
            _spread(cached, window, a.time, b.time, d_hits)
            _spread(prompt, window, a.time, b.time, d_prompt)
    total_cached, total_prompt = sum(cached), sum(prompt)
    # Hits are counted when a request is scheduled and prompt tokens when its prefill is done, so a
    # single bin can briefly show more hits than prompt tokens: computed is clamped at zero there.
    return TokenSeries(
        cached=tuple(c / window.bin_s for c in cached),
        computed=tuple(max(0.0, p - c) / window.bin_s for c, p in zip(cached, prompt, strict=True)),
        cached_tokens=min(total_cached, total_prompt) if total_prompt > 0 else 0.0,
        prompt_tokens=total_prompt,
    )


def _spread(bins: list[float], window: Window, t0: float, t1: float, amount: float) -> None:
    """Add ``amount``, accrued uniformly over [t0, t1), to the bins that interval overlaps."""
    if amount <= 0:
        return
    span = t1 - t0
    lo, hi = max(t0, window.start), min(t1, window.end)
    first = window.index(lo)
    if first is None or hi <= lo:
        return
    for i in range(first, window.bins):
        b0 = window.start + i * window.bin_s
        b1 = b0 + window.bin_s
        if b0 >= hi:
            break
        overlap = min(b1, hi) - max(b0, lo)
        if overlap > 0:
            bins[i] += amount * overlap / span


@dataclass(frozen=True, slots=True)
class LatencySeries:
    """Per-bin p50 and p95 (None for a bin without samples) and the window's own p50/p95."""

    p50: tuple[float | None, ...]
    p95: tuple[float | None, ...]
    count: int
    window_p50: float | None
    window_p95: float | None

    def to_json(self) -> dict[str, object]:
        """A JSON-ready dict (seconds, rounded to 0.1 ms)."""
        return {
            "p50": [_round_s(v) for v in self.p50],
            "p95": [_round_s(v) for v in self.p95],
            "count": self.count,
            "window_p50": _round_s(self.window_p50),
            "window_p95": _round_s(self.window_p95),
        }


def latency_percentiles(samples: Iterable[tuple[float, float]], window: Window) -> LatencySeries:
    """p50/p95 of ``(time, seconds)`` samples per bin and over the whole window."""
    per_bin: list[list[float]] = [[] for _ in range(window.bins)]
    everything: list[float] = []
    for t, value in samples:
        i = window.index(t)
        if i is not None:
            per_bin[i].append(value)
            everything.append(value)
    for values in per_bin:
        values.sort()
    everything.sort()
    return LatencySeries(
        p50=tuple(percentile_of_sorted(v, 50) for v in per_bin),
        p95=tuple(percentile_of_sorted(v, 95) for v in per_bin),
        count=len(everything),
        window_p50=percentile_of_sorted(everything, 50),
        window_p95=percentile_of_sorted(everything, 95),
    )


@dataclass(frozen=True, slots=True)
class QueueSeries:
    """A queue's peak depth in each bin: requests and estimated prompt tokens."""

    depth: tuple[int, ...]
    tokens: tuple[int, ...]

    def to_json(self) -> dict[str, list[int]]:
        """A JSON-ready dict."""
        return {"depth": list(self.depth), "tokens": list(self.tokens)}


def queue_depths(timelines: Iterable[Iterable[QueueSample]], window: Window) -> QueueSeries:
    """Per bin, the queue's peak depth, summed over ``timelines`` (one per router process, each in
    time order).  A bin without a sample holds the depth the last sample before it left: the queue
    did not change in between."""
    depth = [0] * window.bins
    tokens = [0] * window.bins
    for timeline in timelines:
        samples = list(timeline)
        k, carry, carry_tokens = 0, 0, 0
        while k < len(samples) and samples[k].second < window.start:
            carry, carry_tokens = samples[k].depth, samples[k].tokens
            k += 1
        for i in range(window.bins):
            end = window.start + (i + 1) * window.bin_s
            peak, peak_tokens = carry, carry_tokens
            while k < len(samples) and samples[k].second < end:
                s = samples[k]
                peak, peak_tokens = max(peak, s.peak), max(peak_tokens, s.peak_tokens)
                carry, carry_tokens = s.depth, s.tokens
                k += 1
            depth[i] += peak
            tokens[i] += peak_tokens
    return QueueSeries(tuple(depth), tuple(tokens))


def _round_s(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
