"""The one table of engine metric names kvroute reads, and the names a router re-exports them under.

Each figure lists the sample names that carry it, preferred first: vLLM v1, older vLLM (``gpu_``
names), then SGLang.  The fleet probe, the doctor, the canary and the benchmarks all look names up
here, so an engine renaming a metric is a change in one place.
"""

from __future__ import annotations

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PROMPT_TOKENS = ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total")
GENERATION_TOKENS = ("vllm:generation_tokens_total", "sglang:generation_tokens_total")
PREEMPTIONS = ("vllm:num_preemptions_total",)
REQUEST_SUCCESS = "vllm:request_success_total"
# The prompt-length histogram's sum and count: the mean prompt per finished request.
REQUEST_PROMPT_TOKENS_SUM = "vllm:request_prompt_tokens_sum"
REQUEST_PROMPT_TOKENS_COUNT = "vllm:request_prompt_tokens_count"
START_TIME = "process_start_time_seconds"
# vLLM publishes its configuration as the labels of ``*_config_info`` gauges (value 1).
VLLM_PREFIX = "vllm:"
CONFIG_INFO_SUFFIX = "_config_info"
CACHE_CONFIG_INFO = "vllm:cache_config_info"

# A kvroute router's re-export of each worker's prefix-cache counters (label ``worker``).
ROUTER_WORKER_PREFIX_HITS = "kvroute_worker_prefix_cache_hits_total"
ROUTER_WORKER_PREFIX_QUERIES = "kvroute_worker_prefix_cache_queries_total"
