"""Saturation (routing/saturation.py): the instant reading, its hysteresis, thrashing; placement for
a full fleet against a brute-force reference; late binding and its bound.  Pure: injected clocks."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from routing_helpers import Clock, fleet, key, send, text

from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.flow import TicketState
from kvroute.routing.learning import LearningSettings
from kvroute.routing.policies.auto import AutoSettings
from kvroute.routing.saturation import (
    FleetReading,
    FullReason,
    Saturation,
    SaturationSettings,
    read_fleet,
    replica_full,
)
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.settings import PlacementSettings
from kvroute.routing.worker import WorkerState

S = SaturationSettings()
P = PlacementSettings()


def worker(**figures: Any) -> WorkerState:
    return WorkerState("w", "http://w", frozenset({"m"}), max_num_seqs=4, **figures)


@pytest.mark.parametrize("figures, expected", [
    ({}, None),
    ({"inflight": 3}, None),
    ({"inflight": 4}, FullReason.SLOTS),
    ({"inflight": 2, "running": 4, "waiting": 0, "scraped_inflight": 2}, FullReason.SLOTS),  # foreign load
    ({"inflight": 1, "kv_tokens": 1000, "inflight_tokens": 1300}, FullReason.KV),  # past flow_kv_fill 1.25
    ({"inflight": 1, "kv_tokens": 1000, "inflight_tokens": 1200}, None),
    ({"kv_usage": 0.97}, FullReason.KV),
    ({"kv_usage": 0.9}, None),
    ({"inflight": 1, "running": 1, "waiting": 1, "scraped_inflight": 1}, FullReason.WAITING),
])
def test_replica_full(figures: dict[str, Any], expected: FullReason | None) -> None:
    assert replica_full(worker(**figures), P, S, 1.25) is expected


def _fleet_of(*busy: int, ready: bool = True) -> list[WorkerState]:
    return [WorkerState(f"w{i}", f"http://w{i}", frozenset({"m"}), max_num_seqs=2, inflight=b, healthy=ready)
            for i, b in enumerate(busy)]


@pytest.mark.parametrize("busy, share, queued, full, reasons", [
    ((2, 2), 1.0, 0, True, (FullReason.SLOTS,)),
    ((2, 1), 1.0, 0, False, ()),
    ((2, 1), 0.5, 0, True, (FullReason.SLOTS,)),
    ((1, 1), 1.0, 3, True, (FullReason.QUEUE,)),  # requests wait at the gate for room
    ((2, 2), 1.0, 1, True, (FullReason.QUEUE, FullReason.SLOTS)),
])
def test_read_fleet(busy: tuple[int, ...], share: float, queued: int, full: bool,
                    reasons: tuple[FullReason, ...]) -> None:
    s = SaturationSettings(fleet_full_share=share)
    reading = read_fleet("m", _fleet_of(*busy), P, s, 1.25, queued, lambda w: 1.0)
    assert (reading.full, reading.reasons) == (full, reasons)
    assert reading.replicas == len(busy)


def test_read_fleet_counts_only_ready_replicas_of_the_model() -> None:
    ws = _fleet_of(2, 0)
    ws[1].healthy = False  # the only replica with room is down: the fleet that serves is full
    assert read_fleet("m", ws, P, S, 1.25, 0, lambda w: 1.0).full
    assert not read_fleet("other", ws, P, S, 1.25, 0, lambda w: 1.0).full  # served by none
    assert not read_fleet("m", _fleet_of(2, 2, ready=False), P, S, 1.25, 5, lambda w: 1.0).full


def test_read_fleet_working_set_and_realisation() -> None:
    ws = _fleet_of(0, 0)
    for w in ws:
        w.kv_tokens = 1000
    reading = read_fleet("m", ws, P, S, 1.25, 0, lambda w: 0.5 if w == "w0" else 1.0, working_set=3000)
    assert reading.realisation == 0.75 and reading.working_set == 1.5
    ws[0].kv_tokens = None  # unknown KV: no working-set share
    assert read_fleet("m", ws, P, S, 1.25, 0, lambda w: 1.0, working_set=3000).working_set is None


FULL = FleetReading(True, 4, 4, (FullReason.SLOTS,))
ROOM = FleetReading(False, 4, 0, ())


def _run(sat: Saturation, s: SaturationSettings, t0: float, t1: float, reading: FleetReading,
         dt: float = 0.25) -> float | None:
    """Feed ``reading`` every ``dt`` from ``t0`` to ``t1``; the time ``engaged`` first flipped."""
    t = t0
    flipped = None
    while t <= t1 + 1e-9:
        if sat.observe(t, reading, s) and flipped is None:
            flipped = t
        t += dt
    return flipped


def test_hysteresis_engages_and_releases_in_the_stated_times() -> None:
    sat = Saturation()
    engaged_at = _run(sat, S, 0.0, 60.0, FULL)
    expected = S.fleet_full_window_s * math.log(1 / (1 - S.fleet_full_engage))
    assert engaged_at is not None and abs(engaged_at - expected) <= 0.5
    assert sat.engaged and sat.engagements == 1 and sat.reasons() == (FullReason.SLOTS,)
    released_at = _run(sat, S, 60.25, 120.0, ROOM)
    # The level was ~1 after 60 s full: release takes ln(1/release) time constants.
    assert released_at is not None
    assert abs(released_at - 60.0 - S.fleet_full_window_s * math.log(1 / S.fleet_full_release)) <= 0.5
    assert not sat.engaged and sat.reasons() == ()
    shown = sat.to_json()  # what /admin/workers shows
    assert (shown["saturated"], shown["engagements"], shown["reasons"]) == (False, 1, [])
    assert shown["replicas"] == 4
    assert shown["since"] == released_at and float(str(shown["level"])) <= S.fleet_full_release
    assert engaged_at <= 30 and released_at - 60.0 <= 30  # the step-change goal


def test_a_flickering_fleet_does_not_engage() -> None:
    """Full half of the time (a slot frees whenever an answer ends): the level stays near 0.5."""
    sat = Saturation()
    t = 0.0
    for _ in range(400):
        sat.observe(t, FULL, S)
        sat.observe(t + 0.5, ROOM, S)
        t += 1.0
    assert not sat.engaged and 0.3 < sat.level < 0.7


def test_once_engaged_a_half_full_fleet_stays_engaged() -> None:
    sat = Saturation()
    _run(sat, S, 0.0, 30.0, FULL)
    t = 30.25
    for _ in range(200):
        sat.observe(t, ROOM, S)
        sat.observe(t + 0.5, FULL, S)
        t += 1.0
    assert sat.engaged and sat.engagements == 1


def test_thrashing_engages_while_saturated_and_ends_with_the_release() -> None:
    sat = Saturation()
    thrash = FleetReading(True, 4, 4, (FullReason.KV,), realisation=0.5)
    sat.observe(0.0, thrash, S)
    assert not sat.thrashing  # not saturated yet
    _run(sat, S, 0.25, 30.0, FULL)
    assert sat.engaged and not sat.thrashing
    assert sat.observe(30.25, thrash, S) and sat.thrashing
    _run(sat, S, 30.5, 40.0, FULL)  # the cache recovers: still thrashing until the release
    assert sat.thrashing
    big = FleetReading(True, 4, 4, (FullReason.KV,), working_set=2.0)
    fresh = Saturation()
    _run(fresh, S, 0.0, 30.0, FULL)
    fresh.observe(30.25, big, S)
    assert fresh.thrashing
    _run(sat, S, 40.25, 100.0, ROOM)
    assert not sat.engaged and not sat.thrashing


@pytest.mark.parametrize("bad", [
    {"fleet_full_engage": 0.2, "fleet_full_release": 0.3},
    {"fleet_full_share": 0.0}, {"fleet_full_kv_usage": 1.5}, {"fleet_load_bound": 0.9},
    {"fleet_full_placement": "nearest"}, {"fleet_full_window_s": 0}, {"fleet_late_bind": -1},
    {"fleet_thrash_realisation": 2.0},
])
def test_settings_are_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ModelSettings(**bad)


@pytest.mark.parametrize("value, ok", [
    ("auto", True), (True, True), (False, True), ("on", False), (1, False)])
def test_flow_switches_take_true_false_or_auto(value: Any, ok: bool) -> None:
    if ok:
        policy = ModelSettings(flow_control=value, flow_session_admission=value)
        assert policy.flow_control == value
    else:
        with pytest.raises(ValueError):
            ModelSettings(flow_control=value)


# --- placement for a full fleet ------------------------------------------------------------------

def _reference(s: Scheduler, k: Any, workers: list[WorkerState]) -> set[str]:
    """The workers bounded-load placement may pick, computed from the definition: the accepted
    workers (with a free slot if any has one), those that would carry at most fleet_load_bound x
    the mean load with this request, then the least fleet cost (prefill it adds + decode
    interference), then the deepest match, then the fewest in flight."""
    policy = s.settings_for("m")
    auto, sat = policy.block(AutoSettings), policy.block(SaturationSettings)
    spt = policy.block(LearningSettings).prefill_s_per_token
    ok = [w for w in workers if w.ready]
    free = [w for w in ok if w.inflight < (w.max_num_seqs or 256)]
    cands = free or ok
    limit = math.ceil(sat.fleet_load_bound * (sum(w.inflight for w in cands) + 1) / len(cands))
    cands = [w for w in cands if w.inflight + 1 <= limit]
    hashes = s.hashes(k)
    slots = s._index.slots_of([(w.id, w.epoch) for w in cands])
    depth = {cands[slots[slot]].id: d for slot, d in s._index.match(hashes, slots, s._clock()).items()}
    block_tokens = s.config.block_bytes / 4

    def cost(w: WorkerState) -> tuple[float, float, int]:
        held = min(float(k.est_prompt_tokens), depth.get(w.id, 0) * block_tokens)
        uncached = k.est_prompt_tokens - held
        c = spt * (auto.inflight_tokens * w.inflight + (1 + auto.prefill_penalty) * uncached)
        return (c, -depth.get(w.id, 0), w.inflight)

    best = min(cost(w) for w in cands)
    return {w.id for w in cands if cost(w) == best}


@pytest.mark.parametrize("seed", range(30))
def test_bounded_load_placement_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock()
    policy = ModelSettings(fleet_load_bound=rng.choice([1.0, 1.25, 2.0]))
    s = Scheduler(RoutingConfig(default=policy), clock=clock)
    workers = fleet(rng.randint(2, 12), max_num_seqs=8)
    groups = [text(seed * 100 + g, 8192) for g in range(rng.randint(1, 6))]
    for _ in range(rng.randint(0, 30)):  # prefixes spread over the fleet
        send(s, key(rng.choice(groups) + text(rng.randrange(10**6), 512)), workers)
    for w in workers:
        w.inflight = rng.randint(0, 8)
        w.healthy = rng.random() > 0.1
    if not any(w.ready for w in workers):
        workers[0].healthy = True
    k = key(rng.choice(groups) + text(rng.randrange(10**6), 600))
    d = s.decide(k, workers, fleet_full=True)
    assert d.worker_id in _reference(s, k, workers), d.reason
    assert "fleet saturated" in d.reason


def test_a_hot_prefix_gets_a_second_replica_only_past_the_bound() -> None:
    clock = Clock()
    s = Scheduler(RoutingConfig(default=ModelSettings(fleet_load_bound=1.5)), clock=clock)
    workers = fleet(4, max_num_seqs=32)
    head = text(7, 16384)
    holder = send(s, key(head + "a"), workers)
    for w in workers:
        w.inflight = 4
    h = next(w for w in workers if w.id == holder)
    h.inflight = 6  # within 1.5 x the mean (ceil(1.5 * 19 / 4) = 8, 6 + 1 <= 8): it keeps the prefix
    assert s.decide(key(head + "b"), workers, fleet_full=True).worker_id == holder
    h.inflight = 8  # past the bound (ceil(1.5 * 21 / 4) = 8): a second replica takes it
    assert s.decide(key(head + "c"), workers, fleet_full=True).worker_id != holder


# --- late binding ----------------------------------------------------------------------------------

def _saturated_dispatcher(clock: Clock, **policy: Any) -> Dispatcher:
    # A time constant of a day keeps the test's fleet saturated whatever it reads meanwhile.
    settings = {"flow_control": True, "fleet_full_window_s": 86400.0, **policy}
    d = Dispatcher(Scheduler(RoutingConfig(default=ModelSettings(**settings)), clock=clock), timer=clock)
    d.saturation["m"] = Saturation(level=1.0, engaged=True)
    return d


def test_late_binding_waits_for_the_holder_then_goes_to_it() -> None:
    clock = Clock()
    d = _saturated_dispatcher(clock)
    workers = fleet(2, max_num_seqs=1)
    head = text(3, 16384)
    first = key(head + "one")
    decision = d.route(first, workers)
    holder = next(w for w in workers if w.id == decision.worker_id)
    flight, _ = d.sent(first, decision, holder)
    granted: list[str] = []
    ticket = d.admit(key(head + "two"), workers, lambda t: granted.append(t.state.value))
    assert ticket.queued and ticket.holder == holder.id  # the other replica is free, but cold
    assert "late binding" in ticket.why
    clock.advance(0.1)
    d.scraped(holder, 1, 0, 0.5)
    assert ticket.queued
    d.finished(flight, ok=True)
    assert ticket.state is TicketState.GRANTED and granted == ["granted"]
    d.claim(ticket)
    assert d.route(ticket.key, workers).worker_id == holder.id


def test_late_binding_is_bounded_by_a_multiple_of_the_cold_prefill() -> None:
    clock = Clock()
    d = _saturated_dispatcher(clock, fleet_late_bind=2.0)
    workers = fleet(2, max_num_seqs=1)
    head = text(4, 16384)
    first = key(head + "one")
    decision = d.route(first, workers)
    holder = next(w for w in workers if w.id == decision.worker_id)
    d.sent(first, decision, holder)
    ticket = d.admit(key(head + "two"), workers)
    bound = 2.0 * ticket.key.est_prompt_tokens * d.scheduler.prefill_s_per_token(holder.id)
    assert ticket.queued and ticket.bind_until == pytest.approx(ticket.arrived + bound)
    clock.advance(bound * 0.9)
    d.scraped(holder, 1, 0, 0.5)
    assert ticket.queued
    clock.advance(bound * 0.2)
    d.scraped(holder, 1, 0, 0.5)  # any wake-up past the bound lets it go to the free replica
    assert ticket.state is TicketState.GRANTED
    d.claim(ticket)
    assert d.route(ticket.key, workers).worker_id != holder.id


def test_without_saturation_nothing_waits_for_its_holder() -> None:
    clock = Clock()
    config = RoutingConfig(default=ModelSettings(flow_control=True))
    d = Dispatcher(Scheduler(config, clock=clock), timer=clock)
    workers = fleet(2, max_num_seqs=1)
    head = text(5, 16384)
    first = key(head + "one")
    decision = d.route(first, workers)
    d.sent(first, decision, next(w for w in workers if w.id == decision.worker_id))
    ticket = d.admit(key(head + "two"), workers)
    assert ticket.state is TicketState.GRANTED and ticket.holder is None


def test_the_default_gate_engages_with_saturation_and_opens_with_its_release() -> None:
    """flow_control = "auto": no gate while the fleet has room; once the fleet reads full long
    enough, requests wait at the gate; once it has room again, they all go."""
    clock = Clock()
    d = Dispatcher(Scheduler(RoutingConfig(default=ModelSettings(policy="least-loaded")), clock=clock),
                   timer=clock)
    workers = fleet(1, max_num_seqs=1)
    flight, _ = d.sent(key("a" * 400), d.route(key("a" * 400), workers), workers[0])
    assert d.admit(key("b" * 400), workers).state is TicketState.GRANTED  # not saturated: no gate
    for _ in range(80):  # 20 s full
        clock.advance(0.25)
        d.scraped(workers[0], 1, 0, 0.5)
    assert d.saturated("m")
    waiting = d.admit(key("c" * 400), workers)
    assert waiting.queued
    d.finished(flight, ok=True)
    assert waiting.state is TicketState.GRANTED  # a slot freed: the gate lets it in
    d.claim(waiting)
    for _ in range(120):  # 30 s with room
        clock.advance(0.25)
        d.scraped(workers[0], 0, 0, 0.1)
    assert not d.saturated("m")


# --- the bound lifted where one kind is served ------------------------------------------------------

@pytest.mark.parametrize("session, other, stays", [
    ("agent-1", None, True),  # one kind served: a later turn stays on its replica past the bound
    ("agent-1", "conv:question", False),  # both kinds served: the bound holds
    ("agent-1", "agent-2", True),  # another session of the same kind is still one kind
    ("conv:agent", None, False),  # a session the router derived: the bound holds
])
def test_a_bound_turn_stays_past_the_load_bound_only_where_one_kind_is_served(
        session: str, other: str | None, stays: bool) -> None:
    clock = Clock()
    d = _saturated_dispatcher(clock)
    workers = fleet(4, max_num_seqs=32)
    head = text(11, 16384)
    first = key(head + "turn one", session=session)
    decision = d.route(first, workers)
    holder = next(w for w in workers if w.id == decision.worker_id)
    flight, _ = d.sent(first, decision, holder)
    d.finished(flight, ok=True)
    if other is not None:  # in the door's book, on another replica
        k = key(text(12, 4096), session=other)
        rest = next(w for w in workers if w is not holder)
        d.sent(k, d.route(k, workers, exclude={holder.id}), rest)
    for w in workers:
        w.inflight = 4
    holder.inflight = 6  # past the bound: ceil(1.25 * 19 / 4) = 6 < 6 + 1
    clock.advance(1.0)
    later = d.route(key(head + "turn one" + text(13, 2048), session=session), workers)
    assert (later.worker_id == holder.id) is stays, later.reason
