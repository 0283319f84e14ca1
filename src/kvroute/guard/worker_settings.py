"""Which models' settings apply to a worker: a guard check is about a worker, settings are per model."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvroute.routing.settings import Blocks, BlockT


def blocks_for(models: Iterable[str], settings_for: Callable[[str], Blocks],
               kind: type[BlockT]) -> list[BlockT]:
    """The ``kind`` settings block of every model the worker serves, in name order; the default
    model's (``settings_for("")``) while its models are not known yet."""
    names = sorted(models) or [""]
    return [settings_for(name).block(kind) for name in names]
