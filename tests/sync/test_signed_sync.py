"""Signed sync (issue 24, item 5): what a writer to Redis can do to routers that share a secret,
against real routers, simulated replicas and a real redis-server.

The campaign of issue 24 forged heartbeats with 5,000 requests in flight on two workers (every
request then went to the others) and an epoch fact that moved every worker to ~2058, for good.
Here the same forgeries, unsigned, wrongly signed and signed with the real secret, move nothing;
a plausible signed heartbeat from an instance that is alive does (the control: the test could
fail).
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from sync_helpers import Conversation, bus, metric, synced, total, wait_until

from kvroute.router_settings import Settings, SettingsError
from kvroute.server.app import RunningRouter
from kvroute.sim.server import SimFleet
from kvroute.sync.local_redis import LocalRedis, free_port
from kvroute.sync.messages import FIELD
from kvroute.sync.metrics import REJECT_REASONS
from kvroute.sync.redis_bus import CLIENT_NAME_PREFIX
from kvroute.sync.trust import SIGNATURE_FIELD, Signer

Instances = Callable[..., Awaitable[RunningRouter]]

SECRET = "4f1c9a0e7b2d4c6e8a1f3b5d7e9c0a2b"
OTHER_SECRET = "another-secret-of-enough-bytes!"
FAR = 2_845_000_000.0  # an epoch in 2060, as forged in issue 24


def rejected(r: RunningRouter, reason: str) -> float:
    return metric(r, "kvroute_sync_rejected_total", {"reason": reason})


def epochs(r: RunningRouter) -> dict[str, float]:
    return {s.id: s.epoch for s in r.registry.states()}


async def forge(url: str, key: bytes, doc: dict[str, Any], secret: str | None = None,
                client: aioredis.Redis | None = None) -> None:
    """Append ``doc`` to a stream as a writer to Redis can: unsigned, or signed with ``secret``."""
    fields = Signer(None if secret is None else secret.encode()).fields(orjson.dumps(doc))
    own = client is None
    client = client or aioredis.from_url(url)
    try:
        await client.xadd(key, fields)
    finally:
        if own:
            await client.aclose()


def heartbeat(src: str, workers: dict[str, tuple[int, float]], t: float | None = None) -> dict[str, Any]:
    return {"v": 1, "kind": "load", "src": src, "t": time.time() if t is None else t, "ttl": 1.0,
            "workers": {w: list(v) for w, v in workers.items()}}


@asynccontextmanager
async def forging(period_s: float, *beats: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Send the forged heartbeats every ``period_s`` while the block runs."""
    done = asyncio.Event()

    async def loop() -> None:
        # Stopped by the flag, not by cancelling: redis-py can swallow a cancellation that lands
        # while a connection opens or closes, and the loop would go on for ever.
        while not done.is_set():
            for beat in beats:
                await beat()
            await asyncio.sleep(period_s)

    task = asyncio.create_task(loop())
    try:
        await asyncio.sleep(period_s * 3)  # several rounds before the first request
        yield
    finally:
        done.set()
        await asyncio.wait_for(task, 10)


async def spread(routers: list[RunningRouter], http: aiohttp.ClientSession, n: int,
                 first: int) -> Counter[str]:
    """Where ``n`` new conversations (one request each, alternating instances) are served."""
    served: Counter[str] = Counter()
    for i in range(n):
        served[await Conversation(first + i).turn(http, routers[i % len(routers)].url)] += 1
    return served


async def test_forged_heartbeats_move_no_traffic_and_a_live_signed_one_does(
        redis_server: LocalRedis, instances: Instances, http: aiohttp.ClientSession) -> None:
    a = await instances(redis_server.url, sync_secret=SECRET)
    b = await instances(redis_server.url, sync_secret=SECRET)
    await wait_until(lambda: bus(a).peers == 1 and bus(b).peers == 1, what="the routers to hear each other")
    ids = sorted(epochs(a))
    targets = ids[:2]
    held = epochs(a)
    slots = min(s.max_num_seqs or 256 for s in a.registry.states())  # the simulated engines say 32
    load_key = bus(a).load_key
    url = redis_server.url

    def beat(src: str, n: int) -> dict[str, Any]:
        return heartbeat(src, {w: (n, held[w]) for w in targets})

    async def unsigned() -> None:
        await forge(url, load_key, beat("forger-1", 5000))

    async def wrong_secret() -> None:
        await forge(url, load_key, beat("forger-2", 5000), OTHER_SECRET)

    async def signed_implausible() -> None:  # the real secret: the bounds still hold
        await forge(url, load_key, beat("forger-3", 5000), SECRET)

    async def signed_from_nobody() -> None:  # plausible, but no such instance is connected
        await forge(url, load_key, beat("ghost", slots), SECRET)

    peer_load: list[int] = []

    async def watch() -> None:
        peer_load.extend(s.peer_inflight for r in (a, b) for s in r.registry.states())

    async with forging(0.2, unsigned, wrong_secret, signed_implausible, signed_from_nobody, watch):
        served = await spread([a, b], http, 24, first=0)
    for r in (a, b):
        for reason in ("unsigned", "bad_signature", "implausible_load", "unknown_instance"):
            assert rejected(r, reason) >= 3, (reason, rejected(r, reason))
    # Requests go one at a time: a peer's real load is 0 or 1 (2 while a heartbeat lags a turn).
    assert max(peer_load) <= 2, max(peer_load)
    assert all(served[w] > 0 for w in targets), served

    # The control: a signed, plausible heartbeat from an instance that holds a connection to Redis
    # (as a real peer does) is believed, and the two workers it fills get no new conversation.
    ghost = aioredis.from_url(url, client_name=CLIENT_NAME_PREFIX + "ghost-2")
    await ghost.ping()

    async def live_signed() -> None:
        await forge(url, load_key, beat("ghost-2", slots), SECRET, client=ghost)

    try:
        async with forging(0.2, live_signed):
            await wait_until(lambda: all(s.peer_inflight == slots for r in (a, b) for s in r.registry.states()
                                         if s.id in targets), what="the live peer's load to count")
            moved = await spread([a, b], http, 12, first=100)
    finally:
        await ghost.aclose()
    assert all(moved[w] == 0 for w in targets), moved


async def test_a_forged_epoch_changes_nothing_and_is_not_adopted_later(
        redis_server: LocalRedis, instances: Instances) -> None:
    a = await instances(redis_server.url, sync_secret=SECRET)
    b = await instances(redis_server.url, sync_secret=SECRET)
    await wait_until(lambda: bus(a).peers == 1 and bus(b).peers == 1, what="the routers to hear each other")
    before = epochs(a)
    assert epochs(b) == before
    url, facts, load = redis_server.url, bus(a).facts_key, bus(a).load_key
    poison = {"v": 1, "kind": "facts", "src": "evil", "t": time.time(),
              "records": [{"type": "epoch", "worker_id": w, "epoch": FAR} for w in before]}
    await forge(url, facts, poison)  # as stored before the routers had a secret: unsigned
    await forge(url, facts, poison, SECRET)  # a signed peer gone wrong
    prefix = {**poison, "records": [{"type": "prefix", "worker_id": w, "epoch": FAR, "time": time.time(),
                                     "hashes": [1, 2, 3], "prefill_tokens": 10} for w in before]}
    await forge(url, facts, prefix, SECRET)
    named = aioredis.from_url(url, client_name=CLIENT_NAME_PREFIX + "evil")
    try:
        await forge(url, load, heartbeat("evil", {w: (0, FAR) for w in before}), SECRET, client=named)
        for r in (a, b):
            await wait_until(lambda r=r: rejected(r, "unsigned") >= 1 and rejected(r, "future_epoch") >= 3,
                             what="the forged epochs rejected")
    finally:
        await named.aclose()
    await asyncio.sleep(0.3)  # a few heartbeats more: nothing follows the forged epoch
    assert epochs(a) == epochs(b) == before
    assert metric(a, "kvroute_sync_applied_total", {"kind": "epoch"}) == 0

    # Routers started now read those facts from the stream's history: none adopts them, with or
    # without a secret (the bounds do not need one).
    c = await instances(redis_server.url, sync_secret=SECRET)
    d = await instances(redis_server.url)
    for late in (c, d):
        assert bus(late).caught_up
        assert epochs(late) == before
        assert rejected(late, "future_epoch") >= 2
    assert rejected(c, "unsigned") >= 1


async def test_routers_with_the_same_secret_agree(
        redis_server: LocalRedis, instances: Instances, http: aiohttp.ClientSession,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.sync")
    a = await instances(redis_server.url, policy="prefix", sync_secret=SECRET)
    b = await instances(redis_server.url, policy="prefix", sync_secret=SECRET)
    convs = [Conversation(i) for i in range(4)]
    for turn in range(3):
        for c in convs:
            await c.turn(http, (a, b)[(c.index + turn) % 2].url)
        await asyncio.sleep(0.25)
        await synced([a, b], redis_server.url)
    assert all(c.follow_ups_home() == (2, 2) for c in convs), [c.workers for c in convs]
    assert epochs(a) == epochs(b)
    for r in (a, b):
        assert bus(r).peers == 1
        assert total(r, "kvroute_sync_applied_total") > 0
        assert all(rejected(r, reason) == 0 for reason in REJECT_REASONS)
    assert not [r for r in caplog.records if "no sync secret" in r.getMessage()]
    # Every entry on both streams is signed with the secret.
    client = aioredis.from_url(redis_server.url)
    try:
        entries = [e for key in (bus(a).facts_key, bus(a).load_key) for e in await client.xrange(key)]
    finally:
        await client.aclose()
    assert entries
    signer = Signer(SECRET.encode())
    for _, fields in entries:
        signer.verify(fields)


async def test_a_wrong_secret_shares_nothing_and_is_counted(
        redis_server: LocalRedis, instances: Instances, http: aiohttp.ClientSession) -> None:
    a = await instances(redis_server.url, policy="prefix", sync_secret=SECRET)
    b = await instances(redis_server.url, policy="prefix", sync_secret=OTHER_SECRET)
    for i in range(3):
        await Conversation(i).turn(http, a.url)
        await Conversation(10 + i).turn(http, b.url)
    for r in (a, b):
        await wait_until(lambda r=r: rejected(r, "bad_signature") >= 5, what="the other's messages rejected")
    assert bus(a).peers == bus(b).peers == 0
    assert total(a, "kvroute_sync_applied_total") == total(b, "kvroute_sync_applied_total") == 0
    assert all(s.peer_inflight == 0 for r in (a, b) for s in r.registry.states())


async def test_with_and_without_a_secret_only_the_one_without_listens(
        redis_server: LocalRedis, instances: Instances, http: aiohttp.ClientSession,
        caplog: pytest.LogCaptureFixture) -> None:
    """A mixed rollout: the router with the secret ignores the one without; the one without, which
    authenticates nothing, still hears the signed one."""
    caplog.set_level(logging.WARNING, logger="kvroute.sync")
    signed = await instances(redis_server.url, policy="prefix", sync_secret=SECRET)
    unsigned = await instances(redis_server.url, policy="prefix")
    for i in range(3):
        await Conversation(i).turn(http, signed.url)
        await Conversation(10 + i).turn(http, unsigned.url)
    await wait_until(lambda: rejected(signed, "unsigned") >= 5 and bus(unsigned).peers == 1
                     and total(unsigned, "kvroute_sync_applied_total") >= 3, what="one-way sharing")
    assert bus(signed).peers == 0 and total(signed, "kvroute_sync_applied_total") == 0
    assert rejected(unsigned, "bad_signature") == rejected(unsigned, "unsigned") == 0
    warned = [r for r in caplog.records if "no sync secret" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


async def test_a_replayed_heartbeat_of_a_stopped_instance_is_refused(
        redis_server: LocalRedis, instances: Instances) -> None:
    a = await instances(redis_server.url, sync_secret=SECRET)
    b = await instances(redis_server.url, sync_secret=SECRET)
    a.registry.states()[0].inflight = 7  # a's heartbeats now carry load worth replaying
    victim = a.registry.states()[0].id
    await wait_until(lambda: b.registry.get(victim).state.peer_inflight == 7, what="b to count a's load")
    client = aioredis.from_url(redis_server.url)
    try:
        newest = (await client.xrevrange(bus(a).load_key, "+", "-", count=1))[0][1]
        a.registry.states()[0].inflight = 0
        await a.close()
        await wait_until(lambda: bus(b).peers == 0, what="a's heartbeat to run out")
        for _ in range(3):
            await client.xadd(bus(b).load_key, newest)  # signed by a, byte for byte
            await asyncio.sleep(0.1)
    finally:
        await client.aclose()
    await wait_until(lambda: rejected(b, "unknown_instance") >= 3, what="the replays refused")
    assert bus(b).peers == 0 and b.registry.get(victim).state.peer_inflight == 0


@pytest.mark.parametrize("denied", ["-client", "-client|list"])
async def test_without_client_commands_heartbeats_are_judged_by_time_alone(
        denied: str, redis_servers: Callable[..., LocalRedis], instances: Instances,
        caplog: pytest.LogCaptureFixture) -> None:
    """An ACL user that may not name its connection or list clients: sharing works, the liveness
    check is off (said once per instance), the other checks hold."""
    caplog.set_level(logging.WARNING, logger="kvroute.sync")
    server = redis_servers(extra_args=("--user", "kv", "on", ">pw", "~*", "&*", "+@all", denied))
    url = f"redis://kv:pw@127.0.0.1:{server.port}/0"
    a = await instances(url, sync_secret=SECRET)
    b = await instances(url, sync_secret=SECRET)
    a.registry.states()[1].inflight = 2
    busy = a.registry.states()[1].id
    await wait_until(lambda: b.registry.get(busy).state.peer_inflight == 2, what="b to count a's load")
    await forge(url, bus(a).load_key, heartbeat("x", {busy: (5000, 0.0)}), SECRET)
    await wait_until(lambda: rejected(b, "implausible_load") >= 1, what="the bound to hold")
    a.registry.states()[1].inflight = 0
    off = [r for r in caplog.records if "judged by their time alone" in r.getMessage()]
    assert len(off) == 2  # one per instance


# --- settings and the command line --------------------------------------------------------------

def test_the_secret_comes_from_the_setting_a_file_or_the_environment(tmp_path: Path) -> None:
    assert Settings().sync_key() is None
    assert Settings.load(env={"KVROUTE_SYNC_SECRET": SECRET}).sync_key() == SECRET.encode()
    assert Settings.load(env={"KVROUTE_SYNC_SECRET": ""}).sync_secret is None
    path = tmp_path / "sync.secret"
    path.write_text(SECRET + "\n")
    config = tmp_path / "kvroute.toml"
    config.write_text(f'sync_secret_file = "{path}"\nsync_max_clock_skew_s = 5\n')
    s = Settings.load(config, env={})
    assert s.sync_key() == SECRET.encode() and s.sync_max_clock_skew_s == 5.0
    assert Settings.load(env={"KVROUTE_SYNC_SECRET_FILE": str(path)}).sync_key() == SECRET.encode()


@pytest.mark.parametrize(("raw", "message"), [
    ({"sync_secret": "short"}, "at least 16 bytes"),
    ({"sync_secret": SECRET, "sync_secret_file": "/x"}, "not both"),
    ({"sync_secret_file": "/nonexistent/kvroute-secret"}, "cannot read sync_secret_file"),
    ({"sync_max_clock_skew_s": -1}, "sync_max_clock_skew_s must not be negative"),
])
def test_bad_sync_settings_are_named(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_dict(raw)


async def test_kvroute_serve_signs_with_the_secret_file(
        tmp_path: Path, redis_server: LocalRedis, sim: SimFleet, http: aiohttp.ClientSession) -> None:
    path = tmp_path / "sync.secret"
    path.write_text(SECRET)
    port = free_port()
    log = tmp_path / "router.log"
    args = [sys.executable, "-c", "from kvroute.cli import main; main()", "serve", "--worker", sim.urls[0],
            "--port", str(port), "--redis", redis_server.url, "--sync-secret-file", str(path)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "KVROUTE_ADMIN_TOKEN": ""})
    client = aioredis.from_url(redis_server.url)
    try:
        for _ in range(300):
            assert proc.poll() is None, log.read_text()
            entries = await client.xrange(b"kvroute:sync:load", count=1)
            if entries:
                break
            await asyncio.sleep(0.05)
        fields = entries[0][1]
        Signer(SECRET.encode()).verify(fields)
        assert fields[SIGNATURE_FIELD] and fields[FIELD]
    finally:
        await client.aclose()
        proc.terminate()
        proc.wait(30)
    assert "no sync secret" not in log.read_text()
