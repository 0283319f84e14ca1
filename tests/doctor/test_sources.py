"""/metrics, /v1/models, /server_info and router records -> facts; merging sources."""

from __future__ import annotations

import pytest

from kvroute.doctor.endpoint import EndpointBundle, facts_for_endpoint, facts_from_router_record
from kvroute.doctor.facts import EngineFacts, Observed, merge_facts
from kvroute.doctor.sources import facts_from_metrics, facts_from_models, facts_from_server_info
from kvroute.prometheus_text import MetricsParseError, parse_exposition

HYBRID_METRICS = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="qwen3.8-27b"} 30000.0
vllm:prefix_cache_queries_total{engine="1",model_name="qwen3.8-27b"} 10000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="qwen3.8-27b"} 15000.0
vllm:prefix_cache_hits_total{engine="1",model_name="qwen3.8-27b"} 3520.0
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="qwen3.8-27b"} 20.0
vllm:request_prompt_tokens_count{engine="0",model_name="qwen3.8-27b"} 20.0
vllm:request_prompt_tokens_sum{engine="0",model_name="qwen3.8-27b"} 40000.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="1600",cache_dtype="fp8",enable_prefix_caching="True",engine="0",\
mamba_block_size="1600",mamba_cache_mode="align",num_gpu_blocks="127",prefix_match_unit="None"} 1.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e+09
"""


def test_metrics_give_settings_counters_and_mean_prompt() -> None:
    facts = facts_from_metrics(parse_exposition(HYBRID_METRICS))
    assert facts.block_size == Observed(1600, "/metrics vllm:cache_config_info block_size")
    assert facts.enable_prefix_caching is not None and facts.enable_prefix_caching.value is True
    assert facts.mamba_cache_mode is not None and facts.mamba_cache_mode.value == "align"
    assert facts.prefix_match_unit is None  # "None": the block size applies
    assert facts.hybrid is not None and facts.hybrid.value is True
    assert "mamba_block_size" in facts.hybrid.source
    assert facts.prefix_cache_queries is not None and facts.prefix_cache_queries.value == 40000
    assert facts.prefix_cache_hits is not None and facts.prefix_cache_hits.value == 18520
    assert facts.mean_prompt_tokens is not None and facts.mean_prompt_tokens.value == 2000
    assert facts.model is not None and facts.model.value == "qwen3.8-27b"
    assert facts.start_time is not None and facts.start_time.value == 1.7e9
    total = facts.total_kv_tokens()
    assert total is not None and total.value == 1600 * 127


def test_older_counter_names_and_counter_mean() -> None:
    text = ('vllm:gpu_prefix_cache_queries_total{model_name="m"} 100\n'
            'vllm:gpu_prefix_cache_hits_total{model_name="m"} 40\n'
            'vllm:prompt_tokens_total{model_name="m"} 900\n'
            'vllm:request_success_total{finished_reason="stop",model_name="m"} 2\n'
            'vllm:request_success_total{finished_reason="length",model_name="m"} 1\n')
    facts = facts_from_metrics(parse_exposition(text))
    assert facts.prefix_cache_hits is not None and facts.prefix_cache_hits.value == 40
    assert facts.mean_prompt_tokens is not None and facts.mean_prompt_tokens.value == 300


def test_mamba_block_size_tells_hybrid_from_attention_only() -> None:
    # vLLM resolves mamba_block_size for every model with Mamba layers; unset means attention-only.
    text = ('vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",'
            'is_attention_free="False",mamba_block_size="None",mamba_cache_mode="none",'
            'mamba_page_size_padded="None"} 1.0\n')
    facts = facts_from_metrics(parse_exposition(text))
    assert facts.hybrid == Observed(False, "/metrics vllm:cache_config_info mamba_block_size=None")
    facts = facts_from_metrics(parse_exposition(text.replace('mamba_block_size="None"',
                                                             'mamba_block_size="65536"')))
    assert facts.hybrid is not None and facts.hybrid.value is True
    facts = facts_from_metrics(parse_exposition(text.replace('is_attention_free="False"',
                                                             'is_attention_free="True"')))
    assert facts.hybrid is not None and facts.hybrid.value is True
    assert "is_attention_free" in facts.hybrid.source


def test_mamba_slots_from_a_flat_server_info() -> None:
    # The simulator's /server_info (real vLLM has none) adds what /metrics cannot say.
    facts = facts_from_server_info({"hybrid": True, "mamba_cache_blocks": 160, "max_num_seqs": 128})
    assert facts.hybrid is not None and facts.hybrid.value is True
    assert facts.mamba_cache_blocks is not None and facts.mamba_cache_blocks.value == 160
    facts = facts_from_server_info({"mamba_cache_blocks": 0})
    assert facts.hybrid is not None and facts.hybrid.value is False


def test_garbage_metrics_raise_a_clear_error() -> None:
    with pytest.raises(MetricsParseError):
        parse_exposition("this is { not prometheus\n")


def test_models_body() -> None:
    facts = facts_from_models({"object": "list", "data": [{"id": "qwen", "max_model_len": 65536}]})
    assert facts.model == Observed("qwen", "/v1/models id")
    assert facts.max_model_len is not None and facts.max_model_len.value == 65536
    assert facts_from_models({"data": []}) == EngineFacts()
    assert facts_from_models("nonsense") == EngineFacts()


def test_server_info_text_config_dump() -> None:
    body = {"vllm_config": "model='/m', speculative_config=None, kv_cache_dtype=fp8, max_seq_len=8192, "
                           "served_model_name=qwen3.8-27b, enable_prefix_caching=False, "
                           "compilation_config={'level': 3}"}
    facts = facts_from_server_info(body)
    assert facts.enable_prefix_caching is not None and facts.enable_prefix_caching.value is False
    assert facts.cache_dtype is not None and facts.cache_dtype.value == "fp8"
    assert facts.max_model_len is not None and facts.max_model_len.value == 8192
    assert facts.speculative is None


def test_server_info_json_config_nested() -> None:
    body = {"vllm_config": {
        "model_config": {"model": "/m", "served_model_name": "qwen", "max_model_len": 4096,
                         "architectures": ["Qwen3NextForCausalLM"]},
        "cache_config": {"block_size": 1600, "enable_prefix_caching": True, "mamba_cache_mode": "align",
                         "prefix_match_unit": 32, "cache_dtype": "fp8"},
        "scheduler_config": {"max_num_seqs": 128},
        "speculative_config": {"method": "mtp", "model": "/draft"},
    }}
    facts = facts_from_server_info(body)
    assert facts.model is not None and facts.model.value == "qwen"
    assert facts.architecture is not None and facts.architecture.value == "Qwen3NextForCausalLM"
    assert facts.hybrid is not None and facts.hybrid.value is True
    assert facts.prefix_match_unit is not None and facts.prefix_match_unit.value == 32
    assert facts.max_num_seqs is not None and facts.max_num_seqs.value == 128
    assert facts.speculative is not None and facts.speculative.value == "mtp"


def test_router_record() -> None:
    record = {"id": "w1", "url": "http://w1", "models": ["qwen"], "max_num_seqs": 64, "max_model_len": None,
              "prefix_cache_hits": 10.0, "prefix_cache_queries": 40.0,
              "cache_config": {"block_size": "1600", "enable_prefix_caching": "True"}}
    facts = facts_from_router_record(record)
    assert facts.block_size is not None and facts.block_size.value == 1600
    assert facts.max_num_seqs is not None and facts.max_num_seqs.value == 64
    assert facts.max_model_len is None
    assert facts.model is not None and facts.model.value == "qwen"
    assert facts.prefix_cache_hits is not None and facts.prefix_cache_hits.value == 10


def test_merge_keeps_first_source_and_records_disagreement() -> None:
    live = EngineFacts(block_size=Observed(1600, "/metrics"), prefix_cache_hits=Observed(5.0, "/metrics"))
    log = EngineFacts(block_size=Observed(800, "log line 7"), prefix_cache_hits=Observed(0.0, "x"),
                      max_num_seqs=Observed(128, "log line 2"))
    merged = merge_facts(live, log)
    assert merged.facts.block_size == Observed(1600, "/metrics")
    assert merged.facts.max_num_seqs == Observed(128, "log line 2")
    assert [(c.name, c.kept.value, c.other.value) for c in merged.conflicts] == [("block_size", 1600, 800)]


def test_bundle_without_engine_endpoints_says_so() -> None:
    bundle = EndpointBundle("http://x", problems=["/metrics: HTTP 404", "/server_info: HTTP 404"])
    _, findings = facts_for_endpoint(bundle)
    assert [f.code for f in findings] == ["no-engine-endpoints"]
    unreachable = EndpointBundle("http://x", problems=["/metrics: ClientConnectorError"], reachable=False)
    _, findings = facts_for_endpoint(unreachable)
    assert [f.code for f in findings] == ["unreachable"]
