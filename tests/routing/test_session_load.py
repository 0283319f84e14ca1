"""``auto`` weighs the sessions living on a worker as future load, not as a hard filter, so a
burst of new sessions follows the work actually queued even when recently ended sessions make the
active counts uneven; a loose ``session_spread`` guard still keeps a shared head from pulling every
new session onto one worker."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from routing_helpers import Clock, fleet, key, send, text

from kvroute.routing.scheduler import Scheduler

MakeScheduler = Callable[..., Scheduler]


def burst_after_ended_sessions(s: Scheduler, clock: Clock) -> Counter[str]:
    """Four sessions served by w0 and ended 20 s ago (still "active": younger than
    ``session_active_s``), then six new 10k-token sessions at one instant, each still in flight."""
    ws = fleet(2)
    for i in range(4):
        send(s, key(text(i, 40_000), session=f"old-{i}"), [ws[0]])
    clock.advance(20)
    placed = [send(s, key(text(100 + i, 40_000), session=f"new-{i}"), ws, keep_inflight=True)
              for i in range(6)]
    return Counter(placed)


def test_a_burst_follows_queued_work_not_just_active_counts(make_scheduler: MakeScheduler,
                                                           clock: Clock) -> None:
    placed = burst_after_ended_sessions(make_scheduler("auto"), clock)
    assert placed["w0"] >= 2 and placed["w1"] <= 4, placed


def test_a_hard_session_filter_alone_sends_the_burst_to_one_worker(make_scheduler: MakeScheduler,
                                                                   clock: Clock) -> None:
    """The rule ``auto`` had before: new sessions only where active sessions are fewest."""
    s = make_scheduler("auto", session_spread=0, active_session_tokens=0.0)
    placed = burst_after_ended_sessions(s, clock)
    assert placed["w0"] <= 1, placed


def test_new_sessions_avoid_the_worker_other_sessions_live_on(make_scheduler: MakeScheduler,
                                                             clock: Clock) -> None:
    s, ws = make_scheduler("auto", session_spread=None), fleet(2)
    send(s, key(text(1, 8_000), session="a"), [ws[0]])
    clock.advance(30)  # its prefill has drained: only the session itself is left on w0
    d = s.decide(key(text(2, 8_000), session="b"), ws)
    assert d.worker_id == "w1"
    # A request without a session joins no conversation: the sessions there do not count, and
    # the two workers tie (ties go round in turn).
    assert {s.decide(key(text(3, 8_000)), ws).worker_id for _ in range(4)} == {"w0", "w1"}


def test_session_spread_guard_limits_a_pile_behind_a_shared_head(make_scheduler: MakeScheduler,
                                                                clock: Clock) -> None:
    """A long head cached on one worker only is worth more than a few sessions' future load; the
    guard keeps new sessions within ``session_spread`` of the fewest anyway."""
    head = text(0, 120_000)
    ws = fleet(4)
    for spread, limit in ((2, 3), (None, 8)):
        s = make_scheduler("auto", session_spread=spread)
        homes = []
        for i in range(8):
            homes.append(send(s, key(head + text(10 + i, 2_000), session=f"{spread}-{i}"), ws))
            clock.advance(3)
        first = Counter(homes[:4]).most_common(1)[0][1]
        assert first <= limit, (spread, homes)
        if spread is None:
            assert first == 4  # without the guard the cached head wins the first four
