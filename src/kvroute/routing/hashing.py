"""Cumulative block hashes of a prompt, and which of them the index stores.

``h(i) = xxh3_64(block i, seed=h(i-1))`` with ``h(0)`` seeded by the cache scope (model and salt):
stable across processes and machines, and a worker that owns ``h(i)`` has served the whole prefix
up to block ``i``.  Appending bytes leaves every earlier hash unchanged.
"""

from __future__ import annotations

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def scope_seed(scope: bytes) -> int:
    """The chain's starting value for one cache scope."""
    return _xxh3(scope)


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
