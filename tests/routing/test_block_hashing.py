"""Cumulative block hashes and the positions a request stores (seed 1's tests, plus the window)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from routing_helpers import text

from kvroute.routing.hashing import block_hashes, stored_positions

SCOPE = b"m\x00"


def hashes(data: str | bytes, scope: bytes = SCOPE, max_bytes: int = 1 << 30) -> tuple[int, ...]:
    raw = data.encode() if isinstance(data, str) else data
    return block_hashes(scope, raw, 512, max_bytes)


def test_growing_conversation_keeps_its_hashes() -> None:
    turn1 = text(1, 5000)
    turn2 = turn1 + text(2, 700)
    turn3 = turn2 + text(3, 900)
    h1, h2, h3 = hashes(turn1), hashes(turn2), hashes(turn3)
    assert len(h1) == 9 and len(h2) == 11 and len(h3) == 12  # only full blocks
    assert h2[: len(h1)] == h1
    assert h3[: len(h2)] == h2


def test_partly_shared_prompt_matches_only_as_far_as_it_shares() -> None:
    shared = text(1, 512 * 5 + 100)  # 5 full blocks, then 100 shared bytes inside block 6
    a, b = hashes(shared + text(2, 2000)), hashes(shared + text(3, 2000))
    assert a[:5] == b[:5]
    # Block 6 differs after 100 shared bytes, and every later hash differs because it chains.
    assert all(x != y for x, y in zip(a[5:], b[5:], strict=False))


def test_one_changed_byte_changes_every_later_hash() -> None:
    base = bytearray(text(1, 512 * 8).encode())
    changed = bytearray(base)
    changed[512 * 3 + 7] ^= 1
    a, b = hashes(bytes(base)), hashes(bytes(changed))
    assert a[:3] == b[:3]
    assert all(x != y for x, y in zip(a[3:], b[3:], strict=True))


def test_scope_separates_models_and_salts() -> None:
    data = text(1, 4096)
    assert hashes(data, b"m\x00")[0] != hashes(data, b"m\x00salt")[0]
    assert hashes(data, b"m\x00") != hashes(data, b"other\x00")


def test_hashes_are_stable_across_processes() -> None:
    # Seeded xxh3_64 chains, never Python's per-process hash(): pinned, since router instances
    # exchange these values and a silent change would make them disagree.
    assert hashes(b"a" * 512) == (0x5737FD61E4949CC3,)
    assert hashes(b"a" * 1024)[:1] == hashes(b"a" * 512)


def test_max_bytes_limits_hashing() -> None:
    assert len(hashes(text(1, 100_000), max_bytes=32768)) == 64


def test_stored_positions_keep_window_and_tail() -> None:
    pos = stored_positions(215, 64, 8, 16)
    assert pos[:64] == list(range(64))
    assert pos[-16:] == list(range(199, 215))
    assert pos == sorted(set(pos))


@given(st.integers(0, 20_000), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 64))
def test_stored_positions_are_bounded_and_fixed(n: int, per_octave: int, tail: int) -> None:
    pos = stored_positions(n, 64, per_octave, tail)
    assert pos == sorted(set(pos))
    assert all(0 <= p < n for p in pos)
    assert set(range(min(n, 64))) <= set(pos)
    assert set(range(max(0, n - tail), n)) <= set(pos)
    octaves = math.log2(n / 64) + 1 if n > 64 else 0
    assert len(pos) <= 64 + per_octave * octaves + tail
    # Anchors are a function of the position alone: a longer prompt stores the same ones below.
    longer = set(stored_positions(n + 1000, 64, per_octave, tail))
    anchors = [p for p in pos if p < max(0, n - tail)]
    assert set(anchors) <= longer


@pytest.mark.parametrize("n_bytes", [8 * 1024, 128 * 1024, 1024 * 1024])
def test_stored_blocks_per_request_stay_small(n_bytes: int) -> None:
    n = n_bytes // 512
    assert len(stored_positions(n, 64, 8, 16)) <= 64 + 8 * 6 + 16
