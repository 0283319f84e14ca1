"""Recognising hybrid (attention + Mamba / linear-attention) models.

On a hybrid vLLM keeps a recurrent state per sequence next to the KV blocks, which changes every
caching rule the doctor checks: prefix caching is off unless asked for, it needs
``--mamba-cache-mode align``, and the attention block is stretched to hundreds or thousands of
tokens so that its page is at least as large as the Mamba page.
"""

from __future__ import annotations

import re

# vLLM architectures with Mamba, Gated DeltaNet or other linear-attention layers.
_HYBRID_ARCH = re.compile(
    r"Mamba|Jamba|Bamba|Zamba|NemotronH|FalconH1|GraniteMoeHybrid|Qwen3Next|Qwen3_[5-9]|"
    r"Lfm2|KimiLinear|Plamo2|MiniMaxText01|HunYuanHybrid|Hybrid",
)
# Attention-only models in vLLM use power-of-two blocks (16 on GPU, 128 on CPU); hybrids get a
# block stretched to match the Mamba page, e.g. 800 or 1600 tokens.
_MIN_STRETCHED_BLOCK = 256


def is_hybrid_architecture(architecture: str) -> bool:
    """Whether a vLLM architecture name (``Qwen3NextForCausalLM``) is a hybrid."""
    return bool(_HYBRID_ARCH.search(architecture))


def looks_like_stretched_block(block_size: int) -> bool:
    """A block size that only a hybrid's page alignment produces (large, not a power of two)."""
    return block_size >= _MIN_STRETCHED_BLOCK and block_size & (block_size - 1) != 0
