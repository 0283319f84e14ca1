"""The fleet guard's per-model settings, as one settings group.

The routing core cannot import them (it sits below the guard): ``router_settings.settings_groups``
adds this group to the routing core's, and every model a router configures carries it.  A new
guard part adds its block here.
"""

from __future__ import annotations

from kvroute.guard.canary_watch import CanarySettings
from kvroute.guard.doctor_hold import DoctorGuardSettings
from kvroute.guard.drift import DriftSettings
from kvroute.routing.settings import SettingsGroup

GUARD = SettingsGroup(
    "guard", "Guard: checks that hold a faulty replica out (docs/fleet-guard.md)",
    (DoctorGuardSettings, DriftSettings, CanarySettings),
    first=("guard_doctor_action", "canary", "guard_drift"))
