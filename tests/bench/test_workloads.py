"""Workloads: a fixed seed gives identical prompts, and every round extends the previous one."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from kvroute.bench.trace import TraceError, TraceWorkload, read_trace, write_trace
from kvroute.bench.workloads import (
    SESSION_HEADER,
    AgentWorkload,
    AgentWorkloadConfig,
    GrowingChatConfig,
    SharedPrefixConfig,
    SharedPrefixWorkload,
    growing_chat,
)
from kvroute.sim.presets import build_config


def test_same_seed_same_sessions_different_seed_different() -> None:
    a, b, c = AgentWorkload(seed=7), AgentWorkload(seed=7), AgentWorkload(seed=8)
    assert a.session(3) == b.session(3)
    assert a.session(3).session_id != c.session(3).session_id
    assert a.session(3).requests[0].messages != c.session(3).requests[0].messages
    assert a.session(3) != a.session(4)


def test_agent_session_shape_matches_seed_two() -> None:
    script = AgentWorkload(seed=1).session(0)
    assert script.rounds == 6  # the first message, then five rounds
    first = script.requests[0]
    assert 3500 * 0.9 <= len(first.system) / 4 <= 3500 * 1.1
    assert 10_500 * 0.9 <= first.est_prompt_tokens <= 10_500 * 1.1
    for prev, cur in pairwise(script.requests):
        added = cur.est_prompt_tokens - prev.est_prompt_tokens
        assert 256 + 400 * 0.9 - 10 <= added <= 256 + 400 * 1.1 + 10
        assert cur.max_tokens == 256
    assert first.headers() == {SESSION_HEADER: script.session_id}


def test_every_round_extends_the_previous_prompt() -> None:
    script = AgentWorkload(seed=2).session(5)
    model = "m"
    for prev, cur in pairwise(script.requests):
        assert cur.messages[: len(prev.messages)] == prev.messages
        assert cur.system == prev.system
        p, c = prev.openai_body(model)["messages"], cur.openai_body(model)["messages"]
        assert c[: len(p)] == p


def test_think_time_pauses_between_rounds_without_changing_prompts() -> None:
    paused = AgentWorkload(AgentWorkloadConfig(think_time_s=2.0), seed=6).session(1)
    strict = AgentWorkload(AgentWorkloadConfig(think_time_s=0.0), seed=6).session(1)
    assert paused.requests[0].think_s == 0.0
    assert all(0.0 <= r.think_s <= 4.0 for r in paused.requests)
    assert len({r.think_s for r in paused.requests[1:]}) == len(paused.requests) - 1
    assert all(r.think_s == 0.0 for r in strict.requests)
    assert [r.messages for r in paused.requests] == [r.messages for r in strict.requests]
    with pytest.raises(ValueError):
        AgentWorkloadConfig(think_time_s=-1.0)


def test_system_prompt_is_shared_and_first_message_unique() -> None:
    wl = AgentWorkload(seed=3)
    s0, s1 = wl.session(0).requests[0], wl.session(1).requests[0]
    assert s0.system == s1.system
    assert s0.messages[0].content[:200] != s1.messages[0].content[:200]
    several = AgentWorkload(AgentWorkloadConfig(system_prompts=4, jitter=0.0), seed=3)
    assert len({several.session(i).requests[0].system for i in range(40)}) == 4


def test_sizes_are_parameters() -> None:
    cfg = AgentWorkloadConfig(system_tokens=100, first_tokens=200, rounds=2, round_tokens=50,
                              min_output_tokens=16, max_output_tokens=16, jitter=0.0)
    script = AgentWorkload(cfg, seed=0).session(0)
    assert script.rounds == 3
    sizes = [r.est_prompt_tokens for r in script.requests]
    assert sizes[0] == pytest.approx(300, abs=15)
    assert sizes[1] - sizes[0] == pytest.approx(16 + 50, abs=5)
    with pytest.raises(ValueError):
        AgentWorkloadConfig(jitter=1.5)
    with pytest.raises(IndexError):
        AgentWorkload().session(-1)


def test_growing_chat_like_seed_one() -> None:
    steps = growing_chat(GrowingChatConfig(), seed=0)
    labels = [s.label for s in steps]
    assert labels == ["1 (cold)", "2", "3", "a different conversation", "4", "5"]
    chat = [s.request for s in steps if s.label != "a different conversation"]
    assert chat[0].est_prompt_tokens == pytest.approx(5600, abs=5)
    for prev, cur in pairwise(chat):
        assert cur.messages[: len(prev.messages)] == prev.messages
        assert cur.est_prompt_tokens - prev.est_prompt_tokens == pytest.approx(190, abs=2)
        assert cur.max_tokens == 1 and cur.headers() == {}
    assert growing_chat(GrowingChatConfig(), seed=0) == steps


def test_trace_round_trip(tmp_path: Path) -> None:
    cfg = AgentWorkloadConfig(system_tokens=20, first_tokens=30, rounds=2, round_tokens=5)
    wl = AgentWorkload(cfg, seed=4)
    path = tmp_path / "t.jsonl"
    assert write_trace(path, (wl.session(i) for i in range(3))) == 9
    replay = TraceWorkload.from_path(path)
    assert replay.size == 3
    assert [replay.session(i) for i in range(3)] == [wl.session(i) for i in range(3)]
    with pytest.raises(IndexError):
        replay.session(3)


def test_trace_groups_by_session_and_numbers_rounds_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"session_id": "s", "messages": [{"role": "user", "content": "a"}]}\n'
        '{"messages": [{"role": "user", "content": "lone"}]}\n'
        '\n'
        '{"session_id": "s", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 3,'
        ' "think_s": 1.5}\n'
    )
    sessions = read_trace(path)
    assert [s.session_id for s in sessions] == ["s", None]
    assert [r.round for r in sessions[0].requests] == [0, 1]
    assert sessions[0].requests[1].max_tokens == 3
    assert sessions[0].requests[1].think_s == 1.5


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "line 1: not JSON"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', "messages[0] needs string"),
    ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "'max_tokens'"),
    ('{"session_id": 5, "messages": [{"role": "user", "content": "x"}]}', "'session_id'"),
    ('{"messages": [{"role": "user", "content": "x"}], "think_s": -2}', "'think_s'"),
])
def test_trace_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_trace(path)


def test_empty_trace_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        TraceWorkload.from_path(path)


def test_shared_prefix_requests_share_their_group_prompt_and_carry_no_session() -> None:
    cfg = SharedPrefixConfig(groups=3, system_tokens=500, questions=2, question_tokens=50, output_tokens=20)
    wl, same, other = SharedPrefixWorkload(cfg, 4), SharedPrefixWorkload(cfg, 4), SharedPrefixWorkload(cfg, 5)
    requests = [wl.request(i) for i in range(60)]
    assert requests == [same.request(i) for i in range(60)]
    assert requests[0] != other.request(0)
    assert len({r.system for r in requests}) == 3  # every group drawn
    assert len({r.messages for r in requests}) == 6  # and every question of every group
    for r in requests:
        assert r.session_id is None and r.headers() == {} and r.max_tokens == 20
        assert 500 + 50 <= r.est_prompt_tokens <= 500 + 50 + 10
    with pytest.raises(IndexError):
        wl.request(-1)


def test_shared_prefix_arrivals_are_poisson_and_scale_with_the_rate() -> None:
    wl = SharedPrefixWorkload(SharedPrefixConfig(groups=2, system_tokens=10, questions=1), 0)
    slow, fast = list(wl.arrivals(2.0, 1000.0)), list(wl.arrivals(4.0, 500.0))
    assert 1800 <= len(slow) <= 2200  # 2/s for 1,000 s
    assert [t.request for t in fast] == [t.request for t in slow]  # the same requests, twice as fast
    assert all(f.at_s == pytest.approx(s.at_s / 2) for f, s in zip(fast, slow, strict=True))
    assert next(t.index for t in wl.arrivals(1.0, 20.0, 100)) == 100
    assert all(b.at_s > a.at_s for a, b in pairwise(slow))
    with pytest.raises(ValueError):
        next(wl.arrivals(0.0, 10.0))


def test_shared_prefix_default_is_half_the_fleets_kv() -> None:
    engine = build_config("a4000-qwen3-4b")
    fleet_kv = 4 * engine.num_gpu_blocks * engine.block_size
    cfg = SharedPrefixConfig()
    assert cfg.groups == round(0.5 * fleet_kv / cfg.system_tokens)
    assert 0.45 <= cfg.groups * cfg.system_tokens / fleet_kv <= 0.55
