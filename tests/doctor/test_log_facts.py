"""Startup logs -> facts, each with the line it came from."""

from __future__ import annotations

from pathlib import Path

from kvroute.doctor.sources import facts_from_log

FIXTURES = Path(__file__).parent / "fixtures"


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_seed_config_dump_line_caching_off_on_hybrid() -> None:
    facts = facts_from_log(read("hybrid_caching_off.log"))
    assert facts.enable_prefix_caching is not None and facts.enable_prefix_caching.value is False
    assert "config dump" in facts.enable_prefix_caching.source
    assert facts.hybrid is not None and facts.hybrid.value is True
    assert facts.architecture is not None and facts.architecture.value == "Qwen3_5ForConditionalGeneration"
    assert facts.block_size is not None and facts.block_size.value == 1600
    assert facts.cache_dtype is not None and facts.cache_dtype.value == "fp8"
    assert facts.model is not None and facts.model.value == "qwen3.8-27b"
    assert facts.max_num_seqs is not None and facts.max_num_seqs.value == 128
    assert facts.kv_cache_tokens is not None and facts.kv_cache_tokens.value == 203_200
    assert facts.startup_errors == ()


def test_mode_defaults_to_none_when_args_do_not_set_it() -> None:
    facts = facts_from_log(read("hybrid_mode_none.log"))
    assert facts.enable_prefix_caching is not None and facts.enable_prefix_caching.value is True
    assert facts.mamba_cache_mode is not None and facts.mamba_cache_mode.value == "none"
    assert "default" in facts.mamba_cache_mode.source


def test_align_warning_is_read() -> None:
    facts = facts_from_log(read("hybrid_align_block1600.log"))
    assert facts.mamba_cache_mode is not None and facts.mamba_cache_mode.value == "align"
    assert facts.experimental_warning is not None and facts.experimental_warning.value is True
    assert facts.prefix_match_unit is None


def test_prefix_match_unit_from_non_default_args() -> None:
    facts = facts_from_log(read("hybrid_align_unit32.log"))
    assert facts.prefix_match_unit is not None and facts.prefix_match_unit.value == 32
    assert "non-default args" in facts.prefix_match_unit.source


def test_mamba_blocks_error_gives_both_numbers() -> None:
    facts = facts_from_log(read("hybrid_no_fp8_mamba_error.log"))
    assert facts.max_num_seqs is not None and facts.max_num_seqs.value == 128
    assert facts.mamba_cache_blocks is not None and facts.mamba_cache_blocks.value == 127
    assert facts.block_size is not None and facts.block_size.value == 800
    assert facts.cache_dtype is not None and facts.cache_dtype.value == "auto"
    messages = [e.value for e in facts.startup_errors]
    assert messages[0].startswith("ValueError: max_num_seqs (128) exceeds available Mamba cache blocks (127)")
    assert len(messages) == len(set(messages)), "repeated tracebacks are reported once"


def test_speculative_method_from_config_dump() -> None:
    facts = facts_from_log(read("hybrid_align_mtp.log"))
    assert facts.speculative is not None and facts.speculative.value == "mtp"


def test_dense_model_is_not_hybrid() -> None:
    facts = facts_from_log(read("dense_caching_on.log"))
    assert facts.hybrid is not None and facts.hybrid.value is False
    assert facts.enable_prefix_caching is not None and facts.enable_prefix_caching.value is True
    assert facts.mamba_cache_mode is None
    assert facts.speculative is None


def test_compose_and_timestamp_prefixes_are_stripped() -> None:
    facts = facts_from_log(read("docker_compose_prefix.log"))
    assert [e.value.split(":")[0] for e in facts.startup_errors] == [
        "torch.OutOfMemoryError", "RuntimeError"]
    assert facts.block_size is not None and facts.block_size.value == 1600


def test_only_the_last_start_counts() -> None:
    text = read("hybrid_no_fp8_mamba_error.log") + read("hybrid_align_unit32.log")
    facts = facts_from_log(text)
    assert facts.startup_errors == ()
    assert facts.cache_dtype is not None and facts.cache_dtype.value == "fp8"
    first_lines = len(read("hybrid_no_fp8_mamba_error.log").splitlines())
    assert facts.block_size is not None
    assert int(facts.block_size.source.split()[-1]) > first_lines


def test_text_without_vllm_lines_yields_nothing() -> None:
    facts = facts_from_log("hello\nworld\nINFO: nothing to see\n")
    assert facts.enable_prefix_caching is None
    assert facts.startup_errors == ()
