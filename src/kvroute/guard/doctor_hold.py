"""What the doctor's findings about a worker do to it: a warning, or a hold out of rotation (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from kvroute.routing.settings import setting
from kvroute.routing.worker import WorkerState

# The hold's reason in ``WorkerState.guard_holds``.
HOLD_REASON = "doctor"
# Findings about reading the engine rather than about its configuration: the probe already takes
# an unreachable worker out, so the check is retried instead of holding on them.
UNREAD_CODES = frozenset({"unreachable"})
# The doctor's hit rate since the engine started: at a new epoch it covers seconds of traffic, all
# of it cold on a fresh engine, so a zero then says nothing (it showed as a warning on every replica
# of `kvroute demo`).  The drift alarm judges the cache under traffic, against what was predicted.
TRAFFIC_CODES = frozenset({"hit-rate", "hit-rate-zero", "hit-rate-no-traffic"})


@dataclass(frozen=True, slots=True)
class DoctorGuardSettings:
    """The doctor's checks at each worker's registration and restart (docs/fleet-guard.md)."""

    guard_doctor: bool = setting(
        True, "run the doctor's checks against each worker when it registers or its epoch changes")
    guard_doctor_action: Literal["warn", "exclude"] = setting(
        "warn", "what an error-severity doctor finding does: warn (log, metric, dashboard) or exclude "
                "(also hold the worker out of rotation until a clean check at a new epoch)")
    guard_doctor_probe: bool = setting(
        False, "also run the doctor's active probe at each check (two requests of a few thousand "
               "tokens sent straight to the engine)")

    def __post_init__(self) -> None:
        if self.guard_doctor_action not in ("warn", "exclude"):
            raise ValueError("guard_doctor_action must be 'warn' or 'exclude'")


class FindingLike(Protocol):
    """What the rule reads of a doctor ``Finding``."""

    @property
    def severity(self) -> str: ...

    @property
    def code(self) -> str: ...


def combined(blocks: Sequence[DoctorGuardSettings]) -> DoctorGuardSettings:
    """One worker's settings from those of the models it serves: any model asking for a check,
    the probe or exclusion gets it (a worker serving a model that must not be served wrong is
    held for that model's sake)."""
    return DoctorGuardSettings(
        guard_doctor=any(b.guard_doctor for b in blocks),
        guard_doctor_action="exclude" if any(b.guard_doctor_action == "exclude" for b in blocks) else "warn",
        guard_doctor_probe=any(b.guard_doctor_probe for b in blocks),
    )


def blocking(findings: Iterable[FindingLike]) -> list[FindingLike]:
    """The findings that hold a worker out under ``exclude``: errors about its configuration."""
    return [f for f in findings if f.severity == "error" and f.code not in UNREAD_CODES]


def holds_out(findings: Iterable[FindingLike], action: str) -> bool:
    """Whether a check with these findings keeps the worker out of rotation."""
    return action == "exclude" and bool(blocking(findings))


def unread(findings: Iterable[FindingLike]) -> bool:
    """The check could not read the engine at all (retry it rather than judge it)."""
    return any(f.code in UNREAD_CODES for f in findings)


F = TypeVar("F", bound=FindingLike)


def about_configuration(findings: Iterable[F]) -> list[F]:
    """The findings a check at a new epoch keeps: what the engine's configuration and metrics say,
    not its hit rate so far (``TRAFFIC_CODES``)."""
    return [f for f in findings if f.code not in TRAFFIC_CODES]


def new_findings(before: Iterable[FindingLike], now: Iterable[F]) -> list[F]:
    """The findings of ``now`` that the previous check did not have (same code and severity), ok
    ones left out: one log line each."""
    seen = {(f.code, f.severity) for f in before}
    return [f for f in now if f.severity != "ok" and (f.code, f.severity) not in seen]


def last_to_serve(state: WorkerState, fleet: Iterable[WorkerState]) -> bool:
    """Whether holding ``state`` out would leave one of its models without a ready worker (any
    model, while its models are unknown).  A slow answer beats none: a new hold spares it."""
    others = [s for s in fleet if s.id != state.id and s.ready]
    if not state.models:
        return not others
    return any(not any(s.serves(m) for s in others) for m in state.models)
