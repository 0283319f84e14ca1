"""Routing facts and load shared between router instances through Redis streams.

Two bounded streams per namespace: ``<ns>:sync:facts`` carries the facts each instance learns
(prefix blocks -> worker, session -> worker, worker epochs), ``<ns>:sync:load`` the instances'
load heartbeats.  Streams rather than pub/sub because a stream is also the history: an instance
that starts (or restarts) reads the recent window and routes warm from its first request, and one
that lost its connection for a while resumes from the last entry it read instead of losing
everything published meanwhile.  ``XADD MAXLEN ~`` keeps both bounded.

Redis is never on a request's path: ``publish`` appends to a bounded in-memory queue (dropping and
counting when full) that a background task drains, lookups stay in the scheduler's memory, and a
separate task tails both streams with ``XREAD BLOCK``.  When Redis is down, slow or restarted the
router keeps routing on what it knows, the bus reconnects with exponential backoff and jitter, logs
the outage once and its end once, and ``kvroute_sync_connected`` says where it stands.

Nothing read is believed before ``sync/trust.py`` has judged it: signed with the shared secret (when
one is set), no time or epoch in the future, no implausible load, and a heartbeat only from an
instance that is alive, that is, holds a connection to Redis under its name (``CLIENT SETNAME
kvroute:<id>``, seen in ``CLIENT LIST``).  A rejected message is counted in
``kvroute_sync_rejected_total{reason}`` and changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from kvroute.fleet.registry import Registry
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.settings import DEFAULT_MAX_NUM_SEQS
from kvroute.routing.sync_record import PrefixRecord, SyncRecord
from kvroute.sync.backoff import Backoff
from kvroute.sync.messages import (
    FactsMessage,
    LoadMessage,
    MessageError,
    WorkerLoad,
    decode_facts,
    decode_load,
    encode_facts,
    encode_load,
)
from kvroute.sync.metrics import SyncMetrics
from kvroute.sync.peer_load import PeerLoads
from kvroute.sync.shared_view import SharedView
from kvroute.sync.trust import Signer, check_facts, check_load, within_context

log = logging.getLogger("kvroute.sync")

_PAGE = 1000                 # stream entries per catch-up read
_MAX_BATCH_HASHES = 32_768   # keeps one facts message well under a megabyte
CLIENT_NAME_PREFIX = "kvroute:"


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _stream_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


Entry = tuple[bytes, Mapping[Any, Any]]


def _range(resp: Any) -> list[Entry]:
    """An ``XRANGE``/``XREVRANGE`` reply as (id, fields) pairs (the client's types are loose)."""
    return [(_as_bytes(entry_id), fields or {}) for entry_id, fields in resp or ()]


def _streams(resp: Any) -> list[tuple[bytes, list[Entry]]]:
    """``XREAD``'s reply as (stream, entries) pairs, whichever RESP version answered."""
    if not resp:
        return []
    if isinstance(resp, Mapping):
        pairs = [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in resp.items()]
    else:
        pairs = [(k, v) for k, v in resp]
    return [(_as_bytes(k), _range(v)) for k, v in pairs]


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RedisBus:
    """Shares this router instance's routing facts and load with the others (``RouteSync``).

    ``registry`` and ``scheduler`` are the router's own; the bus writes ``peer_inflight`` and
    agreed epochs into the registry's ``WorkerState``s and calls ``scheduler`` only to move epochs.
    Metrics go on ``metrics_registry`` (the router's; a private one if None).  ``secret`` signs and
    checks every message (None: unsigned, with a warning at start); ``max_clock_skew_s`` is how far
    in the future a remote time or epoch may be.
    """

    def __init__(
        self,
        url: str,
        *,
        registry: Registry,
        scheduler: Scheduler,
        metrics_registry: CollectorRegistry | None = None,
        namespace: str = "kvroute",
        instance_id: str | None = None,
        heartbeat_s: float = 0.25,
        heartbeat_min_s: float = 0.05,
        peer_ttl_s: float | None = None,
        queue_max: int = 10_000,
        batch_max: int = 256,
        stream_maxlen: int = 20_000,
        load_maxlen: int = 1_000,
        history_s: float | None = None,
        max_pending: int = 20_000,
        connect_timeout_s: float = 2.0,
        command_timeout_s: float = 3.0,
        start_timeout_s: float = 10.0,
        secret: bytes | None = None,
        max_clock_skew_s: float = 60.0,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < heartbeat_min_s <= heartbeat_s or queue_max < 1 or batch_max < 1 or stream_maxlen < 1:
            raise ValueError("need 0 < heartbeat_min_s <= heartbeat_s, and positive queue_max, batch_max "
                             "and stream_maxlen")
        if max_clock_skew_s < 0:
            raise ValueError("max_clock_skew_s must not be negative")
        self.url = url
        self.instance_id = instance_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        if not self.instance_id.isascii() or not self.instance_id.isprintable() or " " in self.instance_id:
            raise ValueError("instance_id must be printable ASCII without spaces (it names the Redis client)")
        self.facts_key = f"{namespace}:sync:facts".encode()
        self.load_key = f"{namespace}:sync:load".encode()
        self.metrics = SyncMetrics(metrics_registry or CollectorRegistry(auto_describe=True))
        self._registry = registry
        self._heartbeat_s = heartbeat_s
        self._heartbeat_min_s = heartbeat_min_s
        self._peer_ttl_s = peer_ttl_s or 4 * heartbeat_s
        self._queue: deque[SyncRecord] = deque()
        self._queue_max = queue_max
        self._batch_max = batch_max
        self._stream_maxlen = stream_maxlen
        self._load_maxlen = load_maxlen
        self._history_s = history_s if history_s is not None else scheduler.config.index_max_age_s
        self._connect_timeout_s = connect_timeout_s
        self._command_timeout_s = command_timeout_s
        self._block_ms = max(10, int(min(1.0, command_timeout_s / 2) * 1000))
        self._start_timeout_s = start_timeout_s
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._monotonic = monotonic
        self._signer = Signer(secret)
        self._max_skew_s = max_clock_skew_s
        # Liveness: this instance's connections carry its name while Redis lets them (None: not
        # yet known whether CLIENT LIST shows them; False: it cannot, heartbeats are then judged
        # by their time alone).
        self._named = True
        self._listing: bool | None = None
        self._alive: frozenset[str] = frozenset()
        self._listed_at = -math.inf
        self._peers = PeerLoads()
        config = scheduler.config
        self._configured_slots = max(
            (p.placement.max_num_seqs for p in (config.default, *config.models.values())
             if p.placement.max_num_seqs), default=DEFAULT_MAX_NUM_SEQS)
        self._view = SharedView(registry, scheduler, self._peers, self.metrics, max_pending=max_pending,
                                clock=clock)
        self._facts_id = b"0-0"
        self._load_id = b"0-0"
        self._wake = asyncio.Event()
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._connected = False
        self._outage_since: float | None = None
        self._in_flight = 0  # facts taken from the queue whose XADD has not been answered yet
        self._closing = False

    # --- RouteSync -----------------------------------------------------------------------------

    async def start(self, apply: Callable[[SyncRecord], None]) -> None:
        """Connect and catch up on the recent history, then keep syncing in the background.

        Returns once caught up, or as soon as the first attempt to reach Redis failed (the router
        then starts on local state and the bus keeps retrying), or after ``start_timeout_s``."""
        self._view.apply = apply
        if not self._signer.enabled:
            log.warning("redis sync: no sync secret (--sync-secret, --sync-secret-file or "
                        "KVROUTE_SYNC_SECRET): anyone who can write to %s can steer this router's traffic "
                        "within the bounds (docs/multi-instance.md#trust-model)", redact_url(self.url))
        self._tasks = [asyncio.create_task(self._supervise(), name="kvroute-sync"),
                       asyncio.create_task(self._tick(), name="kvroute-sync-tick")]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), self._start_timeout_s)

    def publish(self, records: Sequence[SyncRecord]) -> None:
        """Queue facts for the other instances; never blocks (drops and counts when full)."""
        for record in records:
            if not self._view.local(record):
                continue
            if len(self._queue) >= self._queue_max:
                self.metrics.dropped.labels("queue_full").inc()
                continue
            self._queue.append(record)
        if self._queue:
            self._wake.set()

    async def stop(self) -> None:
        """Stop syncing; facts still queued get one short chance to reach Redis."""
        self._closing = True
        await _cancel(self._tasks, self._command_timeout_s)
        self._tasks = []
        if self._queue and self._connected:
            client = self._client()
            try:
                await asyncio.wait_for(self._flush(client), self._command_timeout_s)
            except Exception as exc:  # best effort: a lost fact costs a cache miss
                log.debug("redis sync: final flush failed: %s", exc)
            finally:
                await client.aclose()
        self._set_connected(False)

    # --- status --------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the bus is connected to Redis now."""
        return self._connected

    @property
    def caught_up(self) -> bool:
        """Whether the recent history has been read at least once."""
        return self._view.caught_up

    @property
    def unsent(self) -> int:
        """Facts published here that Redis has not acknowledged yet."""
        return len(self._queue) + self._in_flight

    @property
    def read_id(self) -> bytes:
        """Stream ID of the last facts entry read (every fact up to it has been applied or held)."""
        return self._facts_id

    @property
    def peers(self) -> int:
        """Other instances with a live heartbeat."""
        return len(self._peers)

    # --- connection lifecycle ------------------------------------------------------------------

    def _client(self) -> aioredis.Redis:
        # No client-side retries: this loop owns reconnection, with its own backoff.
        return aioredis.from_url(
            self.url, socket_connect_timeout=self._connect_timeout_s,
            socket_timeout=self._command_timeout_s + self._block_ms / 1000,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
            client_name=CLIENT_NAME_PREFIX + self.instance_id if self._named else None)

    async def _connect(self) -> aioredis.Redis:
        """A client that answered a PING; unnamed if Redis refuses ``CLIENT SETNAME`` (an ACL
        user without it), which only costs the liveness check."""
        client = self._client()
        try:
            await client.ping()
            return client
        except ResponseError as exc:
            await client.aclose()
            if not self._named:
                raise
            self._named = False
            self._listing_unavailable(f"Redis refused to name this instance's connections ({exc})")
        client = self._client()
        try:
            await client.ping()
        except BaseException:
            await client.aclose()
            raise
        return client

    async def _supervise(self) -> None:
        while not self._closing:
            client: aioredis.Redis | None = None
            try:
                client = await self._connect()
                self._listed_at = -math.inf  # who is alive is read again on this connection
                if self._view.caught_up:
                    await self._check_reset(client)
                else:
                    await self._catch_up(client)
                if self._closing:
                    return
                self._on_connected()
                self._ready.set()
                over = asyncio.Event()
                await self._run_all(over, self._read(client, over), self._send(client, over),
                                    self._heartbeat(client, over))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure, Redis or ours, must not end syncing for good
                self._on_outage(exc)
            finally:
                if client is not None:
                    with contextlib.suppress(Exception):
                        await client.aclose()
            self._ready.set()
            await asyncio.sleep(self._backoff.next_delay())

    async def _run_all(self, over: asyncio.Event, *coros: Coroutine[Any, Any, None]) -> None:
        """Run the loops together; the first to fail stops the others and its error is raised."""
        tasks = [asyncio.create_task(c) for c in coros]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            over.set()
            await _cancel(tasks, self._command_timeout_s)
        for t in done:
            exc = t.exception()
            if exc is not None:
                raise exc
        raise RuntimeError("a sync loop ended")

    def _on_connected(self) -> None:
        if self._outage_since is not None:
            log.warning("redis sync: reconnected to %s after %.1f s; sharing routing facts again",
                        redact_url(self.url), self._monotonic() - self._outage_since)
            self._outage_since = None
        else:
            log.info("redis sync: connected to %s as %s", redact_url(self.url), self.instance_id)
        self._backoff.reset()
        self._set_connected(True)

    def _on_outage(self, exc: BaseException) -> None:
        self._set_connected(False)
        if self._outage_since is not None:
            log.debug("redis sync: still unavailable: %s", exc)
            return
        self._outage_since = self._monotonic()
        self.metrics.outages.inc()
        level = logging.WARNING if _is_redis_failure(exc) else logging.ERROR
        log.log(level, "redis sync: %s unavailable (%s: %s); routing on local state, reconnecting with "
                "backoff", redact_url(self.url), type(exc).__name__, exc,
                exc_info=None if level == logging.WARNING else exc)

    def _set_connected(self, up: bool) -> None:
        self._connected = up
        self.metrics.connected.set(1 if up else 0)

    # --- reading -------------------------------------------------------------------------------

    async def _catch_up(self, client: aioredis.Redis) -> None:
        """Read the live heartbeats and the recent facts, then settle and apply them."""
        now = self._clock()
        beats = _range(await client.xrevrange(self.load_key, "+", "-", count=self._load_maxlen))
        if beats:
            self._load_id = beats[0][0]
        mono = self._monotonic()
        for _, fields in reversed(beats):
            await self._on_load(client, fields, mono, now)
        start = max(0, int((now - self._history_s) * 1000))
        self._facts_id = f"{start}-0".encode()
        low = self._facts_id
        applied = 0
        while True:
            page = _range(await client.xrange(self.facts_key, min=low, max="+", count=_PAGE))
            for entry_id, fields in page:
                self._facts_id = entry_id
                applied += self._on_facts(fields, live=False)
            if len(page) < _PAGE:
                break
            low = b"(" + self._facts_id
        self._view.finish_catch_up()
        log.info("redis sync: caught up on %d facts from %d peer(s) and the last %.0f s", applied,
                 len(self._peers), self._history_s)

    async def _check_reset(self, client: aioredis.Redis) -> None:
        """After an outage: keep reading where we stopped, unless a stream was reset (Redis restarted
        empty, or a different server): then read it from its beginning."""
        for key, attr in ((self.facts_key, "_facts_id"), (self.load_key, "_load_id")):
            newest = _range(await client.xrevrange(key, "+", "-", count=1))
            if not newest or _stream_id(newest[0][0]) < _stream_id(getattr(self, attr)):
                setattr(self, attr, b"0-0")

    async def _read(self, client: aioredis.Redis, over: asyncio.Event) -> None:
        while not over.is_set():
            resp = await client.xread({self.facts_key: self._facts_id, self.load_key: self._load_id},
                                      count=_PAGE, block=self._block_ms)
            for key, entries in _streams(resp):
                is_facts = key == self.facts_key
                for entry_id, fields in entries:
                    if is_facts:
                        self._facts_id = entry_id
                        self._on_facts(fields, live=True)
                    else:
                        self._load_id = entry_id
                        await self._on_load(client, fields, self._monotonic(), None)

    def _on_facts(self, fields: Mapping[Any, Any], *, live: bool) -> int:
        try:
            self._signer.verify(fields)
            msg = decode_facts(fields)
            if msg.instance == self.instance_id:
                return 0
            check_facts(msg, now=self._clock(), max_skew_s=self._max_skew_s,
                        held_epoch=self._held_epoch)
        except MessageError as exc:
            self._reject(exc, "facts")
            return 0
        if live:
            self.metrics.lag.observe(max(0.0, self._clock() - msg.time))
        for record in msg.records:
            state = self._registry.get(record.worker_id)
            self._view.receive(within_context(record, None if state is None else state.state.max_model_len))
        return len(msg.records)

    async def _on_load(self, client: aioredis.Redis, fields: Mapping[Any, Any], mono: float,
                       catch_up_now: float | None) -> None:
        try:
            self._signer.verify(fields)
            msg = decode_load(fields)
            if msg.instance == self.instance_id:
                return
            age = 0.0 if catch_up_now is None else max(0.0, catch_up_now - msg.time)
            if age >= msg.ttl_s:
                return  # history: it ran out long ago, whoever sent it
            known = self._peers.live(msg.instance, mono)
            instances = len(self._peers) + (1 if known else 2)
            check_load(msg, now=self._clock(), max_skew_s=self._max_skew_s, live=catch_up_now is None,
                       held_epoch=self._held_epoch,
                       max_inflight=lambda wid: self._slots(wid) * instances)
            if not known and not await self._is_alive(client, msg.instance):
                raise MessageError("unknown_instance", f"a heartbeat from {msg.instance}, which holds no "
                                                       "connection to Redis")
        except MessageError as exc:
            self._reject(exc, "load")
            return
        self._peers.update(msg, mono, age_s=age)
        self._view.peer_epochs({w: load.epoch for w, load in msg.workers.items()})
        self._peers.apply_to(self._registry.states(), self._registry.dispatch)
        self.metrics.peers.set(len(self._peers))

    def _reject(self, exc: MessageError, kind: str) -> None:
        self.metrics.rejected.labels(exc.reason).inc()
        log.debug("redis sync: rejected a %s message (%s): %s", kind, exc.reason, exc)

    def _held_epoch(self, worker_id: str) -> float | None:
        """The epoch this instance uses for a worker: agreed with the others, else its own."""
        agreed = self._view.agreed_epoch(worker_id)
        if agreed is not None:
            return agreed
        record = self._registry.get(worker_id)
        return None if record is None else record.state.epoch

    def _slots(self, worker_id: str) -> int:
        """A worker's sequence slots: what it reports or is declared with, else the configured or
        vLLM's default."""
        record = self._registry.get(worker_id)
        return (record.state.max_num_seqs if record is not None else None) or self._configured_slots

    async def _is_alive(self, client: aioredis.Redis, instance: str) -> bool:
        """Whether ``instance`` holds a connection to Redis (True when that cannot be known).
        Redis is asked again at most every ``heartbeat_min_s``: only heartbeats of instances not
        already live get here, so that is once per new peer, replay or forgery."""
        if self._listing is False:
            return True
        since = self._monotonic() - self._listed_at
        if (instance not in self._alive or since >= self._peer_ttl_s) and since >= self._heartbeat_min_s:
            await self._list_instances(client)
        return self._listing is not True or instance in self._alive

    async def _list_instances(self, client: aioredis.Redis) -> None:
        self._listed_at = self._monotonic()
        try:
            clients = await client.client_list()
        except ResponseError as exc:
            self._listing_unavailable(f"Redis refused CLIENT LIST ({exc})")
            return
        names = (str(c.get("name", "")) for c in clients)
        alive = frozenset(n.removeprefix(CLIENT_NAME_PREFIX) for n in names
                          if n.startswith(CLIENT_NAME_PREFIX))
        if self.instance_id not in alive:
            self._listing_unavailable("this instance's own connection is not in CLIENT LIST (a proxy in "
                                      "between, or names refused)")
            return
        self._alive = alive
        self._listing = True

    def _listing_unavailable(self, why: str) -> None:
        if self._listing is not False:
            log.warning("redis sync: %s; heartbeats will be judged by their time alone", why)
        self._listing = False

    # --- writing -------------------------------------------------------------------------------

    async def _send(self, client: aioredis.Redis, over: asyncio.Event) -> None:
        while not over.is_set():
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await self._flush(client)

    async def _flush(self, client: aioredis.Redis) -> None:
        while self._queue:
            batch: list[SyncRecord] = []
            hashes = 0
            while self._queue and len(batch) < self._batch_max and hashes < _MAX_BATCH_HASHES:
                record = self._queue.popleft()
                batch.append(record)
                if isinstance(record, PrefixRecord):
                    hashes += len(record.hashes)
            records = tuple(o for r in batch if (o := self._view.outgoing(r)) is not None)
            if not records:
                continue
            payload = encode_facts(FactsMessage(self.instance_id, self._clock(), records))
            self._in_flight = len(batch)
            try:
                await client.xadd(self.facts_key, self._signer.fields(payload),
                                  maxlen=self._stream_maxlen, approximate=True)
            except ResponseError as exc:
                # Redis answered but refused (out of memory, a key of another type): retrying the
                # same batch would fail the same way.
                self.metrics.dropped.labels("send_error").inc(len(records))
                log.warning("redis sync: Redis refused %d facts: %s", len(records), exc)
                continue
            except BaseException:
                self._requeue(batch)
                raise
            finally:
                self._in_flight = 0
            for r in records:
                self.metrics.published.labels(r.TYPE).inc()

    def _requeue(self, batch: list[SyncRecord]) -> None:
        """Put an unsent batch back in front (a resend after a lost reply only repeats facts,
        which is harmless), as far as the queue bound allows."""
        room = self._queue_max - len(self._queue)
        keep = batch[:max(0, room)]
        if len(keep) < len(batch):
            self.metrics.dropped.labels("queue_full").inc(len(batch) - len(keep))
        self._queue.extendleft(reversed(keep))

    async def _heartbeat(self, client: aioredis.Redis, over: asyncio.Event) -> None:
        """Send this instance's load: within ``heartbeat_min_s`` of a change, and at least every
        ``heartbeat_s`` (which keeps it alive in the peers' eyes)."""
        last: dict[str, WorkerLoad] | None = None
        sent_at = 0.0
        while not over.is_set():
            workers: dict[str, WorkerLoad] = {}
            for state in self._registry.states():
                epoch = self._view.agreed_epoch(state.id)
                if epoch is not None:  # an unsettled epoch must not reach the others
                    workers[state.id] = WorkerLoad(max(0, state.inflight), epoch)
            now = self._monotonic()
            if workers != last or now - sent_at >= self._heartbeat_s:
                msg = LoadMessage(self.instance_id, self._clock(), self._peer_ttl_s, workers)
                await client.xadd(self.load_key, self._signer.fields(encode_load(msg)),
                                  maxlen=self._load_maxlen, approximate=True)
                self.metrics.heartbeats.inc()
                last, sent_at = workers, now
            await asyncio.sleep(self._heartbeat_min_s)

    async def _tick(self) -> None:
        """Local housekeeping that must go on while Redis is away: peers whose heartbeat ran out
        stop counting, workers registered meanwhile get settled."""
        while not self._closing:
            await asyncio.sleep(self._heartbeat_s)
            self._peers.expire(self._monotonic())
            self._peers.apply_to(self._registry.states(), self._registry.dispatch)
            self.metrics.peers.set(len(self._peers))
            self._view.refresh()


async def _cancel(tasks: Sequence[asyncio.Task[None]], timeout_s: float) -> None:
    """Cancel ``tasks`` and wait for them, for at most ``timeout_s``.  The loops also stop on
    their own flag: a cancellation can be swallowed inside the Redis client (seen with TLS
    connections), and shutting down must not hang on it."""
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


def _is_redis_failure(exc: BaseException) -> bool:
    """Errors that mean Redis is unreachable, slow or refusing us, as opposed to a bug here."""
    return isinstance(exc, RedisError | OSError | TimeoutError)
