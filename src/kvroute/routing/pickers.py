"""Pickers: turn the scorers' opinions into one candidate."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.routing.stages import Key, PickerState


def lowest(state: PickerState, keys: Sequence[Key]) -> int:
    """The lowest key; ties go round-robin, so equal workers share the load evenly."""
    n = len(keys)
    start = state.turn % n
    state.turn += 1
    best = start
    best_key = keys[start]
    for offset in range(1, n):
        i = (start + offset) % n
        if keys[i] < best_key:
            best, best_key = i, keys[i]
    return best


def round_robin(state: PickerState, keys: Sequence[Key]) -> int:
    """The next candidate in turn, ignoring the scores."""
    i = state.turn % len(keys)
    state.turn += 1
    return i


def two_choices(state: PickerState, keys: Sequence[Key]) -> int:
    """Power of two choices: two candidates at random, the lower key of the two."""
    n = len(keys)
    if n == 1:
        return 0
    a, b = state.rng.sample(range(n), 2)
    return b if keys[b] < keys[a] else a
