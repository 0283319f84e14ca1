"""Fixed-size rings of numbers, allocated up front: the router's bounded histories.

A deque of tuples or small objects costs about a hundred bytes a sample, allocated as samples
arrive, so a router's memory grows for as long as such a history fills (a soak saw it as steady
RSS growth for the first hour).  These hold 8 bytes a number in arrays of doubles and never grow.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from itertools import chain


class NumberRing:
    """The last ``size`` rows of ``columns`` numbers each, oldest first."""

    __slots__ = ("_columns", "_full", "_next", "_size")

    def __init__(self, size: int, columns: int) -> None:
        if size < 1 or columns < 1:
            raise ValueError("a ring needs at least one row and one column")
        self._size = size
        self._columns = [array("d", bytes(8 * size)) for _ in range(columns)]
        self._next = 0
        self._full = False

    def append(self, *row: float) -> None:
        """Add a row (one number per column), forgetting the oldest once ``size`` are held."""
        i = self._next
        for column, value in zip(self._columns, row, strict=True):
            column[i] = value
        i += 1
        if i == self._size:
            i = 0
            self._full = True
        self._next = i

    def __len__(self) -> int:
        return self._size if self._full else self._next

    def _order(self) -> Iterator[int]:
        n = self._next
        return chain(range(n, self._size), range(n)) if self._full else iter(range(n))

    def __iter__(self) -> Iterator[tuple[float, ...]]:
        columns = self._columns
        return (tuple(column[i] for column in columns) for i in self._order())

    def first(self) -> tuple[float, ...]:
        """The oldest row held (IndexError when empty)."""
        if not len(self):
            raise IndexError("the ring is empty")
        i = self._next if self._full else 0
        return tuple(column[i] for column in self._columns)


class PairRing(NumberRing):
    """A ``NumberRing`` of ``(time, value)`` pairs."""

    __slots__ = ()

    def __init__(self, size: int) -> None:
        super().__init__(size, 2)

    def __iter__(self) -> Iterator[tuple[float, float]]:
        times, values = self._columns
        return ((times[i], values[i]) for i in self._order())
