"""Facts -> findings: each configuration the prefix-hashing design hit gets the right finding and
the exact fix."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.doctor.checks import diagnose, suggest_match_unit
from kvroute.doctor.facts import Conflict, EngineFacts, MergedFacts, Observed, TrafficAssumptions
from kvroute.doctor.finding import Finding, Severity, worst


def facts(**values: Any) -> EngineFacts:
    return EngineFacts(**{k: Observed(v, "test") for k, v in values.items()})


def run(merged: EngineFacts | MergedFacts, traffic: TrafficAssumptions | None = None) -> dict[str, Finding]:
    m = merged if isinstance(merged, MergedFacts) else MergedFacts(merged)
    return {f.code: f for f in diagnose(m, traffic)}


HYBRID = {"hybrid": True, "block_size": 1600, "cache_dtype": "fp8", "max_num_seqs": 128}


def test_hybrid_with_caching_off() -> None:
    found = run(facts(enable_prefix_caching=False, mamba_cache_mode="none", **HYBRID))
    f = found["prefix-caching-off-hybrid"]
    assert f.severity is Severity.ERROR
    assert f.fix == "--enable-prefix-caching --mamba-cache-mode align"
    assert "enable_prefix_caching=False (test)" in f.evidence
    # Nothing about blocks or fp8 while the cache is off: those are the next steps.
    assert not {"match-unit-coarse", "fp8-kv-cache", "mamba-mode-none"} & found.keys()


def test_hybrid_with_mode_none() -> None:
    found = run(facts(enable_prefix_caching=True, mamba_cache_mode="none", **HYBRID))
    assert found["mamba-mode-none"].severity is Severity.ERROR
    assert found["mamba-mode-none"].fix == "--mamba-cache-mode align"
    assert "prefix-caching-on" not in found


def test_hybrid_with_align_and_a_1600_block() -> None:
    found = run(facts(enable_prefix_caching=True, mamba_cache_mode="align", **HYBRID))
    assert found["mamba-mode-align"].severity is Severity.OK
    coarse = found["match-unit-coarse"]
    assert coarse.severity is Severity.WARNING
    assert coarse.fix == "--prefix-match-unit 32"
    assert "1,600" in coarse.title
    assert found["fp8-kv-cache"].severity is Severity.INFO
    assert "keep --kv-cache-dtype fp8" in (found["fp8-kv-cache"].fix or "")
    assert found["mamba-align-experimental"].fix is not None
    assert "kvroute canary" in found["mamba-align-experimental"].fix


def test_hybrid_with_align_and_match_unit_32() -> None:
    found = run(facts(enable_prefix_caching=True, mamba_cache_mode="align", prefix_match_unit=32, **HYBRID))
    assert "match-unit-coarse" not in found
    assert found["match-unit-fine"].severity is Severity.OK
    assert worst(found.values()) is Severity.INFO


def test_simulator_reports_match_unit_equal_to_block() -> None:
    found = run(facts(enable_prefix_caching=True, mamba_cache_mode="align", prefix_match_unit=1600, **HYBRID))
    assert found["match-unit-coarse"].fix == "--prefix-match-unit 32"


def test_long_typical_prompts_make_the_coarse_block_a_note() -> None:
    f = facts(enable_prefix_caching=True, mamba_cache_mode="align", **HYBRID)
    long, short = TrafficAssumptions(typical_prompt_tokens=20_000), TrafficAssumptions(
        typical_prompt_tokens=3_100)
    assert run(f, long)["match-unit-coarse"].severity is Severity.INFO
    assert run(f, short)["match-unit-coarse"].severity is Severity.WARNING


def test_match_unit_that_does_not_divide_the_block() -> None:
    found = run(facts(enable_prefix_caching=True, mamba_cache_mode="align", prefix_match_unit=48, **HYBRID))
    assert found["prefix-match-unit-invalid"].severity is Severity.ERROR
    assert found["prefix-match-unit-invalid"].fix == "--prefix-match-unit 32"


def test_dense_model_with_caching_explicitly_off() -> None:
    found = run(facts(enable_prefix_caching=False, hybrid=False, block_size=16))
    assert found["prefix-caching-off"].severity is Severity.ERROR
    assert "--enable-prefix-caching" in (found["prefix-caching-off"].fix or "")
    assert "mamba" not in found["prefix-caching-off"].detail.lower()


def test_unknown_architecture_with_caching_off_mentions_both_flags() -> None:
    found = run(facts(enable_prefix_caching=False))
    assert "--mamba-cache-mode align" in found["prefix-caching-off"].detail


def test_healthy_dense_model() -> None:
    found = run(facts(enable_prefix_caching=True, hybrid=False, block_size=16, cache_dtype="auto"))
    assert worst(found.values()) is Severity.OK
    assert set(found) == {"prefix-caching-on", "match-unit-fine"}


def test_max_num_seqs_above_mamba_blocks() -> None:
    found = run(facts(enable_prefix_caching=True, mamba_cache_mode="align", hybrid=True, block_size=800,
                      cache_dtype="auto", max_num_seqs=128, mamba_cache_blocks=127))
    f = found["mamba-blocks-below-max-num-seqs"]
    assert f.severity is Severity.ERROR
    assert f.fix is not None and f.fix.startswith("--max-num-seqs 127")
    assert "removing --kv-cache-dtype fp8" in f.detail


def test_mamba_slots_at_the_limit_are_a_ceiling_note() -> None:
    found = run(facts(enable_prefix_caching=True, mamba_cache_mode="align", hybrid=True, block_size=800,
                      max_num_seqs=127, mamba_cache_blocks=127))
    assert found["mamba-slots"].severity is Severity.INFO


def test_speculative_decoding_with_hybrid_caching() -> None:
    found = run(facts(enable_prefix_caching=True, mamba_cache_mode="align", prefix_match_unit=32,
                      speculative="mtp", **HYBRID))
    f = found["hybrid-cache-with-spec-decode"]
    assert f.severity is Severity.WARNING
    assert "run of exclamation marks" in f.detail
    assert "mamba-align-experimental" not in found


@pytest.mark.parametrize(("hits", "queries", "code", "severity"), [
    (0.0, 0.0, "hit-rate-no-traffic", Severity.INFO),
    (0.0, 50_000.0, "hit-rate-zero", Severity.WARNING),
    (23_150.0, 50_000.0, "hit-rate", Severity.INFO),
])
def test_hit_rate(hits: float, queries: float, code: str, severity: Severity) -> None:
    found = run(facts(enable_prefix_caching=True, hybrid=False, block_size=16,
                      prefix_cache_hits=hits, prefix_cache_queries=queries))
    assert found[code].severity is severity
    if code == "hit-rate":
        assert found[code].title.startswith("46.3%")


def test_hit_rate_with_fp8_is_a_floor() -> None:
    found = run(facts(enable_prefix_caching=True, mamba_cache_mode="align", prefix_match_unit=32,
                      prefix_cache_hits=463.0, prefix_cache_queries=1000.0, **HYBRID))
    assert "floor" in found["hit-rate"].detail


def test_no_hit_rate_finding_while_caching_is_off() -> None:
    found = run(facts(enable_prefix_caching=False, hybrid=False, prefix_cache_hits=0.0,
                      prefix_cache_queries=5000.0))
    assert not any(code.startswith("hit-rate") for code in found)


def test_kv_capacity_rule_of_thumb() -> None:
    base = {"enable_prefix_caching": True, "hybrid": False, "block_size": 16, "num_gpu_blocks": 2500}
    short = run(facts(**base), TrafficAssumptions(typical_prompt_tokens=10_000, concurrent_sessions=8))
    assert short["kv-capacity-short"].severity is Severity.WARNING
    assert "80,000 > 40,000" in short["kv-capacity-short"].title
    fits = run(facts(**base), TrafficAssumptions(typical_prompt_tokens=4_000, concurrent_sessions=8))
    assert fits["kv-capacity"].severity is Severity.OK
    unknown = run(facts(**base))
    assert unknown["kv-capacity"].severity is Severity.INFO
    assert "--context-tokens" in unknown["kv-capacity"].detail


def test_measured_mean_prompt_and_max_num_seqs_are_the_defaults() -> None:
    found = run(facts(enable_prefix_caching=True, hybrid=False, block_size=16, kv_cache_tokens=40_000,
                      max_num_seqs=32, mean_prompt_tokens=2000.0))
    assumed = found["kv-capacity-short"]
    assert assumed.severity is Severity.INFO, "an assumed session count only cautions"
    assert "--sessions" in assumed.detail


def test_startup_errors_and_wrapper_noise() -> None:
    f = EngineFacts(startup_errors=(
        Observed("torch.OutOfMemoryError: CUDA out of memory", "log line 7"),
        Observed("RuntimeError: Engine core initialization failed. See root cause above.", "log line 8"),
    ))
    found = diagnose(MergedFacts(f))
    errors = [x for x in found if x.code == "startup-error"]
    assert [x.detail for x in errors] == ["torch.OutOfMemoryError: CUDA out of memory"]
    only_wrapper = EngineFacts(startup_errors=(Observed("RuntimeError: Engine core initialization failed.",
                                                        "log line 3"),))
    assert [x.code for x in diagnose(MergedFacts(only_wrapper))] == ["startup-error"]


def test_conflicting_sources_are_reported() -> None:
    merged = MergedFacts(facts(enable_prefix_caching=True, hybrid=False, block_size=16),
                         [Conflict("block_size", Observed(16, "/metrics"), Observed(128, "log line 3"))])
    found = run(merged)
    assert found["sources-disagree"].severity is Severity.WARNING
    assert "/metrics" in found["sources-disagree"].detail


def test_nothing_known_says_so() -> None:
    found = run(EngineFacts())
    assert set(found) == {"config-unknown"}


def test_findings_are_sorted_most_severe_first() -> None:
    found = diagnose(MergedFacts(facts(enable_prefix_caching=True, mamba_cache_mode="align", **HYBRID)))
    ranks = [f.severity.rank for f in found]
    assert ranks == sorted(ranks, reverse=True)


@given(st.integers(min_value=1, max_value=10_000))
def test_suggested_match_unit_always_divides_the_block(block: int) -> None:
    unit = suggest_match_unit(block)
    assert block % unit == 0
    assert unit <= 32
    if block % 32 == 0:
        assert unit == 32


def test_attention_only_models_have_no_mamba_slots_to_check() -> None:
    found = run(facts(enable_prefix_caching=True, hybrid=False, block_size=16, max_num_seqs=128,
                      mamba_cache_blocks=0))
    assert not {"mamba-blocks-below-max-num-seqs", "mamba-slots"} & found.keys()
