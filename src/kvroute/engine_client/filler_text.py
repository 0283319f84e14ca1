"""Deterministic filler text of a chosen length, for probe prompts and the canary's shared prefix.

About four characters per token, as English text runs with common tokenizers (and exactly as the
simulator counts); the engine's ``usage.prompt_tokens`` reports the real size.
"""

from __future__ import annotations

import random

CHARS_PER_TOKEN = 4
_WORDS = (
    "river", "stone", "garden", "window", "letter", "market", "silver", "harbor", "winter", "candle",
    "forest", "mirror", "bridge", "lantern", "meadow", "orchard", "pepper", "planet", "ribbon", "saddle",
    "tunnel", "valley", "wagon", "basket", "copper", "desert", "engine", "falcon", "ginger", "hammer",
)


def filler(tokens: int, seed: str) -> str:
    """About ``tokens`` tokens of sentences; the same ``seed`` always gives the same text."""
    rng = random.Random(seed)
    target = max(tokens, 0) * CHARS_PER_TOKEN
    parts: list[str] = []
    length = 0
    while length < target:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ". "
        parts.append(sentence)
        length += len(sentence)
    return "".join(parts)[:target].rstrip()
