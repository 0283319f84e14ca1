"""The seeds' measurements, reproduced on the engine model in virtual (model) time.

Model time is deterministic, so these compare model seconds directly; the HTTP tests only check
ratios.  Sizes follow the seeds' tables; see docs/simulator.md for the calibration.
"""

from __future__ import annotations

import pytest
from sim_helpers import VirtualEngine, chat, prose, render

from kvroute.sim.answers import filler
from kvroute.sim.presets import build_config
from kvroute.sim.tokenizer import count_tokens


def grow(messages: list[dict[str, str]], reply: bytes, new_tokens: int, seed: int) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": reply.decode()},
            {"role": "user", "content": prose(new_tokens, seed)}]


# ------------------------------------------------------------------------------- seed 1, dense


def test_dense_table_follow_ups_cost_a_fraction_unless_they_switch_replica() -> None:
    a, b = VirtualEngine(build_config("dense-3b")), VirtualEngine(build_config("dense-3b"))
    conv = chat(prose(5616, 1))
    assert 5600 <= count_tokens(render(conv)) <= 5650              # "5,629-token prompt"
    t1 = a.run(render(conv))
    conv = grow(conv, t1.output, 185, 2)
    t2 = a.run(render(conv))                                       # stays on A
    conv = grow(conv, t2.output, 185, 3)
    t3 = b.run(render(conv))                                       # switched to B
    other = b.run(render(chat(prose(5690, 4))))                    # "a different conversation"
    conv = grow(conv, t3.output, 185, 5)
    t4 = b.run(render(conv))                                       # stays on B

    assert 2.0 <= t1.latency <= 3.0                                # seed: 2.28-2.56 s on B (6.3 s on A)
    assert t2.latency <= t1.latency / 5 and t4.latency <= t3.latency / 5
    assert 0.85 <= t3.latency / other.latency <= 1.2               # "about what a brand-new prompt costs"
    assert t3.cached == 0 and t2.cached > 5600


# ------------------------------------------------------------------------------- seed 1, hybrid


def _repeat(engine: VirtualEngine, tokens: int, seed: int, times: int = 3) -> list[float]:
    prompt = render(chat(prose(tokens - 13, seed)))
    return [engine.run(prompt).latency for _ in range(times)]


@pytest.mark.parametrize("settings", [{}, {"enable_prefix_caching": True}],
                         ids=["caching-off-by-default", "caching-on-mode-none"])
def test_hybrid_repeat_costs_the_same_as_new_without_align(settings: dict[str, object]) -> None:
    v = VirtualEngine(build_config("hybrid-27b", **settings))
    runs = _repeat(v, 10_175, 1)
    different = _repeat(v, 10_135, 2, times=1)[0]
    assert 2.8 <= runs[0] <= 3.4                                   # seed: 3.07-3.22 s
    assert max(runs) - min(runs) < 1e-9
    assert abs(different - runs[0]) / runs[0] < 0.02
    assert v.engine.snapshot().stats.prefix_cache_hits == 0


def test_hybrid_align_repeat_costs_about_a_third() -> None:
    v = VirtualEngine(build_config("hybrid-27b", enable_prefix_caching=True, mamba_cache_mode="align"))
    first = _repeat(v, 13_056, 1)
    other = _repeat(v, 13_000, 2, times=2)
    back = _repeat(v, 13_056, 1, times=1)[0]
    for repeat in (*first[1:], other[1], back):
        assert 0.25 <= repeat / first[0] <= 0.45                   # seed: 1.41-1.72 s vs 4.37-4.67 s
    stats = v.engine.snapshot().stats
    assert 0.35 <= stats.prefix_cache_hits / stats.prefix_cache_queries <= 0.6   # seed: 46.3 %


def _conversation_ttfts(v: VirtualEngine, tokens: int, seed: int, turns: int = 4) -> list[tuple[float, int]]:
    conv = chat(prose(tokens - 13, seed))
    out = []
    for turn in range(turns):
        o = v.run(render(conv), out_tokens=40)
        out.append((o.ttft, o.cached))
        conv = grow(conv, o.output, 12, seed * 100 + turn)
    return out


@pytest.mark.parametrize("size", [1200, 1550, 2900])
def test_short_chats_gain_nothing_with_a_1600_block_until_prefix_match_unit_32(size: int) -> None:
    coarse = VirtualEngine(build_config("hybrid-27b", enable_prefix_caching=True, mamba_cache_mode="align"))
    fine = VirtualEngine(build_config("hybrid-27b", enable_prefix_caching=True, mamba_cache_mode="align",
                                      prefix_match_unit=32))
    flat = _conversation_ttfts(coarse, size, size)
    assert all(cached == 0 for _, cached in flat)
    assert max(t for t, _ in flat) / min(t for t, _ in flat) < 1.15
    better = _conversation_ttfts(fine, size, size)
    assert better[0][0] == pytest.approx(flat[0][0])
    for (t_fine, cached), (t_flat, _) in zip(better[1:], flat[1:], strict=True):
        assert cached > size * 0.9
        assert t_fine <= 0.4 * t_flat                              # seed: about a quarter


def test_fp8_free_tokens_versus_auto_blocks() -> None:
    fp8 = build_config("hybrid-27b")
    auto = build_config("hybrid-27b", kv_cache_dtype="auto", max_num_seqs=64)
    assert fp8.num_gpu_blocks * fp8.block_size == 2 * auto.num_gpu_blocks * auto.block_size
    assert fp8.mamba_cache_blocks >= 128 > auto.mamba_cache_blocks


# ------------------------------------------------------------------------------- seed 2


def _agent_rounds(sessions: int, rounds: int = 4) -> float:
    """Seed 2's workload on one replica: shared ~3.5k system prompt, ~7.3k first message, then
    ~400-token turns with 256-token replies; every session sends each round together."""
    v = VirtualEngine(build_config("a4000-qwen3-4b"))
    system = {"role": "system", "content": prose(3500, 0)}
    convs = [[system, {"role": "user", "content": prose(7300, 10 + s)}] for s in range(sessions)]
    for r in range(rounds):
        for conv in convs:
            v.submit(render(conv), out_tokens=256)
        v.drain()
        convs = [grow(c, filler(render(c), 256), 400, 1000 * s + r) for s, c in enumerate(convs)]
    stats = v.engine.snapshot().stats
    return stats.prefix_cache_hits / stats.prefix_cache_queries


def test_hit_rate_collapses_when_sessions_times_context_exceed_the_pool() -> None:
    fits = _agent_rounds(2)             # 2 x ~13k tokens in a ~40k-token pool
    spills = _agent_rounds(8)           # 8 x ~13k tokens
    assert fits > 0.6
    assert spills < 0.45
    assert fits - spills > 0.3


def test_requests_queue_beyond_max_num_seqs() -> None:
    v = VirtualEngine(build_config("a4000-qwen3-4b"))
    for i in range(40):
        v.submit(render(chat(prose(100, 500 + i))), out_tokens=32)
    loads: list[tuple[int, int]] = []
    v.drain(lambda engine: loads.append((engine.snapshot().num_running, engine.snapshot().num_waiting)))
    assert max(running for running, _ in loads) == 32
    assert (32, 8) in loads             # 40 requests, max_num_seqs 32: eight wait
