"""Calibrated engine presets.  docs/simulator.md says where every number comes from.

A preset is a recipe rather than a fixed config: the KV pool (``num_gpu_blocks``) follows from a KV
memory budget, the KV bytes per token for the chosen ``kv_cache_dtype`` and the block size, so that
overriding the dtype or the block size changes the pool the way it would on the real card.  For the
hybrid preset the block size itself follows from the dtype (vLLM sizes the attention page to match
the Mamba state page: 1600 tokens with fp8, 800 without, as the prefix-hashing design's hybrid
workers reported), and so does
the number of Mamba state blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.sim.cost_model import CostModel
from kvroute.sim.engine import EngineConfig

_GIB = 1024**3
_FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class Preset:
    """How to build an :class:`EngineConfig` for one model on one card."""

    name: str
    model: str
    kv_budget_bytes: int
    kv_bytes_per_token: int          # with kv_cache_dtype "auto" (bf16); fp8 halves it
    cost: CostModel
    engine: Mapping[str, Any] = field(default_factory=dict)
    hybrid_block_size: Mapping[str, int] = field(default_factory=dict)      # "auto" / "fp8"
    hybrid_mamba_blocks: Mapping[str, int] = field(default_factory=dict)    # "auto" / "fp8"

    def build(self, model: str | None = None, **overrides: Any) -> EngineConfig:
        """The engine config of this preset with ``overrides`` (EngineConfig or CostModel fields,
        plus vLLM's ``num_gpu_blocks_override``) applied."""
        overrides = dict(overrides)
        blocks_override = overrides.pop("num_gpu_blocks_override", None)
        cost_fields = {f.name for f in dataclasses.fields(CostModel)}
        cost_overrides = {k: overrides.pop(k) for k in list(overrides) if k in cost_fields}
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}")
        values: dict[str, Any] = {"model": model or self.model, **self.engine, **overrides}
        dtype = values.get("kv_cache_dtype", "auto")
        kind = "fp8" if dtype in _FP8 else "auto"
        if values.get("hybrid"):
            values.setdefault("block_size", self.hybrid_block_size[kind])
            values.setdefault("mamba_cache_blocks", self.hybrid_mamba_blocks[kind])
        values.setdefault("user_specified_block_size", "block_size" in overrides)
        block_size = values.setdefault("block_size", 16)
        per_token = self.kv_bytes_per_token // 2 if kind == "fp8" else self.kv_bytes_per_token
        if blocks_override is not None:
            values["num_gpu_blocks"] = values["num_gpu_blocks_override"] = int(blocks_override)
        elif "num_gpu_blocks" not in overrides:
            values["num_gpu_blocks"] = self.kv_budget_bytes // (per_token * block_size)
        values["cost"] = dataclasses.replace(self.cost, **cost_overrides)
        return EngineConfig(**values)


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="a4000-qwen3-4b",
            model="qwen3-4b",
            # Qwen3-4B-Instruct-2507 bf16 on one 16 GiB RTX A4000 (the session-stickiness benchmark's
            # replicas).
            # ~6 GB left for KV after weights and activations; 36 layers x 8 KV heads x 128 dims
            # x 2 (K,V) x 2 bytes = 144 KiB per token -> ~40k tokens.
            kv_budget_bytes=6 * 10**9,
            kv_bytes_per_token=147_456,
            cost=CostModel(a=0.004, b=1.3e-4, c=1.2e-8, d0=0.020, d1=2.0e-4, d_kv=2.5e-8,
                           request_overhead_s=0.0),
            engine={"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_model_len": 32768},
        ),
        Preset(
            name="dense-3b",
            model="qwen3-3b",
            # The prefix-hashing design's dense 3B model (enable_prefix_caching=True by default).
            # 36 layers x 2 KV heads x 128 dims x 2 x 2 bytes = 36 KiB per token, ~10 GiB of KV.
            kv_budget_bytes=10 * _GIB,
            kv_bytes_per_token=36_864,
            cost=CostModel(a=0.005, b=3.2e-4, c=1.5e-8, d0=0.012, d1=1.0e-4, d_kv=1.0e-8,
                           request_overhead_s=0.3),
            engine={"max_num_seqs": 128, "max_num_batched_tokens": 8192, "max_model_len": 32768},
        ),
        Preset(
            name="hybrid-27b",
            model="qwen3.8-27b",
            # The prefix-hashing design's hybrid 27B (16 attention + 48 Gated DeltaNet layers); prefix
            # caching off by default, as vLLM does for hybrid models.
            # 16 attention layers x 4 KV heads x 256 dims x 2 x 2 bytes = 64 KiB per token (bf16).
            kv_budget_bytes=8 * _GIB,
            kv_bytes_per_token=65_536,
            cost=CostModel(a=0.010, b=2.4e-4, c=8.0e-9, d0=0.025, d1=2.0e-4, d_kv=5.0e-9,
                           request_overhead_s=0.05),
            engine={"hybrid": True, "enable_prefix_caching": False, "mamba_cache_mode": "none",
                    "kv_cache_dtype": "fp8", "max_num_seqs": 128, "max_num_batched_tokens": 4096,
                    "max_model_len": 65536},
            hybrid_block_size={"auto": 800, "fp8": 1600},
            hybrid_mamba_blocks={"auto": 127, "fp8": 160},
        ),
    )
}


def build_config(preset: str, model: str | None = None, **overrides: Any) -> EngineConfig:
    """Engine config for a named preset; raises KeyError naming the presets for an unknown name."""
    try:
        recipe = PRESETS[preset]
    except KeyError:
        raise KeyError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}") from None
    return recipe.build(model, **overrides)
