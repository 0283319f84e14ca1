"""Load over HTTP against one endpoint: closed-loop steps of concurrent agent sessions, or open-loop
steps of requests arriving at a rate.

Each of ``n`` session loops sends a session's rounds one after another (the next round starts when
the previous response has ended) and starts the workload's next session when one is done; each
names itself (``x-kvroute-client``) and sends a request that was shed again after its Retry-After,
up to ``SHED_TRIES`` times.  When a
step's window closes no new request starts; requests in flight run to their end (bounded by the
drain timeout) so that their time to first byte is measured rather than censored.  In the open
loop (a :class:`SharedPrefixWorkload`) each request is sent at its arrival time whatever the
answers do, a shed one is recorded and not retried, and the step drains the same way.  Meanwhile
the replicas' ``/metrics`` are polled for the number of busy replicas, and scraped before and after the
step for the prefix-cache counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from kvroute.api.requests import CLIENT_HEADER
from kvroute.bench.results import PolicyRun, RequestRecord, StepResult
from kvroute.bench.stats import (
    Samples,
    busy_count,
    cache_delta,
    parse_samples,
    queue_figures,
    summarize_step,
)
from kvroute.bench.workloads import SHED_TRIES, PlannedRequest, SharedPrefixWorkload, Workload
from kvroute.event_loop import cancel_and_wait

WORKER_HEADER = "x-kvroute-worker"
ApiKind = Literal["openai", "anthropic"]

# Synthetic workloads start each step at its own block of session indices, so a step replays the
# same sessions under every policy however many the previous step used.
STEP_STRIDE = 1_000_000

# A router's "too busy, come back later": 429 (OpenAI routes, sglang-router's full queue), 529
# (Anthropic's overloaded_error), 503 (busy / no capacity) and 408 (sglang-router's queue timeout).
OVERLOAD_STATUSES = frozenset({408, 429, 503, 529})
# What a client waits when an overload answer has no usable Retry-After (sglang-router sends none).
DEFAULT_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class HttpTarget:
    """Where the load goes and where the replicas' metrics are.

    ``time_scale`` converts measured seconds into the target's own seconds: a simulator running at
    ``--speed 10`` is given ``time_scale=10`` so that the report reads in simulated seconds.
    ``router_metrics_url``: the router's own ``/metrics`` (kvroute's), for its queue figures.
    """

    url: str
    model: str
    metrics_urls: tuple[str, ...] = ()
    api: ApiKind = "openai"
    time_scale: float = 1.0
    api_key: str | None = None
    router_metrics_url: str | None = None


def retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header given in seconds (an HTTP date, or garbage: None)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0.0 <= seconds < float("inf") else None


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Load steps (concurrent sessions; or ``rates``, requests/s, for an open-loop workload), the
    window of each, and the bounds around it, in the target's seconds (simulated seconds for a
    simulator running faster than real time); only the busy-replica poll interval is in wall
    seconds (scraping every replica is not free)."""

    sessions: tuple[int, ...] = (4, 8, 16, 24, 32)
    duration_s: float = 180.0
    drain_timeout_s: float = 120.0
    poll_interval_s: float = 1.0
    request_timeout_s: float = 600.0
    rates: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.sessions or any(n < 1 for n in self.sessions):
            raise ValueError("steps must be positive session counts")
        if any(not 0.0 < r < float("inf") for r in self.rates):
            raise ValueError("rates must be positive requests per second")
        if self.duration_s <= 0 or self.drain_timeout_s < 0 or self.poll_interval_s <= 0:
            raise ValueError("duration and poll interval must be > 0, drain timeout >= 0")


# (the step's load: sessions or rate, seconds into its window, its records so far)
StepCallback = Callable[[float, float, Sequence[RequestRecord]], None]


def _content_of(event: dict[str, Any]) -> str | None:
    """Generated text carried by one streamed event (OpenAI or Anthropic), None if it carries none."""
    if event.get("type") == "content_block_delta":
        delta = event.get("delta") or {}
        return str(delta.get("text") or delta.get("thinking") or "")
    choices = event.get("choices")
    if not choices:
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    text = choice.get("text")
    return None if text is None else str(text)


def _apply_usage(event: dict[str, Any], rec: RequestRecord) -> None:
    """Fill token counts from an OpenAI ``usage`` chunk or Anthropic ``message_start``/``message_delta``."""
    usage = event.get("usage")
    if event.get("type") == "message_start":
        usage = (event.get("message") or {}).get("usage")
    if not isinstance(usage, dict):
        return
    if "prompt_tokens" in usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        return
    if "input_tokens" in usage:
        cached = int(usage.get("cache_read_input_tokens") or 0)
        rec.cached_tokens = cached
        rec.prompt_tokens = (int(usage.get("input_tokens") or 0) + cached
                             + int(usage.get("cache_creation_input_tokens") or 0))
    if "output_tokens" in usage:
        rec.output_tokens = int(usage.get("output_tokens") or 0)


async def send_request(http: aiohttp.ClientSession, target: HttpTarget, req: PlannedRequest,
                       rec: RequestRecord, clock: Callable[[], float], client: str | None = None) -> None:
    """Send ``req`` with streaming and fill ``rec`` as the response arrives (``clock()`` is seconds
    since the step started, in the target's time scale); ``client`` is sent as
    ``x-kvroute-client``."""
    if target.api == "anthropic":
        path, body = "/v1/messages", req.anthropic_body(target.model)
        headers = {"anthropic-version": "2023-06-01", **req.headers()}
        if target.api_key:
            headers["x-api-key"] = target.api_key
    else:
        path, body = "/v1/chat/completions", req.openai_body(target.model)
        headers = dict(req.headers())
        if target.api_key:
            headers["authorization"] = f"Bearer {target.api_key}"
    headers["content-type"] = "application/json"
    if client is not None:
        headers[CLIENT_HEADER] = client
    chunks = 0
    try:
        async with http.post(target.url.rstrip("/") + path, data=orjson.dumps(body), headers=headers) as resp:
            rec.worker = resp.headers.get(WORKER_HEADER)
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                rec.error = f"HTTP {resp.status}: {text}"
                if resp.status in OVERLOAD_STATUSES:
                    rec.shed = True
                    rec.retry_after_s = retry_after(resp.headers.get("retry-after"))
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = orjson.loads(payload)
                if event.get("type") == "error" or "error" in event:
                    rec.error = f"stream error: {orjson.dumps(event.get('error'))[:300].decode()}"
                    return
                content = _content_of(event)
                if content is not None:
                    # The first event carrying a choice: vLLM sends it (role chunk included) once
                    # the first token exists.
                    if rec.ttfb_s is None:
                        rec.ttfb_s = clock() - rec.start_s
                    chunks += 1 if content else 0
                _apply_usage(event, rec)
        if rec.output_tokens == 0:
            rec.output_tokens = chunks
        rec.end_s = clock()
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]


async def scrape(http: aiohttp.ClientSession, urls: Sequence[str]) -> list[Samples | None]:
    """One ``/metrics`` scrape of every replica; None for a replica that did not answer."""

    async def one(url: str) -> Samples | None:
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    return None
                return parse_samples(await resp.text())
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None

    return list(await asyncio.gather(*(one(u) for u in urls)))


class _Clock:
    """A step's clock (the target's seconds since it started) and its records."""

    def __init__(self, time_scale: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.time_scale = time_scale
        self.records: list[RequestRecord] = []

    def now(self) -> float:
        return (self.loop.time() - self.t0) * self.time_scale


class _Step(_Clock):
    """The state of one running closed-loop step: its clock, its records and the session indices it
    hands out."""

    def __init__(self, workload: Workload, first_index: int, time_scale: float) -> None:
        super().__init__(time_scale)
        self.workload = workload
        self.next_index = first_index

    def take_session(self) -> int | None:
        size = self.workload.size
        if size is not None and self.next_index >= size:
            return None
        index = self.next_index
        self.next_index += 1
        return index


async def _session_loop(http: aiohttp.ClientSession, target: HttpTarget, step: _Step,
                        window_s: float, client: str) -> None:
    while step.now() < window_s:
        index = step.take_session()
        if index is None:
            return
        script = step.workload.session(index)
        for i, req in enumerate(script.requests):
            if req.think_s and i:
                await asyncio.sleep(req.think_s / step.time_scale)
            for _ in range(SHED_TRIES):
                if step.now() >= window_s:
                    return
                rec = RequestRecord(req.session_id, req.round, step.now(), last_round=i == script.rounds - 1)
                step.records.append(rec)
                await send_request(http, target, req, rec, step.now, client)
                if not rec.shed:
                    break
                # Shed: sent again after Retry-After (within the window), as the SDKs do.
                wait = rec.retry_after_s if rec.retry_after_s is not None else DEFAULT_RETRY_AFTER_S
                await asyncio.sleep(min(wait, max(0.0, window_s - step.now()) / step.time_scale))
            if rec.error is not None:
                break  # an agent whose request failed (or was shed every try) gives up on that task


class _Measure:
    """What every step measures around its load: the replicas' and the router's counters before and
    after, and the busy-replica polls (with the progress callback) during the window."""

    def __init__(self, http: aiohttp.ClientSession, target: HttpTarget) -> None:
        self.http, self.target = http, target
        self.busy: list[int] = []
        self.before: list[Samples | None] = []
        self.router_before: list[Samples | None] = []

    async def start(self) -> None:
        http, target = self.http, self.target
        self.before = await scrape(http, target.metrics_urls) if target.metrics_urls else []
        if target.router_metrics_url:
            self.router_before = await scrape(http, [target.router_metrics_url])

    async def poll(self, clock: _Clock, load: float, window_s: float, plan: StepPlan,
                   on_tick: StepCallback | None) -> None:
        # Polls start one interval in, so that none sees the fleet before the first requests.
        while True:
            await asyncio.sleep(plan.poll_interval_s)
            if self.target.metrics_urls and clock.now() < window_s:
                self.busy.append(busy_count(await scrape(self.http, self.target.metrics_urls)))
            if on_tick is not None:
                on_tick(load, min(clock.now(), window_s), clock.records)

    async def finish(self, policy: str, sessions: int, window_s: float, records: Sequence[RequestRecord],
                     rate: float | None = None) -> StepResult:
        http, target = self.http, self.target
        cache = None
        if target.metrics_urls:
            after = await scrape(http, target.metrics_urls)
            if all(s is not None for s in self.before + after):
                cache = cache_delta([s or {} for s in self.before], [s or {} for s in after])
        result = summarize_step(policy, sessions, window_s, records, self.busy, cache, rate=rate)
        if target.router_metrics_url:
            router_after = await scrape(http, [target.router_metrics_url])
            if self.router_before[0] is not None and router_after[0] is not None:
                queue = queue_figures(self.router_before[0], router_after[0], target.time_scale)
                if queue is not None:
                    result.queue_wait_p50_s, result.queue_wait_p95_s = queue.wait_p50_s, queue.wait_p95_s
                    result.router_shed = queue.shed
        return result


async def run_step(http: aiohttp.ClientSession, target: HttpTarget, workload: Workload, policy: str,
                   sessions: int, first_index: int, plan: StepPlan,
                   on_tick: StepCallback | None = None) -> tuple[StepResult, int]:
    """Run one step of ``sessions`` concurrent session loops; returns its summary and the next unused
    session index."""
    measure = _Measure(http, target)
    await measure.start()
    step = _Step(workload, first_index, target.time_scale)
    window_s = plan.duration_s
    poller = asyncio.create_task(measure.poll(step, sessions, window_s, plan, on_tick))
    loops = [asyncio.create_task(_session_loop(http, target, step, window_s, f"agent-{i}"))
             for i in range(sessions)]
    wall_limit = (window_s + plan.drain_timeout_s) / target.time_scale
    _, pending = await asyncio.wait(loops, timeout=wall_limit)
    await cancel_and_wait([*pending, poller])
    if on_tick is not None:
        on_tick(sessions, window_s, step.records)
    return await measure.finish(policy, sessions, window_s, step.records), step.next_index


async def run_open_step(http: aiohttp.ClientSession, target: HttpTarget, workload: SharedPrefixWorkload,
                        policy: str, rate: float, first_index: int, plan: StepPlan,
                        on_tick: StepCallback | None = None) -> StepResult:
    """Run one open-loop step: the workload's requests sent at their Poisson arrival times at
    ``rate`` requests/s (the target's seconds) for the window, each on its own, then the drain."""
    measure = _Measure(http, target)
    await measure.start()
    clock = _Clock(target.time_scale)
    window_s = plan.duration_s
    poller = asyncio.create_task(measure.poll(clock, rate, window_s, plan, on_tick))
    sends: list[asyncio.Task[None]] = []
    for timed in workload.arrivals(rate, window_s, first_index):
        # Sleep to the arrival's own instant (not by the gap): a late wake-up does not delay the rest.
        delay = (timed.at_s - clock.now()) / target.time_scale
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(timed.request.session_id, timed.request.round, clock.now())
        clock.records.append(rec)
        sends.append(asyncio.create_task(send_request(http, target, timed.request, rec, clock.now)))
    drain_left = (window_s + plan.drain_timeout_s) / target.time_scale - (clock.loop.time() - clock.t0)
    pending: set[asyncio.Task[None]] = set()
    if sends:
        _, pending = await asyncio.wait(sends, timeout=max(0.0, drain_left))
    await cancel_and_wait([*pending, poller])
    if on_tick is not None:
        on_tick(rate, window_s, clock.records)
    return await measure.finish(policy, 0, window_s, clock.records, rate=rate)


async def run_policy(target: HttpTarget, workload: Workload | SharedPrefixWorkload, policy: str,
                     plan: StepPlan, on_tick: StepCallback | None = None) -> PolicyRun:
    """Every step of ``plan`` against ``target``, labelled ``policy``: its rates for an open-loop
    workload, its session counts otherwise."""
    if isinstance(workload, SharedPrefixWorkload) and not plan.rates:
        raise ValueError("an open-loop workload needs the plan's rates")
    run = PolicyRun(policy)
    timeout = aiohttp.ClientTimeout(total=plan.request_timeout_s / target.time_scale)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        if isinstance(workload, SharedPrefixWorkload):
            for k, rate in enumerate(plan.rates):
                run.steps.append(await run_open_step(http, target, workload, policy, rate, k * STEP_STRIDE,
                                                     plan, on_tick))
            return run
        next_index = 0
        for k, sessions in enumerate(plan.sessions):
            first = k * STEP_STRIDE if workload.size is None else next_index
            result, next_index = await run_step(http, target, workload, policy, sessions, first, plan,
                                                on_tick)
            run.steps.append(result)
    return run
