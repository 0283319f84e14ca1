"""vLLM's settings, whatever shape they were printed in -> partial ``EngineFacts``.

vLLM prints settings in three shapes: Prometheus info labels (``enable_prefix_caching="True"``,
``num_cpu_blocks="None"``), the ``str(VllmConfig)`` dump (``model='x', kv_cache_dtype=fp8,
enable_prefix_caching=False, compilation_config={...}``) in its startup log and ``/server_info``,
and the ``non-default args: {...}`` Python dict at startup.  Every source is reduced to a flat
name -> raw value mapping first, so the names vLLM uses are interpreted in one place
(``facts_from_settings``).

Hybrid models (attention + Mamba / linear-attention layers) change every caching rule the doctor
checks: vLLM keeps a recurrent state per sequence next to the KV blocks, prefix caching is off
unless asked for, it needs ``--mamba-cache-mode align``, and the attention block is stretched to
hundreds or thousands of tokens so that its page is at least as large as the Mamba page.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping

from kvroute.doctor.facts import EngineFacts, Observed

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


# --- vLLM's textual renderings: info labels, the config dump, the args dict -----------------------

_OPEN = "([{"
_CLOSE = ")]}"


def parse_bool(raw: object) -> bool | None:
    """``True``/``true``/``1`` -> True, ``False``/``false``/``0`` -> False, anything else None."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().strip("'\"").lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    return None


def parse_int(raw: object) -> int | None:
    """An integer from ``1600``, ``"1,600"``, ``1600.0``; None for ``None``/empty/garbage."""
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int):
        return raw
    text = str(raw).strip().strip("'\"").replace(",", "").replace("_", "")
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def parse_text(raw: object) -> str | None:
    """A setting as text, with vLLM's spellings of "unset" (``None``, ``null``, empty) as None."""
    if raw is None:
        return None
    text = str(raw).strip().strip("'\"")
    return None if text in ("", "None", "none_", "null") else text


def split_config_dump(text: str) -> dict[str, str]:
    """Top-level ``key=value`` pairs of a ``str(VllmConfig)`` rendering.

    Commas inside brackets or quotes do not split; nested values are returned as raw text.
    """
    pairs: dict[str, str] = {}
    depth = 0
    quote: str | None = None
    start = 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            _add_pair(pairs, text[start:i])
            start = i + 1
    _add_pair(pairs, text[start:])
    return pairs


def _add_pair(pairs: dict[str, str], chunk: str) -> None:
    key, sep, value = chunk.partition("=")
    key = key.strip()
    if sep and key.isidentifier():
        pairs[key] = value.strip()


def parse_python_dict(text: str) -> dict[str, object] | None:
    """A Python dict literal as logged by vLLM (``non-default args: {...}``); None if not one."""
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# --- recognising hybrid (attention + Mamba / linear-attention) models -----------------------------

# vLLM architectures with Mamba, Gated DeltaNet or other linear-attention layers.
_HYBRID_ARCH = re.compile(
    r"Mamba|Jamba|Bamba|Zamba|NemotronH|FalconH1|GraniteMoeHybrid|Qwen3Next|Qwen3_[5-9]|"
    r"Lfm2|KimiLinear|Plamo2|MiniMaxText01|HunYuanHybrid|Hybrid",
)


def is_hybrid_architecture(architecture: str) -> bool:
    """Whether a vLLM architecture name (``Qwen3NextForCausalLM``) is a hybrid."""
    return bool(_HYBRID_ARCH.search(architecture))
