"""Why the exact-mode prediction of a request's cached tokens missed: a per-request trace, by cause.

    python benchmarks/prediction_misses.py --steps 16,24,32,48 --seeds 0-7 --think-time 3
    python benchmarks/prediction_misses.py --steps 16,24,32,48 --seeds 0-7 --think-time 0

Runs ``ab_flow.py``'s exact variant (``auto/default+kv_events=True``, or ``--variant``) in virtual
time with the engines instrumented: each engine's block pool logs which request's allocation
evicted which cached block, and when (a prefill admitted from the queue, a running prefill's next
chunk, a decode growing its answer); each request's trace holds its routing time, the engine's true
match then, its arrival at the engine, every step it spent at the head of the engine's queue held
for KV room or behind other requests, and its scheduling.  A finished request whose engine-reported
cached tokens differ from the router's prediction by more than one block is a miss, classified by
the first block the prediction got wrong:

* over-prediction (the engine served less): that block was evicted before routing (the engine step
  in progress, not told yet), between routing and reaching the engine, or while in the engine's
  queue — behind other requests, or at its head held for KV room — by a prefill or a decode of
  which request (sent before this one or after; routed unanswered or already answering); or never
  computed (a speculative entry of a prompt not computed by then);
* under-prediction (the engine served more): the router predicted that block evicted and it was
  not, or it was stored (not told yet) when routed, or stored after routing (another request's
  prefill extended the prefix meanwhile).

A diagnostic: it patches the simulator's block pool and engine *in this process* to log, never to
change what they do, so its share within one block is ``ab_flow.py --prediction``'s for the same
steps and seeds.  Seeds run one after another in this process.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from ab_flow import cluster_config, parse_seeds, variant_settings

from kvroute.bench.cluster import VirtualCluster
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig
from kvroute.sim import engine as sim_engine
from kvroute.sim.block_pool import BlockPool
from kvroute.sim.engine import EngineModel, EventKind

# --- instrumentation ------------------------------------------------------------------------------


@dataclass
class _Ctx:
    """What the engine is doing while it allocates: which engine, at what model time, for whom."""

    engine: EngineModel | None = None
    now: float = 0.0
    who: str | None = None
    kind: str = ""


_CTX = _Ctx()
# (engine id, unit hash) -> [(time, evictor request id, kind)], every eviction of that unit's block.
_EVICTED: dict[tuple[int, int], list[tuple[float, str, str]]] = collections.defaultdict(list)
# (engine id, unit hash) -> first time it was indexed.
_STORED: dict[tuple[int, int], float] = {}
# Request id -> (time, "head" | "behind") for every engine step it spent waiting.
_WAITS: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
_SEQS: dict[str, Any] = {}

_orig_allocate = BlockPool.allocate
_orig_register = BlockPool.register
_orig_step = EngineModel.step
_orig_admit = EngineModel._admit
_orig_grow = EngineModel._grow
_orig_add = EngineModel.add_request


def _allocate(self: BlockPool, n: int) -> list[int]:
    eng = _CTX.engine
    if eng is not None and n <= len(self._free):
        who, kind = _CTX.who, _CTX.kind
        if who is None and eng._waiting:  # called by _admit: the head of the queue is admitted
            who, kind = eng._waiting[0].request_id, "admitted prefill"
        it = iter(self._free)
        for _ in range(n):
            b = next(it)
            for h in self._hashes[b]:
                if self._cached.get(h) == b:
                    _EVICTED[(id(eng), h)].append((_CTX.now, who or "?", kind))
    return _orig_allocate(self, n)


def _register(self: BlockPool, block: int, unit_hash: int) -> bool:
    fresh = _orig_register(self, block, unit_hash)
    if fresh and _CTX.engine is not None:
        _STORED.setdefault((id(_CTX.engine), unit_hash), _CTX.now)
    return fresh


def _step(self: EngineModel, now: float) -> Any:
    _CTX.engine, _CTX.now = self, now
    try:
        return _orig_step(self, now)
    finally:
        _CTX.engine = None


def _admit(self: EngineModel, budget: int, scheduled: Any, events: Any, now: float) -> int:
    out = _orig_admit(self, budget, scheduled, events, now)
    waiting = list(self._waiting)
    if waiting:
        held = out > 0 and len(self._running) < self.config.max_num_seqs
        for i, seq in enumerate(waiting):
            _WAITS[seq.request_id].append((now, "head" if i == 0 and held else "behind"))
    return out


def _grow(self: EngineModel, seq: Any, n: int) -> bool:
    _CTX.who = seq.request_id
    _CTX.kind = "decode" if seq.num_output else "prefill chunk"
    try:
        return _orig_grow(self, seq, n)
    finally:
        _CTX.who = None


def _add(self: EngineModel, req: Any, now: float) -> None:
    _orig_add(self, req, now)
    _SEQS[req.request_id] = self._seqs[req.request_id]


def _instrument() -> None:
    BlockPool.allocate = _allocate  # type: ignore[method-assign]
    BlockPool.register = _register  # type: ignore[method-assign]
    EngineModel.step = _step  # type: ignore[method-assign]
    EngineModel._admit = _admit  # type: ignore[method-assign]
    EngineModel._grow = _grow  # type: ignore[method-assign]
    EngineModel.add_request = _add  # type: ignore[method-assign]


# --- the traced cluster ---------------------------------------------------------------------------


@dataclass
class _Trace:
    rid: str
    engine: int
    first_turn: bool
    routed: float
    predicted: float
    unroomed: int  # the router's match without the eviction prediction, in blocks
    hashes: list[int]  # the engine's unit hashes of the prompt
    true_at_route: int  # units the engine held then
    inflight_at_route: set[str] = field(default_factory=set)  # requests on that engine then
    answering_at_route: set[str] = field(default_factory=set)  # of those, past their prefill
    arrived: float | None = None
    scheduled: float | None = None
    cached: int | None = None


class TracedCluster(VirtualCluster):
    """The virtual cluster, recording a ``_Trace`` per routed request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.traces: dict[str, _Trace] = {}
        self.by_record: dict[int, _Trace] = {}  # id of the client's record -> its trace
        self._pending: list[_Trace] = []
        route = self.dispatch.route

        def traced_route(key: Any, workers: Any) -> Any:
            decision = route(key, workers)
            if decision.worker_id is not None and decision.exact:
                e = self._index[decision.worker_id]
                eng = self.engines[e]
                unroomed = self.scheduler.exact.match(decision.token_hashes, [decision.worker_id],
                                                      self._clock())[decision.worker_id]
                self._pending.append(_Trace(
                    "", e, False, self.now,
                    decision.held_tokens, unroomed, [], 0,
                    {s.request_id for s in eng._seqs.values()},
                    {s.request_id for s in eng._seqs.values() if s.first_token_at is not None}))
            return decision

        self.dispatch.route = traced_route  # type: ignore[method-assign]

    def _route(self, loop: int, req: Any, rec: Any, rendered: Any, key: Any, arrived: float) -> None:
        before = len(self._live)
        self._pending.clear()
        super()._route(loop, req, rec, rendered, key, arrived)
        if len(self._live) == before or not self._pending:
            return
        rid = next(reversed(self._live))
        tr = self._pending.pop()
        tr.rid = rid
        tr.first_turn = req.round == 0
        live = self._live[rid]
        eng = self.engines[live.engine]
        seq = sim_engine._Seq(live.sim, eng.config.model, self.now)
        units = (seq.num_tokens - 1) // eng._unit
        if units:
            seq.unit_hash(units, eng._unit_bytes)
        tr.hashes = seq.hashes
        tr.true_at_route = len(eng._pool.match(seq.hashes))
        self.traces[rid] = tr
        self.by_record[id(rec)] = tr

    def _arrive(self, live: Any) -> None:
        tr = self.traces.get(live.sim.request_id)
        if tr is not None:
            tr.arrived = self.now
        super()._arrive(live)

    def _stepped(self, e: int, result: Any) -> None:
        for event in result.events:
            if event.kind is EventKind.SCHEDULED:
                tr = self.traces.get(event.request_id)
                if tr is not None and tr.scheduled is None:
                    # The step ran (and allocated) at its start: that is when it was scheduled.
                    tr.scheduled = self.now - result.duration_s
                    tr.cached = event.cached_tokens
        super()._stepped(e, result)


# --- classification -------------------------------------------------------------------------------


def classify(tr: _Trace, rec: Any, block: int, eng_id: int, unit: int) -> str | None:
    """The cause of a miss (None: within one block)."""
    predicted, reported = rec.predicted_cached, rec.cached_tokens
    if abs(predicted - reported) <= block:
        return None
    turn = "first turn" if tr.first_turn else "continuing turn"
    if reported < predicted:
        k = reported // unit
        h = tr.hashes[k] if k < len(tr.hashes) else None
        if h is None:
            return f"over | {turn} | prompt shorter than predicted"
        assert tr.scheduled is not None and tr.arrived is not None
        evs = [ev for ev in _EVICTED.get((eng_id, h), []) if ev[0] <= tr.scheduled]
        stored = _STORED.get((eng_id, h))
        if not evs:
            if stored is None or stored > tr.scheduled:
                return f"over | {turn} | never computed by then (speculative)"
            return f"over | {turn} | held, not hit (?)"
        t, who, kind = evs[-1]
        if t < tr.routed:
            return f"over | {turn} | evicted before routing, not told yet"
        if t < tr.arrived:
            return f"over | {turn} | evicted between routing and the engine"
        waits = dict(_WAITS.get(tr.rid, []))
        # Not waiting at that step's end: the step that admitted it (running requests grow first).
        where = waits.get(t, "the step admitting it")
        whom = ("answering at routing" if who in tr.answering_at_route else
                "unanswered at routing" if who in tr.inflight_at_route else "sent after")
        return f"over | {turn} | evicted in the engine queue ({where}) by {kind}, {whom}"
    k = int(predicted) // unit
    if tr.unroomed * block > predicted + block:
        return f"under | {turn} | eviction predicted, not made"
    if tr.true_at_route > k:
        return f"under | {turn} | held at routing, not told yet"
    return f"under | {turn} | stored after routing"


def _run(job: tuple[str, int, float, list[int], float]) -> list[dict[str, Any]]:
    variant, seed, think, steps, duration = job
    policy, settings = variant_settings(variant, {})
    cfg = cluster_config(settings)
    cluster = TracedCluster(cfg, policy)
    block = cluster.config.engine_config().block_size
    unit = cluster.engines[0]._unit
    out: list[dict[str, Any]] = []

    def on_step(_: Any) -> None:
        causes: collections.Counter[str] = collections.Counter()
        records = [r for r in cluster.last_records
                   if r.error is None and r.end_s is not None and r.predicted_cached is not None]
        by_rec = cluster.by_record
        waited_head = waited_behind = 0
        for r in records:
            tr = by_rec.get(id(r))
            if tr is None:
                causes["not traced (routed approximately)"] += 1
                continue
            ws = [w for _, w in _WAITS.get(tr.rid, [])]
            waited_head += "head" in ws
            waited_behind += "behind" in ws
            cause = classify(tr, r, block, id(cluster.engines[tr.engine]), unit)
            if cause is not None:
                causes[cause] += 1
        out.append({"n": len(records), "causes": causes, "head": waited_head, "behind": waited_behind})
        by_rec.clear()

    workload = AgentWorkload(AgentWorkloadConfig(think_time_s=think), seed)
    cluster.run(workload, steps, duration, on_step=on_step)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="auto/default+kv_events=True")
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--think-time", type=float, default=3.0)
    parser.add_argument("--steps", default="8,16,24,32,48")
    parser.add_argument("--duration", type=float, default=180.0)
    args = parser.parse_args()
    _instrument()
    seeds, steps = parse_seeds(args.seeds), [int(s) for s in args.steps.split(",")]
    runs = []
    for seed in seeds:
        _EVICTED.clear()
        _STORED.clear()
        _WAITS.clear()
        _SEQS.clear()
        runs.append(_run((args.variant, seed, args.think_time, steps, args.duration)))
    print(f"{args.variant}, seeds {args.seeds}, think time {args.think_time:g} s: share of finished "
          "requests (%), mean over seeds\n")
    causes = sorted({c for run in runs for row in run for c in row["causes"]})
    print("| cause | " + " | ".join(str(n) for n in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for cause in causes:
        cells = [statistics.mean(100.0 * run[k]["causes"].get(cause, 0) / max(run[k]["n"], 1) for run in runs)
                 for k in range(len(steps))]
        print(f"| {cause} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    within = [statistics.mean(100.0 * (1 - sum(run[k]["causes"].values()) / max(run[k]["n"], 1))
                              for run in runs) for k in range(len(steps))]
    print("| **within one block** | " + " | ".join(f"{c:.1f}" for c in within) + " |")
    for name, label in (("head", "waited at the engine queue's head"), ("behind", "waited behind others")):
        cells = [statistics.mean(100.0 * run[k][name] / max(run[k]["n"], 1) for run in runs)
                 for k in range(len(steps))]
        print(f"| ({label}, missed or not) | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
