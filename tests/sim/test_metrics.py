"""The exposition's vLLM-specific parts: cache config labels per preset, bucket layouts, counters."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_helpers import VirtualEngine, prose

from kvroute.sim.cache_config import cache_config_labels
from kvroute.sim.engine import EngineConfig
from kvroute.sim.metrics import render_metrics
from kvroute.sim.presets import build_config
from kvroute.sim.stats import token_buckets

ALIGN = {"enable_prefix_caching": True, "mamba_cache_mode": "align"}


def test_token_buckets_follow_vllms_1_2_5_series_up_to_max_model_len() -> None:
    # What real vLLM 0.32.0 exposes for --max-model-len 4096 (tests/vllm/fixtures).
    assert token_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert token_buckets(100)[-1] == 100 and token_buckets(1) == (1,)


def test_dense_labels_say_attention_only_and_unset_fields_none() -> None:
    labels = cache_config_labels(build_config("dense-3b"))
    assert "model_name" not in labels and labels["engine"] == "0"
    unset = ("mamba_block_size", "prefix_match_unit", "num_gpu_blocks_override", "mamba_page_size_padded")
    assert [labels[name] for name in unset] == ["None"] * len(unset)
    assert labels["is_attention_free"] == "False" and labels["mamba_cache_mode"] == "none"
    assert labels["user_specified_block_size"] == "False" and labels["block_size"] == "16"
    assert int(labels["kv_cache_size_tokens"]) == int(labels["num_gpu_blocks"]) * 16
    assert float(labels["kv_cache_max_concurrency"]) == int(labels["kv_cache_size_tokens"]) / 32768
    assert list(labels) == sorted(labels)


@pytest.mark.parametrize(("overrides", "mamba_block", "mode", "unit"), [
    ({}, "65536", "none", "None"),                                   # caching off: one state per sequence
    ({"enable_prefix_caching": True}, "65536", "none", "None"),      # mode none keeps no prefix states
    (ALIGN, "1600", "align", "None"),
    ({**ALIGN, "prefix_match_unit": 32}, "1600", "align", "32"),
    ({**ALIGN, "kv_cache_dtype": "auto", "max_num_seqs": 127}, "800", "align", "None"),
])
def test_hybrid_labels_carry_the_mamba_block_like_vllm(overrides: dict[str, object], mamba_block: str,
                                                       mode: str, unit: str) -> None:
    labels = cache_config_labels(build_config("hybrid-27b", **overrides))
    assert (labels["mamba_block_size"], labels["mamba_cache_mode"], labels["prefix_match_unit"]) == (
        mamba_block, mode, unit)
    assert labels.keys() == cache_config_labels(build_config("dense-3b")).keys()


def test_overridden_pool_and_block_are_reported_as_given() -> None:
    labels = cache_config_labels(build_config("a4000-qwen3-4b", block_size=32, num_gpu_blocks_override=2000))
    assert labels["num_gpu_blocks_override"] == labels["num_gpu_blocks"] == "2000"
    assert labels["user_specified_block_size"] == "True" and labels["kv_cache_size_tokens"] == "64000"
    with pytest.raises(ValueError, match="must agree"):
        EngineConfig(num_gpu_blocks=4096, num_gpu_blocks_override=2000)


def test_exposition_parses_and_histograms_count_finished_requests() -> None:
    config = build_config("dense-3b", max_model_len=4096)
    v = VirtualEngine(config)
    shared = prose(1200, 1)
    first = v.run(shared.encode())
    second = v.run((shared + prose(100, 2)).encode())
    text = render_metrics(config, [v.engine.snapshot()], "m", 1.7e9).decode()
    samples = {(s.name, s.labels.get("le", s.labels.get("source", ""))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("vllm:request_prompt_tokens_bucket", "2000.0")] == 2
    assert samples[("vllm:request_prompt_tokens_bucket", "1000.0")] == 0
    assert ("vllm:request_prompt_tokens_bucket", "5000.0") not in samples
    assert samples[("vllm:request_prompt_tokens_count", "")] == 2
    cached = first.cached + second.cached
    assert samples[("vllm:prompt_tokens_by_source_total", "local_cache_hit")] == cached > 0
    assert samples[("vllm:request_success_created", "")] == 1.7e9
