"""The router's own Prometheus metrics, in a registry per router (several run in one test process).

Counters and histograms are updated on the hot path; everything that is a snapshot of state
(in-flight counts, engine figures, index and session sizes) is read at scrape time by a collector,
so the hot path never pays for it.
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kvroute.fleet.breaker import STATE_VALUE
from kvroute.fleet.metric_names import ROUTER_WORKER_PREFIX_HITS, ROUTER_WORKER_PREFIX_QUERIES
from kvroute.fleet.registry import Registry
from kvroute.routing.flow import TENANT_LABELS
from kvroute.server.front import FrontServer

TTFB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class RouterMetrics:
    """The metric objects of one router; ``render()`` is the ``/metrics`` body."""

    def __init__(self, registry: Registry, scheduler_stats: Callable[[], Mapping[str, Any]]) -> None:
        self.prometheus = CollectorRegistry(auto_describe=True)
        r = self.prometheus
        self.requests = LoopCounter(
            "kvroute_requests", "Requests sent to a worker, by worker, model and decision kind",
            ("worker", "model", "kind"), r,
        )
        self.prefix_blocks = LoopHistogram(
            "kvroute_prefix_blocks_matched", "Prefix-index blocks the chosen worker already held",
            BLOCK_BUCKETS, r,
        )
        self.ttfb = LoopHistogram(
            "kvroute_ttfb_seconds", "Time from the request's arrival to its first response byte",
            TTFB_BUCKETS, r,
        )
        self.retries = Counter(
            "kvroute_retries", "Requests retried on another worker, by why the attempt failed",
            ["reason"], registry=r,
        )
        self.failures = Counter(
            "kvroute_failures", "Failed upstream attempts and rejected requests, by reason",
            ["reason"], registry=r,
        )
        self.queue_wait = Histogram(
            "kvroute_queue_wait_seconds",
            "Time a request waited at the router's gate (flow control) before it was routed, by model",
            ["model"], buckets=QUEUE_BUCKETS, registry=r,
        )
        r.register(_StateCollector(registry, scheduler_stats))

    def count_request(self, worker: str, model: str, kind: str) -> None:
        """Count a request sent to ``worker`` for ``model`` under its decision ``kind``."""
        self.requests.inc((worker, model, kind))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric of this router."""
        return generate_latest(self.prometheus)


class LoopHistogram(Collector):
    """An unlabelled histogram exposed as prometheus_client's ``Histogram`` is (the same samples,
    ``_created`` included) but observed without its per-value locks and its walk over the bounds:
    a bisection and two additions, a quarter of the instructions, and every request observes two
    (docs/benchmarks.md, "2026-12-07: instructions per request").  Only the router's event loop
    observes it and renders it, so nothing needs a lock."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        bounds = [float(b) for b in buckets]
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = tuple(bounds)
        # The "le" labels as prometheus_client writes a Histogram's (untyped there).
        self._les = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._created = time.time()
        registry.register(self)

    def observe(self, amount: float) -> None:
        """Record one observation (in the first bucket whose bound is at least ``amount``)."""
        self._sum += amount
        self._counts[bisect_left(self._bounds, amount)] += 1

    def collect(self) -> Iterator[Metric]:
        cumulative = itertools.accumulate(self._counts)
        family = HistogramMetricFamily(self._name, self._documentation,
                                       buckets=list(zip(self._les, cumulative, strict=True)),
                                       sum_value=self._sum)
        family.samples.append(Sample(self._name + "_created", {}, self._created))
        yield family


class LoopCounter(Collector):
    """A labelled counter exposed as prometheus_client's ``Counter`` is (``_total`` and ``_created``
    per label set, in the order the sets first counted) but counted by one dict update: its
    ``labels(...).inc()`` takes two locks and builds its child's key on every call, ~4,000
    instructions, and every request counts one (docs/benchmarks.md, "2026-12-08: more instructions
    per request").  Only the router's event loop counts and renders it, so nothing needs a lock."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        self._created: dict[tuple[str, ...], float] = {}
        registry.register(self)

    def inc(self, labels: tuple[str, ...]) -> None:
        """Count one under ``labels`` (one value per label name, in their order)."""
        values = self._values
        value = values.get(labels)
        if value is None:
            self._created[labels] = time.time()
            values[labels] = 1.0
        else:
            values[labels] = value + 1.0

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        created = self._created
        for labels, value in self._values.items():
            family.add_metric(labels, value, created=created[labels])
        yield family


class _StateCollector(Collector):
    """Scrape-time gauges: per-worker state and engine figures, index and session sizes."""

    def __init__(self, registry: Registry, scheduler_stats: Callable[[], Mapping[str, Any]]) -> None:
        self._registry = registry
        self._stats = scheduler_stats

    def describe(self) -> list[Metric]:
        # Nothing to pre-register: these families vary with the fleet and are built per scrape.
        return []

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily("kvroute_inflight", "Requests this router has in flight, per worker",
                                     labels=["worker"])
        healthy = GaugeMetricFamily("kvroute_worker_healthy", "1 if the worker is a candidate (healthy)",
                                    labels=["worker"])
        draining = GaugeMetricFamily("kvroute_worker_draining", "1 if the worker is being drained",
                                     labels=["worker"])
        epoch = GaugeMetricFamily("kvroute_worker_epoch", "The worker's epoch (registration or engine start)",
                                  labels=["worker"])
        running = GaugeMetricFamily("kvroute_worker_running", "vllm:num_requests_running of the worker",
                                    labels=["worker"])
        waiting = GaugeMetricFamily("kvroute_worker_waiting", "vllm:num_requests_waiting of the worker",
                                    labels=["worker"])
        kv = GaugeMetricFamily("kvroute_worker_kv_cache_usage",
                               "vllm:kv_cache_usage_perc of the worker (fraction, 0-1)", labels=["worker"])
        # CounterMetricFamily drops the names' "_total"; the samples get it back.
        hits = CounterMetricFamily(ROUTER_WORKER_PREFIX_HITS,
                                   "vllm:prefix_cache_hits_total of the worker (tokens)", labels=["worker"])
        queries = CounterMetricFamily(ROUTER_WORKER_PREFIX_QUERIES,
                                      "vllm:prefix_cache_queries_total of the worker (tokens)",
                                      labels=["worker"])
        breaker = GaugeMetricFamily("kvroute_breaker_state",
                                    "The worker's circuit breaker: 0 closed, 1 half-open, 2 open",
                                    labels=["worker"])
        transitions = CounterMetricFamily("kvroute_breaker_transitions",
                                          "Circuit-breaker state changes, by worker and new state",
                                          labels=["worker", "to"])
        ejections = CounterMetricFamily("kvroute_ejections",
                                        "Workers taken out of rotation (breaker opened), by worker and "
                                        "reason: failures, latency (outlier), malformed (answers that "
                                        "were not) or trial (half-open failed)",
                                        labels=["worker", "reason"])
        for record in self._registry.records():
            s, wid = record.state, [record.id]
            b = record.breaker
            breaker.add_metric(wid, STATE_VALUE[b.state])
            for to, n in b.transitions.items():
                transitions.add_metric([record.id, to], n)
            for reason, n in b.ejections.items():
                ejections.add_metric([record.id, reason], n)
            inflight.add_metric(wid, s.inflight)
            healthy.add_metric(wid, 1.0 if s.healthy else 0.0)
            draining.add_metric(wid, 1.0 if s.draining else 0.0)
            epoch.add_metric(wid, s.epoch)
            if s.running is not None:
                running.add_metric(wid, s.running)
            if s.waiting is not None:
                waiting.add_metric(wid, s.waiting)
            if s.kv_usage is not None:
                kv.add_metric(wid, s.kv_usage)
            m = record.metrics
            if m is not None and m.prefix_hits is not None:
                hits.add_metric(wid, m.prefix_hits)
            if m is not None and m.prefix_queries is not None:
                queries.add_metric(wid, m.prefix_queries)
        yield from (inflight, healthy, draining, epoch, running, waiting, kv, hits, queries, breaker,
                    transitions, ejections)
        yield from _flow_families(self._registry)
        stats = self._stats()
        yield _gauge("kvroute_index_blocks", "Blocks held by the prefix index", stats.get("index_blocks"))
        yield _gauge("kvroute_sessions", "Sessions bound to a worker", stats.get("sessions"))


def _flow_families(registry: Registry) -> Iterator[Metric]:
    """Flow control's queues (routing/flow.py): depth and queued tokens per model and priority
    class, admissions and sheds (flow control's own counts: one source for /metrics and the
    dashboard), the tokens served per tenant, and session admission's door."""
    flow = registry.dispatch.flow
    depth = GaugeMetricFamily("kvroute_queue_depth",
                              "Requests waiting at the router's gate, by model and priority class",
                              labels=["model", "class"])
    tokens = GaugeMetricFamily("kvroute_queue_tokens",
                               "Estimated prompt tokens waiting at the router's gate, by model and "
                               "priority class", labels=["model", "class"])
    for (model, cls), (n, t) in sorted(flow.depth_by_class().items()):
        depth.add_metric([model, cls], n)
        tokens.add_metric([model, cls], t)
    admitted = CounterMetricFamily("kvroute_admitted",
                                   "Requests flow control admitted, by model, whether they waited "
                                   "and priority class", labels=["model", "when", "class"])
    for (model, when, cls), count in sorted(flow.admitted.items()):
        admitted.add_metric([model, when, cls], count)
    shed = CounterMetricFamily("kvroute_shed",
                               "Requests answered with the overload error by flow control, by model, "
                               "reason and priority class", labels=["model", "reason", "class"])
    for (model, reason, cls), count in sorted(flow.shed.items()):
        shed.add_metric([model, reason, cls], count)
    tenants = CounterMetricFamily("kvroute_tenant_tokens",
                                  "Tokens served through flow control's gate (the engine's prompt + output "
                                  "tokens; estimated prompt + max_tokens where it reported none), by model "
                                  f"and tenant (a model's first {TENANT_LABELS} tenants; the rest 'other')",
                                  labels=["model", "tenant"])
    for (model, tenant), count in sorted(flow.tenant_tokens.items()):
        tenants.add_metric([model, tenant], count)
    sessions = GaugeMetricFamily("kvroute_flow_sessions",
                                 "Session admission (where it is on): sessions admitted to the "
                                 "working set, and new sessions waiting at the door, by model",
                                 labels=["model", "state"])
    for model, (admitted_n, waiting_n) in sorted(flow.session_counts(registry.dispatch.now()).items()):
        sessions.add_metric([model, "admitted"], admitted_n)
        sessions.add_metric([model, "waiting"], waiting_n)
    yield from (depth, tokens, admitted, shed, tenants, sessions)
    yield from _saturation_families(registry)


def _saturation_families(registry: Registry) -> Iterator[Metric]:
    """Whether each model's fleet is saturated (routing/saturation.py): the state, the level its
    hysteresis reads, thrashing, and how often it engaged.  Per router process, summed over the
    processes of a multi-process router (each reads the fleet itself)."""
    saturated = GaugeMetricFamily("kvroute_fleet_saturated",
                                  "1 while the model's fleet is saturated: no replica could start a "
                                  "request at once for a while (placement then routes for the fleet)",
                                  labels=["model"])
    thrashing = GaugeMetricFamily("kvroute_fleet_thrashing",
                                  "1 while the saturated fleet holds more conversations than its caches "
                                  "keep (session admission's 'auto' engaged)", labels=["model"])
    level = GaugeMetricFamily("kvroute_fleet_full_level",
                              "Share of recent time the model's fleet read full (exponentially "
                              "averaged over fleet_full_window_s)", labels=["model"])
    engaged = CounterMetricFamily("kvroute_fleet_saturations",
                                  "Times the model's fleet became saturated", labels=["model"])
    for model, sat in sorted(registry.dispatch.saturation.items()):
        saturated.add_metric([model], int(sat.engaged))
        thrashing.add_metric([model], int(sat.thrashing))
        level.add_metric([model], sat.level)
        engaged.add_metric([model], sat.engagements)
    yield from (saturated, thrashing, level, engaged)


def _gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    if isinstance(value, int | float):
        family.add_metric([], value)
    return family


# How the figures of several router processes (``kvroute serve --processes N``) combine into one
# exposition.  By default samples add up: counters, histograms, and the gauges that count things
# each process holds (``kvroute_inflight``).  Figures every process reads alike — a worker's
# state and engine counters, the shared index and sessions — are taken from the answering process,
# not multiplied.  A process is connected to Redis only if all are.
_ANSWERING_PREFIXES = ("kvroute_worker_",)
# Each process keeps its own breakers (on its own requests): its transitions and ejections add up,
# the state shown is the answering process's.
# Every process discovers on its own, from the same sources: what they list is the answering one's.
_ANSWERING = frozenset({"kvroute_index_blocks", "kvroute_sessions", "kvroute_sync_peers",
                        "kvroute_breaker_state", "kvroute_discovered_workers"})
_LEAST = frozenset({"kvroute_sync_connected"})

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def _rule(family: Metric) -> str:
    if family.name in _ANSWERING or family.name.startswith(_ANSWERING_PREFIXES):
        return "first"
    if family.name in _LEAST or family.name.endswith("_created"):
        return "min"
    if family.type in ("counter", "gauge", "histogram", "summary"):
        return "sum"
    return "first"


def merge_expositions(parts: Sequence[tuple[str, str]]) -> bytes:
    """One ``/metrics`` body for several router processes: ``parts`` are (process label, text
    exposition) pairs, the answering process first.  Adds ``kvroute_processes`` (how many were
    merged) and ``kvroute_process_requests_total{process}`` (each one's share of the requests)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[SampleKey, Sample]] = {}
    per_process = CounterMetricFamily("kvroute_process_requests",
                                      "Requests sent to a worker, by router process", labels=["process"])
    for label, text in parts:
        routed = 0.0
        for family in text_string_to_metric_families(text):
            if family.name == "kvroute_requests":
                routed += sum(s.value for s in family.samples if s.name == "kvroute_requests_total")
            merged = values.setdefault(family.name, {})
            if family.name not in families:
                families[family.name] = family
            rule = _rule(families[family.name])
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                held = merged.get(key)
                if held is None:
                    merged[key] = sample
                elif rule == "sum":
                    merged[key] = held._replace(value=held.value + sample.value)
                elif rule == "min" and sample.value < held.value:
                    merged[key] = sample
        per_process.add_metric([label], routed)
    per_process.samples.sort(key=lambda s: (len(s.labels["process"]), s.labels["process"]))
    out: list[Metric] = []
    for name, family in families.items():
        combined = Metric(family.name, family.documentation, family.type, family.unit)
        combined.samples = list(values[name].values())
        out.append(combined)
    out.append(_gauge("kvroute_processes", "Router processes whose figures this answer merges",
                      len(parts)))
    out.append(per_process)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(out))
    return generate_latest(registry)


def front_families(front: FrontServer) -> Callable[[], Iterator[Metric]]:
    """The listening side's counters (server/front.py), read at scrape time: connections closed to
    make room at the connection cap, and request bodies answered 408 for arriving too slowly."""

    def families() -> Iterator[Metric]:
        evictions = CounterMetricFamily(
            "kvroute_front_evictions",
            "Client connections closed to make room at max_connections, by what they were doing: idle "
            "(after a request), new (nothing sent yet), slow_head or slow_body (a request still "
            "arriving, answered 408)", labels=["reason"])
        for reason, n in front.evictions.items():
            evictions.add_metric([reason], n)
        timeouts = CounterMetricFamily(
            "kvroute_front_body_timeouts",
            "Request bodies answered 408 for arriving too slowly, by the bound broken: total "
            "(body_timeout_s) or min_rate (body_min_rate_bytes_s after body_min_rate_grace_s)",
            labels=["reason"])
        for reason, n in front.body_timeouts.items():
            timeouts.add_metric([reason], n)
        yield from (evictions, timeouts)

    return families


class FamiliesCollector(Collector):
    """Yields the families a function builds at scrape time (the fleet guard's)."""

    def __init__(self, families: Callable[[], Iterator[Metric]]) -> None:
        self._families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        return self._families()


class _Fixed(Collector):
    """Yields metric families built elsewhere (a merged exposition)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
