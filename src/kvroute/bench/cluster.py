"""Virtual-time simulation: N engine models, the router's real dispatch path and a workload: closed-loop
sessions, or open-loop requests arriving at their own (Poisson) times.

Nothing here reads a clock or does I/O, so a run is a pure function of its inputs: the same seed
gives the same results, and a five-step A/B of a four-replica fleet takes seconds instead of an
hour.  Requests go through the same code as over HTTP wherever it matters: the router's
``parse_request`` makes the routing key from the OpenAI body, the simulator's ``parse_request``
renders the prompt the engine sees, and each engine is the simulator's :class:`EngineModel`.

The router's side is the server's own code: every request goes through the same
:class:`~kvroute.routing.dispatch.Dispatcher` as over HTTP (flow control's gate and queue, route,
sent, first byte, finished; a request's time to first byte counts its wait at the gate), and
engine figures reach it through ``Dispatcher.scraped``, so in-flight counts, backlog and learning
are computed by one piece of code for both clocks.  What differs is only where events come from:

* ``running``, ``waiting`` and ``kv_usage`` come from a scrape of each engine every
  ``scrape_interval_s`` (the server's probe interval, 1 s by default), so they are up to that old
  — the staleness every load-based policy lives with in production;
* ``max_num_seqs`` and ``max_model_len`` are known from the start (the probe reads them from
  ``/server_info`` and ``/v1/models``);
* the first byte is the engine's first token (requests are streamed, as the HTTP benchmark does).

The network is instantaneous: a session sends its next round ``think_s`` (the workload's pause for
the agent's tools, 0 by default) after the previous response ends, and a request reaches its
engine ``request_overhead_s`` (the preset's fixed per-request cost) after the decision.  Each
agent names itself (``x-kvroute-client``), and sends a request the gate sheds again after its
Retry-After, up to ``SHED_TRIES`` times.  In the open loop (:meth:`VirtualCluster.run_open`) each
request is sent at its arrival time through the same path; a request the gate sheds is recorded
and not retried.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.api.requests import CLIENT_HEADER
from kvroute.api.requests import parse_request as route_key
from kvroute.bench.results import BenchResult, PolicyRun, RequestRecord, StepResult
from kvroute.bench.stats import CacheCounters, summarize_step
from kvroute.bench.workloads import (
    SHED_TRIES,
    PlannedRequest,
    SessionScript,
    SharedPrefixWorkload,
    TimedRequest,
    Workload,
)
from kvroute.fleet.kv_event_wire import EventBatch
from kvroute.fleet.kv_events import apply_batch
from kvroute.fleet.vllm_metrics import EngineMetrics
from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.decision import Decision
from kvroute.routing.dispatch import Dispatcher, InFlight
from kvroute.routing.flow import Ticket, TicketState
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.token_chains import TokenChains, with_tokens
from kvroute.routing.worker import WorkerState
from kvroute.sim.answers import filler
from kvroute.sim.cache_config import cache_config_labels
from kvroute.sim.engine import EngineConfig, EngineModel, EngineStep, EventKind, SimRequest
from kvroute.sim.presets import build_config
from kvroute.sim.protocol import GenerationRequest
from kvroute.sim.protocol import parse_generation_request as sim_request
from kvroute.sim.tokenizer import token_ids

# The scheduler's clock is wall-clock seconds (epochs and entry ages travel between routers); the
# virtual run starts at this fixed instant so that nothing depends on when it ran.
EPOCH = 1_700_000_000.0
# Synthetic workloads start each step at its own block of session indices (as the HTTP runner does).
STEP_STRIDE = 1_000_000


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The simulated fleet and the router's view of it.

    ``engine`` overrides preset settings (EngineConfig or cost-model fields); ``policy`` overrides
    ``ModelSettings`` fields (the tunables of ``auto``, the overflow threshold, ...) and ``routing``
    ``RoutingConfig`` fields.
    """

    preset: str = "a4000-qwen3-4b"
    replicas: int = 4
    engine: Mapping[str, Any] = field(default_factory=dict)
    policy: Mapping[str, Any] = field(default_factory=dict)
    routing: Mapping[str, Any] = field(default_factory=dict)
    scrape_interval_s: float = 1.0
    # The engines publish KV-cache events (vLLM's enable_kv_cache_events) and the router reads
    # them after ``kv_event_lag_s``: workers are then in exact mode (routing/exact_index.py).
    kv_events: bool = False
    kv_event_lag_s: float = 0.005
    # Each agent names itself (``x-kvroute-client``), so that its next session frees the one
    # before at session admission's door; False: agents as clients that send no such header.
    client_header: bool = True

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.kv_event_lag_s < 0:
            raise ValueError("kv_event_lag_s must not be negative")
        if self.scrape_interval_s <= 0:
            raise ValueError("scrape_interval_s must be positive")

    def engine_config(self) -> EngineConfig:
        """The engine config every replica runs."""
        extra = {"enable_kv_cache_events": True} if self.kv_events else {}
        return build_config(self.preset, **{**extra, **dict(self.engine)})

    def routing_config(self, policy: str) -> RoutingConfig:
        """The router's configuration for ``policy``."""
        return RoutingConfig(default=ModelSettings(policy=policy, **dict(self.policy)), **dict(self.routing))


@dataclass(slots=True)
class _Live:
    """A request between its decision and its end."""

    record: RequestRecord
    loop: int
    engine: int
    arrived: float  # at the router: the time to first byte counts any wait in its queue
    step_start: float
    sim: SimRequest
    flight: InFlight


@dataclass(slots=True)
class _Loop:
    """One closed-loop session: which script, which round next."""

    script: SessionScript | None = None
    next_round: int = 0
    tries: int = 0  # times its current request was shed in a row


# The ``loop`` of an open-loop request: its client sends nothing after it.
OPEN_LOOP = -1


@dataclass(slots=True)
class _Step:
    """One step's traffic: ``loops`` closed-loop sessions handing out ``workload``'s sessions in
    order, and/or open-loop ``arrivals`` at their own times, whatever the fleet does."""

    start: float
    end: float
    workload: Workload | None = None
    next_index: int = 0
    loops: list[_Loop] = field(default_factory=list)
    arrivals: Iterator[TimedRequest] | None = None
    records: list[RequestRecord] = field(default_factory=list)  # the closed loop's
    open_records: list[RequestRecord] = field(default_factory=list)
    busy: list[int] = field(default_factory=list)

    def next_request(self, i: int, now: float) -> tuple[PlannedRequest, RequestRecord] | None:
        """Loop ``i``'s next request at ``now`` (None once the window closed or the trace ran out)."""
        lp = self.loops[i]
        if now >= self.end or self.workload is None:
            return None
        if lp.script is None or lp.next_round >= lp.script.rounds:
            size = self.workload.size
            if size is not None and self.next_index >= size:
                return None
            lp.script, lp.next_round = self.workload.session(self.next_index), 0
            self.next_index += 1
        req = lp.script.requests[lp.next_round]
        lp.next_round += 1
        rec = RequestRecord(req.session_id, req.round, now - self.start,
                            last_round=lp.next_round == lp.script.rounds)
        self.records.append(rec)
        return req, rec


class VirtualCluster:
    """A fleet of engine models behind one router instance, in virtual time.

    One cluster serves one policy: build a new one per policy so every policy starts from empty
    caches and an empty router.  Steps run one after another on the same cluster, so later steps
    find the caches the earlier ones left, as on a real fleet.
    """

    def __init__(self, config: ClusterConfig, policy: str) -> None:
        self.config = config
        self.policy = policy
        self.now = 0.0
        engine_cfg = config.engine_config()
        self.model = engine_cfg.model
        self._overhead = engine_cfg.cost.request_overhead_s
        # The engine's cache_config_info, read as a scrape over HTTP reads it (its KV size, its block).
        self._cache = EngineMetrics(cache_config=cache_config_labels(engine_cfg))
        scheduler = Scheduler(config.routing_config(policy), clock=self._clock)
        scheduler.publishes = False  # one router instance: nobody hears its facts
        self.dispatch = Dispatcher(scheduler, timer=lambda: self.now)
        self.engines = [EngineModel(engine_cfg, EPOCH) for _ in range(config.replicas)]
        self.workers = [
            WorkerState(id=f"replica-{i}", url=f"sim://replica-{i}", models=frozenset({self.model}),
                        epoch=EPOCH, max_num_seqs=engine_cfg.max_num_seqs,
                        max_model_len=engine_cfg.max_model_len, running=0, waiting=0, kv_usage=0.0)
            for i in range(config.replicas)
        ]
        self._index = {w.id: i for i, w in enumerate(self.workers)}
        for w in self.workers:
            self.dispatch.worker_epoch(w.id, w.epoch)
            if config.kv_events:
                self.scheduler.exact.attach(w.id, [0])
                self.scheduler.exact.synced(w.id, 0, self._clock())
        self._chains = TokenChains()
        self._busy = [False] * config.replicas
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._rid = itertools.count()
        self._live: dict[str, _Live] = {}
        self._waiting: dict[int, Ticket] = {}  # queued at the router, or woken and not yet routed
        self.last_records: list[RequestRecord] = []  # the last step's requests, as the client saw them
        self._next_scrape = 0.0
        self._step: _Step | None = None
        self._poll_interval = 1.0

    @property
    def scheduler(self) -> Scheduler:
        """The router's scheduler behind the dispatch path."""
        return self.dispatch.scheduler

    def _clock(self) -> float:
        return EPOCH + self.now

    def _at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), action))

    # --- the router's view ------------------------------------------------------------------------

    def _scrape(self) -> None:
        for w, engine in zip(self.workers, self.engines, strict=True):
            snap = engine.snapshot()
            self.dispatch.scraped(w, snap.num_running, snap.num_waiting, snap.kv_cache_usage,
                                  self._cache.kv_tokens, block_size=self._cache.block_size)
        self._next_scrape = self.now + self.config.scrape_interval_s
        self._at(self._next_scrape, self._scrape)

    # --- engines ----------------------------------------------------------------------------------

    def _kick(self, e: int) -> None:
        if self._busy[e] or not self.engines[e].has_work():
            return
        engine = self.engines[e]
        result = engine.step(self.now)
        if result.duration_s == 0 and not result.events:
            return  # blocked until something finishes or arrives; that will kick it again
        self._busy[e] = True
        end = self.now + result.duration_s
        self._at(end, lambda: self._stepped(e, result))
        events = engine.drain_kv_events()
        if events:
            # Published when the step ends, read by the router after the lag.
            batch = EventBatch(EPOCH + end, events, 0)
            wid = self.workers[e].id

            def publish() -> None:
                apply_batch(self.scheduler.exact, wid, 0, batch, self._clock())

            self._at(end + self.config.kv_event_lag_s, publish)

    def _stepped(self, e: int, result: EngineStep) -> None:
        self._busy[e] = False
        done: list[_Live] = []
        for event in result.events:
            live = self._live.get(event.request_id)
            if live is None:
                continue
            rec = live.record
            if event.kind is EventKind.TOKEN and event.token_index == 0:
                self.dispatch.first_byte(live.flight)
                rec.ttfb_s = self.now - live.arrived
            elif event.kind is EventKind.FINISHED:
                rec.end_s = self.now - live.step_start
                rec.prompt_tokens, rec.cached_tokens = event.prompt_tokens, event.cached_tokens
                rec.output_tokens = event.output_tokens
                done.append(live)
        self._kick(e)
        for live in done:
            self._finish(live)

    # --- requests ---------------------------------------------------------------------------------

    def _send(self, loop: int, req: PlannedRequest, rec: RequestRecord) -> None:
        body = req.openai_body(self.model)
        headers = req.headers()
        if loop != OPEN_LOOP and self.config.client_header:  # its next session ends the one before
            headers[CLIENT_HEADER] = f"agent-{loop}"
        key: RoutingKey = route_key("chat", body, headers)
        # The engine's own rendering, made once: the prompt it prefills and, in exact mode, the
        # tokens its /tokenize would answer over HTTP.
        rendered = sim_request("chat", body, self.model)
        arrived = self.now
        exact = self.scheduler.exact_worker(key.model, self.workers) if key.cache_salt is None else None
        if exact is not None:
            block = self.scheduler.block_size(exact)
            assert block is not None
            key = with_tokens(key, token_ids(rendered.prompt), block, self._chains)

        def decided(ticket: Ticket) -> None:  # granted or shed from the queue, as over HTTP
            self._at(self.now, lambda: self._woken(ticket, loop, req, rec, rendered, key, arrived))

        ticket = self.dispatch.admit(key, self.workers, decided)
        if ticket.state is TicketState.SHED:
            self._shed(ticket, loop, req, rec)
        elif ticket.queued:
            self._waiting[ticket.seq] = ticket
            self._at(ticket.deadline, lambda: self._expire(ticket))  # the dispatcher's clock is ours
        else:
            self._route(loop, req, rec, rendered, key, arrived)

    def _woken(self, ticket: Ticket, loop: int, req: PlannedRequest, rec: RequestRecord,
               rendered: GenerationRequest, key: RoutingKey, arrived: float) -> None:
        if self._waiting.pop(ticket.seq, None) is None:
            return  # withdrawn when the step was cut off
        rec.queue_s = ticket.waited_s
        if ticket.state is TicketState.SHED:
            self._shed(ticket, loop, req, rec)
            return
        self.dispatch.claim(ticket)
        self._route(loop, req, rec, rendered, key, arrived)

    def _expire(self, ticket: Ticket) -> None:
        self.dispatch.expire(ticket)  # a no-op once it left the queue

    def _shed(self, ticket: Ticket, loop: int, req: PlannedRequest, rec: RequestRecord) -> None:
        # What a client sees over HTTP: the overload answer (429 on the OpenAI route).  An agent
        # sends the request again after Retry-After, as the SDKs do, a few times before it gives up.
        rec.error = f"HTTP 429: shed ({ticket.reason}), retry after {ticket.retry_after_s} s"
        rec.shed, rec.retry_after_s = True, float(ticket.retry_after_s)
        step = self._step
        if loop != OPEN_LOOP and step is not None:
            lp = step.loops[loop]
            lp.tries += 1
            if lp.tries < SHED_TRIES:
                self._at(self.now + ticket.retry_after_s, lambda: self._retry(loop, req, rec))
                return
        self._at(self.now + ticket.retry_after_s, lambda: self._after(loop, failed=True))

    def _retry(self, loop: int, req: PlannedRequest, shed: RequestRecord) -> None:
        step = self._step
        assert step is not None
        if self.now >= step.end:
            self._after(loop, failed=True)
            return
        rec = RequestRecord(req.session_id, req.round, self.now - step.start, last_round=shed.last_round)
        step.records.append(rec)
        self._send(loop, req, rec)

    def _route(self, loop: int, req: PlannedRequest, rec: RequestRecord, rendered: GenerationRequest,
               key: RoutingKey, arrived: float) -> None:
        assert self._step is not None
        step_start = self._step.start
        decision: Decision = self.dispatch.route(key, self.workers)
        if decision.worker_id is None:
            rec.error = decision.reason
            self._after(loop, failed=True)
            return
        e = self._index[decision.worker_id]
        flight, _ = self.dispatch.sent(key, decision, self.workers[e])
        rec.worker = decision.worker_id
        rec.predicted_cached = decision.held_tokens
        limit = rendered.max_tokens if rendered.max_tokens is not None else req.max_tokens
        rid = f"r{next(self._rid)}"
        sim = SimRequest(rid, rendered.prompt, filler(rendered.prompt, limit), limit, rendered.cache_salt)
        live = _Live(rec, loop, e, arrived, step_start, sim, flight)
        self._live[rid] = live
        self._at(self.now + self._overhead, lambda: self._arrive(live))

    def _arrive(self, live: _Live) -> None:
        try:
            self.engines[live.engine].add_request(live.sim, self.now)
        except ValueError as exc:  # the engine refused it (context too long): a 400 over HTTP
            live.record.error = f"HTTP 400: {exc}"
            self._finish(live)
            return
        self._kick(live.engine)

    def _finish(self, live: _Live) -> None:
        del self._live[live.sim.request_id]
        rec = live.record
        self.dispatch.finished(live.flight, ok=rec.error is None, prompt_tokens=rec.prompt_tokens,
                               cached_tokens=rec.cached_tokens, output_tokens=rec.output_tokens)
        self._after(live.loop, failed=rec.error is not None)

    # --- closed loop ------------------------------------------------------------------------------

    def _issue(self, i: int) -> None:
        step = self._step
        assert step is not None
        nxt = step.next_request(i, self.now)
        if nxt is not None:
            self._send(i, *nxt)

    def _after(self, loop: int, failed: bool) -> None:
        step = self._step
        assert step is not None
        if loop == OPEN_LOOP:
            return
        lp = step.loops[loop]
        lp.tries = 0
        if failed:
            lp.script = None  # an agent whose request failed gives up on that task
        pause = 0.0
        if lp.script is not None and lp.next_round < lp.script.rounds:
            pause = lp.script.requests[lp.next_round].think_s
        if pause:
            self._at(self.now + pause, lambda: self._issue(loop))
        else:
            self._issue(loop)

    def _poll(self) -> None:
        step = self._step
        assert step is not None
        if self.now < step.end:
            step.busy.append(sum(1 for e in self.engines if e.has_work()))
            self._at(self.now + self._poll_interval, self._poll)

    # --- open loop --------------------------------------------------------------------------------

    def _next_arrival(self) -> None:
        # One arrival in the heap at a time: a long step never holds all of its requests at once.
        step = self._step
        assert step is not None and step.arrivals is not None
        timed = next(step.arrivals, None)
        if timed is not None:
            self._at(step.start + timed.at_s, lambda: self._arrival(timed))

    def _arrival(self, timed: TimedRequest) -> None:
        step = self._step
        assert step is not None
        rec = RequestRecord(timed.request.session_id, timed.request.round, self.now - step.start)
        step.open_records.append(rec)
        self._send(OPEN_LOOP, timed.request, rec)
        self._next_arrival()

    # --- steps ------------------------------------------------------------------------------------

    def _drive(self, step: _Step, drain_timeout_s: float) -> CacheCounters:
        """Run ``step`` through its window and the drain; the engines' prefix-cache and preemption
        counters over it."""
        self._step = step
        before = [e.snapshot().stats for e in self.engines]
        for i in range(len(step.loops)):
            self._at(self.now, functools.partial(self._issue, i))
        if step.arrivals is not None:
            self._next_arrival()
        self._at(self.now + self._poll_interval, self._poll)
        if self._next_scrape <= self.now:
            self._scrape()
        deadline = step.end + drain_timeout_s
        # The open loop also drains the router's queue: its requests have no client loop that
        # would give up on them at the window's end.
        open_loop = step.arrivals is not None
        while self._heap and (self.now < step.end or self._live or (open_loop and self._waiting)):
            t, _, action = heapq.heappop(self._heap)
            if t > deadline:
                break
            self.now = t
            action()
        self.now = max(self.now, step.end)
        for rid, live in list(self._live.items()):  # cut off after the drain timeout
            self.engines[live.engine].abort(rid, self.now)
            self.dispatch.finished(live.flight, ok=False)
            del self._live[rid]
        while self._waiting:  # requests still at the router's gate leave with the step
            self.dispatch.withdraw(self._waiting.popitem()[1])
        # Pending engine steps and polls of this step are dropped; scrapes carry on from here.
        self._heap = []
        self._busy = [False] * len(self.engines)
        self._scrape()
        after = [e.snapshot().stats for e in self.engines]
        pairs = list(zip(after, before, strict=True))
        self._step = None
        self.last_records = step.records + step.open_records
        return CacheCounters(hits=sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in pairs),
                             queries=sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in pairs),
                             preemptions=sum(a.num_preemptions - b.num_preemptions for a, b in pairs))

    @staticmethod
    def _check(duration_s: float, poll_interval_s: float, drain_timeout_s: float) -> None:
        if duration_s <= 0 or poll_interval_s <= 0 or drain_timeout_s < 0:
            raise ValueError("duration and poll interval must be positive, the drain timeout non-negative")

    def run_open(self, workload: SharedPrefixWorkload, rates: Sequence[float], duration_s: float, *,
                 poll_interval_s: float = 1.0, drain_timeout_s: float = 600.0, label: str | None = None,
                 on_step: Callable[[StepResult], None] | None = None) -> PolicyRun:
        """Run each step (an arrival rate, requests/s) for ``duration_s`` virtual seconds, one after
        another: open-loop arrivals, then the drain (requests in flight and at the router's gate)."""
        self._check(duration_s, poll_interval_s, drain_timeout_s)
        self._poll_interval = poll_interval_s
        run = PolicyRun(label or self.policy)
        for k, rate in enumerate(rates):
            step = _Step(self.now, self.now + duration_s,
                         arrivals=workload.arrivals(rate, duration_s, k * STEP_STRIDE))
            cache = self._drive(step, drain_timeout_s)
            result = summarize_step(run.policy, 0, duration_s, step.open_records, step.busy, cache,
                                    rate=rate)
            run.steps.append(result)
            if on_step is not None:
                on_step(result)
        return run

    def run(self, workload: Workload, steps: Sequence[int], duration_s: float, *,
            poll_interval_s: float = 1.0, drain_timeout_s: float = 600.0, label: str | None = None,
            on_step: Callable[[StepResult], None] | None = None) -> PolicyRun:
        """Run each step (concurrent sessions) for ``duration_s`` virtual seconds, one after another."""
        self._check(duration_s, poll_interval_s, drain_timeout_s)
        self._poll_interval = poll_interval_s
        run = PolicyRun(label or self.policy)
        next_index = 0
        for k, sessions in enumerate(steps):
            first = k * STEP_STRIDE if workload.size is None else next_index
            step = _Step(self.now, self.now + duration_s, workload, first,
                         [_Loop() for _ in range(sessions)])
            cache = self._drive(step, drain_timeout_s)
            next_index = step.next_index
            result = summarize_step(run.policy, sessions, duration_s, step.records, step.busy, cache)
            run.steps.append(result)
            if on_step is not None:
                on_step(result)
        return run

    def run_mixed(self, agents: Workload, sessions: Sequence[int], shared: SharedPrefixWorkload,
                  rates: Sequence[float], duration_s: float, *, poll_interval_s: float = 1.0,
                  drain_timeout_s: float = 600.0) -> tuple[PolicyRun, PolicyRun]:
        """Both kinds of traffic on one fleet at once: step k runs ``sessions[k]`` closed-loop
        sessions of ``agents`` beside open-loop arrivals of ``shared`` at ``rates[k]`` requests/s.
        Each kind's figures apart (the agents', then the open loop's), their prefix hits from the
        answers' usage (the engines' counters mix both); the preemptions are the fleet's."""
        self._check(duration_s, poll_interval_s, drain_timeout_s)
        if len(sessions) != len(rates):
            raise ValueError("one arrival rate per step of sessions")
        self._poll_interval = poll_interval_s
        closed, opened = PolicyRun(self.policy), PolicyRun(self.policy)
        for k, (n, rate) in enumerate(zip(sessions, rates, strict=True)):
            step = _Step(self.now, self.now + duration_s, agents, k * STEP_STRIDE,
                         [_Loop() for _ in range(n)],
                         arrivals=shared.arrivals(rate, duration_s, k * STEP_STRIDE))
            fleet = self._drive(step, drain_timeout_s)
            preempted = CacheCounters(hits=0, queries=0, preemptions=fleet.preemptions)
            closed.steps.append(summarize_step(self.policy, n, duration_s, step.records, step.busy,
                                               preempted))
            opened.steps.append(summarize_step(self.policy, 0, duration_s, step.open_records, step.busy,
                                               preempted, rate=rate))
        return closed, opened


def _each_policy(config: ClusterConfig, policies: Sequence[str], meta: Mapping[str, Any],
                 run: Callable[[VirtualCluster], PolicyRun]) -> BenchResult:
    """``run`` under each policy, each on a fresh cluster."""
    return BenchResult(dict(meta), [run(VirtualCluster(config, policy)) for policy in policies])


def run_virtual_bench(config: ClusterConfig, policies: Sequence[str], workload: Workload,
                      steps: Sequence[int], duration_s: float, meta: Mapping[str, Any], *,
                      poll_interval_s: float = 1.0, drain_timeout_s: float = 600.0,
                      on_step: Callable[[StepResult], None] | None = None) -> BenchResult:
    """The same workload under each policy, each on a fresh cluster."""
    return _each_policy(config, policies, meta, lambda cluster: cluster.run(
        workload, steps, duration_s, poll_interval_s=poll_interval_s, drain_timeout_s=drain_timeout_s,
        on_step=on_step))


def run_virtual_open_bench(config: ClusterConfig, policies: Sequence[str], workload: SharedPrefixWorkload,
                           rates: Sequence[float], duration_s: float, meta: Mapping[str, Any], *,
                           poll_interval_s: float = 1.0, drain_timeout_s: float = 600.0,
                           on_step: Callable[[StepResult], None] | None = None) -> BenchResult:
    """The same open-loop arrivals under each policy, each on a fresh cluster."""
    return _each_policy(config, policies, meta, lambda cluster: cluster.run_open(
        workload, rates, duration_s, poll_interval_s=poll_interval_s, drain_timeout_s=drain_timeout_s,
        on_step=on_step))
