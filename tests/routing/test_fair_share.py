"""Tenants' fair share on its own (routing/fair_share.py): start-time fair queuing tags, the busy
period, settling a charge to what was used, and the bound on tenants remembered."""

from __future__ import annotations

import pytest

from kvroute.routing.fair_share import MAX_TENANTS, ClassShare, FairShare, tenant_weights

NOTHING_WAITS: tuple[str, ...] = ()


@pytest.mark.parametrize("charges, expected_finish, expected_vtime", [
    # (tenant, tokens, weight, busy) in order; the tags after them
    ([("a", 100, 1.0, True)], {"a": 100.0}, 0.0),
    ([("a", 100, 1.0, True), ("a", 100, 1.0, True)], {"a": 200.0}, 100.0),
    ([("a", 100, 2.0, True), ("b", 100, 1.0, True)], {"a": 50.0, "b": 100.0}, 0.0),  # weights
    # a's busy period ends: the virtual time catches up with its finish, so b starts level
    ([("a", 100, 1.0, False), ("b", 100, 1.0, True)], {"a": 100.0, "b": 200.0}, 100.0),
])
def test_charges_advance_the_finish_tags(charges: list[tuple[str, int, float, bool]],
                                         expected_finish: dict[str, float], expected_vtime: float) -> None:
    fair = FairShare()
    for tenant, tokens, weight, busy in charges:
        fair.charge(0, tenant, tokens, weight, busy=busy, waiting=lambda: NOTHING_WAITS)
    share = fair.classes[0]
    assert (share.finish, share.vtime) == (expected_finish, expected_vtime)


def test_a_tenant_idle_comes_back_level_with_no_credit() -> None:
    share = ClassShare(vtime=500.0, finish={"busy": 600.0, "idle": 10.0})
    assert share.start("idle") == 500.0 and share.start("busy") == 600.0
    assert share.start("new") == 500.0


def test_classes_are_separate() -> None:
    fair = FairShare()
    fair.charge(1, "a", 1000, 1.0, busy=True, waiting=lambda: NOTHING_WAITS)
    assert fair.start(1, "a") == 1000.0 and fair.start(0, "a") == 0.0


@pytest.mark.parametrize("heads, expected", [
    # (tenant, sort key, request): the earliest start wins, then the smaller sort key
    ([("a", (1.0,), "a1"), ("b", (2.0,), "b1")], "b1"),   # a was served 100: b starts earlier
    ([("b", (2.0,), "b1"), ("c", (1.0,), "c1")], "c1"),   # b and c level: the better head
])
def test_pick(heads: list[tuple[str, tuple[float, ...], str]], expected: str) -> None:
    fair = FairShare()
    fair.charge(0, "a", 100, 1.0, busy=True, waiting=lambda: NOTHING_WAITS)
    assert fair.pick(0, heads) == expected


@pytest.mark.parametrize("tenant, correction, weight, expected", [
    ("a", -60, 1.0, 40.0),   # asked for 100, used 40
    ("a", -60, 2.0, 70.0),   # weighted
    ("a", 20, 1.0, 120.0),   # used more than estimated
    ("gone", -60, 1.0, None),  # forgotten: nothing to settle
])
def test_settle(tenant: str, correction: int, weight: float, expected: float | None) -> None:
    fair = FairShare()
    fair.charge(0, "a", 100, 1.0, busy=True, waiting=lambda: NOTHING_WAITS)
    fair.settle(0, tenant, correction, weight)
    fair.settle(1, tenant, correction, weight)  # a class never charged: nothing happens
    assert fair.classes[0].finish.get(tenant) == expected
    assert 1 not in fair.classes


def test_idle_tenants_are_forgotten_and_waiting_ones_kept() -> None:
    """Past the sweep threshold, tenants whose tag the virtual time passed and with nothing queued
    go (they would start at the virtual time anyway); a waiting one stays however far behind."""
    fair = FairShare()
    asked = 0

    def waiting() -> tuple[str, ...]:
        nonlocal asked
        asked += 1
        return ("t0",)

    for i in range(200):
        fair.charge(0, f"t{i}", 10, 1.0, busy=False, waiting=waiting)
    share = fair.classes[0]
    assert asked >= 1 and "t0" in share.finish
    assert len(share.finish) <= share.sweep_at <= 2 * 64
    assert asked < 200  # asked only when a sweep is due


def test_past_the_bound_even_indebted_idle_tenants_go() -> None:
    fair = FairShare()
    share = fair.classes[0] = ClassShare(finish={f"t{i}": 1e9 for i in range(MAX_TENANTS + 1)})
    share.sweep_at = MAX_TENANTS
    fair.charge(0, "x", 1, 1.0, busy=True, waiting=lambda: ("t1",))
    assert set(share.finish) == {"t1"}


@pytest.mark.parametrize("text, expected", [
    ("a=2, b=0.5", {"a": 2.0, "b": 0.5}),
    ("", {}),
    ("team=x=3", {"team=x": 3.0}),  # the last '=' splits
])
def test_tenant_weights(text: str, expected: dict[str, float]) -> None:
    assert tenant_weights(text) == expected
