"""The speed factor changes only the wall clock: a fixed batch of work timed by an HTTP client (wall
seconds × speed) costs the same model time at speed 5 and 20 as on the engine model in virtual time."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from sim_helpers import prose

from kvroute.sim.answers import filler
from kvroute.sim.engine import EngineModel, EventKind, SimRequest
from kvroute.sim.presets import build_config
from kvroute.sim.protocol import parse_generation_request
from kvroute.sim.server import start_sim_fleet

PRESET, MODEL = "a4000-qwen3-4b", "qwen3-4b"
# A long prompt first: its chunked prefill takes the whole token budget for five steps (2 model s,
# 100 ms of wall time at speed 20), so the batch sent right after it is admitted at the same step
# whenever each of its requests arrives within that time, and the schedule is the virtual run's.
BLOCKER_TOKENS, BATCH, BATCH_TOKENS, OUTPUT_TOKENS = 12_000, 6, 3000, 128
# The makespan is 142 steps: a simulator that counted event-loop wake-ups as model time took a
# third longer at speed 20 (more on a busy machine); the step-deadline clock stays within 3 %.
TOLERANCE = 0.2


@dataclass
class Timing:
    """Model-time figures of one run of the workload."""

    makespan: float
    first_token_mean: float    # of the batch, from the start
    lag_dropped: float = 0.0   # model seconds the replica reported dropping (a starved CPU)


def body(i: int) -> dict[str, Any]:
    """Request ``i``: 0 is the long one, then the batch (prompts of equal length, nothing shared)."""
    content = prose((BLOCKER_TOKENS if i == 0 else BATCH_TOKENS) - 20, i)
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": OUTPUT_TOKENS,
            "ignore_eos": True, "stream": True}


def virtual_run() -> Timing:
    """The workload on the engine model itself, every request arriving at time 0."""
    engine = EngineModel(build_config(PRESET), 0.0)
    for i in range(BATCH + 1):
        g = parse_generation_request("chat", body(i), MODEL)
        engine.add_request(SimRequest(str(i), g.prompt, filler(g.prompt, OUTPUT_TOKENS), OUTPUT_TOKENS), 0.0)
    now = 0.0
    firsts: list[float] = []
    while engine.has_work():
        result = engine.step(now)
        now += result.duration_s
        firsts += [now for e in result.events
                   if e.kind is EventKind.TOKEN and e.token_index == 0 and e.request_id != "0"]
    assert len(firsts) == BATCH
    return Timing(now, statistics.fmean(firsts))


async def http_run(speed: float) -> Timing:
    """The workload over HTTP, timed by the client in wall seconds and scaled by ``speed``."""
    firsts: list[float] = []
    async with await start_sim_fleet(PRESET, 1, speed=speed) as fleet, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        url = fleet.urls[0] + "/v1/chat/completions"
        engine = fleet.replicas[0].engine

        async def send(i: int) -> None:
            async with http.post(url, data=orjson.dumps(body(i)),
                                 headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
                await resp.content.readany()   # headers and the first chunk come with the first token
                if i:
                    firsts.append((time.perf_counter() - start) * speed)
                text = await resp.text()
            assert text.rstrip().endswith("data: [DONE]")

        start = time.perf_counter()
        blocker = asyncio.create_task(send(0))
        while not engine.has_work():
            await asyncio.sleep(0.001)
        await asyncio.gather(blocker, *(send(i) for i in range(1, BATCH + 1)))
        makespan = (time.perf_counter() - start) * speed
        clock = fleet.replicas[0].clock
    return Timing(makespan, statistics.fmean(firsts), clock.dropped_s * speed)


def close_to(measured: float, expected: float, lag: float) -> bool:
    """Within the tolerance of ``expected``; lag the replica dropped may only add latency."""
    return expected * (1 - TOLERANCE) <= measured <= expected * (1 + TOLERANCE) + lag


async def test_model_time_does_not_depend_on_speed() -> None:
    want = virtual_run()
    for speed in (5.0, 20.0):
        got = await http_run(speed)
        assert close_to(got.makespan, want.makespan, got.lag_dropped), (speed, got, want)
        assert close_to(got.first_token_mean, want.first_token_mean, got.lag_dropped), (speed, got, want)
