"""Statistics of a load step: percentiles, Prometheus counter deltas and the A/B table's figures."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from kvroute.bench.results import RequestRecord, StepResult
from kvroute.fleet import metric_names as names
from kvroute.prometheus_text import parse_exposition
from kvroute.quantiles import percentile

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]
Samples = dict[SeriesKey, float]


def parse_samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, keyed by sample name and sorted labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in parse_exposition(text)}


def gauge_sum(samples: Mapping[SeriesKey, float], name: str) -> float | None:
    """Sum of every series of gauge ``name``; None when the exposition has none."""
    values = [v for (n, _), v in samples.items() if n == name]
    return sum(values) if values else None


def counter_delta(before: Mapping[SeriesKey, float], after: Mapping[SeriesKey, float], name: str) -> float:
    """How much counter ``name`` grew between two scrapes, summed over its series.

    A series that went down was reset (the engine restarted): it counts from zero, so its delta is
    its new value.  A series that appeared counts in full; one that disappeared counts nothing.
    """
    total = 0.0
    for key, value in after.items():
        if key[0] != name:
            continue
        prev = before.get(key)
        total += value if prev is None or value < prev else value - prev
    return total


@dataclass(frozen=True, slots=True)
class CacheCounters:
    """Prefix-cache counters (in tokens) and preemptions, summed over the replicas."""

    hits: float
    queries: float
    preemptions: float | None = None

    @property
    def hit_pct(self) -> float | None:
        """Hits as a percentage of queries; None when nothing was queried."""
        return 100.0 * self.hits / self.queries if self.queries > 0 else None


def cache_delta(before: Sequence[Mapping[SeriesKey, float]],
                after: Sequence[Mapping[SeriesKey, float]]) -> CacheCounters:
    """Prefix-cache and preemption counter deltas summed over replicas (``before[i]``/``after[i]``:
    replica ``i``), by vLLM v1's names: the benchmarks run against vLLM and the simulator."""
    if len(before) != len(after):
        raise ValueError("before and after must list the same replicas")
    pairs = list(zip(before, after, strict=True))
    return CacheCounters(sum(counter_delta(b, a, names.PREFIX_HITS[0]) for b, a in pairs),
                         sum(counter_delta(b, a, names.PREFIX_QUERIES[0]) for b, a in pairs),
                         sum(counter_delta(b, a, names.PREEMPTIONS[0]) for b, a in pairs))


def busy_count(scrapes: Iterable[Mapping[SeriesKey, float] | None]) -> int:
    """Replicas with requests in work (running or waiting) in one poll of every replica."""
    busy = 0
    for samples in scrapes:
        if samples is None:
            continue
        if (gauge_sum(samples, names.RUNNING[0]) or 0.0) + (gauge_sum(samples, names.WAITING[0]) or 0.0) > 0:
            busy += 1
    return busy


def stayed_share(records: Iterable[RequestRecord]) -> float | None:
    """Percentage of follow-up requests served by the replica that served their session's previous
    request; None when there are no follow-ups with a known worker on both sides."""
    by_session: dict[str, list[RequestRecord]] = {}
    for rec in records:
        if rec.session_id is not None:
            by_session.setdefault(rec.session_id, []).append(rec)
    stayed = moved = 0
    for recs in by_session.values():
        recs.sort(key=lambda r: r.round)
        for prev, cur in pairwise(recs):
            if prev.worker is None or cur.worker is None or cur.round != prev.round + 1:
                continue
            if cur.worker == prev.worker:
                stayed += 1
            else:
                moved += 1
    return 100.0 * stayed / (stayed + moved) if stayed + moved else None


@dataclass(frozen=True, slots=True)
class SessionFigures:
    """Per-session percentiles of one step (see :func:`session_figures`)."""

    duration_p50_s: float | None
    duration_p95_s: float | None
    first_ttfb_p50_s: float | None
    first_ttfb_p95_s: float | None
    first_queue_p50_s: float | None
    first_queue_p95_s: float | None
    continuing_ttfb_p50_s: float | None
    continuing_ttfb_p95_s: float | None


def session_figures(records: Iterable[RequestRecord]) -> SessionFigures:
    """What a session's user waits for, from the records of the requests that carry a session id.

    Duration: from the session's first request's start to its last answer's end, over the sessions
    whose last round finished without error (a session cut off by the window, or one that gave up
    after an error, has no duration; the figure is therefore of the sessions that fit).  The start
    is when the client sent the request, so any wait at the router's gate and every pause between
    rounds count.  First turn: round 0's time to first byte (its gate wait included) and that
    gate wait alone; continuing turns: the time to first byte of rounds 1 and later.  Time to first
    byte is over every request that got one.
    """
    by_session: dict[str, list[RequestRecord]] = {}
    for rec in records:
        if rec.session_id is not None:
            by_session.setdefault(rec.session_id, []).append(rec)
    durations: list[float] = []
    first_ttfb: list[float] = []
    first_queue: list[float] = []
    continuing: list[float] = []
    for recs in by_session.values():
        for rec in recs:
            if rec.error is not None or rec.ttfb_s is None:
                continue
            if rec.round == 0:
                first_ttfb.append(rec.ttfb_s)
                first_queue.append(rec.queue_s)
            else:
                continuing.append(rec.ttfb_s)
        # The last try of its last round (one shed is sent again after its Retry-After).
        last = next((r for r in reversed(recs) if r.last_round), None)
        first = next((r for r in recs if r.round == 0), None)
        if last is not None and first is not None and last.error is None and last.end_s is not None:
            durations.append(last.end_s - first.start_s)
    return SessionFigures(percentile(durations, 50), percentile(durations, 95),
                          percentile(first_ttfb, 50), percentile(first_ttfb, 95),
                          percentile(first_queue, 50), percentile(first_queue, 95),
                          percentile(continuing, 50), percentile(continuing, 95))


def summarize_step(policy: str, sessions: int, duration_s: float, records: Sequence[RequestRecord],
                   busy_samples: Sequence[int], cache: CacheCounters | None, *,
                   rate: float | None = None) -> StepResult:
    """The A/B table's figures for one step.

    ``records`` are the requests started during the step's window of ``duration_s`` seconds; each
    ran to its end (or was cut off after the drain).  Throughput counts what completed inside the
    window: output tokens of requests that ended in it, sessions whose last round ended in it.
    A request the router shed (its overload answer) counts in ``shed``, not in ``errors``.
    Time to first byte is over every request that got one, inside the window or during the drain, so
    that slow requests under overload are not censored away.  The hit share comes from the replicas'
    own counters (``cache``) when they were scraped, and from the responses' ``usage`` otherwise.
    ``rate`` is an open-loop step's arrival rate (``sessions`` is 0 there).
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be > 0")
    ok = [r for r in records if r.error is None and r.end_s is not None]
    in_window = [r for r in ok if r.end_s is not None and r.end_s <= duration_s]
    ttfbs = [r.ttfb_s for r in records if r.ttfb_s is not None and r.error is None]
    completed = sum(1 for r in in_window if r.last_round)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    if cache is not None and cache.hit_pct is not None:
        hit_pct: float | None = cache.hit_pct
    else:
        hit_pct = 100.0 * cached / prompt if prompt else None
    per_session = session_figures(records)
    return StepResult(
        policy=policy,
        sessions=sessions,
        duration_s=duration_s,
        requests=len(records),
        errors=sum(1 for r in records if r.error is not None and not r.shed),
        sessions_completed=completed,
        sessions_per_hour=completed * 3600.0 / duration_s,
        output_tokens_per_min=sum(r.output_tokens for r in in_window) * 60.0 / duration_s,
        ttfb_p50_s=percentile(ttfbs, 50),
        ttfb_p95_s=percentile(ttfbs, 95),
        replicas_busy=sum(busy_samples) / len(busy_samples) if busy_samples else None,
        prefix_hit_pct=hit_pct,
        stayed_pct=stayed_share(records),
        prompt_tokens=prompt,
        cached_tokens=cached,
        unfinished=sum(1 for r in records if r.error is None and r.end_s is None),
        preemptions=None if cache is None or cache.preemptions is None else round(cache.preemptions),
        ttfb_p99_s=percentile(ttfbs, 99),
        shed=sum(1 for r in records if r.shed),
        rate=rate,
        completed_per_s=len(in_window) / duration_s,
        session_p50_s=per_session.duration_p50_s,
        session_p95_s=per_session.duration_p95_s,
        first_ttfb_p50_s=per_session.first_ttfb_p50_s,
        first_ttfb_p95_s=per_session.first_ttfb_p95_s,
        first_queue_p50_s=per_session.first_queue_p50_s,
        first_queue_p95_s=per_session.first_queue_p95_s,
        continuing_ttfb_p50_s=per_session.continuing_ttfb_p50_s,
        continuing_ttfb_p95_s=per_session.continuing_ttfb_p95_s,
    )


# kvroute's flow-control metrics (server/metrics.py).
QUEUE_WAIT_BUCKETS = "kvroute_queue_wait_seconds_bucket"
ADMITTED = "kvroute_admitted_total"
SHED = "kvroute_shed_total"


@dataclass(frozen=True, slots=True)
class QueueFigures:
    """A router queue over one step: wait percentiles and the requests it shed."""

    wait_p50_s: float | None
    wait_p95_s: float | None
    shed: int


def _delta_by(before: Mapping[SeriesKey, float], after: Mapping[SeriesKey, float], name: str,
              label: str) -> dict[str, float]:
    """Growth of counter ``name`` between two scrapes, summed per value of ``label``."""
    out: dict[str, float] = {}
    for key, value in after.items():
        if key[0] != name:
            continue
        prev = before.get(key)
        grew = value if prev is None or value < prev else value - prev
        tag = dict(key[1]).get(label, "")
        out[tag] = out.get(tag, 0.0) + grew
    return out


def histogram_quantile(q: float, buckets: Mapping[float, float], zeros: float = 0.0) -> float | None:
    """The ``q`` quantile (0..1) of a cumulative histogram (upper bound -> count at or below it,
    ``inf`` included) plus ``zeros`` observations of 0, interpolated linearly inside the bucket
    as Prometheus' ``histogram_quantile`` does (the lowest bucket from 0; past the largest finite
    bound, that bound).  None when nothing was observed."""
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be within 0..1")
    bounds = sorted(buckets)
    total = zeros + (buckets[bounds[-1]] if bounds else 0.0)
    if total <= 0:
        return None
    rank = q * total
    if rank <= zeros:
        return 0.0
    rank -= zeros
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def queue_figures(before: Mapping[SeriesKey, float], after: Mapping[SeriesKey, float],
                  time_scale: float = 1.0) -> QueueFigures | None:
    """kvroute's router queue over a step, from two scrapes of its ``/metrics``: the wait p50 / p95
    over every request flow control admitted (zero for those admitted at once; the histogram only
    holds those that waited), in the target's seconds (``time_scale`` × the router's), and the
    requests it shed.  None when the router counted no admission (flow control off)."""
    admitted = _delta_by(before, after, ADMITTED, "when")
    if not admitted:
        return None
    buckets = {float(le): n for le, n in _delta_by(before, after, QUEUE_WAIT_BUCKETS, "le").items()}
    zeros = admitted.get("at_once", 0.0)

    def scaled(q: float) -> float | None:
        value = histogram_quantile(q, buckets, zeros)
        return None if value is None else value * time_scale

    shed = sum(_delta_by(before, after, SHED, "reason").values())
    return QueueFigures(scaled(0.50), scaled(0.95), round(shed))
