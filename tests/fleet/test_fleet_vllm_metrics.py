"""Reading engine figures out of Prometheus expositions (vLLM v1, older vLLM, SGLang, the simulator)."""

from __future__ import annotations

import math
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.fleet.vllm_metrics import EngineMetrics, parse_vllm_metrics
from kvroute.prometheus_text import MetricsParseError, parse_exposition, parse_labels
from kvroute.sim.server import start_sim_fleet

# Shaped like vLLM 0.10+ with two data-parallel engines: HELP/TYPE lines, histograms, _created.
VLLM_DP2 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen3-4b"} 3.0
vllm:num_requests_running{engine="1",model_name="qwen3-4b"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen3-4b"} 0.0
vllm:num_requests_waiting{engine="1",model_name="qwen3-4b"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="qwen3-4b"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="qwen3-4b"} 0.75
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="qwen3-4b"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="qwen3-4b"} 1.7e9
vllm:prefix_cache_queries_total{engine="1",model_name="qwen3-4b"} 3000.0
vllm:prefix_cache_hits_total{engine="0",model_name="qwen3-4b"} 400.0
vllm:prefix_cache_hits_total{engine="1",model_name="qwen3-4b"} 600.0
vllm:prompt_tokens_total{engine="0",model_name="qwen3-4b"} 1000.0
vllm:prompt_tokens_total{engine="1",model_name="qwen3-4b"} 3000.0
vllm:generation_tokens_total{engine="0",model_name="qwen3-4b"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="qwen3-4b"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="qwen3-4b"} 7.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
mamba_cache_mode="none",num_gpu_blocks="2543",prefix_match_unit="16"} 1.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7000000123e+09
"""

OLD_VLLM = """\
vllm:num_requests_running{model_name="m"} 1.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
vllm:gpu_prefix_cache_hits_total{model_name="m"} 4.0
"""

SGLANG = """\
sglang:num_running_reqs{model_name="m"} 4.0
sglang:num_queue_reqs{model_name="m"} 1.0
sglang:token_usage{model_name="m"} 0.3
"""


def test_vllm_data_parallel_engines_are_summed():
    m = parse_vllm_metrics(VLLM_DP2)
    assert (m.running, m.waiting) == (8, 2)
    assert m.kv_usage == 0.5  # mean over the engines
    assert (m.prefix_queries, m.prefix_hits, m.prompt_tokens, m.generation_tokens) == (4000, 1000, 4000, 50)
    assert m.process_start_time == 1.7000000123e9
    assert m.cache_config["block_size"] == "16" and m.cache_config["enable_prefix_caching"] == "True"
    assert m.has_load


def test_older_vllm_and_sglang_names_are_understood():
    old = parse_vllm_metrics(OLD_VLLM)
    assert (old.running, old.kv_usage, old.prefix_queries, old.prefix_hits) == (1, 0.5, 10, 4)
    sg = parse_vllm_metrics(SGLANG)
    assert (sg.running, sg.waiting, sg.kv_usage) == (4, 1, 0.3)


def test_engines_without_these_metrics_give_nothing():
    m = parse_vllm_metrics("# HELP http_requests_total x\nhttp_requests_total 5\npython_info{v=\"3\"} 1\n")
    assert m.running is None and m.kv_usage is None and m.process_start_time is None and not m.has_load
    assert parse_vllm_metrics("") == m


def test_unreadable_lines_and_nan_are_skipped():
    text = ("vllm:num_requests_running{model_name=\"m\"} NaN\nvllm:num_requests_running garbage\n"
            "vllm:num_requests_waiting{model_name=\"m\"} 3 1700000000000\nvllm:kv_cache_usage_perc{\n")
    m = parse_vllm_metrics(text)
    assert m.running is None and m.waiting == 3 and m.kv_usage is None


def test_label_values_with_escapes():
    labels = parse_labels('a="x\\"y",b="line\\nnext",c="back\\\\slash",d="}{ ,"')
    assert labels == {"a": 'x"y', "b": "line\nnext", "c": "back\\slash", "d": "}{ ,"}


async def test_agrees_with_prometheus_client_on_the_simulator():
    fleet = await start_sim_fleet("a4000-qwen3-4b", 1, speed=50.0)
    try:
        url = fleet.urls[0]
        async with aiohttp.ClientSession() as http:
            body = {"model": "qwen3-4b", "messages": [{"role": "user", "content": "hi " * 3000}],
                    "max_tokens": 4}
            for _ in range(2):
                async with http.post(url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
    finally:
        await fleet.close()
    ours = parse_vllm_metrics(text)
    reference: dict[str, float] = {}
    config: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                config = dict(s.labels)
            elif not math.isnan(s.value):
                reference[s.name] = reference.get(s.name, 0.0) + s.value
    assert ours.running == reference["vllm:num_requests_running"] == 0
    assert ours.prefix_queries == reference["vllm:prefix_cache_queries_total"] > 0
    assert ours.prefix_hits == reference["vllm:prefix_cache_hits_total"] > 0
    assert ours.prompt_tokens == reference["vllm:prompt_tokens_total"]
    assert ours.kv_usage == reference["vllm:kv_cache_usage_perc"]
    assert ours.process_start_time == reference["process_start_time_seconds"]
    assert ours.cache_config == config and config["enable_prefix_caching"] == "True"


def test_the_reader_agrees_with_prometheus_client_on_real_vllm() -> None:
    """kvroute's one Prometheus-text reader against prometheus-client's, on recorded real answers."""
    fixtures = Path(__file__).resolve().parents[1] / "vllm" / "fixtures"
    for path in sorted(fixtures.glob("metrics_*.prom")):
        text = path.read_text()
        ours = [(s.name, dict(s.labels), s.value) for s in parse_exposition(text)]
        reference = [(s.name, dict(s.labels), float(s.value))
                     for family in text_string_to_metric_families(text) for s in family.samples]
        assert len(ours) == len(reference) > 400, path.name
        for mine, theirs in zip(ours, reference, strict=True):
            assert mine[:2] == theirs[:2]
            assert mine[2] == theirs[2] or (math.isnan(mine[2]) and math.isnan(theirs[2]))


@pytest.mark.parametrize(("labels", "block"), [
    ({"block_size": "16", "hash_block_size": "None"}, 16),  # vLLM's default: hashes by the block
    ({"block_size": "16", "hash_block_size": "64"}, 64),  # hashes by a block of their own
    ({"block_size": "0"}, None),
    ({"block_size": "auto"}, None),
    ({}, None),  # an engine that does not say (SGLang, older vLLM)
])
def test_the_block_its_prefix_cache_hashes_by(labels: dict[str, str], block: int | None) -> None:
    assert EngineMetrics(cache_config=labels).block_size == block


def test_only_the_names_asked_for_and_strictness() -> None:
    wanted = parse_exposition(VLLM_DP2, ("vllm:num_requests_running", "process_start_time_seconds"))
    assert [s.name for s in wanted] == ["vllm:num_requests_running"] * 2 + ["process_start_time_seconds"]
    with pytest.raises(MetricsParseError):
        parse_exposition("vllm:num_requests_running garbage\n")
    assert parse_exposition("vllm:num_requests_running garbage\n", skip_unreadable=True) == []
