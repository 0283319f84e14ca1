"""Seed 2's session table: bindings, idle expiry, the bound, active counts."""

from __future__ import annotations

from kvroute.routing.sessions import SessionTable

T0 = 1_700_000_000.0


def test_bind_refresh_and_move() -> None:
    table = SessionTable(ttl_s=60)
    assert table.bind(1, "w0", T0)
    assert not table.bind(1, "w0", T0 + 1)  # refresh
    assert table.get(1, T0 + 2) == "w0"
    assert table.bind(1, "w1", T0 + 3)  # moved
    assert (table.bound("w0"), table.bound("w1")) == (0, 1)


def test_idle_sessions_expire() -> None:
    table = SessionTable(ttl_s=60)
    table.bind(1, "w0", T0)
    table.bind(2, "w0", T0 + 50)
    assert table.get(1, T0 + 61) is None
    assert table.get(2, T0 + 61) == "w0"
    table.expire(T0 + 61)
    assert len(table) == 1 and table.bound("w0") == 1


def test_table_is_bounded_least_recently_seen_first() -> None:
    table = SessionTable(ttl_s=3600, max_entries=3)
    for s in range(3):
        table.bind(s, f"w{s}", T0 + s)
    table.bind(0, "w0", T0 + 10)  # session 0 is seen again: session 1 is now the oldest
    table.bind(3, "w3", T0 + 11)
    assert len(table) == 3
    assert table.get(1, T0 + 11) is None
    assert table.get(0, T0 + 11) == "w0"


def test_late_remote_refresh_does_not_move_a_session_back() -> None:
    table = SessionTable()
    table.bind(1, "w0", T0)
    table.bind(1, "w1", T0 + 5)
    assert not table.bind(1, "w0", T0 + 2)
    assert table.get(1, T0 + 6) == "w1"


def test_active_counts_only_recent_sessions() -> None:
    table = SessionTable()
    table.bind(1, "w0", T0)
    table.bind(2, "w0", T0 + 400)
    table.bind(3, "w1", T0 + 450)
    assert table.active(T0 + 500, 300) == {"w0": 1, "w1": 1}
    assert table.active(T0 + 500, 600) == {"w0": 2, "w1": 1}


def test_drop_worker_unbinds_its_sessions() -> None:
    table = SessionTable()
    table.bind(1, "w0", T0)
    table.bind(2, "w1", T0)
    assert table.drop_worker("w0") == 1
    assert table.get(1, T0) is None and table.get(2, T0) == "w1"
    assert table.bound("w0") == 0


def test_a_one_shot_is_bound_but_not_active() -> None:
    """A session bound with ``active=False`` (a one-shot: it sends no later turn) keeps its binding
    but is not counted active, in a window that exists already or one first read afterwards; bound
    again as active, it counts again."""
    table = SessionTable()
    table.bind(1, "w0", T0)
    assert table.active(T0, 60) == {"w0": 1}
    table.bind(1, "w0", T0 + 1, active=False)
    table.bind(2, "w1", T0 + 1, active=False)
    assert table.get(1, T0 + 2) == "w0" and table.get(2, T0 + 2) == "w1"
    assert table.active(T0 + 2, 60) == {}
    assert table.active(T0 + 2, 30) == {}  # a window first read now
    table.bind(2, "w1", T0 + 3)
    assert table.active(T0 + 3, 60) == {"w1": 1} and table.active(T0 + 3, 30) == {"w1": 1}
