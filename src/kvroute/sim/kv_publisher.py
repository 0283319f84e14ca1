"""One replica's ZeroMQ KV-event publisher, as vLLM's ``ZmqEventPublisher`` behaves on the wire.

A PUB socket sends each batch as ``(topic, seq, payload)``, ``seq`` counting from 0; a ROUTER socket
(when ``replay_endpoint`` is set) answers a start sequence number with every buffered batch from
there on (the last ``buffer_steps``) and an end marker.  As in vLLM, an endpoint with ``*``, ``::``,
``ipc://`` or ``inproc://`` is bound and any other is connected to (the subscriber binds); the
replay endpoint is always bound; data-parallel rank ``r`` uses both ports plus ``r``.

The encoding decides the generation imitated: ``"map"`` (the newest vLLM: events as maps tagged
``"type"``, replay replies carrying the topic) or ``"array"`` (older vLLM: positional events, replay
replies ``(seq, payload)``).

Where it differs from vLLM: batches are sent on the simulator's event loop when the step that made
them ends, so vLLM's ``max_queue_size`` (its queue to a publishing thread) never fills; a restart
(``reset``) starts the sequence again at 0 with an empty replay buffer, as a new vLLM process does,
without closing the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from kvroute.fleet.kv_event_wire import (
    Encoding,
    EventBatch,
    KVEventsConfig,
    encode_batch,
    offset_endpoint_port,
    parse_seq,
    replay_end_frames,
    replay_frames,
    seq_frame,
)

log = logging.getLogger("kvroute.sim.kv_events")


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6 or local endpoint, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """PUB + ROUTER sockets of one data-parallel rank; ``publish`` is called on the event loop."""

    def __init__(self, config: KVEventsConfig, rank: int, encoding: Encoding,
                 context: zmq.asyncio.Context, *, port_offset: int | None = None) -> None:
        """Publish as data-parallel ``rank`` on the configured ports plus ``port_offset`` (default:
        the rank, as vLLM)."""
        self.config = config
        self.rank = rank
        self.encoding = encoding
        self._topic = config.topic.encode()
        self._with_topic = encoding == "map"
        offset = rank if port_offset is None else port_offset
        self._endpoint = offset_endpoint_port(config.endpoint, offset) or config.endpoint
        self._replay_endpoint = offset_endpoint_port(config.replay_endpoint, offset)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.published = 0
        self.replays = 0
        # The PUB side is a plain (synchronous) socket on the same context: sending never blocks.
        self._pub: zmq.Socket[bytes] = zmq.Context.shadow(context.underlying).socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.bound_endpoint = self._endpoint
        self.bound_replay_endpoint = self._replay_endpoint
        try:
            if _binds(self._endpoint):
                self._pub.bind(self._endpoint)
                self.bound_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(self._endpoint)
            if self._replay_endpoint is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self._replay_endpoint)
                self.bound_replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"KV events of rank {rank}: cannot use {self._endpoint!r} / "
                             f"{self._replay_endpoint!r}: {exc}") from None

    def start(self) -> None:
        """Start answering replay requests (on the running event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.create_task(self._serve_replay(), name=f"sim-kv-replay-{self.rank}")

    def publish(self, batch: EventBatch) -> int:
        """Send one batch (its rank set to ours when it has none); returns its sequence number."""
        if batch.data_parallel_rank is None:
            batch = EventBatch(batch.ts, batch.events, self.rank)
        payload = encode_batch(batch, encoding=self.encoding)
        seq = self._next_seq
        self._next_seq += 1
        # PUB never blocks: past the high-water mark ZeroMQ drops the message for that subscriber,
        # who sees the gap in the sequence numbers and asks for a replay.
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self._topic, seq_frame(seq), payload], flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published += 1
        return seq

    def reset(self) -> None:
        """A new engine process: the sequence starts again at 0 and nothing is left to replay."""
        self._next_seq = 0
        self._buffer.clear()

    async def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                log.warning("kv events rank %d: invalid replay request of %d frames", self.rank, len(frames))
                continue
            client, _empty, start_frame = frames
            try:
                start = parse_seq(start_frame)
            except ValueError:
                log.warning("kv events rank %d: invalid replay start %r", self.rank, start_frame[:16])
                continue
            self.replays += 1
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await replay.send_multipart(
                        [client, b"", *replay_frames(self._topic, seq, payload, with_topic=self._with_topic)])
            await replay.send_multipart([client, b"", *replay_end_frames(with_topic=self._with_topic)])

    def describe(self) -> dict[str, Any]:
        """Where this rank publishes and how far it got (``/server_info`` shows it)."""
        return {
            "data_parallel_rank": self.rank, "encoding": self.encoding, "topic": self.config.topic,
            "endpoint": self.bound_endpoint, "replay_endpoint": self.bound_replay_endpoint,
            "binds": _binds(self._endpoint), "next_seq": self._next_seq,
            "buffered": len(self._buffer), "buffer_steps": self.config.buffer_steps,
            "published": self.published, "replays": self.replays,
        }

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    async def close(self) -> None:
        """Stop replaying and close both sockets."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self._close_sockets()
