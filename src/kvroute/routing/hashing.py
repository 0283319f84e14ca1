"""Cumulative block hashes of a prompt, and which of them the index stores.

``h(i) = xxh3_64(block i, seed=h(i-1))`` with ``h(0)`` seeded by the cache scope (model and salt):
stable across processes and machines, and a worker that owns ``h(i)`` has served the whole prefix
up to block ``i``.  Appending bytes leaves every earlier hash unchanged.

The token-exact index (routing/exact_index.py) chains the same way over blocks of token ids
(``token_block_hashes``), from the engines' KV events and from a request's tokens alike.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def block_hashes(scope: bytes, data: bytes, block_bytes: int, max_bytes: int) -> tuple[int, ...]:
    """Cumulative hashes of the full blocks among the first ``max_bytes`` of ``data``.

    A trailing partial block is not hashed: the engine caches whole blocks, and the next turn of a
    conversation changes what follows the last full one.
    """
    end = min(len(data), max_bytes)
    end -= end % block_bytes
    h = _xxh3(scope)
    out: list[int] = []
    append = out.append
    for start in range(0, end, block_bytes):
        # Slicing bytes copies 512 bytes, which measured faster than a memoryview slice.
        h = _xxh3(data[start:start + block_bytes], h)
        append(h)
    return tuple(out)


# The start of every token chain: a constant, so that an engine's events and the router's
# requests meet whatever the engine's own hash seed is.
TOKEN_CHAIN_SEED = _xxh3(b"kvroute token blocks")


def token_block_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None,
                       extras: Sequence[bytes | None] | None = None) -> list[int]:
    """Own cumulative hashes of the full ``block_size``-token blocks of ``tokens``, chained from
    ``parent`` (the own hash of the block before the first; None: the prompt's start).

    ``extras[i]``, when given and not None, is block ``i``'s extra keys (LoRA, multimodal hashes,
    cache salt) as bytes: hashed in, so such a block never matches a plain prompt's block.
    """
    n = len(tokens) // block_size
    if n <= 0:
        return []
    data = array("Q", tokens[:n * block_size]).tobytes()
    width = 8 * block_size
    h = TOKEN_CHAIN_SEED if parent is None else parent
    out: list[int] = []
    append = out.append
    for i in range(n):
        block = data[i * width:(i + 1) * width]
        extra = extras[i] if extras is not None and i < len(extras) else None
        h = _xxh3(block if extra is None else block + b"\xff" + extra, h)
        append(h)
    return out


def stored_positions(n_blocks: int, window_blocks: int, anchors_per_octave: int,
                     tail_blocks: int) -> list[int]:
    """Zero-based indices of the blocks a request stores in the index, ascending.

    Every block of the window (the first 32 KB); beyond it, ``anchors_per_octave`` evenly
    spaced positions per doubling of the length (fixed positions, so a fork of a conversation still
    meets an earlier turn's anchor); and the last ``tail_blocks``, where the next turn will match.
    At most ``window + anchors_per_octave * log2(n / window) + tail`` blocks per request.
    """
    head_end = min(n_blocks, window_blocks)
    picked = list(range(head_end))
    tail_start = max(head_end, n_blocks - tail_blocks)
    # Anchors are 1-based block counts i with i % step == 0, step = 2**floor(log2 i) / anchors.
    low = head_end + 1
    octave = 1 << max(0, low.bit_length() - 1)
    while octave <= tail_start:
        step = max(1, octave // anchors_per_octave)
        first = max(octave, low)
        first += -first % step
        stop = min(2 * octave - 1, tail_start)
        picked.extend(i - 1 for i in range(first, stop + 1, step))
        octave *= 2
    picked.extend(range(tail_start, n_blocks))
    return picked
