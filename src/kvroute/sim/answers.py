"""What a simulated replica says: deterministic filler text, arithmetic answers, corrupted replies.

Every reply is a pure function of the rendered prompt (and, for corruption, of a draw the caller
makes), so the same request gets the same answer on every replica and in every process.  Reply
lengths are whole tokens (4 bytes each, ASCII), so text and token counts always agree.
"""

from __future__ import annotations

import random
import re
from decimal import Decimal, InvalidOperation
from enum import Enum

import xxhash

from kvroute.sim.tokenizer import BYTES_PER_TOKEN

_WORDS = (
    "the", "cache", "block", "prefix", "token", "replica", "route", "session", "model", "engine",
    "state", "queue", "batch", "prompt", "reply", "turn", "agent", "tool", "result", "step",
    "memory", "layer", "chunk", "hash", "match", "worker", "router", "load", "time", "first",
    "again", "keeps", "reuses", "reads", "writes", "moves", "stays", "finds", "holds", "sends",
    "and", "of", "to", "in", "on", "with", "from", "where", "when", "every",
)

# "What is 37 * 12?", "Compute 5 + 6 =?", "(-3) x 4?" — the last such question in the prompt's tail.
_QUESTION = re.compile(
    rb"\(?(-?\d+(?:\.\d+)?)\)?\s*(\+|-|\*|/|x|\xc3\x97|\xc3\xb7)\s*\(?(-?\d+(?:\.\d+)?)\)?\s*=?\s*\?"
)
_TAIL_BYTES = 512


class Corruption(Enum):
    """The silent failure modes upstream vLLM has shown with experimental prefix caching: empty content,
    or a run of ``!``."""

    EMPTY = "empty"
    BANGS = "bangs"


def reply_length(prompt: bytes, min_tokens: int, max_tokens: int) -> int:
    """The natural length (in tokens) of the reply to ``prompt``: fixed per prompt, in the range."""
    if max_tokens <= min_tokens:
        return max(min_tokens, 1)
    span = max_tokens - min_tokens + 1
    return min_tokens + xxhash.xxh3_64_intdigest(prompt, seed=1) % span


def filler(prompt: bytes, n_tokens: int) -> bytes:
    """``n_tokens`` tokens of deterministic words derived from a hash of the prompt."""
    size = n_tokens * BYTES_PER_TOKEN
    rng = random.Random(xxhash.xxh3_64_intdigest(prompt))
    words: list[str] = []
    length = 0
    while length < size + 1:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    text = " ".join(words).capitalize().encode()[:size]
    return text[:-1] + b"." if size else text


def _format(value: Decimal) -> str:
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.quantize(Decimal("0.000001")).normalize(), "f")


def arithmetic_answer(prompt: bytes) -> bytes | None:
    """The exact answer to the last arithmetic question near the end of the prompt, if any."""
    matches = list(_QUESTION.finditer(prompt[-_TAIL_BYTES:]))
    if not matches:
        return None
    left, op, right = matches[-1].groups()
    try:
        a, b = Decimal(left.decode()), Decimal(right.decode())
    except InvalidOperation:
        return None
    if op == b"+":
        value = a + b
    elif op == b"-":
        value = a - b
    elif op in (b"*", b"x", "×".encode()):
        value = a * b
    elif b == 0:
        return None
    else:
        value = a / b
    return _format(value).encode()


def corrupted(kind: Corruption, n_tokens: int) -> bytes:
    """A corrupted reply of about ``n_tokens`` tokens (empty content is a lone end-of-sequence)."""
    if kind is Corruption.EMPTY:
        return b""
    return b"!" * (max(n_tokens, 1) * BYTES_PER_TOKEN)
