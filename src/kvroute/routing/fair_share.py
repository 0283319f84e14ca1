"""Tenants' fair share of one model's queue: start-time fair queuing (SFQ), token-weighted.

Within a priority class, the tenant whose next request has the earliest virtual start tag goes
first.  Each grant charges its tenant the request's footprint (prompt + ``max_tokens``) over the
tenant's weight (``flow_tenant_weights``); when the request is answered the charge is settled to
the tokens the engine reports it used.  A tenant's next request starts at ``max(vtime, finish)``,
so a tenant that was idle comes back level with the others, with no credit banked; when a class
has nothing left waiting its busy period ends and what was served without contention is nobody's
debt.

Pure: no clock, no I/O.  The gate (routing/flow.py) owns one ``FairShare`` per model and asks it
which tenant's head request goes next (:meth:`FairShare.pick`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

# Tenants whose tag is remembered per model and class before idle ones are forgotten.
MAX_TENANTS = 4096

_Head = TypeVar("_Head")


@functools.lru_cache(maxsize=64)
def tenant_weights(text: str) -> dict[str, float]:
    """``flow_tenant_weights`` read: ``'a=2,b=0.5'`` -> ``{'a': 2.0, 'b': 0.5}`` (ValueError when
    malformed or a weight is not positive)."""
    out: dict[str, float] = {}
    if not isinstance(text, str):
        raise ValueError("flow_tenant_weights must be a string 'tenant=weight,...'")
    for part in filter(None, (p.strip() for p in text.split(","))):
        tenant, sep, weight = part.rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = 0.0
        if not sep or not tenant.strip() or not math.isfinite(value) or value <= 0:
            raise ValueError(f"flow_tenant_weights: {part!r} is not 'tenant=positive weight'")
        out[tenant.strip()] = value
    return out


def tenant_weight(text: str, tenant: str) -> float:
    """``tenant``'s weight by ``flow_tenant_weights`` ``text``: 1 for a tenant it does not name."""
    return tenant_weights(text).get(tenant, 1.0)


@dataclass(slots=True)
class ClassShare:
    """SFQ between the tenants of one priority class: ``finish`` is each tenant's virtual finish
    tag (its weighted service so far), ``vtime`` the start tag of the last request granted."""

    vtime: float = 0.0
    finish: dict[str, float] = field(default_factory=dict)
    sweep_at: int = 64  # forget idle tenants once this many are remembered

    def start(self, tenant: str) -> float:
        """The virtual start tag of ``tenant``'s next request."""
        return max(self.vtime, self.finish.get(tenant, 0.0))


@dataclass(slots=True)
class FairShare:
    """The tenants' shares of one model's queue, one :class:`ClassShare` per priority class."""

    classes: dict[int, ClassShare] = field(default_factory=dict)

    def start(self, priority: int, tenant: str) -> float:
        """The virtual start tag of ``tenant``'s next request of class ``priority``."""
        share = self.classes.get(priority)
        return 0.0 if share is None else share.start(tenant)

    def pick(self, priority: int, heads: Iterable[tuple[str, tuple[float, ...], _Head]]) -> _Head:
        """Of each tenant's head request of class ``priority`` — ``(tenant, its sort key in the
        queue's order, the request)``, at least one — the one whose tenant starts earliest (ties:
        the smaller sort key)."""
        return min(heads, key=lambda h: (self.start(priority, h[0]), h[1]))[2]

    def charge(self, priority: int, tenant: str, tokens: int, weight: float, *, busy: bool,
               waiting: Callable[[], Collection[str]]) -> None:
        """A request of ``tenant`` taking ``tokens`` was granted: its finish tag advances by
        ``tokens / weight``.  ``busy``: requests of the class still wait (else its busy period
        ends); ``waiting`` names the tenants with requests queued, asked only when idle tenants
        are swept."""
        share = self.classes.get(priority)
        if share is None:
            share = self.classes[priority] = ClassShare()
        start = share.start(tenant)
        share.finish[tenant] = start + tokens / weight
        share.vtime = start
        if not busy:
            share.vtime = max(share.vtime, share.finish[tenant])
        if len(share.finish) > share.sweep_at:
            _forget_idle(share, set(waiting()))

    def settle(self, priority: int, tenant: str, correction: int, weight: float) -> None:
        """A granted request of ``tenant`` was answered having used ``correction`` tokens more (or
        less) than it was charged: its finish tag moves by that over ``weight``, so a tenant whose
        clients ask for a large ``max_tokens`` and get short answers is not held back for tokens
        it never used.  Below the virtual time a correction changes nothing (``start`` takes the
        larger), and a forgotten tenant has nothing to settle."""
        share = self.classes.get(priority)
        if share is not None and tenant in share.finish:
            share.finish[tenant] += correction / weight


def _forget_idle(share: ClassShare, waiting: Collection[str]) -> None:
    """Bound the tenants remembered: a tenant with nothing queued whose finish tag the virtual time
    has passed would start at ``vtime`` anyway, so forgetting it changes nothing; past
    ``MAX_TENANTS`` idle tenants still ahead of it are forgotten too (their debt is dropped)."""
    for tenant, tag in list(share.finish.items()):
        if tenant not in waiting and tag <= share.vtime:
            del share.finish[tenant]
    if len(share.finish) > MAX_TENANTS:
        for tenant in list(share.finish):
            if tenant not in waiting:
                del share.finish[tenant]
    share.sweep_at = max(64, 2 * len(share.finish))
