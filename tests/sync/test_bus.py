"""The bus on its own, against a real redis-server: load agreement, bounded publishing while Redis
is away, a late Redis, TLS."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sync_helpers import wait_until

from kvroute.fleet.registry import Registry
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.sync_record import SessionRecord
from kvroute.sync.local_redis import LocalRedis, free_port
from kvroute.sync.redis_bus import RedisBus, redact_url

URLS = [f"http://127.0.0.1:{9100 + i}" for i in range(3)]
KEY = RoutingKey("m", b"<a prompt long enough for a few blocks> " * 100, est_prompt_tokens=1000)


class Node:
    """A router instance without HTTP: registry, scheduler and bus wired as the server wires them."""

    def __init__(self, url: str, **bus_kwargs: object) -> None:
        self.registry = Registry()
        self.scheduler = Scheduler()
        self.prometheus = CollectorRegistry()
        settings: dict[str, Any] = {"heartbeat_s": 0.05, **bus_kwargs}
        self.bus = RedisBus(url, registry=self.registry, scheduler=self.scheduler,
                            metrics_registry=self.prometheus, **settings)
        self.registry.subscribe(self)

    def on_worker_epoch(self, worker_id: str, epoch: float) -> None:
        self.bus.publish(self.scheduler.on_worker_epoch(worker_id, epoch))

    def on_worker_removed(self, worker_id: str) -> None:
        self.scheduler.on_worker_removed(worker_id)

    async def start(self) -> Node:
        for url in URLS:
            self.registry.add(url, models=["m"])
        await self.bus.start(self.scheduler.apply_remote)
        return self

    def route(self) -> str:
        d = self.scheduler.decide(KEY, self.registry.states())
        assert d.worker_id is not None
        self.bus.publish(self.scheduler.commit(KEY, d))
        return d.worker_id

    def matched(self) -> int:
        return self.scheduler.decide(KEY, self.registry.states()).matched_blocks

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.prometheus.get_sample_value(name, labels or {}) or 0.0

    def peer_inflight(self) -> dict[str, int]:
        return {s.id: s.peer_inflight for s in self.registry.states()}


@pytest.fixture
async def nodes() -> AsyncIterator[Callable[..., Awaitable[Node]]]:
    started: list[Node] = []

    async def make(url: str, **bus_kwargs: object) -> Node:
        node = Node(url, **bus_kwargs)
        started.append(node)
        return await node.start()

    yield make
    for node in started:
        await node.bus.stop()


async def test_instances_count_each_others_inflight_until_the_heartbeat_expires(
        redis_server: LocalRedis, nodes: Callable[..., Awaitable[Node]]) -> None:
    a, b = await nodes(redis_server.url), await nodes(redis_server.url)
    busy = a.registry.states()[1]
    busy.inflight = 3
    await wait_until(lambda: b.peer_inflight()[busy.id] == 3, what="b to see a's load")
    assert a.peer_inflight()[busy.id] == 0  # an instance never counts itself twice
    assert b.sample("kvroute_sync_peers") == 1
    # b now prefers the other workers for a cold request, as if it had sent a's requests itself.
    assert b.route() != busy.id
    await a.bus.stop()
    await wait_until(lambda: b.peer_inflight()[busy.id] == 0, what="a's load to expire")
    assert b.sample("kvroute_sync_peers") == 0


async def test_a_load_change_is_sent_without_waiting_for_the_next_heartbeat(
        redis_server: LocalRedis, nodes: Callable[..., Awaitable[Node]]) -> None:
    # Heartbeats every 10 s, changes within 50 ms: seeing the change within 5 s (100 times the
    # change delay, half the heartbeat interval) can only come from the change-driven send.
    a = await nodes(redis_server.url, heartbeat_s=10.0, heartbeat_min_s=0.05)
    b = await nodes(redis_server.url, heartbeat_s=10.0, heartbeat_min_s=0.05)
    await wait_until(lambda: b.bus.peers == 1, what="b to hear a")
    a.registry.states()[0].inflight = 2
    await wait_until(lambda: b.peer_inflight()[a.registry.states()[0].id] == 2, timeout_s=5.0,
                     what="the change to reach b")


async def test_publishing_while_redis_is_away_never_blocks_and_is_bounded(
        nodes: Callable[..., Awaitable[Node]]) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    node = await nodes(dead, queue_max=10, connect_timeout_s=0.5)
    assert node.sample("kvroute_sync_connected") == 0
    assert node.sample("kvroute_sync_outages_total") == 1
    node.bus.publish([SessionRecord(i, "127.0.0.1:9100", 1.0) for i in range(25)])
    # 3 epoch announcements from registering the workers were queued first.
    assert node.bus.unsent == 10
    assert node.sample("kvroute_sync_dropped_total", {"reason": "queue_full"}) == 18
    node.route()  # routing is unaffected


async def test_a_late_redis_gets_the_queued_facts_and_its_outage_is_logged_once(
        nodes: Callable[..., Awaitable[Node]], redis_servers: Callable[..., LocalRedis],
        caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    a = await nodes(url, connect_timeout_s=0.5)
    home = a.route()
    await asyncio.sleep(0.5)  # several reconnect attempts meanwhile
    redis_servers(port=port)
    await wait_until(lambda: a.bus.connected and a.bus.unsent == 0, what="a to connect and send")
    b = await nodes(url)
    assert b.bus.caught_up
    assert b.matched() > 0 and b.route() == home
    lost = [r for r in caplog.records if r.name == "kvroute.sync" and "unavailable" in r.getMessage()]
    assert len(lost) == 1


def test_passwords_stay_out_of_logs() -> None:
    assert redact_url("rediss://user:pw@host:6380/0") == "rediss://user:***@host:6380/0"
    assert redact_url("redis://:pw@[::1]:6379") == "redis://:***@[::1]:6379"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
async def test_tls_urls_work(tmp_path: Path, redis_servers: Callable[..., LocalRedis],
                             nodes: Callable[..., Awaitable[Node]]) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    tls_port = free_port()
    redis_servers(password="pw", extra_args=("--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                                             "--tls-key-file", str(key), "--tls-auth-clients", "no"))
    url = f"rediss://:pw@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
    a = await nodes(url)
    assert a.bus.connected
    home = a.route()
    b = await nodes(url)
    await wait_until(lambda: a.bus.unsent == 0 and b.matched() > 0, what="facts over TLS")
    assert b.route() == home
