"""Flow control's counters: what ``/metrics`` and the dashboard show of the gate.

Requests admitted (at once or after a wait) and shed (by reason), by model and priority class, and
the tokens served per tenant.  A tenant is a client-chosen header value, so the tenant label is
bounded: a model's first ``TENANT_LABELS`` tenants have a label of their own (the first seen keep
it, so every series stays monotone) and the rest are counted as ``"other"``.

Each count is written once, when its event is known for what it is: nothing is counted
provisionally and corrected later.  Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Priority classes (the ``x-kvroute-priority`` header): the metric label of each.
CLASSES: dict[int, str] = {1: "high", 0: "normal", -1: "low"}
# The tenant of a request that names none.
DEFAULT_TENANT = "default"
# Tenants with a label of their own in ``tenant_tokens`` per model; the rest are "other".
TENANT_LABELS = 32


def class_name(priority: int) -> str:
    """The metric label of a priority class."""
    return CLASSES.get(priority, "normal")


@dataclass(slots=True)
class FlowCounters:
    """Flow control's counts since the router started (monotone: they feed Prometheus counters)."""

    # By (model, "at_once" | "after_wait", class).
    admitted: dict[tuple[str, str, str], int] = field(default_factory=dict)
    shed: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (model, reason, class)
    # Tokens served, by (model, tenant label): the engine's prompt + output tokens, or the estimate
    # (prompt + max_tokens) when the answer reported no usage.
    tenant_tokens: dict[tuple[str, str], int] = field(default_factory=dict)
    _labelled: dict[str, set[str]] = field(default_factory=dict)  # per model: tenants with a label

    def count_admitted(self, model: str, priority: int, *, waited: bool) -> None:
        """A request of ``model`` passed the gate: at once, or after waiting in the queue."""
        label = (model, "after_wait" if waited else "at_once", class_name(priority))
        self.admitted[label] = self.admitted.get(label, 0) + 1

    def count_shed(self, model: str, reason: str, priority: int) -> None:
        """A request of ``model`` was answered with the overload error, for ``reason``."""
        label = (model, reason, class_name(priority))
        self.shed[label] = self.shed.get(label, 0) + 1

    def count_served(self, model: str, tenant: str, tokens: int) -> None:
        """``tenant``'s request of ``model`` was answered, having taken ``tokens``."""
        label = (model, self.tenant_label(model, tenant))
        self.tenant_tokens[label] = self.tenant_tokens.get(label, 0) + tokens

    def tenant_label(self, model: str, tenant: str) -> str:
        """``tenant``'s label for ``model``: its own while fewer than ``TENANT_LABELS`` tenants
        have one (it then keeps it), else ``"other"``."""
        labelled = self._labelled.setdefault(model, set())
        if tenant not in labelled and len(labelled) < TENANT_LABELS:
            labelled.add(tenant)
        return tenant if tenant in labelled else "other"
