"""Engine model of one vLLM replica: block pool, v1-style scheduler step, cost model. Pure, clock injected.

The caller owns time.  API::

    engine = EngineModel(config: EngineConfig, start_time: float)
    engine.add_request(req: SimRequest, now: float) -> None          # raises ValueError if it can't fit
    engine.abort(request_id: str, now: float) -> bool                 # True if it was in the engine
    engine.has_work() -> bool                                         # anything running or waiting
    engine.step(now: float) -> EngineStep                             # one scheduler iteration
    engine.restart(now: float) -> list[str]                           # ids of requests dropped
    engine.reset_prefix_cache(reset_running_requests=False) -> bool   # vLLM's /reset_prefix_cache
    engine.drain_kv_events() -> list[KvEvent]                         # KV-cache events since last drain
    engine.snapshot() -> EngineSnapshot                               # counters and gauges

``step(now)`` decides and applies one scheduler iteration at model time ``now`` and returns its
model-time ``duration_s`` and per-request ``events``; the caller delivers the events at
``now + duration_s`` (real time divided by a speed factor in the HTTP server, a virtual event heap
in ``bench/cluster.py``) and calls ``step`` again then.  A step with nothing to do has duration 0
and no events.  Nothing here reads a clock or sleeps.

Scheduling follows vLLM v1: running requests first (a decode needs one token of the budget, a
partial prefill continues), preempting from the tail of the running list (recompute: blocks freed,
back to the head of the waiting queue) when the block pool runs dry; then, if nothing was preempted,
waiting requests in FCFS order while ``max_num_seqs``, the token budget
(``max_num_batched_tokens``, chunked prefill) and free blocks allow.  A waiting request's cached
prefix is the longest run of cached match units, capped so at least one token is recomputed; on a
hybrid model it must also end where a Mamba state checkpoint exists (see ``sim/mamba.py``).
A sequence's KV is prompt plus generated tokens, so reply blocks are cached too.

With ``enable_kv_cache_events`` the engine also reports what its prefix cache does, as vLLM's
KV-cache events (``fleet/kv_event_wire.py``): ``Stored`` for each run of units a step indexed
(group 0, ``full_attention``, at the match unit: its hashes, its parent, its token ids), ``Removed``
for each block whose content an allocation evicted, and on hybrid models the same for the Mamba
state checkpoints (group 1, ``mamba``); ``Cleared`` on a prefix-cache reset or a restart.  They
accumulate in order until ``drain_kv_events()`` takes them: the HTTP server publishes them after
each step, the virtual-time cluster can read them directly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import cast

import xxhash

from kvroute.fleet.kv_event_wire import (
    MEDIUM_GPU,
    SPEC_FULL_ATTENTION,
    SPEC_MAMBA,
    Cleared,
    ExternalBlockHash,
    KvEvent,
    Stored,
)
from kvroute.sim.block_pool import ATTENTION_GROUP, BlockPool
from kvroute.sim.cost_model import CostModel, StepWork
from kvroute.sim.mamba import MAMBA_GROUP, MambaStatePool
from kvroute.sim.stats import EngineStats
from kvroute.sim.tokenizer import BYTES_PER_TOKEN, count_tokens, hash_seed, token_ids

MAMBA_CACHE_MODES = ("none", "align")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One replica's engine settings, with vLLM's names and meanings.

    ``prefix_match_unit`` (default: ``block_size``) is the finest token boundary a prefix-cache hit
    may land on; it must divide ``block_size``.  ``hybrid`` models keep a recurrent state per
    sequence in one of ``mamba_cache_blocks`` slots and reuse cached prefixes only with
    ``enable_prefix_caching`` and ``mamba_cache_mode == "align"``.  ``num_gpu_blocks_override`` and
    ``user_specified_block_size`` only record how the pool and the block were chosen (vLLM reports
    both): the override, when given, is ``num_gpu_blocks``.  ``enable_kv_cache_events`` (vLLM's
    name) makes the engine report its prefix cache's changes (see the module docstring).
    """

    model: str = "sim-model"
    block_size: int = 16
    num_gpu_blocks: int = 4096
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    hybrid: bool = False
    mamba_cache_mode: str = "none"
    mamba_cache_blocks: int = 0
    prefix_match_unit: int | None = None
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    user_specified_block_size: bool = False
    enable_kv_cache_events: bool = False
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.num_gpu_blocks_override not in (None, self.num_gpu_blocks):
            raise ValueError(f"num_gpu_blocks_override ({self.num_gpu_blocks_override}) sets num_gpu_blocks "
                             f"({self.num_gpu_blocks}); they must agree")
        unit = self.match_unit
        if unit <= 0 or self.block_size % unit:
            raise ValueError(f"prefix_match_unit ({unit}) must divide block_size ({self.block_size})")
        capacity = self.num_gpu_blocks * self.block_size
        if self.max_model_len > capacity:
            raise ValueError(
                f"To serve at least one request with the model's max seq len ({self.max_model_len}), "
                f"{self.max_model_len} tokens of KV cache are needed, which is larger than the "
                f"available KV cache ({capacity} tokens in {self.num_gpu_blocks} blocks). Try "
                f"decreasing `max_model_len` when initializing the engine."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill disabled."
            )
        if self.hybrid and self.max_num_seqs > self.mamba_cache_blocks:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) exceeds available Mamba cache blocks "
                f"({self.mamba_cache_blocks}). Each decode sequence requires one Mamba cache block, "
                f"so CUDA graph capture cannot proceed."
            )

    @property
    def match_unit(self) -> int:
        """Tokens per match unit: ``prefix_match_unit`` or, by default, the block size."""
        return self.prefix_match_unit if self.prefix_match_unit is not None else self.block_size

    @property
    def reuses_prefixes(self) -> bool:
        """Whether a cached prefix can actually be reused (hybrid needs ``align`` mode)."""
        return self.enable_prefix_caching and (not self.hybrid or self.mamba_cache_mode == "align")

    def context_error(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """vLLM's message when a request does not fit in ``max_model_len`` (None if it fits)."""
        if prompt_tokens + max_tokens <= self.max_model_len and prompt_tokens < self.max_model_len:
            return None
        return (
            f"This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion."
        )


@dataclass(slots=True)
class SimRequest:
    """One request as the engine sees it.

    ``prompt`` is the rendered prompt (see ``sim/tokenizer.py``); ``output`` the full reply text the
    engine will produce, 4 bytes per token.  The engine generates
    ``max(1, min(max_tokens, count_tokens(output)))`` tokens; a reply cut by ``max_tokens`` finishes
    with ``"length"``, otherwise ``"stop"`` (an empty reply is a lone end-of-sequence token).
    """

    request_id: str
    prompt: bytes
    output: bytes = b""
    max_tokens: int = 16
    cache_salt: str | None = None


class EventKind(Enum):
    """What happened to a request in a step."""

    SCHEDULED = "scheduled"   # admitted from the waiting queue; cached_tokens = prefix hit
    TOKEN = "token"           # generated output token number token_index (0 = first token)
    FINISHED = "finished"     # done; finish_reason and the usage figures are set
    PREEMPTED = "preempted"   # sent back to waiting, KV freed; will recompute


@dataclass(frozen=True, slots=True)
class EngineEvent:
    """One event of one request; which fields are meaningful depends on ``kind``."""

    kind: EventKind
    request_id: str
    cached_tokens: int = 0
    token_index: int = -1
    finish_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineStep:
    """One scheduler iteration: its model-time duration and what the caller must deliver after it."""

    duration_s: float
    events: list[EngineEvent]
    work: StepWork


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Gauges and counters for ``/metrics`` and for routers' load views."""

    start_time: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_mamba_checkpoints: int
    stats: EngineStats


class _Seq:
    """Engine-side state of one request."""

    __slots__ = ("arrival", "blocks", "cache_salt", "cached_tokens", "data", "finish_reason",
                 "first_token_at", "hashes", "holds_slot", "mamba_from", "match", "match_evictions",
                 "n_out", "num_computed", "num_output", "prompt_tokens", "request_id", "seed")

    def __init__(self, req: SimRequest, model: str, now: float) -> None:
        self.request_id = req.request_id
        self.prompt_tokens = count_tokens(req.prompt)
        reply_tokens = count_tokens(req.output)
        self.n_out = max(1, min(req.max_tokens, reply_tokens))
        self.finish_reason = "length" if reply_tokens > req.max_tokens else "stop"
        pad = b"\x00" * (-len(req.prompt) % BYTES_PER_TOKEN)
        self.data = req.prompt + pad + req.output
        self.seed = hash_seed(model, req.cache_salt)
        self.cache_salt = req.cache_salt
        self.hashes: list[int] = []
        self.blocks: list[int] = []
        self.num_computed = 0
        self.num_output = 0
        self.cached_tokens = -1
        self.holds_slot = False
        self.arrival = now
        self.first_token_at: float | None = None
        # The last prefix lookup: blocks of the cached run of units, valid while the pool's
        # eviction count is still ``match_evictions`` (see ``EngineModel._lookup``).
        self.match: list[int] = []
        self.match_evictions = -1
        # Units up to the last Mamba state this sequence checkpointed or resumed from (KV events).
        self.mamba_from = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output

    def unit_hash(self, k: int, unit_bytes: int) -> int:
        """Chained hash of the first ``k`` match units (``k >= 1``), computed lazily."""
        hashes = self.hashes
        if len(hashes) < k:
            view = memoryview(self.data)
            digest = xxhash.xxh3_64_intdigest
            h = hashes[-1] if hashes else self.seed
            for i in range(len(hashes), k):
                h = digest(view[i * unit_bytes:(i + 1) * unit_bytes], seed=h)
                hashes.append(h)
        return hashes[k - 1]


class EngineModel:
    """One replica's engine in model time (see the module docstring for the API)."""

    def __init__(self, config: EngineConfig, start_time: float) -> None:
        self.config = config
        self._unit = config.match_unit
        self._unit_bytes = self._unit * BYTES_PER_TOKEN
        self._align = config.hybrid and config.reuses_prefixes
        # vLLM reports nothing without prefix caching: no block is ever indexed.
        self._kv_events: list[KvEvent] | None = (
            [] if config.enable_kv_cache_events and config.enable_prefix_caching else None)
        self._reset(start_time)

    def _reset(self, start_time: float) -> None:
        cfg = self.config
        self.start_time = start_time
        self._pool = BlockPool(cfg.num_gpu_blocks, cfg.block_size, self._kv_events)
        self._mamba = MambaStatePool(cfg.mamba_cache_blocks, self._kv_events) if cfg.hybrid else None
        self._seqs: dict[str, _Seq] = {}
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self.stats = EngineStats.for_model_len(cfg.max_model_len)

    # ------------------------------------------------------------------------------ requests

    def add_request(self, req: SimRequest, now: float) -> None:
        """Queue a request (FCFS).  Raises ValueError if it can never fit or its id is in use."""
        if req.request_id in self._seqs:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        if not req.prompt:
            raise ValueError("The prompt cannot be empty")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        seq = _Seq(req, self.config.model, now)
        error = self.config.context_error(seq.prompt_tokens, req.max_tokens)
        if error:
            raise ValueError(error)
        self._seqs[req.request_id] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str, now: float) -> bool:
        """Drop a request wherever it is (client gone); its blocks are freed, its cache kept.
        It counts as finished with vLLM's reason ``abort``."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.stats.finished["abort"] = self.stats.finished.get("abort", 0) + 1
        if seq in self._running:
            self._running.remove(seq)
            self._release(seq)
        else:
            self._waiting.remove(seq)
        return True

    def has_work(self) -> bool:
        """Whether a step would do anything."""
        return bool(self._running or self._waiting)

    def restart(self, now: float) -> list[str]:
        """Process restart: every request dropped, cache and counters emptied, new start time.
        Events not yet drained are lost with the process; a ``Cleared`` says the cache is empty."""
        dropped = list(self._seqs)
        if self._kv_events is not None:
            self._kv_events.clear()
            self._kv_events.append(Cleared())
        self._reset(now)
        return dropped

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's prefix-cache reset: every cached block (and Mamba checkpoint) forgotten, one
        ``Cleared`` reported.  Refused (False) while requests hold blocks, unless
        ``reset_running_requests``, which first preempts them (they recompute)."""
        if self._running:
            if not reset_running_requests:
                return False
            preempted: list[EngineEvent] = []
            while self._running:
                self._preempt(self._running.pop(), preempted)
        self._pool.reset_index()
        if self._mamba is not None:
            self._mamba.clear_checkpoints()
        for seq in self._waiting:
            seq.match, seq.match_evictions = [], -1
        if self._kv_events is not None:
            self._kv_events.append(Cleared())
        return True

    def drain_kv_events(self) -> list[KvEvent]:
        """The KV-cache events since the last drain, in the order they happened (empty unless
        ``enable_kv_cache_events`` with prefix caching)."""
        events = self._kv_events
        if not events:
            return []
        out = events.copy()
        events.clear()
        return out

    def queue_figures(self) -> tuple[int, int, float]:
        """Waiting and running requests and the KV cache's usage: what vLLM's engines report to
        its data-parallel balancer."""
        return len(self._waiting), len(self._running), self._pool.usage

    def snapshot(self) -> EngineSnapshot:
        """Current gauges and a copy of the counters."""
        return EngineSnapshot(
            start_time=self.start_time,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=self._pool.usage,
            num_mamba_checkpoints=self._mamba.num_checkpoints if self._mamba else 0,
            stats=self.stats.copy(),
        )

    # ------------------------------------------------------------------------------ the step

    def step(self, now: float) -> EngineStep:
        """Schedule and run one iteration starting at model time ``now``."""
        cfg = self.config
        events: list[EngineEvent] = []
        scheduled: list[tuple[_Seq, int]] = []
        budget = cfg.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            n = self._chunk(seq, seq.num_computed, min(seq.num_tokens - seq.num_computed, budget))
            while not self._grow(seq, n):
                victim = self._running.pop()
                self._preempt(victim, events)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break

        if not preempted:
            budget = self._admit(budget, scheduled, events, now)

        work = self._work(scheduled)
        duration = cfg.cost.step_seconds(work)
        self._apply(scheduled, now + duration, events)
        return EngineStep(duration, events, work)

    def _admit(self, budget: int, scheduled: list[tuple[_Seq, int]], events: list[EngineEvent],
               now: float) -> int:
        cfg = self.config
        pool = self._pool
        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            seq = self._waiting[0]
            hit_blocks, hit = self._lookup(seq)
            remaining = seq.num_tokens - hit
            if not cfg.enable_chunked_prefill and remaining > budget:
                break
            n = self._chunk(seq, hit, min(remaining, budget))
            need = -(-(hit + n) // cfg.block_size) - len(hit_blocks)
            free = pool.num_free
            # Sharing a cached block that is free takes it off the free list: count those (a walk
            # over the hit) only when the answer depends on it.
            if need > free or (need > free - len(hit_blocks)
                               and need > free - pool.num_free_among(hit_blocks)):
                break
            if self._mamba is not None:
                if not self._mamba.acquire():
                    break
                seq.holds_slot = True
            pool.touch(hit_blocks)
            seq.blocks = hit_blocks + pool.allocate(need)
            seq.num_computed = hit
            seq.mamba_from = hit // self._unit
            if seq.cached_tokens < 0:
                seq.cached_tokens = hit
                self.stats.queue_time.observe(now - seq.arrival)
                if cfg.enable_prefix_caching:
                    self.stats.prefix_cache_queries += seq.prompt_tokens
                    self.stats.prefix_cache_hits += hit
            self._waiting.popleft()
            self._running.append(seq)
            events.append(EngineEvent(EventKind.SCHEDULED, seq.request_id, cached_tokens=hit))
            scheduled.append((seq, n))
            budget -= n
        return budget

    def _lookup(self, seq: _Seq) -> tuple[list[int], int]:
        """Blocks to share and tokens already computed for a request leaving the waiting queue.

        A request that does not fit stays at the head of the queue and is looked up again on every
        step, so the run of cached units is kept on the request and only extended while the pool
        has evicted nothing since (a unit, once indexed, stays in its block until evicted).
        """
        cfg = self.config
        if not cfg.reuses_prefixes:
            return [], 0
        unit, bs, pool = self._unit, cfg.block_size, self._pool
        max_units = (seq.num_tokens - 1) // unit
        if max_units:
            seq.unit_hash(max_units, self._unit_bytes)
        hashes = seq.hashes
        found = seq.match
        if seq.match_evictions != pool.evictions:
            found = pool.match(hashes[:max_units])
        elif len(found) < max_units and pool.lookup(hashes[len(found)]) is not None:
            found = found + pool.match(hashes[len(found):max_units])
        seq.match, seq.match_evictions = found, pool.evictions
        k = len(found)
        if self._mamba is not None:
            while k > 0 and not self._mamba.has(hashes[k - 1]):
                k -= 1
        hit = k * unit
        per_block = bs // unit
        # A full block is shared through the block holding its last unit (complete content);
        # a partially matched block is copied into a fresh one by the allocation that follows.
        return found[per_block - 1:hit // bs * per_block:per_block], hit

    def _chunk(self, seq: _Seq, computed: int, n: int) -> int:
        """Tokens to compute this step; hybrid ``align`` mode ends non-final prefill chunks on a block
        boundary (as vLLM does), which is where the Mamba state gets checkpointed."""
        if self._align and seq.num_output == 0 and computed + n < seq.num_tokens:
            end = (computed + n) // self.config.block_size * self.config.block_size
            if end > computed:
                return end - computed
        return n

    def _grow(self, seq: _Seq, n: int) -> bool:
        """Make room for ``n`` more tokens of a running sequence; False if the pool is short."""
        need = -(-(seq.num_computed + n) // self.config.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self._pool.num_free:
            return False
        seq.blocks.extend(self._pool.allocate(need))
        return True

    def _release(self, seq: _Seq) -> None:
        self._pool.free(seq.blocks)
        seq.blocks = []
        if seq.holds_slot and self._mamba is not None:
            self._mamba.release()
            seq.holds_slot = False

    def _preempt(self, seq: _Seq, events: list[EngineEvent]) -> None:
        self._release(seq)
        seq.num_computed = 0
        self._waiting.appendleft(seq)
        self.stats.num_preemptions += 1
        events.append(EngineEvent(EventKind.PREEMPTED, seq.request_id))

    def _register_reporting(self, seq: _Seq, first: int, end: int) -> None:
        """Index units ``first..end-1`` of ``seq`` and report each run of newly indexed ones (a unit
        another sequence indexed first stays that sequence's and splits the run)."""
        pool, unit, bs = self._pool, self._unit, self.config.block_size
        hashes, blocks = seq.hashes, seq.blocks
        events = self._kv_events
        assert events is not None
        run = -1
        for u in range(first, end):
            if pool.register(blocks[u * unit // bs], hashes[u]):
                if run < 0:
                    run = u
            elif run >= 0:
                events.append(self._stored(seq, run, u, ATTENTION_GROUP))
                run = -1
        if run >= 0:
            events.append(self._stored(seq, run, end, ATTENTION_GROUP))

    def _stored(self, seq: _Seq, first: int, end: int, group: int) -> Stored:
        """The event for units ``first..end-1`` of ``seq`` (chained after unit ``first-1``).

        Attention: one hash per unit.  Mamba: the one state checkpointed at the end of the run (the
        tokens since the sequence's previous checkpoint), as vLLM reports a Mamba group whose blocks
        before the last are null.  A cache salt is the first block's extra key, as in vLLM.
        """
        ub = self._unit_bytes
        hashes = seq.hashes
        parent = hashes[first - 1] if first else None
        tokens = token_ids(memoryview(seq.data)[first * ub:end * ub])
        if group == ATTENTION_GROUP:
            run_hashes, kind, n = hashes[first:end], SPEC_FULL_ATTENTION, end - first
        else:
            run_hashes, kind, n = [hashes[end - 1]], SPEC_MAMBA, 1
        extra = [[seq.cache_salt], *([None] * (n - 1))] if seq.cache_salt and first == 0 else None
        return Stored(cast(list[ExternalBlockHash], run_hashes), parent, tokens, self._unit, group, kind,
                      MEDIUM_GPU, extra_keys=extra)

    def _work(self, scheduled: list[tuple[_Seq, int]]) -> StepWork:
        prefill = decoders = context = 0
        attention = 0.0
        for seq, n in scheduled:
            if seq.num_output and seq.num_computed == seq.num_tokens - 1 and n == 1:
                decoders += 1
                context += seq.num_computed + 1
            else:
                prefill += n
                attention += n * (seq.num_computed + n / 2)
        return StepWork(prefill, attention, decoders, context)

    def _apply(self, scheduled: list[tuple[_Seq, int]], end: float, events: list[EngineEvent]) -> None:
        cfg = self.config
        unit, ub, bs, pool = self._unit, self._unit_bytes, cfg.block_size, self._pool
        finished: list[_Seq] = []
        for seq, n in scheduled:
            before = seq.num_computed
            seq.num_computed = after = before + n
            if cfg.enable_prefix_caching:
                done = after // unit
                if done > before // unit:
                    seq.unit_hash(done, ub)
                    hashes, blocks = seq.hashes, seq.blocks
                    if self._kv_events is None:
                        for u in range(before // unit, done):
                            pool.register(blocks[u * unit // bs], hashes[u])
                    else:
                        self._register_reporting(seq, before // unit, done)
                if self._align and self._mamba is not None and after % unit == 0:
                    k = after // unit
                    if self._mamba.store(seq.unit_hash(k, ub)) and self._kv_events is not None:
                        self._kv_events.append(self._stored(seq, seq.mamba_from, k, MAMBA_GROUP))
                    seq.mamba_from = k
            if after < seq.num_tokens:
                continue
            index = seq.num_output
            seq.num_output += 1
            self.stats.generation_tokens += 1
            events.append(EngineEvent(EventKind.TOKEN, seq.request_id, token_index=index))
            if seq.first_token_at is None:
                seq.first_token_at = end
                self.stats.prompt_tokens += seq.prompt_tokens
                self.stats.prompt_tokens_cached += seq.cached_tokens
                self.stats.ttft.observe(end - seq.arrival)
            if seq.num_output >= seq.n_out:
                finished.append(seq)
        for seq in finished:
            self._running.remove(seq)
            self._release(seq)
            del self._seqs[seq.request_id]
            reason = seq.finish_reason
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
            self.stats.e2e.observe(end - seq.arrival)
            self.stats.prompt_len.observe(seq.prompt_tokens)
            self.stats.generation_len.observe(seq.num_output)
            self.stats.prefill_kv_computed.observe(seq.prompt_tokens - seq.cached_tokens)
            events.append(EngineEvent(
                EventKind.FINISHED, seq.request_id, finish_reason=reason,
                cached_tokens=max(seq.cached_tokens, 0), prompt_tokens=seq.prompt_tokens,
                output_tokens=seq.num_output,
            ))
