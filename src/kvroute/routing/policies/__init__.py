"""The policy registry: every policy a router can be configured with, by name.

A new policy is one module beside these (its stages, its settings block, its explainer) and one
entry in ``_BUILT_IN``; configuration validation, per-model overrides, the CLI help and the
dashboard read the registry.  Code outside the package (a benchmark emulating a peer router) adds
its own with :func:`register`.
"""

from __future__ import annotations

from kvroute.routing.flow import FlowSettings
from kvroute.routing.learning import LearningSettings
from kvroute.routing.policies import auto, balance, prefix, session
from kvroute.routing.saturation import SaturationSettings
from kvroute.routing.settings import PlacementSettings
from kvroute.routing.stages import Policy

_BUILT_IN: tuple[Policy, ...] = (
    balance.ROUND_ROBIN,
    balance.P2C,
    balance.LEAST_LOADED,
    prefix.POLICY,
    session.POLICY,
    auto.POLICY,
)

POLICIES: dict[str, Policy] = {p.name: p for p in _BUILT_IN}
BUILT_IN_NAMES: tuple[str, ...] = tuple(POLICIES)

# Settings blocks every model carries, in the order help and docs list them.  The learned figures
# are always kept (a model's policy can change at run time through the admin API).
BLOCKS: list[type] = [PlacementSettings, LearningSettings, FlowSettings, SaturationSettings]
for _p in _BUILT_IN:
    BLOCKS.extend(b for b in _p.settings if b not in BLOCKS)


def register(policy: Policy) -> None:
    """Add a policy (and its settings blocks); its name must be new."""
    if policy.name in POLICIES:
        raise ValueError(f"a policy named {policy.name!r} is already registered")
    POLICIES[policy.name] = policy
    BLOCKS.extend(b for b in policy.settings if b not in BLOCKS)


def register_blocks(*kinds: type) -> None:
    """Add settings blocks read outside the routing core (the fleet guard's): every model then
    carries them, in ``[routing]``, ``[models.NAME]`` and ``--set`` like any other."""
    BLOCKS.extend(k for k in kinds if k not in BLOCKS)


def policy_named(name: str) -> Policy:
    """The policy called ``name``; raises ValueError naming the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}") from None
