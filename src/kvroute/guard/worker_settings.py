"""Which models' settings apply to a worker: a guard check is about a worker, settings are per model."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvroute.routing.settings import B, Blocks


def blocks_for(models: Iterable[str], policy_for: Callable[[str], Blocks], kind: type[B]) -> list[B]:
    """The ``kind`` settings block of every model the worker serves, in name order; the default
    policy's (``policy_for("")``) while its models are not known yet."""
    names = sorted(models) or [""]
    return [policy_for(name).block(kind) for name in names]
