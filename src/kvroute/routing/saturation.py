"""When the fleet is full: a per-model signal, with hysteresis, that the router reads from its own
figures, and the settings of what routing does then.

"Preference, never a queue" assumes a free replica exists.  While one does, each request is sent
where it starts soonest (``auto``'s predicted time to first token).  When none does, moving a
request to a shorter queue costs a cold prefill there, which evicts another prefix, whose next
request goes cold too: the fleet ends up computing several times the prefill it needs
(docs/saturation.md).  So the router tells the two regimes apart, per model, and routes for the
fleet's throughput in the second: placement keeps each prefix on its holders (``auto``'s fleet
cost, routing/policies/auto.py), and flow control's gate and session admission engage
(``flow_control = "auto"``, routing/flow.py).

**The reading.**  At an instant, a replica is *full* when a request could not start there without
queueing or preempting: no free sequence slot by any count the router has, the KV tokens
what the routers sent it adds past ``flow_kv_fill`` of its cache, its scraped KV usage at
``fleet_full_kv_usage``, or requests waiting in the engine's own queue.  The fleet is full when at
least ``fleet_full_share`` of its ready replicas are, or when requests wait in the router's own
queue for room (then the gate is what keeps the engines' queues empty) — not those that wait only
for the replica holding their prefix (late binding), which would hold the fleet saturated by
themselves.

**Thrashing.**  A full fleet whose caches still deliver what the index predicts (the engines'
reported hits over the predicted, ``realisation``) only needs its placement kept; one whose caches
deliver far less (below ``fleet_thrash_realisation``), or whose served sessions' working set is
well past its KV cache (``fleet_thrash_working_set``; the engines' reports lag by whole turns,
the working set does not), holds more conversations than its KV cache: then session admission's
"auto" engages too, and stays until the fleet is released (the cache it restores would otherwise
switch it off again).

**Hysteresis.**  The instant reading flickers: a slot frees for a moment whenever an answer ends.
The *level* is the share of recent time the fleet read full, averaged exponentially with time
constant ``fleet_full_window_s``; the fleet is *saturated* from the moment the level reaches
``fleet_full_engage`` until it falls to ``fleet_full_release``.  A fleet that turns full at once is
engaged after ``ln(1 / (1 - engage)) x window`` (14 s with the defaults) and released after
``ln(1 / release) x window`` once it has room again (14 s).

Pure: the dispatcher (routing/dispatch.py) passes its clock's readings and the workers; nothing
here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from kvroute.routing.filters import seq_slots
from kvroute.routing.settings import PlacementSettings, check_non_negative, check_positive, setting
from kvroute.routing.view import Candidate
from kvroute.routing.worker import WorkerState

PLACEMENTS = ("fleet", "request")


@dataclass(frozen=True, slots=True)
class SaturationSettings:
    """When the fleet counts as full, and what placement does then (docs/saturation.md)."""

    fleet_full_window_s: float = setting(
        7.0, "time constant (seconds) of the fleet-full level: the share of recent time the fleet "
             "had no replica that could start a request without queueing or preempting")
    fleet_full_engage: float = setting(
        0.86, "the fleet counts as saturated once the fleet-full level reaches this share")
    fleet_full_release: float = setting(
        0.14, "a saturated fleet is released once the fleet-full level falls to this share")
    fleet_full_share: float = setting(
        1.0, "share of the ready replicas that must be full at once for the fleet to read full")
    fleet_full_kv_usage: float = setting(
        0.97, "a replica whose scraped KV-cache usage is at least this share reads full")
    fleet_thrash_realisation: float = setting(
        0.75, "a saturated fleet whose caches deliver less than this share of the prefix hits the "
              "index predicted (the mean over its replicas) is thrashing: session admission's "
              "'auto' engages, until the fleet is released (0: never)")
    fleet_thrash_working_set: float = setting(
        1.5, "a saturated fleet is thrashing too once the working set of the sessions it serves "
             "(flow_session_rule) passes this multiple of its KV cache")
    fleet_full_placement: str = setting(
        "fleet", "what 'auto' optimises while the fleet is saturated: 'fleet' (the prefill the "
                 "fleet computes: each prefix stays on its holders within fleet_load_bound) or "
                 "'request' (each request's predicted time to first token, as with room)")
    fleet_load_bound: float = setting(
        1.25, "while saturated, a replica takes a request only while it carries at most this "
              "multiple of the fleet's mean load (consistent hashing with bounded loads): a hot "
              "prefix gets a second replica only when its holder is that far above the mean")
    fleet_late_bind: float = setting(
        2.0, "while saturated, a queued request whose prefix a busy replica holds waits for that "
             "replica up to this multiple of its prompt's cold prefill time before it may go "
             "elsewhere (0: never waits for its holder)")

    def __post_init__(self) -> None:
        check_positive(self, "fleet_full_window_s", what="number of seconds")
        check_positive(self, "fleet_thrash_working_set", what="multiple")
        check_non_negative(self, "fleet_thrash_realisation", "fleet_late_bind")
        for name in ("fleet_full_engage", "fleet_full_release", "fleet_full_share",
                     "fleet_full_kv_usage"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise ValueError(f"{name} must be a share in (0, 1]")
        if self.fleet_full_release >= self.fleet_full_engage:
            raise ValueError("fleet_full_release must be below fleet_full_engage")
        if self.fleet_thrash_realisation > 1:
            raise ValueError("fleet_thrash_realisation must be a share in [0, 1]")
        if self.fleet_full_placement not in PLACEMENTS:
            raise ValueError(f"fleet_full_placement must be one of {', '.join(PLACEMENTS)}")
        if isinstance(self.fleet_load_bound, bool) or not isinstance(self.fleet_load_bound, int | float) \
                or not 1 <= self.fleet_load_bound < math.inf:
            raise ValueError("fleet_load_bound must be a finite number >= 1")


class FullReason(StrEnum):
    """Why a replica (or the fleet) reads full; the order is the one reported first."""

    QUEUE = "queue"  # requests wait in the router's own queue
    SLOTS = "slots"  # no free sequence slot
    KV = "kv"  # the KV tokens the routers' requests add there, or its scraped KV usage, at the ceiling
    WAITING = "waiting"  # the engine reports requests in its own queue


def replica_full(w: WorkerState, placement: PlacementSettings, s: SaturationSettings,
                 kv_fill: float) -> FullReason | None:
    """Why ``w`` could not start another request without queueing or preempting (None: it could)."""
    if Candidate.of(w).busy >= seq_slots(w, placement):
        return FullReason.SLOTS
    cap = w.kv_tokens
    if cap is not None and w.inflight_tokens > kv_fill * cap:
        return FullReason.KV
    if w.kv_usage is not None and w.kv_usage >= s.fleet_full_kv_usage:
        return FullReason.KV
    # Waiting beyond the routers' own requests the engine has not started yet is what piles up
    # when every slot or KV block is taken; one waiting request at a scrape is already a queue.
    if w.waiting:
        return FullReason.WAITING
    return None


@dataclass(frozen=True, slots=True)
class FleetReading:
    """One instant's reading of a model's fleet."""

    full: bool
    replicas: int  # ready replicas serving the model
    full_replicas: int
    reasons: tuple[FullReason, ...]  # distinct, in FullReason's order
    realisation: float = 1.0  # mean over the ready replicas: engine-reported / predicted hits
    working_set: float | None = None  # the served sessions' working set / the fleet's KV cache


def read_fleet(model: str, workers: Sequence[WorkerState], placement: PlacementSettings,
               s: SaturationSettings, kv_fill: float, queued: int,
               realisation: Callable[[str], float], working_set: int = 0) -> FleetReading:
    """Whether ``model``'s fleet is full now: at least ``fleet_full_share`` of its ready replicas
    are (``replica_full``), or ``queued`` requests wait at the router's gate for room.  A model no
    ready replica serves reads not full: there is nothing to place.  ``realisation`` gives each
    replica's learned cache realisation, ``working_set`` the served sessions' KV tokens (both for
    ``thrashing``)."""
    ready = full = 0
    kv: int | None = 0
    realised = 0.0
    seen: set[FullReason] = set()
    for w in workers:
        if not w.ready or not w.serves(model):
            continue
        ready += 1
        realised += realisation(w.id)
        kv = None if kv is None or w.kv_tokens is None else kv + w.kv_tokens
        why = replica_full(w, placement, s, kv_fill)
        if why is not None:
            full += 1
            seen.add(why)
    if queued:
        seen.add(FullReason.QUEUE)
    is_full = ready > 0 and (queued > 0 or full >= s.fleet_full_share * ready)
    reasons = tuple(r for r in FullReason if r in seen) if is_full else ()
    return FleetReading(is_full, ready, full, reasons, realised / ready if ready else 1.0,
                        working_set / kv if kv else None)


@dataclass(slots=True)
class Saturation:
    """One model's saturation state: the fleet-full level and whether it is engaged.

    ``observe(now, reading, settings)`` integrates the reading held since the previous call (the
    indicator is piecewise constant between readings) and applies the hysteresis.
    """

    level: float = 0.0
    engaged: bool = False
    thrashing: bool = False
    changed_at: float | None = None  # when ``engaged`` last changed
    last: FleetReading | None = None
    at: float | None = None  # when ``last`` was read
    engagements: int = 0

    def observe(self, now: float, reading: FleetReading, s: SaturationSettings) -> bool:
        """Take ``reading`` (made at ``now``); True when this changed ``engaged`` or ``thrashing``."""
        if self.at is not None and self.last is not None and now > self.at:
            weight = 1.0 - math.exp(-(now - self.at) / s.fleet_full_window_s)
            target = 1.0 if self.last.full else 0.0
            self.level += weight * (target - self.level)
        self.last, self.at = reading, now
        flip = (not self.engaged and self.level >= s.fleet_full_engage) or \
            (self.engaged and self.level <= s.fleet_full_release)
        if flip:
            self.engaged = not self.engaged
            self.changed_at = now
            self.engagements += self.engaged
        over = reading.working_set is not None and reading.working_set > s.fleet_thrash_working_set
        thrashing = self.engaged and (self.thrashing or over or
                                      reading.realisation < s.fleet_thrash_realisation)
        flip |= thrashing != self.thrashing
        self.thrashing = thrashing
        return flip

    def to_json(self) -> dict[str, object]:
        """Plain data for the admin API: the state, the level, why the fleet read full last, and
        the last reading's figures."""
        last = self.last
        return {"saturated": self.engaged, "thrashing": self.thrashing, "level": round(self.level, 3),
                "since": self.changed_at, "engagements": self.engagements,
                "reasons": [r.value for r in self.reasons()],
                "full_replicas": None if last is None else last.full_replicas,
                "replicas": None if last is None else last.replicas,
                "realisation": None if last is None else round(last.realisation, 3),
                "working_set": None if last is None or last.working_set is None
                else round(last.working_set, 3)}

    def reasons(self) -> tuple[FullReason, ...]:
        """Why the fleet read full at the last reading (empty when it did not)."""
        return self.last.reasons if self.last is not None else ()


def check_switch(block: object, *names: str) -> None:
    """Raise ValueError unless each named field is true, false or "auto"."""
    for name in names:
        value = getattr(block, name)
        if not (value is True or value is False or value == "auto"):
            raise ValueError(f"{name} must be true, false or \"auto\"")


def switch_on(value: bool | Literal["auto"], saturated: bool) -> bool:
    """A true/false/"auto" switch read: "auto" follows the fleet's saturation."""
    return saturated if value == "auto" else bool(value)
