"""The circuit breaker and latency-outlier ejection: pure, on an injected clock."""

from __future__ import annotations

import pytest

from kvroute.fleet.breaker import (
    ANSWER_WINDOW,
    Breaker,
    BreakerSettings,
    BreakerState,
    latency_outlier,
    malformed_outlier,
)
from kvroute.fleet.registry import ProbeResult, Registry

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
S = BreakerSettings(failures=3, cooldown_s=10.0, max_cooldown_s=40.0)


def run(events: list[tuple[float, str]]) -> Breaker:
    b = Breaker(S)
    for now, event in events:
        b.tick(now)
        if event == "fail":
            b.failed(now, "timeout")
        elif event == "ok":
            b.succeeded()
        elif event == "send":
            b.sending(now)
    return b


# (events as (time, what), state, admits, cool-down in force, ejections by reason)
@pytest.mark.parametrize(("events", "state", "admits", "cooldown", "ejections"), [
    ([], CLOSED, True, 0.0, {}),
    ([(0, "fail"), (1, "fail")], CLOSED, True, 0.0, {}),
    ([(0, "fail"), (1, "fail"), (2, "fail")], OPEN, False, 10.0, {"failures": 1}),
    ([(0, "fail"), (1, "fail"), (2, "ok"), (3, "fail")], CLOSED, True, 0.0, {}),  # streak broken
    ([(0, "fail")] * 3 + [(9, "tick")], OPEN, False, 10.0, {"failures": 1}),  # 10 s not over yet
    ([(0, "fail")] * 3 + [(10, "tick")], HALF, True, 10.0, {"failures": 1}),
    ([(0, "fail")] * 3 + [(10, "send")], HALF, False, 10.0, {"failures": 1}),  # one trial at a time
    ([(0, "fail")] * 3 + [(10, "send"), (11, "ok")], CLOSED, True, 0.0, {"failures": 1}),
    # a failed trial re-opens with twice the cool-down, then capped at max_cooldown_s
    ([(0, "fail")] * 3 + [(10, "send"), (11, "fail")], OPEN, False, 20.0, {"failures": 1, "trial": 1}),
    ([(0, "fail")] * 3 + [(10, "send"), (11, "fail"), (31, "send"), (32, "fail"), (72, "send"),
                          (73, "fail")], OPEN, False, 40.0, {"failures": 1, "trial": 3}),
    # failures of requests already under way when it opened change nothing
    ([(0, "fail")] * 5, OPEN, False, 10.0, {"failures": 1}),
    # a trial that never reports back (its client left) is forgotten after max_cooldown_s
    ([(0, "fail")] * 3 + [(10, "send"), (50, "tick")], HALF, True, 10.0, {"failures": 1}),
])
def test_breaker_state_machine(events, state, admits, cooldown, ejections):
    b = run(events)
    assert (b.state, b.admits, b.cooldown_s, dict(b.ejections)) == (state, admits, cooldown, ejections)


def test_transitions_are_counted():
    b = run([(0, "fail")] * 3 + [(10, "send"), (11, "ok")])
    assert dict(b.transitions) == {"open": 1, "half_open": 1, "closed": 1}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_registry_breaker_probe_cannot_close_it_only_a_trial_can():
    clock = Clock()
    registry = Registry(clock=clock, breaker=S)
    a = registry.add("http://a:1")
    for _ in range(3):
        registry.mark_failure("a:1", "first_byte_timeout")
    assert a.state.healthy and a.state.ejected and not a.state.ready
    healthy = ProbeResult(reachable=True, healthy=True)
    registry.apply_probe("a:1", healthy)
    assert a.state.ejected  # /health answering is not enough
    clock.t += 10
    registry.apply_probe("a:1", healthy)  # the probe round is where time moves the breaker
    assert a.breaker.state is HALF and a.state.ready
    registry.sending(a)
    assert not a.state.ready  # its trial is under way: nothing else goes there
    registry.mark_success("a:1")
    assert a.breaker.state is CLOSED and a.state.ready
    assert a.to_json(clock.t)["breaker"]["state"] == "closed"


def fleet(n: int, **settings: float) -> dict[str, Breaker]:
    s = BreakerSettings(outlier_factor=3.0, outlier_min_samples=5, outlier_min_excess_s=0.1, **settings)
    return {f"w{i}": Breaker(s) for i in range(n)}


def feed(b: Breaker, ttft: float, n: int = 5, predicted: float = 0.0) -> None:
    for _ in range(n):
        b.observe(ttft, predicted, 0.05)


@pytest.mark.parametrize(("n", "slow_ttft", "predicted_slow", "ejected"), [
    (3, 1.0, 0.0, True),     # 10x the others and 0.9 s slower
    (3, 0.2, 0.0, False),    # 2x: within the factor
    (3, 1.0, 0.5, False),    # slow, but the router predicted it (a long prompt, a queue)
    (2, 1.0, 0.0, False),    # no fleet to compare with: one other replica is just noise
])
def test_latency_outlier(n, slow_ttft, predicted_slow, ejected):
    breakers = fleet(n)
    for wid, b in breakers.items():
        feed(b, slow_ttft if wid == "w0" else 0.1, predicted=predicted_slow if wid == "w0" else 0.0)
    assert (latency_outlier(breakers, "w0", ready=n) is not None) == ejected


def test_latency_outliers_are_bounded_and_never_the_last():
    breakers = fleet(6)
    for wid, b in breakers.items():
        feed(b, 2.0 if wid in ("w0", "w1", "w2") else 0.1)
    # Three slow replicas of six: at most a third of the fleet (2) is ejected for latency.
    out = []
    for wid in ("w0", "w1", "w2"):
        if latency_outlier(breakers, wid, ready=6 - len(out)) is not None:
            breakers[wid].eject(0.0, "latency", "slow")
            out.append(wid)
    assert out == ["w0", "w1"]
    solo = fleet(3, max_ejected_fraction=1.0)
    for wid, b in solo.items():
        feed(b, 2.0 if wid == "w0" else 0.1)
    assert latency_outlier(solo, "w0", ready=1) is None  # the only one left admitting requests


def test_answers_that_are_not_answers_eject_even_between_good_ones():
    clock = Clock()
    registry = Registry(clock=clock, breaker=S)
    bad, *_ = (registry.add(f"http://{h}:1") for h in ("a", "b", "c"))
    for _ in range(2):  # a garbage stream, then a good plain answer, and so on: never 3 in a row
        registry.mark_failure("a:1", "midstream malformed: garbage", malformed=True)
        registry.mark_success("a:1")
    assert bad.breaker.state is CLOSED and bad.breaker.malformed == 2
    registry.mark_failure("a:1", "midstream malformed: garbage", malformed=True)
    assert bad.breaker.state is OPEN and bad.state.ejected
    assert dict(bad.breaker.ejections) == {"malformed": 1} and bad.last_error.startswith("ejected: 3 of")
    assert bad.to_json(clock.t)["breaker"]["malformed_answers"] == 0  # a clean slate for its trial
    # Other failures (timeouts) are not answers: they count for the streak only.
    registry.mark_failure("b:1", "timeout")
    registry.mark_success("b:1")
    assert registry.get("b:1").breaker.malformed == 0  # type: ignore[union-attr]


@pytest.mark.parametrize(("others", "ready", "ejected"), [
    ([0, 0], 3, True),
    ([0, 1], 3, True),   # half the others have none
    ([1, 1], 3, False),  # the fleet shares the fault: ejecting one only shrinks the fleet
    ([0, 0], 1, False),  # the last replica admitting requests
    ([], 2, True),       # ready counts replicas of other models too; no one to compare with: none
])
def test_malformed_outlier(others, ready, ejected):
    breakers = fleet(1 + len(others))
    for _ in range(3):
        breakers["w0"].answered(True)
    for i, n in enumerate(others, start=1):
        for _ in range(n):
            breakers[f"w{i}"].answered(True)
    assert (malformed_outlier(breakers, "w0", ready=ready) is not None) == ejected


def test_the_malformed_count_is_over_the_last_answers_only():
    b = Breaker(S)
    for _ in range(2):
        b.answered(True)
    for _ in range(ANSWER_WINDOW - 1):
        b.answered(False)
    assert b.malformed == 1 and len(b.answers) == ANSWER_WINDOW  # the first one left the window
    b.answered(False)
    assert b.malformed == 0
