"""The replica's model clock: back-to-back steps in model time, deadlines on the wall clock, bounded lag."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.sim.clock import ModelClock


def clock(**kw: float) -> ModelClock:
    return ModelClock(speed=10.0, origin_model=100.0, origin_wall=0.0, **kw)


def test_busy_steps_follow_each_other_and_wake_up_lag_is_not_model_time() -> None:
    c = clock()
    start = c.start_step(1.0)                    # idle: starts at the wall clock's model time
    assert start == pytest.approx(110.0)
    assert c.end_step(start, 0.5) == pytest.approx(1.05)
    # The loop woke 10 ms late: the next step still starts where the last one ended.
    assert c.start_step(1.06) == pytest.approx(110.5) and c.late_s == pytest.approx(0.01)
    assert c.end_step(110.5, 0.5) == pytest.approx(1.10)   # its deadline is not pushed back
    # Arrivals while a step runs are not later than its end, even when the loop is late.
    assert c.now(1.2) == pytest.approx(111.0)
    assert c.now(1.08) == pytest.approx(110.8)
    c.idle()
    assert c.now(1.2) == pytest.approx(112.0) and c.start_step(1.2) == pytest.approx(112.0)
    assert c.dropped_s == 0.0 and c.drops == 0


def test_lag_beyond_the_bound_is_dropped_and_reported() -> None:
    c = clock(max_lag_s=0.25)
    c.end_step(c.start_step(1.0), 0.5)          # due at 1.05
    assert c.start_step(1.2) == pytest.approx(110.5)   # 0.15 s late: caught up, not dropped
    assert c.end_step(110.5, 0.5) == pytest.approx(1.10)
    assert c.start_step(2.1) == pytest.approx(111.0)   # 1 s late: dropped
    assert c.drops == 1 and c.dropped_s == pytest.approx(1.0) and c.late_s == 0.0
    assert c.end_step(111.0, 0.5) == pytest.approx(2.15)
    assert c.describe()["dropped_lag_s"] == pytest.approx(1.0)


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        ModelClock(speed=0.0, origin_model=0.0, origin_wall=0.0)
    with pytest.raises(ValueError):
        clock(max_lag_s=-1.0)


@given(st.lists(st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 2.0), st.booleans()), max_size=60))
def test_model_time_never_goes_back_and_busy_time_is_the_sum_of_steps(
        steps: list[tuple[float, float, bool]]) -> None:
    c = clock()
    wall, last_end = 0.0, 100.0
    busy_since: float | None = None
    busy_total = 0.0
    for wait, duration, go_idle in steps:
        wall += wait
        start = c.start_step(wall)
        assert start >= last_end
        if busy_since is not None:
            assert start == last_end                # no gap while busy, whatever the wall clock did
        else:
            busy_since, busy_total = start, 0.0
        deadline = c.end_step(start, duration)
        assert deadline >= wall - c.max_lag_s - 1e-9   # never more than the bound behind
        wall = max(wall, deadline)                  # the loop sleeps until the deadline
        last_end = start + duration
        busy_total += duration
        assert c.now(wall) <= last_end + 1e-9
        assert last_end - busy_since == pytest.approx(busy_total)
        if go_idle:
            c.idle()
            busy_since = None
