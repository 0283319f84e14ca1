"""vLLM's three textual renderings of settings: info labels, the config dump, non-default args."""

from __future__ import annotations

import pytest

from kvroute.doctor.settings import (
    parse_bool,
    parse_int,
    parse_python_dict,
    parse_text,
    split_config_dump,
)


@pytest.mark.parametrize(("raw", "expected"), [
    ("True", True), ("False", False), ("true", True), ("0", False), (True, True), ("None", None),
    ("'True'", True), ("maybe", None),
])
def test_parse_bool(raw: object, expected: bool | None) -> None:
    assert parse_bool(raw) is expected


@pytest.mark.parametrize(("raw", "expected"), [
    ("1600", 1600), ("1,600", 1600), ("203_200", 203200), (128, 128), ("16.0", 16), ("None", None),
    ("", None), ("1.5", None), (True, None), ("abc", None),
])
def test_parse_int(raw: object, expected: int | None) -> None:
    assert parse_int(raw) == expected


def test_parse_text_treats_vllm_unset_spellings_as_none() -> None:
    assert parse_text("None") is None
    assert parse_text("") is None
    assert parse_text(None) is None
    assert parse_text("'fp8'") == "fp8"


def test_config_dump_splits_only_at_top_level() -> None:
    dump = ("model='/models/x', speculative_config=SpeculativeConfig(method='mtp', num_spec_tokens=2), "
            "kv_cache_dtype=fp8, compilation_config={'level': None, 'sizes': [1, 2, 4]}, "
            "served_model_name=qwen3.8-27b, enable_prefix_caching=False, quote='a, b'")
    pairs = split_config_dump(dump)
    assert pairs["model"] == "'/models/x'"
    assert pairs["speculative_config"] == "SpeculativeConfig(method='mtp', num_spec_tokens=2)"
    assert pairs["kv_cache_dtype"] == "fp8"
    assert pairs["compilation_config"] == "{'level': None, 'sizes': [1, 2, 4]}"
    assert pairs["enable_prefix_caching"] == "False"
    assert pairs["quote"] == "'a, b'"
    assert "num_spec_tokens" not in pairs


def test_python_dict_is_read_safely() -> None:
    assert parse_python_dict("{'max_num_seqs': 128, 'served_model_name': ['q']}") == {
        "max_num_seqs": 128, "served_model_name": ["q"]}
    assert parse_python_dict("__import__('os').system('true')") is None
    assert parse_python_dict("[1, 2]") is None
    assert parse_python_dict("{'unterminated': ") is None
