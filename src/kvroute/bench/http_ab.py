"""A/B over HTTP: the same seeded workload under several router policies.

Three kinds of target:

* simulated replicas (``kvroute sim`` in-process): for each policy a fresh fleet and a fresh router,
  so every policy starts from empty caches.  The session-stickiness benchmark did *not* do that (its
  second variant began with a warm prefix cache); a fresh fleet per policy removes that bias.
* given replica URLs: a kvroute router is started in front of them for each policy.  Their caches
  cannot be reset from here, so each policy after the first starts warm, as in the session-stickiness
  benchmark.
* an external URL (a router or engine already running): measured as is, under one label.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvroute.bench.results import BenchResult, RequestRecord
from kvroute.bench.runner import ApiKind, HttpTarget, StepCallback, StepPlan, run_policy, send_request
from kvroute.bench.workloads import ChatStep, SharedPrefixWorkload, Workload


class BenchSetupError(RuntimeError):
    """The target could not be prepared (no model, router never became ready, ...)."""


@dataclass(frozen=True, slots=True)
class SimSpec:
    """Simulated replicas to start for each policy."""

    preset: str = "a4000-qwen3-4b"
    replicas: int = 4
    speed: float = 1.0
    overrides: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HttpBenchSpec:
    """Exactly one of ``sim``, ``replicas`` or ``target`` says what to drive."""

    sim: SimSpec | None = None
    replicas: tuple[str, ...] = ()
    target: str | None = None
    metrics_urls: tuple[str, ...] = ()
    model: str | None = None
    api: ApiKind = "openai"
    time_scale: float = 1.0
    probe_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if sum((self.sim is not None, bool(self.replicas), self.target is not None)) != 1:
            raise ValueError("give exactly one of: simulated replicas, replica URLs, a target URL")

    @property
    def starts_router(self) -> bool:
        """Whether the bench runs its own router (and can therefore switch policies)."""
        return self.target is None


async def discover_model(url: str) -> str:
    """The first model an OpenAI-compatible endpoint lists at ``/v1/models``."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http, \
                http.get(url.rstrip("/") + "/v1/models") as resp:
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise BenchSetupError(f"cannot list models at {url}: {exc}") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not models:
        raise BenchSetupError(f"{url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


async def _wait_serving(url: str, model: str, timeout_s: float = 30.0) -> None:
    """Wait until the router lists ``model`` (its probes have seen the workers)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with http.get(url + "/v1/models") as resp:
                    data = await resp.json(content_type=None)
                if any(m.get("id") == model for m in data.get("data", [])):
                    return
            await asyncio.sleep(0.1)
    raise BenchSetupError(f"router at {url} did not list model {model!r} within {timeout_s:.0f} s")


@contextlib.asynccontextmanager
async def _replicas(spec: HttpBenchSpec) -> AsyncIterator[tuple[list[str], float]]:
    """Replica URLs for one policy's run and the time scale they run at."""
    if spec.sim is None:
        yield list(spec.replicas), spec.time_scale
        return
    from kvroute.sim.server import start_sim_fleet

    fleet = await start_sim_fleet(spec.sim.preset, spec.sim.replicas, speed=spec.sim.speed,
                                  **dict(spec.sim.overrides))
    try:
        yield list(fleet.urls), spec.sim.speed
    finally:
        await fleet.close()


@contextlib.asynccontextmanager
async def policy_target(spec: HttpBenchSpec, policy: str) -> AsyncIterator[HttpTarget]:
    """The target for one policy: fresh simulated replicas (if asked) and a router running ``policy``."""
    if spec.target is not None:
        model = spec.model or await discover_model(spec.target)
        yield HttpTarget(spec.target, model, spec.metrics_urls, spec.api, spec.time_scale)
        return
    from kvroute.router_settings import Settings, WorkerSpec
    from kvroute.server.app import start_router

    async with _replicas(spec) as (urls, scale):
        model = spec.model or await discover_model(urls[0])
        # The fleet guard's canary off: its questions would count in the engines' prefix-cache
        # counters and busy figures, which are the benchmark's (docs/fleet-guard.md).
        settings = Settings(workers=tuple(WorkerSpec(url=u) for u in urls), policy=policy,
                            probe_interval_s=spec.probe_interval_s / scale, port=0,
                            routing={"canary": False})
        router = await start_router(settings, host="127.0.0.1", port=0)
        try:
            await _wait_serving(router.url, model)
            metrics = tuple(u.rstrip("/") + "/metrics" for u in urls)
            yield HttpTarget(router.url, model, metrics, spec.api, scale,
                             router_metrics_url=router.url + "/metrics")
        finally:
            await router.close()


async def run_http_bench(spec: HttpBenchSpec, policies: Sequence[str],
                         workload: Workload | SharedPrefixWorkload, plan: StepPlan,
                         meta: Mapping[str, Any],
                         on_tick: Callable[[str], StepCallback] | None = None) -> BenchResult:
    """Run ``plan`` under each policy in turn; ``on_tick(policy)`` returns that run's step callback."""
    if not spec.starts_router and len(policies) > 1:
        raise BenchSetupError("an external target cannot switch policies; give one label or use replicas")
    result = BenchResult(dict(meta))
    for policy in policies:
        async with policy_target(spec, policy) as target:
            callback = on_tick(policy) if on_tick is not None else None
            result.runs.append(await run_policy(target, workload, policy, plan, callback))
    return result


@dataclass(frozen=True, slots=True)
class ChatRow:
    """One row of the growing-chat table."""

    label: str
    worker: str
    prompt_tokens: int
    seconds: float
    cached_tokens: int = 0  # as the replica reported it


async def run_http_chat(spec: HttpBenchSpec, policy: str, steps: Sequence[ChatStep]) -> list[ChatRow]:
    """Send the growing chat one request at a time; workers are lettered A, B, ... as they appear."""
    rows: list[ChatRow] = []
    letters: dict[str, str] = {}
    async with policy_target(spec, policy) as target, aiohttp.ClientSession() as http:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        def clock() -> float:
            return (loop.time() - t0) * target.time_scale

        for step in steps:
            rec = RequestRecord(step.request.session_id, step.request.round, clock())
            await send_request(http, target, step.request, rec, clock)
            if rec.error is not None or rec.end_s is None:
                raise BenchSetupError(f"chat request {step.label!r} failed: {rec.error}")
            worker = rec.worker or "?"
            letter = letters.setdefault(worker, chr(ord("A") + len(letters)))
            rows.append(ChatRow(step.label, letter, rec.prompt_tokens, rec.end_s - rec.start_s,
                                rec.cached_tokens))
    return rows

