"""Discovery of replicas end to end: a router started with ``discover`` alone finds simulated
replicas through a real DNS server (dnsmasq on loopback) whose records change during the test, or
through a watched file; replicas that appear are probed and registered, those that vanish are
drained (a request in flight there finishes) and then removed; failures keep the last set."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from serve_process import wait_ready
from test_processes import ADMIN, TOKEN, free_port, router_processes, samples
from test_processes import Router as ProcessRouter

from dns_server import DnsServer, require_dnsmasq
from kvroute.router_settings import Settings, SettingsError, parse_worker_spec
from kvroute.server.app import RunningRouter, start_router
from kvroute.sim.server import SimFleet, start_sim_fleet

MODEL = "qwen3-4b"
AUTH = {"Authorization": "Bearer secret"}
ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


async def sims_on_one_port(addresses: Sequence[str]) -> tuple[list[SimFleet], int]:
    """One simulated replica on each loopback address, all on the same port (a DNS name gives one
    port for all its records)."""
    for _ in range(10):
        first = await start_sim_fleet("a4000-qwen3-4b", 1, host=addresses[0], speed=1.0)
        port = int(first.urls[0].rpartition(":")[2])
        fleets = [first]
        try:
            for address in addresses[1:]:
                fleets.append(await start_sim_fleet("a4000-qwen3-4b", 1, host=address, base_port=port,
                                                    speed=1.0))
        except OSError:  # that port is taken on another address: try another one
            for fleet in fleets:
                await fleet.close()
            continue
        return fleets, port
    raise RuntimeError("no port free on every loopback address")


@pytest.fixture
async def sims() -> AsyncIterator[Callable[[Sequence[str]], Awaitable[int]]]:
    started: list[SimFleet] = []

    async def make(addresses: Sequence[str]) -> int:
        fleets, port = await sims_on_one_port(addresses)
        started.extend(fleets)
        return port

    yield make
    for fleet in started:
        await fleet.close()


@pytest.fixture
async def dns(tmp_path) -> AsyncIterator[Callable[..., Awaitable[DnsServer]]]:
    servers: list[DnsServer] = []

    async def make(records: dict[str, list[str]], **kwargs: Any) -> DnsServer:
        server = await DnsServer.start(tmp_path / f"dns{len(servers)}", records, **kwargs)
        servers.append(server)
        return server

    require_dnsmasq()
    yield make
    for server in servers:
        server.close()


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    routers: list[RunningRouter] = []

    async def make(*, workers: Sequence[str] = (), **settings: Any) -> RunningRouter:
        base = {"probe_interval_s": 0.1, "probe_timeout_s": 1.0, "admin_token": "secret",
                "discover_interval_s": 0.1}
        s = Settings.from_dict({**base, **settings}).replace(
            workers=tuple(parse_worker_spec(u) for u in workers))
        running = await start_router(s)
        routers.append(running)
        return running

    yield make
    for running in routers:
        await running.close()


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting until {what}")


def fleet(r: RunningRouter) -> dict[str, tuple[str, bool]]:
    """worker id -> (source, draining)."""
    return {rec.id: (rec.source, rec.state.draining) for rec in r.registry.records()}


async def metric(http, r: RunningRouter, name: str, source: str) -> float:
    async with http.get(r.url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + "{") and f'source="{source}"' in line:
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"no {name}{{source={source!r}}} in /metrics")


async def chat(http, r: RunningRouter) -> tuple[int, str | None]:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvroute-worker")


async def test_dns_records_that_change_become_the_fleet(dns, sims, router, http, caplog):
    caplog.set_level(logging.INFO, logger="kvroute.discovery")
    port = await sims(ADDRESSES)
    server = await dns({"replicas.test": ["127.0.0.2", "127.0.0.3"]},
                       names_without_addresses=["replicas.test"])
    source = f"dns://replicas.test:{port}?server={server.address}"
    r = await router(discover=[source])
    ids = [f"{a}:{port}" for a in ADDRESSES]
    # Registered and probed before the router accepted its first request.
    assert fleet(r) == {ids[0]: (source, False), ids[1]: (source, False)}
    assert all(rec.state.healthy and rec.state.models == {MODEL} for rec in r.registry.records())
    async with http.get(r.url + "/ready") as resp:
        assert resp.status == 200
    assert (await chat(http, r))[0] == 200
    assert await metric(http, r, "kvroute_discovered_workers", source) == 2

    # A third record: probed and registered.
    await server.set_records({"replicas.test": list(ADDRESSES)})
    await until(lambda: ids[2] in fleet(r), "the new replica is registered")
    assert r.registry.get(ids[2]).state.healthy

    # A replica serving a long stream leaves the DNS answer: drained, the stream finishes, removed.
    body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "a long answer please"}]}
    async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        busy = resp.headers["x-kvroute-worker"]
        first = await resp.content.readany()
        staying = [a for a, wid in zip(ADDRESSES, ids, strict=True) if wid != busy]
        await server.set_records({"replicas.test": staying})
        await until(lambda: fleet(r)[busy] == (source, True), "the vanished replica is draining")
        await asyncio.sleep(0.5)  # five discovery rounds: not removed while its request is in flight
        assert not resp.content.at_eof()
        assert fleet(r)[busy] == (source, True)
        rest = await resp.read()
    assert (first + rest).endswith(b"data: [DONE]\n\n")
    assert len(re.findall(rb'"content":', first + rest)) >= 200
    await until(lambda: busy not in fleet(r), "the drained replica is removed")
    assert {w for _, w in [await chat(http, r) for _ in range(6)]} <= set(fleet(r))
    assert await metric(http, r, "kvroute_discovered_workers", source) == 2

    # The name answers no address: the replicas are kept for one round, then drained.
    await server.set_records({"replicas.test": []})
    await until(lambda: all(draining for _, draining in fleet(r).values()) or not fleet(r),
                "every replica is drained")
    assert "lists no replica (1 in a row): keeping the last 2" in caplog.text
    await until(lambda: not fleet(r), "the drained replicas are removed")
    async with http.get(r.url + "/ready") as resp:
        assert resp.status == 503
    assert (await chat(http, r))[0] == 503

    # Back again: registered afresh.
    await server.set_records({"replicas.test": ["127.0.0.3"]})
    await until(lambda: fleet(r) == {ids[1]: (source, False)}, "the replica comes back")
    assert (await chat(http, r)) == (200, ids[1])
    assert await metric(http, r, "kvroute_discovery_errors_total", source) == 0


async def test_a_name_that_stops_resolving_keeps_the_last_replicas(dns, sims, router, http, caplog):
    caplog.set_level(logging.INFO, logger="kvroute.discovery")
    port = await sims(ADDRESSES[:2])
    server = await dns({"fleet.test": list(ADDRESSES[:2])})
    source = f"dns://fleet.test:{port}?server={server.address}"
    r = await router(discover=[source])
    assert len(fleet(r)) == 2
    await server.set_records({"fleet.test": []})  # NXDOMAIN
    await until(lambda: r.discovery is not None and r.discovery.reconciler.views[source].failures >= 5,
                "several rounds failed")
    assert fleet(r) == {f"{a}:{port}": (source, False) for a in ADDRESSES[:2]}
    assert (await chat(http, r))[0] == 200
    assert await metric(http, r, "kvroute_discovery_errors_total", source) >= 5
    assert await metric(http, r, "kvroute_discovered_workers", source) == 2
    failures = [m for m in caplog.messages if "failed: fleet.test" in m]
    assert len(failures) == 1, failures  # logged once, then at most once a minute
    assert "no such name (NXDOMAIN); keeping the last 2 replica(s)" in failures[0]
    await server.set_records({"fleet.test": [ADDRESSES[0]]})
    await until(lambda: len(fleet(r)) == 1 or any(d for _, d in fleet(r).values()), "the answer is back")
    assert any("answers again after" in m for m in caplog.messages)


async def test_a_router_may_start_before_its_dns_answers(dns, sims, router, http):
    port = await sims(ADDRESSES[:1])
    server = await dns({})
    source = f"dns://late.test:{port}?server={server.address}"
    r = await router(discover=[source], admin_token=None)
    assert fleet(r) == {}
    await server.set_records({"late.test": [ADDRESSES[0]]})
    await until(lambda: bool(fleet(r)), "the replica is discovered")
    await until(lambda: r.registry.get(f"{ADDRESSES[0]}:{port}").state.ready, "it is ready")
    assert (await chat(http, r))[0] == 200


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_a_watched_file_of_urls_becomes_the_fleet(sim_fleet, router, http, tmp_path):
    sims = await sim_fleet(5)
    static, by_admin, a, b, c = sims.urls
    path = tmp_path / "workers"
    path.write_text(f"# the fleet\n{a}\n{b}\n{static}\n")
    source = f"file://{path}"
    r = await router(workers=[static], discover=[source], discover_empty_rounds=3)
    async with http.post(r.url + "/admin/workers", json={"url": by_admin}, headers=AUTH) as resp:
        assert resp.status == 201
    sid, aid, bid, cid, admin_id = (u.removeprefix("http://") for u in (static, a, b, c, by_admin))
    # The configured worker listed in the file stays the configuration's.
    assert fleet(r) == {sid: ("config", False), aid: (source, False), bid: (source, False),
                        admin_id: ("admin", False)}
    async with http.get(r.url + "/admin/workers", headers=AUTH) as resp:
        assert {w["id"]: w["source"] for w in (await resp.json())["workers"]}[aid] == source

    write_atomically(path, f"{b}\n{c}\n")
    await until(lambda: aid not in fleet(r) and cid in fleet(r), "the file's change is applied")
    assert fleet(r)[bid] == (source, False)

    # A malformed file keeps the last set and is counted.
    write_atomically(path, f"{b}\n{c}\nnot a url\n")
    await until(lambda: r.discovery.reconciler.views[source].failures >= 2, "the bad file is read")
    assert {bid, cid} <= set(fleet(r))
    assert await metric(http, r, "kvroute_discovery_errors_total", source) >= 2

    # An empty file, repeated discover_empty_rounds times, drains the file's workers only.
    write_atomically(path, "# nobody\n")
    await until(lambda: bid not in fleet(r) and cid not in fleet(r), "the file's workers are removed")
    assert fleet(r) == {sid: ("config", False), admin_id: ("admin", False)}
    assert (await chat(http, r))[0] == 200

    # A missing file is a failure too: nothing changes.
    path.unlink()
    before = await metric(http, r, "kvroute_discovery_errors_total", source)
    await until(lambda: r.discovery.reconciler.views[source].failures >= 2, "the missing file is noticed")
    assert await metric(http, r, "kvroute_discovery_errors_total", source) > before
    assert fleet(r) == {sid: ("config", False), admin_id: ("admin", False)}


async def test_a_discovered_worker_the_admin_api_registers_again_is_the_operators(sim_fleet, router, http,
                                                                                     tmp_path):
    sims = await sim_fleet(2)
    a, b = sims.urls
    path = tmp_path / "workers.json"
    path.write_text(f'[{{"targets": ["{a.removeprefix("http://")}", "{b.removeprefix("http://")}"]}}]')
    source = f"file://{path}"
    r = await router(discover=[source], discover_empty_rounds=1)
    aid, bid = a.removeprefix("http://"), b.removeprefix("http://")
    assert fleet(r) == {aid: (source, False), bid: (source, False)}
    async with http.post(r.url + "/admin/workers", json={"url": a}, headers=AUTH) as resp:
        assert resp.status == 201
    # An operator's drain of a listed worker stays.
    async with http.post(r.url + f"/admin/workers/{bid}/drain", headers=AUTH) as resp:
        assert resp.status == 200
    await asyncio.sleep(0.5)  # five discovery rounds
    assert fleet(r) == {aid: ("admin", False), bid: (source, True)}
    write_atomically(path, "[]")
    await until(lambda: bid not in fleet(r), "the file's worker is removed")
    assert fleet(r) == {aid: ("admin", False)}


def test_discovery_settings_from_the_file_the_environment_and_flags(tmp_path):
    config = tmp_path / "kvroute.toml"
    config.write_text('discover = ["dns://vllm.default.svc.cluster.local:8000", "file:///etc/kvroute/workers"]\n'
                      "discover_interval_s = 2.5\ndiscover_empty_rounds = 3\n")
    s = Settings.load(config, env={})
    assert s.discover == ("dns://vllm.default.svc.cluster.local:8000", "file:///etc/kvroute/workers")
    assert (s.discover_interval_s, s.discover_empty_rounds) == (2.5, 3)
    s = Settings.load(config, env={"KVROUTE_DISCOVER": "dns://a.test:80?server=10.0.0.10, file://w"})
    assert s.discover == ("dns://a.test:80?server=10.0.0.10", "file://w")
    s = Settings.load(config, env={}, overrides={"discover": ["file://only"]})
    assert s.discover == ("file://only",)
    assert Settings.from_dict({"discover": "file://one"}).discover == ("file://one",)
    assert Settings().discover == ()
    for raw, says in (({"discover": ["dns://vllm"]}, "needs a name and the replicas' port"),
                      ({"discover": ["consul://vllm"]}, "must be dns://NAME:PORT or file://PATH"),
                      ({"discover": [1]}, "discover must list"),
                      ({"discover": ["file://w", "file://w"]}, "the same source twice"),
                      ({"discover_interval_s": 0}, "discover_interval_s must be positive"),
                      ({"discover_empty_rounds": 0}, "discover_empty_rounds must be positive")):
        with pytest.raises(SettingsError, match=re.escape(says)):
            Settings.from_dict(raw)


SERVE = [sys.executable, "-c", "from kvroute.cli import main; main()", "serve"]


async def test_serve_starts_with_discovery_alone(sim_fleet, tmp_path, http):
    sims = await sim_fleet(1)
    path = tmp_path / "workers"
    path.write_text(sims.urls[0] + "\n")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *SERVE, "--discover", f"file://{path}", "--port", str(port), "--log-level", "warning",
        stderr=subprocess.PIPE, env={**os.environ, "KVROUTE_ADMIN_TOKEN": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(http, url, proc)
        body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]}
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvroute-worker"] == sims.urls[0].removeprefix("http://")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_serve_names_a_bad_discovery_source():
    done = subprocess.run([*SERVE, "--discover", "dns://vllm"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 2
    assert "needs a name and the replicas' port" in done.stderr


async def test_every_router_process_discovers_on_its_own(sim_fleet, tmp_path):
    """``--processes 2``: both processes follow the file, the merged /metrics counts the listed
    replicas once, and a restarted process copies the configured worker but discovers the rest."""
    sims = await sim_fleet(3)
    static, a, c = sims.urls
    path = tmp_path / "workers"
    path.write_text(a + "\n")
    config = tmp_path / "kvroute.toml"
    config.write_text("discover_interval_s = 0.1\ndiscover_empty_rounds = 1\nprobe_interval_s = 0.2\n")
    port = free_port()
    log = tmp_path / "serve.log"
    source = f"file://{path}"
    args = [*SERVE, "--processes", "2", "--port", str(port), "--config", str(config), "--admin-token", TOKEN,
            "--worker", static, "--discover", source, "--log-level", "warning"]
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*args, stderr=out)
    ids = {u: u.removeprefix("http://") for u in sims.urls}

    async def served_by(router: ProcessRouter, n: int, prompt: str) -> set[str]:
        return {await router.chat(f"{prompt} {i}") for i in range(n)}

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            router = ProcessRouter(http, port)
            await router.wait_processes(proc, 2, log)
            async with http.get(router.url + "/admin/workers", headers=ADMIN) as resp:
                assert {w["id"]: w["source"] for w in (await resp.json())["workers"]} == {
                    ids[static]: "config", ids[a]: source}
            assert samples(await router.metrics(), "kvroute_discovered_workers") == {(("source", source),): 1}

            write_atomically(path, c + "\n")
            await asyncio.sleep(1.0)  # ten rounds: a drained, removed, c registered in both processes
            before = await router.per_process()
            assert await served_by(router, 24, "after the change") == {ids[static], ids[c]}
            after = await router.per_process()
            assert all(after[p] > before[p] for p in before), (before, after)

            victim, index = next(iter(router_processes(proc.pid).items()))
            os.kill(victim, signal.SIGKILL)
            for _ in range(400):
                now = router_processes(proc.pid)
                if len(now) == 2 and victim not in now:
                    break
                await asyncio.sleep(0.05)
            await router.wait_processes(proc, 2, log)

            # The file empties: c leaves both processes, the restarted one included (it did not
            # copy c from its sibling as a configured worker).
            write_atomically(path, "")
            await asyncio.sleep(1.0)
            before = await router.per_process()
            assert await served_by(router, 24, "after the file emptied") == {ids[static]}
            after = await router.per_process()
            assert after.get(str(index), 0) > before.get(str(index), 0), (index, before, after)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0, log.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
