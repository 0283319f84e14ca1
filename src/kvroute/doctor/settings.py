"""A flat mapping of vLLM setting names to raw values -> partial ``EngineFacts``.

Every source (info-metric labels, ``/server_info``, the config dump, the non-default args) is
reduced to such a mapping first, so the names vLLM uses are interpreted in one place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvroute.doctor.config_text import parse_bool, parse_int, parse_text
from kvroute.doctor.facts import EngineFacts, Observed
from kvroute.doctor.hybrid import is_hybrid_architecture

# Setting name -> the names vLLM (and the simulator) use for it, most specific first.
_ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("served_model_name", "model_name", "model", "model_tag"),
    "architecture": ("architecture", "architectures"),
    "enable_prefix_caching": ("enable_prefix_caching",),
    "mamba_cache_mode": ("mamba_cache_mode",),
    "block_size": ("block_size",),
    "prefix_match_unit": ("prefix_match_unit",),
    "cache_dtype": ("cache_dtype", "kv_cache_dtype"),
    "num_gpu_blocks": ("num_gpu_blocks", "num_gpu_blocks_override"),
    "kv_cache_tokens": ("kv_cache_size_tokens",),
    "max_num_seqs": ("max_num_seqs",),
    "max_model_len": ("max_model_len", "max_seq_len"),
    "mamba_cache_blocks": ("num_mamba_cache_blocks", "mamba_cache_blocks", "num_mamba_blocks",
                           "mamba_slots", "num_mamba_slots"),
    "speculative": ("speculative_config", "speculative_method"),
    "version": ("version", "vllm_version"),
}
_INTS = frozenset({"block_size", "prefix_match_unit", "num_gpu_blocks", "kv_cache_tokens",
                   "max_num_seqs", "max_model_len", "mamba_cache_blocks"})
_SPEC_METHOD = re.compile(r"method=['\"]?([\w-]+)")
# Explicit statements that the model is (or is not) a hybrid.
_HYBRID_FLAGS = ("is_hybrid", "hybrid")
# Settings vLLM only fills in for models with Mamba layers.
_HYBRID_ONLY = ("mamba_page_size_padded", "mamba_block_size")
# vLLM resolves this for every model with Mamba layers (to the attention block, or to the whole
# context when no prefix states are kept), so a config that lists it unset is attention-only.
_MAMBA_BLOCK = "mamba_block_size"
# An attention-free model is all recurrent state: the same caching rules as a hybrid.
_ATTENTION_FREE = "is_attention_free"


def facts_from_settings(flat: Mapping[str, object], source: str) -> EngineFacts:
    """Interpret vLLM setting names in ``flat`` (values raw: strings, numbers, bools, None)."""
    found: dict[str, object] = {}
    for name, aliases in _ALIASES.items():
        raw = next((flat[a] for a in aliases if a in flat and parse_text(flat[a]) is not None), None)
        if raw is None:
            continue
        value = _interpret(name, raw)
        if value is not None:
            found[name] = Observed(value, f"{source} {_alias_used(flat, aliases)}")
    hybrid = _hybrid(flat, found, source)
    if hybrid is not None:
        found["hybrid"] = hybrid
    return EngineFacts(**found)  # type: ignore[arg-type]


def _alias_used(flat: Mapping[str, object], aliases: tuple[str, ...]) -> str:
    return next(a for a in aliases if a in flat and parse_text(flat[a]) is not None)


def _interpret(name: str, raw: object) -> object | None:
    if name in _INTS:
        return parse_int(raw)
    if name == "enable_prefix_caching":
        return parse_bool(raw)
    if name == "architecture" and isinstance(raw, list | tuple):
        return ",".join(str(a) for a in raw) or None
    if isinstance(raw, list | tuple):  # e.g. served_model_name=['qwen3-3b']
        raw = raw[0] if raw else None
    if name == "speculative" and isinstance(raw, Mapping):
        return str(raw.get("method") or raw.get("model") or "on")
    text = parse_text(raw)
    if text is None:
        return None
    if name == "speculative":
        method = _SPEC_METHOD.search(text)
        return method.group(1) if method else text
    if name in ("mamba_cache_mode", "cache_dtype"):
        return text.lower()
    return text


def _hybrid(flat: Mapping[str, object], found: Mapping[str, object], source: str) -> Observed[bool] | None:
    for key in _HYBRID_FLAGS:
        if key in flat and parse_bool(flat[key]) is not None:
            return Observed(bool(parse_bool(flat[key])), f"{source} {key}")
    for key in _HYBRID_ONLY:
        if key in flat and parse_text(flat[key]) is not None:
            return Observed(True, f"{source} {key}={flat[key]}")
    if _ATTENTION_FREE in flat and parse_bool(flat[_ATTENTION_FREE]):
        return Observed(True, f"{source} {_ATTENTION_FREE}={flat[_ATTENTION_FREE]}")
    slots = found.get("mamba_cache_blocks")
    if isinstance(slots, Observed):
        # Only models with Mamba / linear-attention layers keep recurrent-state slots.
        return Observed(slots.value > 0, f"{slots.source}={slots.value}")
    arch = found.get("architecture")
    if isinstance(arch, Observed):
        return Observed(is_hybrid_architecture(str(arch.value)), f"{source} architecture={arch.value}")
    if _MAMBA_BLOCK in flat:
        return Observed(False, f"{source} {_MAMBA_BLOCK}={flat[_MAMBA_BLOCK]}")
    return None
