"""vLLM-compatible HTTP face of the engine model: one aiohttp app per simulated replica.

Endpoints (as vLLM serves them): ``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/messages`` (Anthropic), streaming or not; ``GET /v1/models``, ``/health``, ``/metrics``,
``/server_info``, ``/version``; ``POST /tokenize``, ``/detokenize``, ``/v1/chat/completions/render``,
``/v1/completions/render``, ``/reset_prefix_cache``; and the simulator's own ``/admin/fault`` (GET
lists, POST sets, DELETE clears; see ``sim/faults.py``).

A replica fronts ``data_parallel_size`` engine ranks (vLLM's ``--data-parallel-size``: one API
server, N engines, each with its own KV cache).  A request's header ``X-data-parallel-rank`` pins
its rank as vLLM does (a value that is not an integer is ignored; one out of range is refused);
without it the rank is the one vLLM's balancer (``DPLBAsyncMPClient``) would pick.  ``/metrics``
has one series per rank (label ``engine``); restarts, prefix-cache resets and faults apply to every
rank.

With a ``KVEventsConfig`` that enables events, each rank publishes vLLM's KV-cache events on ZeroMQ
(``sim/kv_publisher.py``): the engine's events of a step are published when the step ends, those
of a prefix-cache reset at once.  Replica ``i``'s rank ``r`` uses the configured ports plus
``i * data_parallel_size + r``; a one-rank replica is, as before, data-parallel rank ``i`` (a
fleet of one-rank replicas reads as one deployment balanced from outside).

Each rank runs one asyncio task that drives its :class:`EngineModel` on a :class:`ModelClock`:
while busy, each step starts in model time where the previous one ended, and its events are
delivered to the waiting handlers at the wall-clock deadline of its end (model time runs ``speed``
times faster than the wall clock); idle while there is no work, then resynchronised to the wall
clock.  How far behind schedule rank 0 ran is in ``/server_info`` under ``clock``.

Public helper::

    fleet = await start_sim_fleet("a4000-qwen3-4b", 4, speed=20.0)
    fleet.urls        # ["http://127.0.0.1:PORT", ...]
    fleet.replicas    # SimReplica objects: .engine (rank 0), .ranks, .faults, .restart(), .url
    await fleet.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
import zmq.asyncio
from aiohttp import web

from kvroute.api.errors import ApiError, ApiStyle, error_body
from kvroute.fleet.kv_event_wire import ENCODINGS, Encoding, EventBatch, KVEventsConfig
from kvroute.sim.answers import Corruption, arithmetic_answer, corrupted, filler, reply_length
from kvroute.sim.clock import ModelClock
from kvroute.sim.engine import EngineConfig, EngineEvent, EngineModel, EventKind, SimRequest
from kvroute.sim.faults import AnswerFaults, Fault, FaultSet
from kvroute.sim.kv_publisher import KvEventPublisher
from kvroute.sim.metrics import render_metrics
from kvroute.sim.presets import build_config
from kvroute.sim.protocol import Api, GenerationRequest, Reply, parse_generation_request
from kvroute.sim.tokenizer import PseudoTokens, RenderError, count_tokens, is_anthropic_body, token_ids

log = logging.getLogger("kvroute.sim")

SIM_VERSION = "0.26.0+kvroute.sim"
_JSON = "application/json"
# The request header vLLM's OpenAI server reads the engine rank from (entrypoints, "router can
# inject it").
DP_RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True, slots=True)
class ReplyOptions:
    """What replies say (server-level, not engine settings)."""

    answer_mode: bool = False        # answer a trailing arithmetic question exactly
    corrupt_rate: float = 0.0        # fraction of replies that are empty or a run of '!'
    output_tokens_min: int = 32      # natural reply length range (tokens), fixed per prompt
    output_tokens_max: int = 192
    seed: int = 0                    # seeds fault and corruption draws (plus the replica index)

    def __post_init__(self) -> None:
        if not 0.0 <= self.corrupt_rate <= 1.0:
            raise ValueError("corrupt_rate must be between 0 and 1")
        if not 1 <= self.output_tokens_min <= self.output_tokens_max:
            raise ValueError("need 1 <= output_tokens_min <= output_tokens_max")


# What the ``garbage`` and ``wrong_shape`` faults answer: not JSON, not SSE, and JSON that is not
# an answer of any API.
_GARBAGE = b"\x00\xff<html><body>502 upstream garbage</body></html>\n\n"
_WRONG_SHAPE = orjson.dumps({"object": "kvroute.sim.wrong_shape", "detail": "not an answer (fault)"})
_WRONG_SHAPE_EVENT = b"data: " + _WRONG_SHAPE + b"\n\n"


# The handlers vLLM's instrumentator leaves out of http_requests_total
# (vllm/entrypoints/serve/instrumentator/metrics.py).
_UNCOUNTED = frozenset(("/metrics", "/health", "/load", "/ping", "/version", "/server_info"))


class _Dropped(Exception):
    """The engine restarted under this request."""


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type=_JSON)


def _error(style: ApiStyle, exc: ApiError) -> web.Response:
    return web.Response(body=error_body(style, exc.status, exc.message, exc.param, exc.code),
                        status=exc.status, content_type=_JSON)


async def _read_json(request: web.Request) -> Any:
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None


class _Rank:
    """One engine rank of a replica: its engine, model clock, engine loop and KV-event publisher."""

    __slots__ = ("clock", "engine", "index", "inflight", "kv_publisher", "loop_task", "wake")

    def __init__(self, index: int, config: EngineConfig, clock: ModelClock) -> None:
        self.index = index
        self.clock = clock
        self.engine = EngineModel(config, clock.origin_model)
        self.wake = asyncio.Event()
        self.kv_publisher: KvEventPublisher | None = None
        self.loop_task: asyncio.Task[None] | None = None
        # This server's requests on the rank not yet finished (vLLM's ``engine_inflight``).
        self.inflight = 0

    def now(self) -> float:
        """The rank's model time (see ``ModelClock.now``)."""
        return self.clock.now(time.monotonic())


def parse_dp_rank(value: str | None) -> int | None:
    """The rank a request's ``X-data-parallel-rank`` header asks for, as vLLM reads it
    (``int(value)``; anything else is ignored: the balancer picks)."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


class SimReplica:
    """One simulated vLLM replica: HTTP app, faults, and ``data_parallel_size`` engine ranks."""

    def __init__(self, index: int, config: EngineConfig, *, served_model: str, speed: float,
                 options: ReplyOptions, preset: str, kv_events: KVEventsConfig | None = None,
                 kv_events_encoding: Encoding = "map", data_parallel_size: int = 1,
                 tokens: PseudoTokens | None = None) -> None:
        if data_parallel_size < 1:
            raise ValueError("data_parallel_size must be at least 1")
        self.index = index
        if kv_events is not None and kv_events.enable_kv_cache_events != config.enable_kv_cache_events:
            config = dataclasses.replace(config, enable_kv_cache_events=kv_events.enable_kv_cache_events)
        self.config = config
        self.data_parallel_size = data_parallel_size
        self.kv_events = kv_events
        self.kv_events_encoding: Encoding = kv_events_encoding
        self._zmq: zmq.asyncio.Context | None = None
        self.served_model = served_model
        self.speed = speed
        self.options = options
        self.preset = preset
        self.tokens = tokens or PseudoTokens()
        # vLLM's http_requests_total (prometheus-fastapi-instrumentator): by handler, method and
        # status class, so a client can see which endpoints a router called (e.g. /tokenize).
        self.http_requests: Counter[tuple[str, str, str]] = Counter()
        self.faults = FaultSet(options.seed * 1_000_003 + index)
        origin_model, origin_wall = time.time(), time.monotonic()
        self.process_start_time = origin_model
        self.ranks = [_Rank(r, config, ModelClock(speed, origin_model=origin_model, origin_wall=origin_wall))
                      for r in range(data_parallel_size)]
        self._pending: dict[str, asyncio.Queue[EngineEvent | None]] = {}
        # Where vLLM's balancer starts its scan (rotated after each pick, so that ties rotate).
        self._lb_start = 0
        self._down_until = 0.0
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.app = self._build_app()

    @property
    def engine(self) -> EngineModel:
        """Rank 0's engine (the only one unless ``data_parallel_size`` > 1)."""
        return self.ranks[0].engine

    @property
    def clock(self) -> ModelClock:
        """Rank 0's model clock."""
        return self.ranks[0].clock

    @property
    def kv_publisher(self) -> KvEventPublisher | None:
        """Rank 0's KV-event publisher (None when events are not published)."""
        return self.ranks[0].kv_publisher

    # ------------------------------------------------------------------------- lifecycle

    def now(self) -> float:
        """Rank 0's model time: the wall clock at start plus elapsed time times ``speed`` (never
        past the end of the engine step in progress; see ``sim/clock.py``)."""
        return self.ranks[0].now()

    def _event_rank(self, rank: int) -> tuple[int, int]:
        """The ``data_parallel_rank`` rank ``rank``'s events carry, and its ports' offset."""
        n = self.data_parallel_size
        if n == 1:
            return self.index, self.index
        return rank, self.index * n + rank

    async def start(self, host: str, port: int) -> None:
        """Start the engine loops and listen on ``host:port`` (0: a free port); open the KV-event
        sockets of each rank when events are published."""
        if self.kv_events is not None and self.kv_events.publishes:
            self._zmq = zmq.asyncio.Context()
            try:
                for rank in self.ranks:
                    label, offset = self._event_rank(rank.index)
                    rank.kv_publisher = KvEventPublisher(self.kv_events, label, self.kv_events_encoding,
                                                         self._zmq, port_offset=offset)
            except ValueError:
                await self._close_publishers()
                raise
            for rank in self.ranks:
                assert rank.kv_publisher is not None
                rank.kv_publisher.start()
        for rank in self.ranks:
            name = f"sim-engine-{self.index}" + (f"-dp{rank.index}" if self.data_parallel_size > 1 else "")
            rank.loop_task = asyncio.create_task(self._engine_loop(rank), name=name)
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        sockets = self._runner.addresses
        bound_port = sockets[0][1]
        self.url = f"http://{host}:{bound_port}"

    async def _close_publishers(self) -> None:
        for rank in self.ranks:
            if rank.kv_publisher is not None:
                await rank.kv_publisher.close()
                rank.kv_publisher = None
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    async def close(self) -> None:
        """Stop serving and stop the engine loops."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for rank in self.ranks:
            if rank.loop_task is not None:
                rank.loop_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await rank.loop_task
                rank.loop_task = None
        await self._close_publishers()

    def restart(self, down_s: float = 0.0) -> int:
        """Simulate a process restart: drop in-flight requests, empty every rank's cache, reset
        counters, new start time; refuse requests (503) for ``down_s`` model seconds.  Returns
        requests dropped."""
        dropped: list[str] = []
        for rank in self.ranks:
            dropped += rank.engine.restart(rank.now())
            # A new process publishes afresh: sequence 0, nothing to replay, no word of the old cache.
            rank.engine.drain_kv_events()
            if rank.kv_publisher is not None:
                rank.kv_publisher.reset()
        for rid in dropped:
            queue = self._pending.get(rid)
            if queue is not None:
                queue.put_nowait(None)
        self.process_start_time = time.time()
        self._down_until = time.monotonic() + down_s / self.speed
        return len(dropped)

    @property
    def down(self) -> bool:
        """Whether the replica is 'restarting' and refusing requests."""
        return time.monotonic() < self._down_until

    # ------------------------------------------------------------------------- engine loop

    async def _engine_loop(self, rank: _Rank) -> None:
        engine, clock = rank.engine, rank.clock
        while True:
            if not engine.has_work():
                await self._idle(rank)
                continue
            start = clock.start_step(time.monotonic())
            result = engine.step(start)
            if not result.events and result.duration_s == 0:
                await self._idle(rank)
                continue
            deadline = clock.end_step(start, result.duration_s * self.faults.slow_factor)
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            # Events of requests dropped meanwhile (abort, restart) find no queue and are ignored.
            for event in result.events:
                queue = self._pending.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)
            self._publish_kv_events(rank)

    def _publish_kv_events(self, rank: _Rank) -> None:
        """Send what the rank's cache did since the last batch (vLLM: one batch per step)."""
        events = rank.engine.drain_kv_events()
        if events and rank.kv_publisher is not None:
            rank.kv_publisher.publish(EventBatch(time.time(), events, rank.kv_publisher.rank))

    async def _idle(self, rank: _Rank) -> None:
        rank.clock.idle()
        rank.wake.clear()
        await rank.wake.wait()

    def _balanced_rank(self) -> _Rank:
        """The rank vLLM's balancer (``DPLBAsyncMPClient.get_core_engine_for_request``, one API
        server) picks: the least score, the greater of this server's in-flight requests there and
        the engine's waiting + running, waiting ones weighing more as its KV cache fills past half;
        the scan starts one rank further each time, so that ties rotate.  The engines' own figures
        are read exactly here (vLLM's coordinator reports them every 100 ms)."""
        ranks = self.ranks
        n = len(ranks)
        if n == 1:
            return ranks[0]
        best, best_score = ranks[0], float("inf")
        for i in range(n):
            rank = ranks[(self._lb_start + i) % n]
            waiting, running, usage = rank.engine.queue_figures()
            score = float(max(rank.inflight, waiting + running))
            if waiting:
                score += waiting * 6.0 * max(0.0, usage - 0.5)
            if score < best_score:
                best, best_score = rank, score
        self._lb_start = (self._lb_start + 1) % n
        return best

    # ------------------------------------------------------------------------- generation

    def _reply_text(self, g: GenerationRequest, limit: int) -> bytes:
        opts = self.options
        fault = self.faults.draw("corrupt")
        natural = limit if g.ignore_eos else reply_length(g.prompt, opts.output_tokens_min,
                                                          opts.output_tokens_max)
        if fault is not None or (opts.corrupt_rate and self.faults.uniform() < opts.corrupt_rate):
            kind = Corruption.EMPTY if self.faults.uniform() < 0.5 else Corruption.BANGS
            return corrupted(kind, min(natural, limit))
        if opts.answer_mode and not g.ignore_eos:
            answer = arithmetic_answer(self.tokens.tail_text(g.prompt))
            if answer is not None:
                return answer
        return filler(g.prompt, natural)

    async def _generate(self, request: web.Request, api: Api) -> web.StreamResponse:
        style: ApiStyle = "anthropic" if api == "messages" else "openai"
        try:
            body = await _read_json(request)
            if self.down:
                raise ApiError(503, "The engine is restarting.")
            g = parse_generation_request(api, body, self.served_model, self.tokens)
            # vLLM 0.32 caps max_tokens at what the context leaves (Claude Code asks for 32000
            # whatever the model) and rejects only a prompt that does not fit by itself.
            room = self.config.max_model_len - g.prompt_tokens
            limit = min(g.max_tokens, room) if g.max_tokens is not None else room
            message = self.config.context_error(g.prompt_tokens, 0)
            if message or limit < 1:
                raise ApiError(400, message or "The prompt leaves no room for the completion.",
                               param="messages" if api != "completions" else "prompt")
            pinned = parse_dp_rank(request.headers.get(DP_RANK_HEADER))
            if pinned is not None and not 0 <= pinned < self.data_parallel_size:
                # vLLM's input processor refuses it when the engine is asked, that is while a
                # streamed answer has begun: there it is the stream's one event.
                refusal = ApiError(400, f"data_parallel_rank {pinned} is out of range "
                                        f"[0, {self.data_parallel_size}).")
                if g.stream and style == "openai":
                    return await _stream_error(request, refusal)
                raise refusal
            fault = self.faults.draw("error")
            if fault is not None:
                raise ApiError(fault.status, "Simulated engine failure (fault injection).")
        except ApiError as exc:
            return _error(style, exc)
        if self.faults.draw("hang") is not None:
            await asyncio.Event().wait()   # until the client goes away (handler cancelled)
        faults = self.faults.draw_answer()
        overhead = self.config.cost.request_overhead_s
        if overhead:
            await asyncio.sleep(overhead / self.speed)
        output = self._reply_text(g, limit)
        rid = uuid.uuid4().hex
        queue: asyncio.Queue[EngineEvent | None] = asyncio.Queue()
        self._pending[rid] = queue
        rank = self.ranks[pinned] if pinned is not None else self._balanced_rank()
        engine = rank.engine
        rank.inflight += 1
        try:
            try:
                engine.add_request(SimRequest(rid, g.prompt, output, limit, g.cache_salt), rank.now())
            except ValueError as exc:
                return _error(style, ApiError(400, str(exc)))
            rank.wake.set()
            reply = Reply(g)
            if g.stream:
                return await self._stream(request, reply, queue, output, faults)
            return await self._whole(request, reply, queue, output, faults)
        except _Dropped:
            _abort_connection(request)
            return web.Response(status=500)
        finally:
            del self._pending[rid]
            rank.inflight -= 1
            engine.abort(rid, rank.now())

    async def _next(self, queue: asyncio.Queue[EngineEvent | None]) -> EngineEvent:
        event = await queue.get()
        if event is None:
            raise _Dropped
        return event

    async def _whole(self, request: web.Request, reply: Reply, queue: asyncio.Queue[EngineEvent | None],
                     output: bytes, faults: AnswerFaults) -> web.StreamResponse:
        while True:
            event = await self._next(queue)
            if event.kind is EventKind.FINISHED:
                break
        if faults.drop is not None:
            raise _Dropped
        n = event.output_tokens
        text = output[:n * 4].decode("utf-8", "replace")
        body = reply.body(text, event.finish_reason or "stop", n, event.cached_tokens)
        if faults.garbage is not None:
            body = body[:len(body) // 2] + _GARBAGE
        elif faults.wrong_shape is not None:
            body = _WRONG_SHAPE
        if faults.stall is None:
            return web.Response(body=body, content_type=_JSON)
        resp = web.StreamResponse(headers={"Content-Type": _JSON})
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[:len(body) // 2])
        await asyncio.Event().wait()  # until the client goes away (handler cancelled)
        return resp

    async def _stream(self, request: web.Request, reply: Reply, queue: asyncio.Queue[EngineEvent | None],
                      output: bytes, faults: AnswerFaults) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            return await self._stream_events(request, resp, reply, queue, output, faults)
        except ConnectionResetError:
            # The client went away between two chunks (an abort, a reset): the caller aborts the
            # engine request; what is left to answer is nobody's business, so no traceback.
            log.debug("client of %s gone mid-stream", request.path)
            _abort_connection(request)
            return resp

    async def _stream_events(self, request: web.Request, resp: web.StreamResponse, reply: Reply,
                             queue: asyncio.Queue[EngineEvent | None], output: bytes,
                             faults: AnswerFaults) -> web.StreamResponse:
        cached = 0
        drop, stall, garbage, oversized = faults.drop, faults.stall, faults.garbage, faults.oversized
        while True:
            event = await self._next(queue)
            if event.kind is EventKind.SCHEDULED and not resp.prepared:
                cached = event.cached_tokens
            elif event.kind is EventKind.TOKEN:
                i = event.token_index
                if not resp.prepared:
                    await resp.prepare(request)
                    if garbage is not None and garbage.after_tokens == 0:
                        await resp.write(_GARBAGE * 4)
                        await resp.write_eof()
                        return resp
                    start = reply.stream_start(cached)
                    await resp.write(_WRONG_SHAPE_EVENT if faults.wrong_shape is not None else start)
                if drop is not None and i >= drop.after_tokens:
                    raise _Dropped
                if stall is not None and i >= stall.after_tokens:
                    await asyncio.Event().wait()  # until the client goes away (handler cancelled)
                if garbage is not None and i == garbage.after_tokens:
                    await resp.write(_GARBAGE)
                if oversized is not None and i == oversized.after_tokens:
                    await resp.write(reply.stream_delta("x" * oversized.size))
                piece = reply.stream_delta(output[i * 4:(i + 1) * 4].decode("utf-8", "replace"))
                if piece:
                    await resp.write(piece)
            elif event.kind is EventKind.FINISHED:
                await resp.write(reply.stream_end(event.finish_reason or "stop", event.output_tokens,
                                                  event.cached_tokens))
                await resp.write_eof()
                return resp

    # ------------------------------------------------------------------------- other endpoints

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2, middlewares=[self._count_request])
        gen = self._generate

        def route(api: Api) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
            async def handler(request: web.Request) -> web.StreamResponse:
                return await gen(request, api)
            return handler

        app.router.add_post("/v1/chat/completions", route("chat"))
        app.router.add_post("/v1/completions", route("completions"))
        app.router.add_post("/v1/messages", route("messages"))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/version", self._version)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/chat/completions/render", self._render_chat)
        app.router.add_post("/v1/completions/render", self._render_completions)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_get("/admin/fault", self._get_faults)
        app.router.add_post("/admin/fault", self._post_fault)
        app.router.add_delete("/admin/fault", self._clear_faults)
        return app

    @web.middleware
    async def _count_request(self, request: web.Request, handler: Callable[[web.Request], Awaitable[
            web.StreamResponse]]) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            resource = request.match_info.route.resource
            path = resource.canonical if resource is not None else None
            if path is not None and path not in _UNCOUNTED:
                self.http_requests[(path, request.method, f"{status // 100}xx")] += 1

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.down else 200)

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": SIM_VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        created = int(self.process_start_time)
        return _json({"object": "list", "data": [{
            "id": self.served_model, "object": "model", "created": created, "owned_by": "vllm",
            "root": self.served_model, "parent": None, "max_model_len": self.config.max_model_len,
            "permission": [_model_permission(created)],
        }]})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = render_metrics(self.config, [rank.engine.snapshot() for rank in self.ranks],
                              self.served_model, self.process_start_time, self.http_requests)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    def info(self) -> dict[str, Any]:
        """Configuration as ``/server_info`` shows it (flat engine settings plus the cost model)."""
        cfg = dataclasses.asdict(self.config)
        cost = cfg.pop("cost")
        cfg["prefix_match_unit"] = self.config.match_unit
        if self.data_parallel_size > 1:
            cfg["data_parallel_size"] = self.data_parallel_size
        dump = ", ".join(f"{k}={v!r}" for k, v in cfg.items())
        info = {
            **cfg,
            "served_model_name": self.served_model,
            "preset": self.preset,
            "speed": self.speed,
            "clock": self.clock.describe(),
            "cost": cost,
            "reply": dataclasses.asdict(self.options),
            "faults": self.faults.describe(),
            "process_start_time": self.process_start_time,
            "version": SIM_VERSION,
            "vllm_config": dump,
            "kv_events_config": msgspec.structs.asdict(self.kv_events) if self.kv_events else None,
            "kv_events": self.kv_publisher.describe() if self.kv_publisher else None,
        }
        if self.data_parallel_size > 1:
            info["ranks"] = [
                {"data_parallel_rank": rank.index, "inflight": rank.inflight, "num_running": running,
                 "num_waiting": waiting, "kv_cache_usage": usage,
                 "kv_events": rank.kv_publisher.describe() if rank.kv_publisher else None}
                for rank in self.ranks for waiting, running, usage in [rank.engine.queue_figures()]]
        return info

    async def _server_info(self, request: web.Request) -> web.Response:
        return _json(self.info())

    async def _render(self, request: web.Request, kind: str) -> tuple[bytes, dict[str, Any]]:
        """The rendering a generation request with this body would compute (so its KV blocks hold
        exactly these tokens): ``kind`` "chat", "completions", or "auto" for ``/tokenize``, which
        takes an Anthropic messages body too and renders it as ``/v1/messages`` does."""
        body = await _read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        try:
            if kind == "auto" and "messages" in body and is_anthropic_body(body):
                return self.tokens.anthropic(body), body
            if kind == "chat" or (kind == "auto" and "messages" in body):
                return self.tokens.chat(body), body
            if "prompt" not in body:
                raise ApiError(400, "Field required: 'prompt' or 'messages'.")
            return self.tokens.completion(body["prompt"]), body
        except RenderError as exc:
            raise ApiError(400, str(exc)) from None

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            data, body = await self._render(request, "auto")
        except ApiError as exc:
            return _error("openai", exc)
        return _json({"count": count_tokens(data), "max_model_len": self.config.max_model_len,
                      "tokens": token_ids(data),
                      "token_strs": self.tokens.token_strs(data) if body.get("return_token_strs") else None})

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(tokens, list):
                raise ApiError(400, "Field required: 'tokens' (a list of token ids).", param="tokens")
            text = self.tokens.detokenize(tokens)
        except RenderError as exc:
            return _error("openai", ApiError(400, str(exc)))
        except ApiError as exc:
            return _error("openai", exc)
        return _json({"prompt": text})

    def _rendered(self, prefix: str, data: bytes, body: dict[str, Any]) -> dict[str, Any]:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        return {"request_id": prefix + uuid.uuid4().hex, "token_ids": token_ids(data),
                "model": self.served_model, "features": None, "sampling_params": {"max_tokens": max_tokens}}

    async def _render_chat(self, request: web.Request) -> web.Response:
        try:
            data, body = await self._render(request, "chat")
        except ApiError as exc:
            return _error("openai", exc)
        return _json(self._rendered("chatcmpl-", data, body))

    async def _render_completions(self, request: web.Request) -> web.Response:
        try:
            data, body = await self._render(request, "completions")
        except ApiError as exc:
            return _error("openai", exc)
        return _json([self._rendered("cmpl-", data, body)])

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /reset_prefix_cache[?reset_running_requests=true]``: 200 and an empty body
        whether or not the engine could reset (vLLM does not check either; a refusal, while requests
        hold blocks, is logged)."""
        try:
            running = _query_bool(request, "reset_running_requests")
            _query_bool(request, "reset_external")   # no external (connector) cache to reset here
        except ApiError as exc:
            return _error("openai", exc)
        for rank in self.ranks:
            if rank.engine.reset_prefix_cache(reset_running_requests=running):
                log.info("replica %d rank %d: prefix cache reset", self.index, rank.index)
                rank.wake.set()     # preempted requests are waiting again
            else:
                log.warning("replica %d rank %d: failed to reset prefix cache because some blocks are "
                            "not freed yet", self.index, rank.index)
            self._publish_kv_events(rank)
        return web.Response(status=200)

    async def _get_faults(self, request: web.Request) -> web.Response:
        return _json({"faults": self.faults.describe(), "corrupt_rate": self.options.corrupt_rate})

    async def _clear_faults(self, request: web.Request) -> web.Response:
        self.faults.clear()
        return _json({"faults": []})

    async def _post_fault(self, request: web.Request) -> web.Response:
        try:
            body = await _read_json(request)
            fault = Fault.from_json(body)
        except ApiError as exc:
            return _error("openai", exc)
        except ValueError as exc:
            return _error("openai", ApiError(400, str(exc)))
        if fault.kind == "restart":
            dropped = self.restart(fault.down_s)
            return _json({"restarted": True, "dropped": dropped,
                          "process_start_time": self.process_start_time})
        self.faults.set(fault)
        return _json({"faults": self.faults.describe()})


def _query_bool(request: web.Request, name: str) -> bool:
    """A boolean query parameter as FastAPI reads one (true/false, 1/0, yes/no, on/off)."""
    value = request.query.get(name)
    if value is None:
        return False
    text = value.strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ApiError(400, f"{name}: Input should be a valid boolean, unable to interpret input", param=name)


def _model_permission(created: int) -> dict[str, Any]:
    """The one permission object vLLM lists for a served model (fixed, permissive values)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": created,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
        "organization": "*", "group": None, "is_blocking": False,
    }


async def _stream_error(request: web.Request, exc: ApiError) -> web.StreamResponse:
    """A streamed answer whose only event is an error (vLLM's answer to an error raised once the
    stream has begun), then ``[DONE]``."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    body = error_body("openai", exc.status, exc.message, exc.param, exc.code)
    await resp.write(b"data: " + body + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _abort_connection(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


@dataclass(slots=True)
class SimFleet:
    """Running simulated replicas; ``urls[i]`` is ``replicas[i].url``."""

    replicas: list[SimReplica]

    @property
    def urls(self) -> list[str]:
        """Base URLs of the replicas, in order."""
        return [r.url for r in self.replicas]

    async def close(self) -> None:
        """Stop every replica."""
        await asyncio.gather(*(r.close() for r in self.replicas))

    async def restart_with(self, i: int, **settings: Any) -> SimReplica:
        """Stop replica ``i`` and start it again on the same address with some engine settings
        changed (``EngineConfig`` fields such as ``enable_prefix_caching`` or ``mamba_cache_mode``;
        sizes derived from the preset are kept): a restart with other command-line flags.  The new
        process has a new start time and an empty cache."""
        old = self.replicas[i]
        host, _, port = old.url.removeprefix("http://").rpartition(":")
        config = dataclasses.replace(old.config, **settings)
        await old.close()
        new = SimReplica(old.index, config, served_model=old.served_model, speed=old.speed,
                         options=old.options, preset=old.preset, kv_events=old.kv_events,
                         kv_events_encoding=old.kv_events_encoding,
                         data_parallel_size=old.data_parallel_size, tokens=old.tokens)
        await new.start(host, int(port))
        self.replicas[i] = new
        return new

    async def __aenter__(self) -> SimFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


_REPLY_FIELDS = {f.name for f in dataclasses.fields(ReplyOptions)}


async def start_sim_fleet(preset: str, replicas: int, *, host: str = "127.0.0.1", base_port: int = 0,
                          speed: float = 1.0, model: str | None = None,
                          kv_events: KVEventsConfig | None = None, kv_events_encoding: Encoding = "map",
                          data_parallel_size: int = 1, tokenizer: str | None = None,
                          **overrides: Any) -> SimFleet:
    """Start ``replicas`` simulated replicas of ``preset`` in this event loop.

    ``base_port`` 0 binds free ports, otherwise ports ``base_port .. base_port+replicas-1``.
    ``data_parallel_size`` (vLLM's ``--data-parallel-size``) is the number of engine ranks behind
    each replica's one server.  ``kv_events`` (vLLM's ``--kv-events-config``) makes each rank
    publish KV-cache events in ``kv_events_encoding``: replica ``i``'s rank ``r`` on the configured
    ports plus ``i * data_parallel_size + r`` (a one-rank replica as data-parallel rank ``i``).
    ``model`` is the served model name (default: the preset's).  ``tokenizer``: a model's folder
    whose tokenizer and chat template render and tokenize the prompts (sim/real_tokens.py; needs
    kvroute[tokenizer]) instead of the pseudo-tokenizer.  ``overrides`` are engine settings
    (``EngineConfig`` fields such as ``max_num_seqs``, ``enable_prefix_caching``,
    ``mamba_cache_mode``, ``prefix_match_unit``, ``kv_cache_dtype``, ``num_gpu_blocks_override``),
    cost-model parameters (``a``, ``b``, ``c``, ``d0``, ``d1``, ``d_kv``, ``request_overhead_s``),
    or reply options (``answer_mode``, ``corrupt_rate``, ``output_tokens_min``,
    ``output_tokens_max``, ``seed``).  Raises ValueError/TypeError/KeyError for bad settings.
    """
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    if kv_events_encoding not in ENCODINGS:
        raise ValueError(f"kv_events_encoding must be one of {', '.join(ENCODINGS)}")
    reply = ReplyOptions(**{k: overrides.pop(k) for k in list(overrides) if k in _REPLY_FIELDS})
    config = build_config(preset, model, **overrides)
    tokens = PseudoTokens()
    if tokenizer:
        from kvroute.sim.real_tokens import RealTokens  # needs kvroute[tokenizer]

        tokens = RealTokens(tokenizer)
    fleet = SimFleet([
        SimReplica(i, config, served_model=config.model, speed=speed, options=reply, preset=preset,
                   kv_events=kv_events, kv_events_encoding=kv_events_encoding,
                   data_parallel_size=data_parallel_size, tokens=tokens)
        for i in range(replicas)
    ])
    try:
        for i, replica in enumerate(fleet.replicas):
            await replica.start(host, base_port + i if base_port else 0)
    except BaseException:
        await fleet.close()
        raise
    log.info("simulated %d x %s (%s%s) at %s", replicas, preset, config.model,
             f", {data_parallel_size} data-parallel ranks each" if data_parallel_size > 1 else "",
             ", ".join(fleet.urls))
    return fleet
