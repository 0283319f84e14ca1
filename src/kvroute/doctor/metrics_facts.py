"""An engine's ``/metrics`` (vLLM names) -> partial ``EngineFacts``."""

from __future__ import annotations

from typing import Any

from kvroute.doctor.facts import EngineFacts, Observed, merge_facts
from kvroute.doctor.settings import facts_from_settings
from kvroute.prometheus_text import Sample, first_total, label_values, total

_SOURCE = "/metrics"
# vLLM v1 names first, then the names of older releases.
_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_CACHE_INFO = "vllm:cache_config_info"


def facts_from_metrics(samples: list[Sample]) -> EngineFacts:
    """Settings from the ``*_config_info`` labels, counters, and the model and start time."""
    parts = [
        facts_from_settings(s.labels, f"{_SOURCE} {s.name}")
        for s in sorted(_info_samples(samples), key=lambda s: s.name != _CACHE_INFO)
    ]
    found: dict[str, Observed[Any]] = {}
    models = label_values([s for s in samples if s.name.startswith("vllm:")], "model_name")
    if models:
        found["model"] = Observed(models[0], f"{_SOURCE} model_name label")
    queries = first_total(samples, _QUERIES)
    hits = first_total(samples, _HITS)
    if queries is not None and hits is not None:
        found["prefix_cache_queries"] = Observed(queries[1], f"{_SOURCE} {queries[0]}")
        found["prefix_cache_hits"] = Observed(hits[1], f"{_SOURCE} {hits[0]}")
    mean = _mean_prompt_tokens(samples)
    if mean is not None:
        found["mean_prompt_tokens"] = mean
    start = total(samples, "process_start_time_seconds")
    if start is not None:
        found["start_time"] = Observed(start, f"{_SOURCE} process_start_time_seconds")
    parts.append(EngineFacts(**found))  # type: ignore[arg-type]
    return merge_facts(*parts).facts


def _info_samples(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if s.name.startswith("vllm:") and s.name.endswith("_config_info")]


def _mean_prompt_tokens(samples: list[Sample]) -> Observed[float] | None:
    """Mean prompt length per finished request, from the histogram, else from the counters."""
    for numerator, denominator in (
        ("vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count"),
        ("vllm:prompt_tokens_total", "vllm:request_success_total"),
    ):
        num, den = total(samples, numerator), total(samples, denominator)
        if num is not None and den:
            return Observed(num / den, f"{_SOURCE} {numerator} / {denominator}")
    return None
