"""``kvroute serve --processes 2`` as users run it: one port, two router processes sharing state.

Each request goes over a new connection, so the kernel picks a process for each (SO_REUSEPORT);
the merged ``/metrics`` says how many each one served (``kvroute_process_requests_total``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

SERVE = [sys.executable, "-c", "from kvroute.cli import main; main()", "serve"]
TOKEN = "secret"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_processes(parent: int) -> dict[int, int]:
    """The router processes the supervisor ``parent`` runs: pid -> process index."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == parent and b"kvroute.server.processes" in argv:
            out[int(stat.parent.name)] = int(argv[argv.index(b"kvroute.server.processes") + 2])
    return out


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


class Router:
    """Requests to the shared port, each on a connection of its own."""

    def __init__(self, http: aiohttp.ClientSession, port: int) -> None:
        self.http = http
        self.url = f"http://127.0.0.1:{port}"

    async def chat(self, text: str, session: str | None = None, max_tokens: int = 4) -> str:
        headers = {"x-session-id": session} if session else {}
        body = {"model": "qwen3-4b", "max_tokens": max_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": text}]}
        async with self.http.post(self.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return resp.headers["x-kvroute-worker"]

    async def metrics(self) -> str:
        async with self.http.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()

    async def per_process(self) -> dict[str, float]:
        found = samples(await self.metrics(), "kvroute_process_requests_total")
        return {dict(k)["process"]: v for k, v in found.items()}

    async def wait_processes(self, proc: asyncio.subprocess.Process, n: int, log: Path) -> None:
        for _ in range(600):
            assert proc.returncode is None, log.read_text()
            try:
                if samples(await self.metrics(), "kvroute_processes").get(()) == n:
                    return
            except (aiohttp.ClientConnectionError, AssertionError):
                pass
            await asyncio.sleep(0.05)
        raise AssertionError(f"{n} router processes never answered:\n{log.read_text()}")


async def test_processes_share_one_port_state_admin_and_shut_down_gracefully(sim_fleet, tmp_path):
    fleet = await sim_fleet(3)
    port = free_port()
    log = tmp_path / "serve.log"
    args = [*SERVE, "--processes", "2", "--port", str(port), "--policy", "session", "--admin-token", TOKEN,
            "--log-level", "warning"]
    for url in fleet.urls:
        args += ["--worker", url]
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(*args, stderr=out)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            router = Router(http, port)
            await router.wait_processes(proc, 2, log)
            assert len(router_processes(proc.pid)) == 2

            # Sessions: every turn reaches the first turn's worker, whichever process takes it.
            sent = 0
            homes: dict[str, str] = {}
            for turn in range(3):
                for s in range(8):
                    worker = await router.chat(f"conversation {s} turn {turn}", session=f"s{s}")
                    sent += 1
                    assert homes.setdefault(f"s{s}", worker) == worker
                await asyncio.sleep(0.1)  # the sessions bound in one process reach the other
            text = await router.metrics()
            assert sum(samples(text, "kvroute_requests_total").values()) == sent
            # The processes sign what they share through their private Redis: none warns, none rejects.
            assert "no sync secret" not in log.read_text()
            assert sum(samples(text, "kvroute_sync_rejected_total").values()) == 0
            shares = await router.per_process()
            assert set(shares) == {"0", "1"} and all(v > 0 for v in shares.values()), shares
            assert sum(shares.values()) == sent
            async with http.get(router.url + "/dashboard/data.json") as resp:
                snapshot = await resp.json()
            assert snapshot["models"][0]["totals"]["requests_total"] == sent
            assert len(snapshot["decisions"]) == sent  # the latest 25: every one

            # A drain through the shared port applies to both processes.
            drained = fleet.urls[0].removeprefix("http://")
            async with http.post(f"{router.url}/admin/workers/{drained}/drain", headers=ADMIN) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-processes"] == "2/2"
            before = await router.per_process()
            for i in range(60):
                assert await router.chat(f"after the drain {i}") != drained
                after = await router.per_process()
                if all(after[p] - before[p] >= 3 for p in before):
                    break
            else:
                raise AssertionError(f"one process got almost no requests: {before} -> {after}")
            async with http.get(router.url + "/admin/workers", headers=ADMIN) as resp:
                listing = await resp.json()
            assert sum(sum(w["requests"].values()) for w in listing["workers"]) == sum(after.values())

            # A killed process is restarted, catches up on the drain, and serves again.
            children = router_processes(proc.pid)
            victim, index = next(iter(children.items()))
            os.kill(victim, signal.SIGKILL)
            for _ in range(400):
                now = router_processes(proc.pid)
                if len(now) == 2 and victim not in now:
                    break
                await asyncio.sleep(0.05)
            await router.wait_processes(proc, 2, log)
            assert "restarting it" in log.read_text()
            for i in range(60):
                assert await router.chat(f"after the restart {i}") != drained
                if (await router.per_process()).get(str(index), 0) >= 3:
                    break
            else:
                raise AssertionError("the restarted process never served")

            # SIGTERM: streams in flight finish (in either process), then everything exits cleanly.
            pids = set(router_processes(proc.pid))
            body = {"model": "qwen3-4b", "max_tokens": 1500, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": "count to a thousand"}]}
            streams = [await http.post(router.url + "/v1/chat/completions", json=body) for _ in range(6)]
            firsts = [await r.content.readany() for r in streams]
            proc.send_signal(signal.SIGTERM)
            for first, resp in zip(firsts, streams, strict=True):
                assert resp.status == 200
                assert (first + await resp.read()).endswith(b"data: [DONE]\n\n")
                resp.release()
        assert await asyncio.wait_for(proc.wait(), 30) == 0, log.read_text()
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    finally:
        if proc.returncode is None:  # a failed test: let it clean up, then make sure it is gone
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def test_processes_without_redis_fail_with_a_clear_message(tmp_path):
    # No redis-server on PATH and no --redis: refused before anything starts.
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path), "COLUMNS": "300"}
    done = subprocess.run([*SERVE, "--processes", "2", "--worker", "http://127.0.0.1:9"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert "needs Redis" in done.stderr and "--redis" in done.stderr


def test_processes_on_a_busy_port_fail_with_a_clear_message():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([*SERVE, "--processes", "2", "--port", str(port), "--worker", "http://127.0.0.1:9"],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
