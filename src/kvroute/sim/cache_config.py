"""vLLM's ``CacheConfig`` as the labels of ``vllm:cache_config_info``, derived from an engine config.

vLLM 0.32.0 exposes every ``CacheConfig`` field as a label, with ``str(value)`` as its text (so an
unset field reads ``"None"``) and no ``model_name`` label.  The set of names is exactly what
tests/vllm/fixtures/metrics_after_chat.prom records; where the simulator models a field the value
follows from its configuration, and the rest carry vLLM's default (docs/simulator.md lists them).
"""

from __future__ import annotations

from kvroute.sim.engine import EngineConfig

# Fields the simulator does not model, with the value a default vLLM start reports for them.
_DEFAULTS: dict[str, str] = {
    "_block_size_resolved": "True",
    "cache_hit_alignment_tokens": "None",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "gpu_memory_utilization": "0.9",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_cache_memory_bytes": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_cache_dtype": "auto",
    "mamba_page_size_padded": "None",
    "mamba_ssm_cache_dtype": "auto",
    "num_cpu_blocks": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_caching_hash_algo": "sha256",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
}


def _text(value: object) -> str:
    """How vLLM writes a config value into a label: ``str()``, so None is ``"None"``."""
    return str(value)


def mamba_block_size(config: EngineConfig) -> int | None:
    """The Mamba state's block: None on attention-only models; on a hybrid, the attention block
    when prefix caching keeps states (align), else the whole context (one state per sequence),
    which is what vLLM resolves it to for every model with Mamba layers."""
    if not config.hybrid:
        return None
    if config.reuses_prefixes:
        return config.block_size
    return config.max_model_len


def cache_config_labels(config: EngineConfig) -> dict[str, str]:
    """The ``vllm:cache_config_info`` labels (``engine`` included), sorted by name as vLLM's are."""
    tokens = config.num_gpu_blocks * config.block_size
    derived = {
        "block_size": _text(config.block_size),
        "cache_dtype": config.kv_cache_dtype,
        "effective_attention_block_size": _text(config.block_size),
        "enable_prefix_caching": _text(config.enable_prefix_caching),
        "engine": "0",
        "kv_cache_max_concurrency": _text(tokens / config.max_model_len),
        "kv_cache_size_tokens": _text(tokens),
        "mamba_block_size": _text(mamba_block_size(config)),
        "mamba_cache_mode": config.mamba_cache_mode,
        "num_gpu_blocks": _text(config.num_gpu_blocks),
        "num_gpu_blocks_override": _text(config.num_gpu_blocks_override),
        "prefix_match_unit": _text(config.prefix_match_unit),
        "user_specified_block_size": _text(config.user_specified_block_size),
    }
    labels = {**_DEFAULTS, **derived}
    return dict(sorted(labels.items()))
