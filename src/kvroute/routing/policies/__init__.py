"""The policy registry, and the routing core's settings groups.

A new policy is one module beside these (its stages, its settings block, its explainer) and one
entry in ``_BUILT_IN``; configuration validation, per-model overrides, the CLI help and the
dashboard read the registry.  Code outside the package (a benchmark emulating a peer router) adds
its own with :func:`register`.  A policy's settings blocks join the placement group
(:func:`routing_groups`); the fleet guard's group, above routing, joins in
``router_settings.settings_groups``.
"""

from __future__ import annotations

from kvroute.routing.cache_fill import CacheFillSettings
from kvroute.routing.flow import FlowSettings
from kvroute.routing.learning import LearningSettings
from kvroute.routing.policies import auto, balance, prefix, session
from kvroute.routing.saturation import SaturationSettings
from kvroute.routing.settings import PlacementSettings, SettingsGroup
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

# The routing core's settings, by what a user tunes; the learned figures are always kept (a
# model's policy can change at run time through the admin API).
PLACEMENT = SettingsGroup(
    "placement", "Placement: which replica a request goes to", (PlacementSettings,),
    first=("policy", "sticky", "overflow", "max_num_seqs"))
CACHE = SettingsGroup(
    "cache", "Cache: what the router learns of each replica's prefill speed and cache",
    (LearningSettings, CacheFillSettings), first=("prefill_s_per_token", "learn_prefill_speed"))
OVERLOAD = SettingsGroup(
    "overload", "Overload: flow control (docs/flow-control.md) and a saturated fleet (docs/saturation.md)",
    (FlowSettings, SaturationSettings),
    first=("flow_control", "flow_max_queued", "flow_queue_ttl_s", "flow_session_admission"))


def routing_groups() -> tuple[SettingsGroup, ...]:
    """The routing core's settings groups, computed when asked: each registered policy's blocks
    join placement, so a policy registered later brings its own."""
    policy_blocks = tuple(dict.fromkeys(b for p in POLICIES.values() for b in p.settings))
    return PLACEMENT.joined(policy_blocks), CACHE, OVERLOAD


def register(policy: Policy) -> None:
    """Add a policy (its settings blocks join the placement group); its name must be new."""
    if policy.name in POLICIES:
        raise ValueError(f"a policy named {policy.name!r} is already registered")
    POLICIES[policy.name] = policy


def policy_named(name: str) -> Policy:
    """The policy called ``name``; raises ValueError naming the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}") from None
