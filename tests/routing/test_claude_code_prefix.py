"""Claude Code's shape breaks seed 1's 32 KB window: ~27 KB of system prompt and ~82 KB of tools
come before the first message, so every session's first 32 KB is identical.

The index hashes the whole prompt and stores a bounded sample of it (the window, geometric
anchors, the last blocks), so conversations sharing the head are told apart by their own blocks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from routing_helpers import Clock, fleet, key, send, text

from kvroute.routing.decision import DecisionKind
from kvroute.routing.scheduler import Scheduler

MakeScheduler = Callable[..., Scheduler]
SESSIONS = 20
HEAD = text(0, 27 * 1024) + text(1, 82 * 1024)  # system prompt, then tool definitions
# Follow-ups come back in another order than the first turns, so ties broken in turn cannot
# land them home by coincidence.
ORDER = [(7 * i) % SESSIONS for i in range(SESSIONS)]


def first_turn(i: int) -> str:
    return HEAD + text(100 + i, 1500 + 300 * i)


def follow_up(i: int) -> str:
    return first_turn(i) + text(200 + i, 900) + text(300 + i, 400)  # the reply, then the next message


def burst(s: Scheduler, ws: list, *, sessions: bool) -> dict[int, str]:
    """All first turns arrive while the earlier ones are still in flight; then all finish."""
    homes = {i: send(s, key(first_turn(i), session=f"cc-{i}" if sessions else None), ws, keep_inflight=True)
             for i in range(SESSIONS)}
    for w in ws:
        w.inflight = 0
    return homes


@pytest.mark.parametrize("policy", ["prefix", "auto"])
def test_sessions_sharing_a_110kb_head_spread_and_come_back(make_scheduler: MakeScheduler, clock: Clock,
                                                            policy: str) -> None:
    s, ws = make_scheduler(policy), fleet(4)
    homes = burst(s, ws, sessions=False)
    spread = Counter(homes.values())
    assert len(spread) == 4 and max(spread.values()) <= 8, spread
    clock.advance(30)
    for i in ORDER:
        d = s.decide(key(follow_up(i)), ws)
        assert d.worker_id == homes[i], d.reason
        assert d.kind is DecisionKind.PREFIX_HIT
        # It matched its own first turn, well past the shared head.
        assert d.matched_blocks * 512 > len(HEAD)


def test_session_ids_spread_even_one_at_a_time(make_scheduler: MakeScheduler, clock: Clock) -> None:
    s, ws = make_scheduler("auto"), fleet(4)
    homes = {}
    for i in range(SESSIONS):
        homes[i] = send(s, key(first_turn(i), session=f"cc-{i}"), ws)
        clock.advance(3)
    assert sorted(Counter(homes.values()).values()) == [5, 5, 5, 5]
    for i in ORDER:
        d = s.decide(key(follow_up(i), session=f"cc-{i}"), ws)
        assert d.worker_id == homes[i] and d.kind is DecisionKind.STICKY


def test_plain_32kb_window_cannot_tell_these_sessions_apart(make_scheduler: MakeScheduler,
                                                            clock: Clock) -> None:
    """Seed 1's exact window, for contrast: every follow-up matches 64/64 blocks everywhere."""
    s, ws = make_scheduler("prefix", hash_beyond_window=False), fleet(4)
    homes = burst(s, ws, sessions=False)
    clock.advance(30)
    decisions = {i: s.decide(key(follow_up(i)), ws) for i in ORDER}
    assert all(d.matched_blocks == d.total_blocks == 64 for d in decisions.values())
    returned = sum(d.worker_id == homes[i] for i, d in decisions.items())
    assert returned <= SESSIONS // 2


def test_index_stores_a_bounded_number_of_blocks_per_request(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("prefix"), fleet(4)
    send(s, key(first_turn(0)), ws)
    first = s.stats()["index_blocks"]
    assert first < 110  # of ~216 blocks: the window, anchors and the tail
    send(s, key(first_turn(1)), ws)
    # The second session adds only its own tail blocks; the shared head is already indexed.
    assert s.stats()["index_blocks"] - first <= 16
