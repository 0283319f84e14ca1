"""Pickers: turn the scorers' opinions into one candidate."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Key = tuple[float, ...]


@dataclass(slots=True)
class PickerState:
    """What pickers remember between decisions: a turn counter and a seeded random source, so a
    simulation with the same seed makes the same choices."""

    turn: int = 0
    rng: random.Random = field(default_factory=random.Random)


Picker = Callable[[PickerState, Sequence[Key]], int]


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
