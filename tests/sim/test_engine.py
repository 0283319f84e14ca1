"""The engine model in virtual time: block pool, scheduler, counters, hybrid rules."""

from __future__ import annotations

import random

import pytest
from sim_helpers import VirtualEngine, chat, prose, render

from kvroute.sim.cost_model import CostModel
from kvroute.sim.engine import EngineConfig, EngineModel, EventKind, SimRequest
from kvroute.sim.presets import build_config
from kvroute.sim.tokenizer import count_tokens


def small(**kw: object) -> EngineConfig:
    values: dict[str, object] = {"num_gpu_blocks": 256, "max_model_len": 4096, "block_size": 16}
    values.update(kw)
    return EngineConfig(**values)  # type: ignore[arg-type]


def test_repeat_hits_every_full_block_but_recomputes_one_token() -> None:
    v = VirtualEngine(small())
    prompt = render(chat(prose(643, 1)))          # 656 tokens: a whole number of blocks
    assert count_tokens(prompt) % 16 == 0
    first, second = v.run(prompt), v.run(prompt)
    assert first.cached == 0
    assert second.cached == count_tokens(prompt) - 16   # the last block is recomputed
    assert second.latency < first.latency / 3


def test_reply_blocks_are_cached_for_the_next_turn() -> None:
    v = VirtualEngine(small())
    turn1 = chat(prose(300, 1))
    out = v.run(render(turn1), out_tokens=64)
    turn2 = [*turn1, {"role": "assistant", "content": out.output.decode()}, {"role": "user", "content": "ok"}]
    nxt = v.run(render(turn2))
    computed_before = count_tokens(render(turn1)) + 64 - 1
    assert nxt.cached == computed_before // 16 * 16


def test_salt_and_model_scope_the_cache() -> None:
    v = VirtualEngine(small())
    prompt = render(chat(prose(400, 2)))
    v.run(prompt)
    v.engine.add_request(SimRequest("salted", prompt, b"x", 1, cache_salt="tenant"), v.now)
    events = v.drain()["salted"]
    assert next(e for _, e in events if e.kind is EventKind.FINISHED).cached_tokens == 0


def test_lru_evicts_the_oldest_prefix_first_and_its_tail_before_its_head() -> None:
    v = VirtualEngine(small(num_gpu_blocks=80, max_model_len=1024))    # 1280 tokens
    a, b, c = (render(chat(prose(500, s))) for s in (1, 2, 3))
    v.run(a)
    v.run(b)
    v.run(c)                        # needs 33 blocks: 14 never used, then a's (least recently used)
    assert v.run(b).cached == 512
    assert 0 < v.run(a).cached <= 14 * 16


def test_counters_match_what_requests_report() -> None:
    v = VirtualEngine(small())
    outcomes = [v.run(render(chat(prose(200 + 10 * i, i % 2))), out_tokens=5) for i in range(6)]
    stats = v.engine.snapshot().stats
    assert stats.prompt_tokens == sum(o.finished.prompt_tokens for o in outcomes)
    assert stats.prefix_cache_queries == stats.prompt_tokens
    assert stats.prefix_cache_hits == sum(o.cached for o in outcomes) > 0
    assert stats.generation_tokens == 30
    assert stats.finished == {"stop": 6}
    assert stats.ttft.count == 6


def test_max_num_seqs_bounds_running_and_the_rest_waits() -> None:
    v = VirtualEngine(small(max_num_seqs=4))
    for i in range(10):
        v.submit(render(chat(prose(50, 100 + i))), out_tokens=8)
    peak = {"running": 0, "waiting": 0}

    def watch(engine: EngineModel) -> None:
        snap = engine.snapshot()
        peak["running"] = max(peak["running"], snap.num_running)
        peak["waiting"] = max(peak["waiting"], snap.num_waiting)

    done = v.drain(watch)
    assert peak == {"running": 4, "waiting": 6}
    assert all(events[-1][1].kind is EventKind.FINISHED for events in done.values())


def test_chunked_prefill_respects_the_token_budget() -> None:
    v = VirtualEngine(small(max_num_batched_tokens=256))
    v.submit(render(chat(prose(1000, 5))))
    steps = []
    while v.engine.has_work():
        steps.append(v.engine.step(v.now).work.prefill_tokens)
    assert max(steps) == 256 and sum(steps) == count_tokens(render(chat(prose(1000, 5))))


def test_decode_out_of_blocks_preempts_and_recomputes() -> None:
    v = VirtualEngine(small(num_gpu_blocks=40, max_model_len=600, max_num_seqs=8))
    for i in range(3):
        v.submit(render(chat(prose(150, 200 + i))), out_tokens=120)   # 3 x 270 tokens > 640
    done = v.drain()
    assert v.engine.snapshot().stats.num_preemptions > 0
    for events in done.values():
        kinds = [e.kind for _, e in events]
        assert kinds[-1] is EventKind.FINISHED
        assert kinds.count(EventKind.TOKEN) == 120               # no token lost or repeated
    assert v.engine.snapshot().kv_cache_usage == 0.0


def test_abort_frees_blocks_and_restart_empties_everything() -> None:
    engine = EngineModel(small(), 0.0)
    prompt = render(chat(prose(500, 9)))
    engine.add_request(SimRequest("a", prompt, b"y" * 400, 100), 0.0)
    engine.step(0.0)
    assert engine.snapshot().kv_cache_usage > 0
    assert engine.abort("a", 1.0) and not engine.abort("a", 1.0)
    assert engine.snapshot().kv_cache_usage == 0 and not engine.has_work()
    engine.add_request(SimRequest("b", prompt, b"y", 1), 2.0)
    assert engine.restart(5.0) == ["b"]
    snap = engine.snapshot()
    assert snap.start_time == 5.0 and snap.num_waiting == 0 and snap.stats.prefix_cache_queries == 0


def test_requests_beyond_the_context_are_refused() -> None:
    engine = EngineModel(small(max_model_len=100), 0.0)
    with pytest.raises(ValueError, match="maximum context length is 100 tokens"):
        engine.add_request(SimRequest("a", b"x" * 400, b"", 16), 0.0)


def test_cost_model_terms() -> None:
    cost = CostModel(a=1, b=2, c=3, d0=4, d1=5, d_kv=6)
    from kvroute.sim.cost_model import StepWork
    assert cost.step_seconds(StepWork()) == 0
    assert cost.step_seconds(StepWork(10, 7.0, 0, 0)) == 1 + 20 + 21
    assert cost.step_seconds(StepWork(0, 0.0, 2, 100)) == 1 + 4 + 10 + 600


@pytest.mark.parametrize(("kw", "message"), [
    ({"prefix_match_unit": 24}, "must divide block_size"),
    ({"max_model_len": 10**6}, "KV cache"),
    ({"mamba_cache_mode": "sometimes"}, "mamba_cache_mode"),
])
def test_bad_configs_are_refused(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        small(**kw)


def test_hybrid_refuses_more_sequences_than_mamba_blocks_like_vllm() -> None:
    vllm_text = r"max_num_seqs \(128\) exceeds available Mamba cache blocks \(127\)\."
    with pytest.raises(ValueError, match=vllm_text):
        build_config("hybrid-27b", kv_cache_dtype="auto")
    fp8, auto = build_config("hybrid-27b"), build_config("hybrid-27b", kv_cache_dtype="auto", max_num_seqs=64)
    assert (fp8.block_size, auto.block_size) == (1600, 800)
    assert not fp8.enable_prefix_caching and build_config("dense-3b").enable_prefix_caching


def test_mamba_checkpoints_live_in_few_slots_evicted_lru() -> None:
    cfg = build_config("hybrid-27b", enable_prefix_caching=True, mamba_cache_mode="align",
                       prefix_match_unit=32, mamba_cache_blocks=6, max_num_seqs=4)
    v = VirtualEngine(cfg)
    turns = [chat(prose(1000, 300 + i)) for i in range(8)]
    replies = [v.run(render(t), out_tokens=40).output.decode() for t in turns]
    # Each checkpoint was written while its own sequence still held a slot: 6 - 1 kept.
    assert v.engine.snapshot().num_mamba_checkpoints == 5
    follow = [[*t, {"role": "assistant", "content": r}, {"role": "user", "content": "and?"}]
              for t, r in zip(turns, replies, strict=True)]
    assert v.run(render(follow[7])).cached > 1000     # recent conversation: its state is still there
    assert v.run(render(follow[0])).cached == 0       # oldest: its state slot was reused


class _FreshLookupEngine(EngineModel):
    """The engine with every prefix lookup walked from scratch (no run kept on the request)."""

    def _lookup(self, seq):  # type: ignore[no-untyped-def]
        seq.match_evictions = -1
        return super()._lookup(seq)


@pytest.mark.parametrize("kw", [
    {},
    {"prefix_match_unit": 4},
    {"hybrid": True, "enable_prefix_caching": True, "mamba_cache_mode": "align", "prefix_match_unit": 4,
     "mamba_cache_blocks": 12},
], ids=["dense", "unit4", "hybrid-align"])
def test_kept_lookups_match_fresh_walks_under_eviction(kw: dict[str, object]) -> None:
    """Requests kept waiting while the pool evicts under them see the same hits as fresh walks."""
    cfg = small(num_gpu_blocks=96, max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=8, **kw)
    engines = [EngineModel(cfg, 0.0), _FreshLookupEngine(cfg, 0.0)]
    rng = random.Random(5)
    bases = [prose(300, 40 + i) for i in range(3)]
    now, sent, streams = 0.0, 0, [[], []]  # type: ignore[var-annotated]
    while sent < 80 or engines[0].has_work():
        if sent < 80 and rng.random() < 0.3:
            prompt = render(chat(rng.choice(bases) + prose(rng.randint(20, 200), sent)))
            req = SimRequest(f"r{sent}", prompt, prose(64, sent).encode(), rng.randint(8, 64))
            for e in engines:
                e.add_request(req, now)
            sent += 1
        results = [e.step(now) for e in engines]
        for stream, r in zip(streams, results, strict=True):
            stream.append((r.duration_s, r.events))
        now += results[0].duration_s or 0.01
    assert streams[0] == streams[1]
    assert engines[0]._pool.evictions > 20     # the kept runs were invalidated, not just kept
    hits = [ev.cached_tokens for _, events in streams[0] for ev in events if ev.kind is EventKind.FINISHED]
    assert len(hits) == 80 and sum(hits) > 0
