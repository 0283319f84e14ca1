"""Each named policy's behaviour, and seed 1's slack rule at several prompt sizes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from routing_helpers import fleet, key, send, text

from kvroute.routing.decision import DecisionKind
from kvroute.routing.scheduler import Scheduler

MakeScheduler = Callable[..., Scheduler]


def test_round_robin_cycles_through_candidates(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("round-robin"), fleet(3)
    chosen = [send(s, key(text(i, 2000)), ws) for i in range(6)]
    assert chosen == ["w0", "w1", "w2", "w0", "w1", "w2"]
    assert s.decide(key("x"), ws).kind is DecisionKind.BALANCE


def test_least_loaded_uses_vllm_score_and_falls_back_to_inflight(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("least-loaded"), fleet(3)
    ws[0].running, ws[0].waiting = 2, 1  # 4*1 + 2 = 6
    ws[1].running, ws[1].waiting = 5, 0  # 5
    ws[2].inflight = 7  # no engine figures: its 7 in flight count
    assert s.decide(key("x"), ws).worker_id == "w1"
    ws[1].inflight = 9  # the engine's figure lags what the router just sent: 9 > 5
    assert s.decide(key("x"), ws).worker_id == "w0"


def test_least_loaded_ignores_the_cache(make_scheduler: MakeScheduler, clock) -> None:
    s, ws = make_scheduler("least-loaded"), fleet(2)
    prompt = key(text(1, 20_000))
    first = send(s, prompt, ws)
    next(w for w in ws if w.id == first).inflight = 1
    d = s.decide(prompt, ws)
    assert d.worker_id != first and d.matched_blocks == 0


def test_p2c_takes_the_lower_of_two_and_is_reproducible(make_scheduler: MakeScheduler) -> None:
    ws = fleet(4)
    for i, w in enumerate(ws):
        w.inflight = [0, 5, 5, 5][i]
    runs = []
    for _ in range(2):
        s = make_scheduler("p2c", seed=7)
        runs.append([s.decide(key(text(i, 100)), ws).worker_id for i in range(200)])
    assert runs[0] == runs[1]
    counts = Counter(runs[0])
    # w0 is in half of all pairs (3 of 6) and always wins them; the others share the rest.
    assert counts["w0"] == pytest.approx(100, abs=30)
    assert set(counts) == {"w0", "w1", "w2", "w3"}


@pytest.mark.parametrize(
    ("prompt_bytes", "slack"),
    [(2_000, 0), (6_000, 1), (20_000, 2), (40_000, 3), (140_000, 4)],
)
def test_prefix_slack_rule_at_several_sizes(make_scheduler: MakeScheduler, prompt_bytes: int,
                                            slack: int) -> None:
    """The cached worker wins while it carries at most ``slack`` more in flight than the freest."""
    s, ws = make_scheduler("prefix"), fleet(3)
    prompt = key(text(1, prompt_bytes))
    cached = send(s, prompt, ws)
    home = next(w for w in ws if w.id == cached)
    home.inflight = slack
    d = s.decide(prompt, ws)
    assert d.worker_id == cached and d.kind is DecisionKind.PREFIX_HIT
    assert f"slack={slack}" in d.reason and f"slots={slack} min=0" in d.reason
    home.inflight = slack + 1
    d = s.decide(prompt, ws)
    assert d.worker_id != cached and d.kind is DecisionKind.COLD


def test_prefix_follows_a_growing_conversation(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("prefix"), fleet(4)
    conversation = text(1, 22_000)
    first = send(s, key(conversation), ws)
    for turn in range(2, 6):
        conversation += text(turn, 800)
        d = s.decide(key(conversation), ws)
        assert d.worker_id == first and d.kind is DecisionKind.PREFIX_HIT
        s.commit(key(conversation), d)
    assert d.reason.startswith(f"[PREFIX] hit: {first} keeps ")


def test_prefix_log_line_has_seed_1_shape(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("prefix"), fleet(2)
    prompt = key(text(1, 51_808))
    send(s, prompt, ws)
    d = s.decide(prompt, ws)
    expected = f"[PREFIX] hit: {d.worker_id} keeps 101/101 blocks (slots=0 min=0 slack=3, ~12952 tokens)"
    assert d.reason == expected


def test_prefix_prefers_deepest_cached_worker_within_slack(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("prefix"), fleet(3)
    base = text(1, 10_000)
    send(s, key(base), [ws[0]])
    send(s, key(base + text(2, 10_000)), [ws[1]])
    assert s.decide(key(base + text(2, 12_000)), ws).worker_id == "w1"
    ws[1].inflight = 5  # past the slack: the shallower cache within slack wins
    assert s.decide(key(base + text(2, 12_000)), ws).worker_id == "w0"


def test_session_sticks_then_overflows_past_a_quarter_of_max_num_seqs(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("session"), fleet(3, max_num_seqs=32)
    k = key(text(1, 3000), session="s-1")
    home = send(s, k, ws)
    w = next(x for x in ws if x.id == home)
    w.inflight = 8  # threshold is 32/4 = 8: not past it yet
    d = s.decide(k, ws)
    assert d.worker_id == home and d.kind is DecisionKind.STICKY
    w.inflight = 9
    d = s.decide(k, ws)
    assert d.worker_id != home and d.kind is DecisionKind.OVERFLOW
    assert f"{home} -> {d.worker_id}" in d.reason and "threshold=8" in d.reason
    s.commit(k, d)  # the session moves with the request
    w.inflight = 0
    assert s.decide(k, ws).worker_id == d.worker_id
    stats = s.stats()["workers"]
    assert stats[home]["cold"] == 1 and stats[d.worker_id]["overflow"] == 1


def test_session_overflow_is_configurable_and_stickiness_can_be_off(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("session", overflow=2), fleet(2)
    k = key("hello", session="s")
    home = send(s, k, ws)
    next(x for x in ws if x.id == home).inflight = 3
    assert s.decide(k, ws).kind is DecisionKind.OVERFLOW
    off, idle = make_scheduler("session", sticky=False), fleet(2)
    home = send(off, k, idle)
    d = off.decide(k, idle)  # equal loads: without stickiness the tie goes round
    assert d.kind is DecisionKind.COLD and d.session is None and d.worker_id != home


def test_session_places_new_sessions_by_inflight_then_active_sessions(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("session"), fleet(3)
    for i in range(6):
        send(s, key("hi", session=f"s{i}"), ws)
    assert s.stats()["workers"]["w0"]["sessions"] == 2
    ws[2].inflight = 1
    assert s.decide(key("hi", session="new"), ws).worker_id in {"w0", "w1"}
    send(s, key("hi", session="s6"), [ws[0]])
    assert s.decide(key("hi", session="new"), ws).worker_id == "w1"


def test_auto_keeps_a_session_on_its_cache_under_moderate_load(make_scheduler: MakeScheduler, clock) -> None:
    s, ws = make_scheduler("auto"), fleet(4)
    conv = text(1, 40_000)
    home = send(s, key(conv, session="a"), ws)
    clock.advance(10)  # the first prefill is done
    next(w for w in ws if w.id == home).inflight = 3
    conv += text(2, 1500)
    d = s.decide(key(conv, session="a"), ws)
    assert d.worker_id == home and d.kind is DecisionKind.STICKY
    assert d.reason.startswith("[AUTO] sticky: ") and "predicted" in d.reason


def test_auto_moves_a_session_when_its_worker_is_swamped(make_scheduler: MakeScheduler, clock) -> None:
    s, ws = make_scheduler("auto"), fleet(4)
    conv = text(1, 8_000)  # ~2k tokens: little to save
    home = send(s, key(conv, session="a"), ws)
    clock.advance(10)
    hot = next(w for w in ws if w.id == home)
    hot.running, hot.waiting = 32, 4
    d = s.decide(key(conv + text(2, 600), session="a"), ws)
    assert d.worker_id != home and d.kind is DecisionKind.OVERFLOW


def test_auto_without_session_follows_the_prefix(make_scheduler: MakeScheduler, clock) -> None:
    s, ws = make_scheduler("auto"), fleet(4)
    conv = text(1, 30_000)
    home = send(s, key(conv), ws)
    clock.advance(10)
    conv += text(2, 2000)
    d = s.decide(key(conv), ws)
    assert d.worker_id == home and d.kind is DecisionKind.PREFIX_HIT


def test_auto_numeric_overflow_is_a_hard_cap(make_scheduler: MakeScheduler, clock) -> None:
    s, ws = make_scheduler("auto", overflow=2), fleet(2)
    conv = text(1, 100_000)
    home = send(s, key(conv, session="a"), ws)
    clock.advance(30)
    next(w for w in ws if w.id == home).inflight = 3
    assert s.decide(key(conv, session="a"), ws).kind is DecisionKind.OVERFLOW


def test_auto_spreads_new_sessions_even_when_they_share_a_head(make_scheduler: MakeScheduler, clock) -> None:
    s, ws = make_scheduler("auto"), fleet(4)
    head = text(0, 14_000)  # ~3.5k tokens shared by every session (seed 2's workload)
    for i in range(8):
        send(s, key(head + text(100 + i, 28_000), session=f"s{i}"), ws)
        clock.advance(5)  # one at a time, each prefill done before the next session starts
    assert [s.stats()["workers"][w.id]["sessions"] for w in ws] == [2, 2, 2, 2]
