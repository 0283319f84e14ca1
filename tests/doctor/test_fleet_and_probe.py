"""Fleet comparison and probe evidence (pure parts)."""

from __future__ import annotations

from kvroute.doctor.checks import compare_fleet
from kvroute.doctor.facts import EngineFacts, Observed
from kvroute.doctor.finding import Severity
from kvroute.doctor.probe import ProbeStep, judge_probe, probe_size


def facts(**values: object) -> EngineFacts:
    return EngineFacts(**{k: Observed(v, "t") for k, v in values.items()})  # type: ignore[arg-type]


def test_the_odd_replica_is_named() -> None:
    same = {"enable_prefix_caching": True, "mamba_cache_mode": "align", "cache_dtype": "fp8"}
    fleet = [("w1", facts(block_size=1600, **same)), ("w2", facts(block_size=1600, **same)),
             ("w3", facts(block_size=800, **{**same, "cache_dtype": "auto"}))]
    found = compare_fleet(fleet)
    titles = {f.title for f in found}
    assert "block_size differs on w3 (the rest: 1600)" in titles
    assert "cache_dtype differs on w3 (the rest: fp8)" in titles
    assert all(f.severity is Severity.WARNING and f.code == "fleet-differs" for f in found)
    assert all("w3" in (f.fix or "") for f in found)


def test_alike_replicas_are_consistent() -> None:
    fleet = [("a", facts(block_size=16)), ("b", facts(block_size=16)), ("c", EngineFacts())]
    [finding] = compare_fleet(fleet)
    assert finding.code == "fleet-consistent"
    assert "Not readable on c" in finding.detail
    assert compare_fleet(fleet[:1]) == []


def step(label: str, seconds: float, cached: int | None = None, hits: float | None = None,
         prompt: int = 4800) -> ProbeStep:
    return ProbeStep(label, seconds, prompt, cached, hits, None if hits is None else float(prompt))


def test_repeat_hit_and_conversation_hit() -> None:
    found = judge_probe([step("cold", 4.7, 0, 0), step("repeat", 1.7, 4800, 4800),
                         step("turn 2", 1.8, 4801, 4801, prompt=5000), step("turn 3", 1.9, 4960, 4960)])
    assert [f.code for f in found] == ["probe-repeat-hit", "probe-conversation-hit"]
    assert "4,800" in found[0].title
    assert "turn 2 4,801 of 4,800" in found[1].detail


def test_nothing_reused_is_an_error() -> None:
    found = judge_probe([step("cold", 7.23, 0, 0), step("repeat", 7.24, 0, 0), step("turn 2", 7.3, 0, 0)])
    assert [f.code for f in found] == ["probe-no-hit"]
    assert found[0].severity is Severity.ERROR
    assert "7.23 s cold, 7.24 s repeated" in found[0].detail


def test_coarse_blocks_reuse_only_part_of_each_turn() -> None:
    found = judge_probe([step("cold", 1.0, 0), step("repeat", 0.3, 3200, prompt=4818),
                         step("turn 2", 0.4, 3200, prompt=5063), step("turn 3", 0.4, 3200, prompt=5308)],
                        block_size=1600, match_unit=None)
    partial = found[-1]
    assert partial.code == "probe-conversation-partial"
    assert partial.severity is Severity.WARNING
    assert partial.fix == "--prefix-match-unit 32"
    assert "turn 2 3,200 of 4,818" in partial.detail


def test_partial_reuse_with_fine_blocks_has_no_block_fix() -> None:
    found = judge_probe([step("cold", 1.0, 0), step("repeat", 0.3, 3200), step("turn 2", 1.0, 0)],
                        block_size=16, match_unit=None)
    assert found[-1].code == "probe-conversation-partial"
    assert found[-1].fix is None


def test_exact_repeat_may_miss_on_a_hybrid_while_turns_hit() -> None:
    found = judge_probe([step("cold", 0.9, 0, prompt=3018), step("repeat", 0.9, 0, prompt=3018),
                         step("turn 2", 0.3, 3072, prompt=3248), step("turn 3", 0.3, 3296, prompt=3471)],
                        block_size=1600, match_unit=32)
    assert [(f.code, f.severity) for f in found] == [
        ("probe-repeat-miss", Severity.INFO), ("probe-conversation-hit", Severity.OK)]


def test_counters_without_usage_suggest_prompt_token_details() -> None:
    found = judge_probe([step("cold", 2.0, None, 0), step("repeat", 0.5, None, 4000)])
    assert [f.code for f in found] == ["probe-repeat-hit", "probe-no-cached-tokens"]
    assert found[1].fix == "--enable-prompt-tokens-details"


def test_speed_is_the_last_resort() -> None:
    faster = judge_probe([step("cold", 3.0), step("repeat", 1.0)])
    assert [f.code for f in faster] == ["probe-faster"]
    flat = judge_probe([step("cold", 3.0), step("repeat", 3.1)])
    assert [(f.code, f.severity) for f in flat] == [("probe-no-evidence", Severity.WARNING)]


def test_failed_requests() -> None:
    found = judge_probe([ProbeStep("cold", 0.1, error="HTTP 404: model not found")])
    assert [f.code for f in found] == ["probe-failed"]
    assert "HTTP 404" in found[0].detail


def test_probe_size_fits_the_context() -> None:
    assert probe_size(None, None, None) == 3000
    assert probe_size(1600, None, None) == 4800
    assert probe_size(1600, 4096, None) < 4096
    assert probe_size(16, None, 500) == 500
