"""The fleet guard's per-model settings blocks, registered into every model's policy on import.

The routing core cannot import them (it sits below the guard), so whatever reads or lists routing
settings imports this module first: ``router_settings`` (configuration, ``--set``) and
``server/cli`` (``kvroute serve --help``).  A new guard part adds its block here.
"""

from __future__ import annotations

from kvroute.fleet.guard.canary_watch import CanarySettings
from kvroute.fleet.guard.doctor_hold import DoctorGuardSettings
from kvroute.fleet.guard.drift import DriftSettings
from kvroute.routing.policies import register_blocks

GUARD_BLOCKS: tuple[type, ...] = (DoctorGuardSettings, DriftSettings, CanarySettings)

register_blocks(*GUARD_BLOCKS)
