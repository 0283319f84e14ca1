"""Subscribing to the engines' KV-cache events (vLLM's ZeroMQ publisher) and applying them to the
scheduler's token-exact index (routing/exact_index.py).

One ``KvEventWatch`` per router follows the registry: each worker with an event endpoint gets one
subscriber task per data-parallel rank (a SUB socket on the publisher, a DEALER on its replay
socket when it has one).  In order:

* on start, and after an engine restart (a new worker epoch, or sequence numbers going back), the
  rank's entries are dropped and the replay socket is asked for everything from sequence 0;
* a sequence gap is filled by replay from the last applied number + 1; where replay cannot fill it
  (no replay socket, or its buffer no longer reaches back) the rank is cleared — it then knows less
  than the engine, never more;
* a rank is *synchronised* once its replay answered, or (without replay) at its first event;
* malformed frames, unknown event kinds and events of groups that do not hold attention KV
  (Mamba, sliding window, CPU offload) are counted and skipped, never fatal.

``apply_batch`` is the one translation from the wire to the index; the virtual-time cluster calls
it too, with the simulated engines' events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.fleet.kv_event_sources import (
    KvEndpoint,
    KvEventSettings,
    endpoint_for,
    parse_endpoint_spec,
)
from kvroute.fleet.kv_event_wire import (
    END_SEQ,
    MEDIUM_GPU,
    RESIDENT_SPEC_KINDS,
    Cleared,
    EventBatch,
    MalformedEvents,
    Removed,
    Stored,
    Unknown,
    decode_batch,
    parse_pub_frames,
    parse_replay_reply,
    seq_frame,
)
from kvroute.routing.exact_index import EngineHash, ExactIndex

log = logging.getLogger("kvroute.kv_events")

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# How long a replay request may go unanswered before the rank is taken as having no replay.
REPLAY_TIMEOUT_S = 2.0
_encode = msgspec.msgpack.encode


@dataclass(slots=True)
class Counts:
    """What one batch did, by kind (``stored``, ``removed``, ``cleared``, ``unknown``, ``orphan``,
    ``ignored``: events of groups or media that do not make a prefix resident)."""

    by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, n: int = 1) -> None:
        """Count ``n`` of ``kind``."""
        if n:
            self.by_kind[kind] = self.by_kind.get(kind, 0) + n


def _key(group: int | None, engine_hash: EngineHash) -> EngineHash:
    # Groups of one engine may reuse the same block hash; a removal names its group.
    return engine_hash if group is None else (group, engine_hash)  # type: ignore[return-value]


def _resident(medium: str | None, spec_kind: str | None) -> bool:
    on_gpu = medium is None or medium == MEDIUM_GPU
    return on_gpu and (spec_kind is None or spec_kind in RESIDENT_SPEC_KINDS)


def _extras(extra_keys: list[Any] | None, n: int) -> list[bytes | None] | None:
    if not extra_keys:
        return None
    out: list[bytes | None] = []
    for i in range(n):
        keys = extra_keys[i] if i < len(extra_keys) else None
        out.append(_encode(keys) if keys else None)
    return out if any(e is not None for e in out) else None


def apply_batch(index: ExactIndex, worker_id: str, rank: int, batch: EventBatch, now: float) -> Counts:
    """Apply one decoded batch of ``worker_id``'s rank ``rank`` to ``index`` (``now``: the index's
    clock); returns what it did, for the metrics."""
    counts = Counts()
    for event in batch.events:
        if isinstance(event, Stored):
            if not _resident(event.medium, event.spec_kind):
                counts.add("ignored")
                continue
            if event.lora is not None or event.lora_id is not None:
                # A LoRA adapter's blocks are its own cache: keyed apart, never a base prompt's.
                extras: list[bytes | None] | None = [_encode(["lora", event.lora, event.lora_id])] * len(
                    event.engine_hashes)
            else:
                extras = _extras(event.extra_keys, len(event.engine_hashes))
            group = event.group_idx
            parent = None if event.parent is None else _key(group, event.parent)
            applied = index.stored(worker_id, rank, [_key(group, h) for h in event.engine_hashes], parent,
                                   event.token_ids, event.block_size, extras, now)
            counts.add("stored")
            counts.add("orphan", applied.orphans)
            if applied.cleared:
                counts.add("overflow")
        elif isinstance(event, Removed):
            if event.medium is not None and event.medium != MEDIUM_GPU:
                counts.add("ignored")
                continue
            index.removed(worker_id, rank, [_key(event.group_idx, h) for h in event.engine_hashes], now)
            counts.add("removed")
        elif isinstance(event, Cleared):
            index.cleared(worker_id, rank, now)
            counts.add("cleared")
        elif isinstance(event, Unknown):
            counts.add("unknown")
    return counts


class KvEventMetrics:
    """``kvroute_kv_events_total{worker,kind}``, ``kvroute_kv_events_lag_seconds{worker}``,
    ``kvroute_kv_events_gaps_total{worker}``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter("kvroute_kv_events",
                              "KV-cache events received from the engines, by worker and kind "
                              "(stored, removed, cleared, unknown, malformed, orphan, ignored, overflow)",
                              ["worker", "kind"], registry=registry)
        self.lag = Histogram("kvroute_kv_events_lag_seconds",
                             "Seconds from an engine's event batch (its timestamp) to the router's index",
                             ["worker"], buckets=LAG_BUCKETS, registry=registry)
        self.gaps = Counter("kvroute_kv_events_gaps",
                            "Sequence gaps in a worker's KV events (replayed or lost)",
                            ["worker"], registry=registry)

    def forget(self, worker_id: str) -> None:
        """Drop a removed worker's series."""
        for family in (self.events, self.lag, self.gaps):
            for labels in list(family._metrics):  # prometheus_client keeps no public index
                if labels[0] == worker_id:
                    with contextlib.suppress(KeyError):
                        family.remove(*labels)


class CacheModeCollector(Collector):
    """``kvroute_worker_cache_mode{worker,mode}``: 1 for the mode each worker's cache state is
    known in (``exact``: its KV events; ``approximate``: the prefix index), 0 for the other."""

    def __init__(self, index: ExactIndex, workers: Callable[[], Sequence[str]],
                 clock: Callable[[], float] = time.time) -> None:
        self._index, self._workers, self._clock = index, workers, clock

    def collect(self) -> Iterator[Metric]:
        """One sample per worker and mode."""
        family = GaugeMetricFamily("kvroute_worker_cache_mode",
                                   "How the router knows a worker's cache: exact (its KV events) or "
                                   "approximate (the prefix index of what it sent there); 1 for the current "
                                   "mode",
                                   labels=["worker", "mode"])
        now = self._clock()
        for wid in self._workers():
            mode = self._index.mode(wid, now)
            for m in ("exact", "approximate"):
                family.add_metric([wid, m], 1.0 if m == mode else 0.0)
        yield family


class _RankStream:
    """One rank's subscription: sequence bookkeeping, replay, apply."""

    def __init__(self, watch: KvEventWatch, worker_id: str, rank: int, pub: str, replay: str | None,
                 topic: str) -> None:
        self.watch, self.worker_id, self.rank = watch, worker_id, rank
        self.pub, self.replay, self.topic = pub, replay, topic.encode()
        self.last: int | None = None
        # Right after a replay the live stream still delivers batches the replay already applied;
        # once it has passed them, a number not above the last one means the engine restarted.
        self.catching_up = False
        self.reset_wanted = True

    def _apply(self, payload: bytes) -> None:
        watch = self.watch
        try:
            batch = decode_batch(payload)
        except MalformedEvents as exc:
            watch.metrics.events.labels(self.worker_id, "malformed").inc()
            watch.limited_warning(self.worker_id, f"malformed KV event batch from {self.worker_id}: {exc}")
            return
        now = watch.clock()
        counts = apply_batch(watch.index, self.worker_id, self.rank, batch, now)
        events = watch.metrics.events
        for kind, n in counts.by_kind.items():
            events.labels(self.worker_id, kind).inc(n)
        wall = time.time()
        if 0 < batch.ts <= wall + 60:
            watch.metrics.lag.labels(self.worker_id).observe(max(0.0, wall - batch.ts))

    def _restart(self) -> None:
        """The engine's state is unknown from here: drop the rank's entries."""
        self.watch.index.cleared(self.worker_id, self.rank, self.watch.clock())
        self.last = None

    async def _replay_from(self, dealer: zmq.asyncio.Socket, start: int) -> bool:
        """Ask for every buffered batch from ``start`` and apply them; False when unanswered."""
        await dealer.send_multipart([b"", seq_frame(start)])
        self.catching_up = True
        first = True
        while True:
            if not await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                return False
            try:
                seq, payload = parse_replay_reply(await dealer.recv_multipart())
            except MalformedEvents:
                self.watch.metrics.events.labels(self.worker_id, "malformed").inc()
                continue
            if seq == END_SEQ:
                return True
            if first and seq > start and self.last is not None:
                # The buffer no longer reaches back to what was missed.
                self._restart()
            first = False
            if self.last is not None and seq <= self.last:
                continue
            self._apply(payload)
            self.last = seq

    async def run(self) -> None:
        """Subscribe and apply until cancelled (ZeroMQ reconnects on its own)."""
        ctx = self.watch.context
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.connect(self.pub)
        dealer: zmq.asyncio.Socket | None = None
        if self.replay is not None:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay)
        index, wid, rank = self.watch.index, self.worker_id, self.rank
        index.attach(wid, [rank])
        try:
            while True:
                if self.reset_wanted:
                    self.reset_wanted = False
                    self._restart()
                    if dealer is not None:
                        if await self._replay_from(dealer, 0):
                            index.synced(wid, rank, self.watch.clock())
                        else:
                            # No answer (not published yet, or no replay there): live events sync it.
                            dealer.close(0)
                            dealer = None
                if not await sub.poll(1000):
                    continue
                try:
                    _topic, seq, payload = parse_pub_frames(await sub.recv_multipart())
                except MalformedEvents:
                    self.watch.metrics.events.labels(wid, "malformed").inc()
                    continue
                last = self.last
                if last is not None and seq <= last:
                    if self.catching_up:
                        continue  # already applied by the replay
                    self._restart()  # numbered from the start again: the engine restarted
                    last = None
                self.catching_up = False
                if last is not None and seq > last + 1:
                    self.watch.metrics.gaps.labels(wid).inc()
                    if dealer is None or not await self._replay_from(dealer, last + 1):
                        self._restart()
                    if self.last is not None and seq <= self.last:
                        index.synced(wid, rank, self.watch.clock())
                        continue
                self._apply(payload)
                self.last = seq
                index.synced(wid, rank, self.watch.clock())
        finally:
            index.lost(wid, rank)
            sub.close(0)
            if dealer is not None:
                dealer.close(0)


class KvEventWatch:
    """The router's KV-event subscribers, one set per worker, following the registry (a registry
    listener).  A worker whose endpoint comes from the templates is subscribed only while no other
    worker's host gives the same endpoint: engines sharing a host need their endpoints named, and
    one engine's events taken for another's would be worse than none."""

    def __init__(self, index: ExactIndex, settings: KvEventSettings, url_of: Callable[[str], str | None],
                 metrics: KvEventMetrics, clock: Callable[[], float] = time.time,
                 known_urls: Sequence[str] = ()) -> None:
        self.index = index
        self.clock = clock
        self.metrics = metrics
        self.settings = settings
        self._url_of = url_of
        self.context = zmq.asyncio.Context.instance()
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._streams: dict[str, list[_RankStream]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._warned: dict[str, float] = {}
        # Template endpoint -> the workers whose host gives it (URLs configured but not yet
        # registered count too, so that the first of several on one host is not subscribed).
        self._by_endpoint: dict[str, set[str]] = {}
        for url in known_urls:
            where, templated = settings.for_worker(url, url)
            if where is not None and templated:
                self._by_endpoint.setdefault(where.endpoint, set()).add(url)

    def limited_warning(self, key: str, message: str) -> None:
        """Log ``message`` at most once a minute per ``key``."""
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) >= 60.0:
            self._warned[key] = now
            log.warning("%s", message)

    # --- registry listener -----------------------------------------------------------------------

    def on_worker_epoch(self, worker_id: str, epoch: float) -> None:
        """A worker registered (subscribe) or restarted (its ranks start over from a replay)."""
        if worker_id in self._streams:
            for stream in self._streams[worker_id]:
                stream.reset_wanted = True
            return
        url = self._url_of(worker_id)
        if url is not None:
            self.follow(worker_id, url)

    def on_worker_removed(self, worker_id: str) -> None:
        """A worker left: stop its subscription."""
        for members in self._by_endpoint.values():
            members.discard(self._url_of(worker_id) or "")
        task = asyncio.get_running_loop().create_task(self.unfollow(worker_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def advertised(self, worker_id: str, spec: str) -> None:
        """The engine says it publishes at ``spec`` (``PUB[,REPLAY]``, a ``*`` host meaning the
        worker's own): subscribe there unless its endpoint is named in the settings."""
        url = self._url_of(worker_id)
        settings = self.settings
        if url is None or not settings.endpoint or url in settings.explicit or worker_id in settings.explicit:
            return
        host = endpoint_for(url, "{host}")
        spec = spec.replace("://*:", f"://{host}:").replace("://0.0.0.0:", f"://{host}:")
        try:
            where = parse_endpoint_spec(spec, ranks=settings.ranks, topic=settings.topic)
        except ValueError as exc:
            self.limited_warning(worker_id, f"{worker_id} advertises KV events at {spec!r}: {exc}")
            return
        streams = self._streams.get(worker_id)
        if streams and streams[0].pub == where.of_rank(0)[0]:
            return
        for members in self._by_endpoint.values():
            members.discard(url)
        await self.unfollow(worker_id)
        self._start(worker_id, where)

    # --- subscriptions ---------------------------------------------------------------------------

    def follow(self, worker_id: str, url: str) -> None:
        """Start subscribing to ``worker_id``'s events (no-op if it publishes none or is followed)."""
        if worker_id in self._tasks:
            return
        where, templated = self.settings.for_worker(worker_id, url)
        if where is None:
            return
        if templated:
            members = self._by_endpoint.setdefault(where.endpoint, set())
            members.add(url)
            if len(members) > 1:
                log.info("not subscribing to KV events at %s: workers %s share that host (name each "
                         "one's endpoint with --kv-events URL=ENDPOINT)", where.endpoint,
                         ", ".join(sorted(members)))
                for other in list(self._streams):
                    if self._url_of(other) in members:
                        task = asyncio.get_running_loop().create_task(self.unfollow(other))
                        self._closing.add(task)
                        task.add_done_callback(self._closing.discard)
                return
        self._start(worker_id, where)

    def _start(self, worker_id: str, where: KvEndpoint) -> None:
        streams = []
        for rank in range(where.ranks):
            pub, replay = where.of_rank(rank)
            streams.append(_RankStream(self, worker_id, rank, pub, replay, where.topic))
        self._streams[worker_id] = streams
        self._tasks[worker_id] = [asyncio.get_running_loop().create_task(self._guard(s)) for s in streams]
        log.info("subscribing to %s's KV events at %s%s (%d rank%s)", worker_id, where.endpoint,
                 f", replay {where.replay}" if where.replay else "", where.ranks,
                 "" if where.ranks == 1 else "s")

    async def _guard(self, stream: _RankStream) -> None:
        while True:
            try:
                await stream.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a socket error must not end the subscription for good
                self.limited_warning(stream.worker_id, f"KV events of {stream.worker_id} failed: {exc!r}; "
                                     "resubscribing")
                await asyncio.sleep(1.0)
                stream.reset_wanted = True

    async def unfollow(self, worker_id: str) -> None:
        """Stop subscribing to ``worker_id`` and forget its entries."""
        tasks = self._tasks.pop(worker_id, [])
        self._streams.pop(worker_id, None)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.index.detach(worker_id)
        self.metrics.forget(worker_id)

    def followed(self) -> Sequence[str]:
        """The workers subscribed to."""
        return list(self._tasks)

    async def close(self) -> None:
        """Stop every subscription."""
        for worker_id in list(self._tasks):
            await self.unfollow(worker_id)
