"""The learned return share (routing/returns.py) and what ``auto`` does with it: a request of a
derived session that never came back, while few of its model's do, is placed by the cost alone;
clients' sessions and conversations that come back keep the load and session guards."""

from __future__ import annotations

import pytest
from routing_helpers import Clock, fleet, key, send, text

from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.returns import ReturnShare
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

# (session, prompt tokens, seconds since the previous event) per event; then the share expected
# at the end (None: not yet told) and the sessions that count as returned then.
Event = tuple[int, int, float]
CASES: dict[str, tuple[list[Event], float | None, set[int]]] = {
    "nothing resolved yet": ([(1, 100, 0.0), (1, 200, 1.0)], None, {1}),
    # The same question asked again derives the same identity: a repeat, not a follow-up.
    "repeats are not returns": ([(s, 100, 0.5) for s in range(4)] * 8 + [(99, 1, 61.0)], 0.0, set()),
    "follow-ups return at once": ([(s, 100, 0.0) for s in range(4)] + [(s, 300, 2.0) for s in range(4)],
                                  1.0, {0, 1, 2, 3}),
    "a shorter prompt is no follow-up": ([(s, 300, 0.0) for s in range(4)] + [(s, 100, 1.0) for s in range(4)]
                                         + [(99, 1, 61.0)], 0.0, set()),
    "a follow-up after the window is a new identity": (
        [(s, 100, 0.0) for s in range(4)] + [(0, 200, 61.0)] + [(s, 200, 0.0) for s in range(1, 4)]
        + [(99, 1, 61.0)], 0.0, set()),
    "one in four comes back": ([(s, 100, 0.1) for s in range(8)] + [(0, 200, 0.1), (4, 200, 0.1)]
                               + [(99, 1, 61.0)], 0.25, set()),
    "a second follow-up counts once": ([(s, 100, 0.0) for s in range(4)] + [(0, 200, 1.0), (0, 300, 1.0)]
                                       + [(99, 1, 61.0)], 0.25, set()),
}


@pytest.mark.parametrize("name", CASES)
def test_return_share(name: str) -> None:
    events, share, returned = CASES[name]
    r = ReturnShare(window_s=60.0, min_resolved=4, memory=64)
    now = 0.0
    for session, tokens, dt in events:
        now += dt
        r.seen(session, tokens, now)
    assert r.share(now) == (None if share is None else pytest.approx(share))
    assert {s for s in range(100) if r.returned(s)} == returned


def test_the_share_follows_the_recent_resolutions() -> None:
    """Past ``memory`` resolutions the share is an exponentially weighted mean: a workload that
    turns from conversations to one-shots is seen as one-shot within a few times ``memory``."""
    r = ReturnShare(window_s=10.0, min_resolved=1, memory=8)
    now = 0.0
    for s in range(100):  # conversations: each comes back
        r.seen(s, 100, now)
        r.seen(s, 200, now + 1)
        now += 1
    assert r.share(now) == 1.0
    for s in range(100, 140):  # one-shots, resolved once the window has passed
        r.seen(s, 100, now)
        now += 1
    assert r.share(now + 10) == pytest.approx((7 / 8) ** 40)


@pytest.mark.parametrize("tokens, returned", [(100, False), (50, False), (101, True)])
def test_a_follow_up_is_returned_before_it_is_seen(tokens: int, returned: bool) -> None:
    """A conversation's first follow-up is routed before the table sees it: a request longer than
    its identity's first is one (the same prompt again, or a shorter one, is not)."""
    r = ReturnShare(window_s=60.0, min_resolved=1)
    r.seen(7, 100, 0.0)
    assert r.returned(7, tokens) is returned
    assert not r.returned(8, tokens)  # an identity not seen


def test_the_table_is_bounded() -> None:
    r = ReturnShare(window_s=60.0, min_resolved=1, max_tracked=3)
    for s in range(5):
        r.seen(s, 100, 0.0)
    r.seen(0, 200, 1.0)  # forgotten: its follow-up is a first sight again
    assert not r.returned(0) and r.share(1.0) is None
    r.seen(4, 200, 1.0)
    assert r.returned(4) and r.share(1.0) == 1.0


# --- what auto does with it ------------------------------------------------------------------

HEAD = text(1, 24_000)  # a 6,000-token system prompt, a slack of 2


def _fleet_with_a_busy_holder(settings: ModelSettings) -> tuple[Scheduler, Clock, list[WorkerState]]:
    """Four workers; w0 holds HEAD and carries 4 requests, past the prompt-size slack of 2."""
    clock = Clock()
    s = Scheduler(RoutingConfig(default=settings), clock=clock)
    ws = fleet(4)
    for w in ws:
        s.on_worker_epoch(w.id, w.epoch)
    s.commit(key(HEAD + text(2, 600)), s.decide(key(HEAD + text(2, 600)), [ws[0]]))
    ws[0].inflight = 4
    return s, clock, ws


def _teach(s: Scheduler, clock: Clock, ws: list[WorkerState], *, follow_ups: bool) -> None:
    """Twenty derived sessions under their own heads, each sent to w1 (so that w0's load and cache
    stay as they are); with ``follow_ups`` each comes back with a longer turn.  Then a minute
    passes, and each resolves."""
    for j in range(20):
        first = text(100 + j, 2000)
        send(s, key(first, session=f"conv:teach{j}"), [ws[1]])
        clock.advance(0.5)
        nxt = first if not follow_ups else first + text(200 + j, 800)
        send(s, key(nxt, session=f"conv:teach{j}"), [ws[1]])
    clock.advance(61.0)


def test_a_one_shot_goes_to_the_busy_holder_of_its_prefix() -> None:
    """Once the model's derived sessions are known not to come back, a new question under a head
    that a busy worker holds goes there (its cost: a short prefill behind 4 requests) instead of
    being held to the slack and copied cold onto an idle worker; the decision line says so."""
    s, clock, ws = _fleet_with_a_busy_holder(ModelSettings(policy="auto"))
    question = key(HEAD + text(3, 600), session="conv:q3")
    before = s.decide(question, ws)
    assert before.worker_id != "w0"  # nothing learned yet: the guards hold
    _teach(s, clock, ws, follow_ups=False)
    d = s.decide(question, ws)
    assert d.worker_id == "w0", d.reason
    assert "one-shot (derived sessions coming back 0 %)" in d.reason


@pytest.mark.parametrize("settings", [{"one_shot_return_share": 0.0}])
def test_the_setting_at_0_keeps_the_guards(settings: dict[str, float]) -> None:
    s, clock, ws = _fleet_with_a_busy_holder(ModelSettings(policy="auto", **settings))
    _teach(s, clock, ws, follow_ups=False)
    d = s.decide(key(HEAD + text(3, 600), session="conv:q3"), ws)
    assert d.worker_id != "w0" and "one-shot" not in d.reason


def test_a_clients_session_keeps_the_guards() -> None:
    """A session the client named is a conversation whatever the derived ones do."""
    s, clock, ws = _fleet_with_a_busy_holder(ModelSettings(policy="auto"))
    _teach(s, clock, ws, follow_ups=False)
    assert s.decide(key(HEAD + text(3, 600), session="client-7"), ws).worker_id != "w0"


def test_a_derived_session_that_came_back_keeps_the_guards() -> None:
    """Among one-shots, a conversation that did come back is placed as a conversation (here: its
    binding's worker left, so it is placed afresh)."""
    s, clock, ws = _fleet_with_a_busy_holder(ModelSettings(policy="auto"))
    _teach(s, clock, ws, follow_ups=False)
    first = HEAD + text(4, 600)
    conv = key(first, session="conv:c4")
    send(s, conv, [ws[2]])
    send(s, key(first + text(5, 800), session="conv:c4"), [ws[2]])
    s.on_worker_removed("w2")
    rest = [w for w in ws if w.id != "w2"]
    d = s.decide(key(first + text(5, 800) + text(6, 800), session="conv:c4"), rest)
    assert d.worker_id != "w0" and "one-shot" not in d.reason


def test_conversations_without_ids_under_one_head_still_spread() -> None:
    """Agents that send no session id come back with follow-ups: the share stays high, and a new
    conversation under a head the busy w0 holds is still held to the slack (had the guards been
    lifted for every derived session, it would pile onto w0)."""
    s, clock, ws = _fleet_with_a_busy_holder(ModelSettings(policy="auto"))
    _teach(s, clock, ws, follow_ups=True)
    d = s.decide(key(HEAD + text(3, 600), session="conv:agent"), ws)
    assert d.worker_id != "w0" and "one-shot" not in d.reason


def test_a_one_shot_is_not_charged_for_the_sessions_living_on_the_holder() -> None:
    """Three clients' sessions live on w0, which holds HEAD: a conversation would join them there
    (and ``balanced_sessions`` keeps it off), but a one-shot sends no later turn beside them, so
    its cost is only the short prefill w0 leaves it."""
    s, clock, ws = _fleet_with_a_busy_holder(ModelSettings(policy="auto"))
    ws[0].inflight = 0
    _teach(s, clock, ws, follow_ups=False)
    for j in range(3):
        send(s, key(text(300 + j, 2000), session=f"client-{j}"), [ws[0]])
    question = s.decide(key(HEAD + text(3, 600), session="conv:q3"), ws[:2])
    assert question.worker_id == "w0", question.reason
    conversation = s.decide(key(HEAD + text(3, 600), session="client-new"), ws[:2])
    assert conversation.worker_id == "w1", conversation.reason


def _turn_beside_questions(*, follow_ups: bool) -> str:
    """A client's session lives on w1, beside ten requests of derived sessions under HEAD (which
    come back with follow-ups or not, as taught); w0 is idle and empty.  Where its next turn goes."""
    s, clock, ws = _fleet_with_a_busy_holder(ModelSettings(policy="auto"))
    ws[0].inflight = 0
    _teach(s, clock, ws, follow_ups=follow_ups)
    history = text(400, 8000)
    send(s, key(history, session="client-a"), [ws[1]])
    for j in range(10):
        send(s, key(HEAD + text(500 + j, 600), session=f"conv:q{j}"), [ws[1]])
    return send(s, key(history + text(401, 1600), session="client-a"), ws[:2])


def test_one_shots_are_no_sessions_living_on_their_worker() -> None:
    """A one-shot sends no later turn, so it is not one of the sessions a worker's future load is
    counted in: the client's turn stays with its history on w1.  Counted, the ten questions made w1
    look ten sessions busier than w0, and the turn left its cache for w0 (what starved the agents
    beside shared-prefix questions at 8 sessions and 1 request/s, docs/saturation.md)."""
    assert _turn_beside_questions(follow_ups=False) == "w1"


def test_conversations_without_ids_are_sessions_living_on_their_worker() -> None:
    """Derived sessions that come back are conversations: each still counts as a session living on
    w1, and ten of them outweigh the client's short history there."""
    assert _turn_beside_questions(follow_ups=True) == "w0"


def test_another_instances_one_shots_are_no_sessions_living_on_their_worker() -> None:
    """The same across router instances: the instance that routed the questions publishes their
    bindings as one-shots', and the one that routes the client's turn does not count them either."""
    a, clock, ws = _fleet_with_a_busy_holder(ModelSettings(policy="auto"))
    ws[0].inflight = 0
    _teach(a, clock, ws, follow_ups=False)
    b = Scheduler(RoutingConfig(default=ModelSettings(policy="auto")), clock=clock)
    for w in ws:
        b.on_worker_epoch(w.id, w.epoch)
    history = text(400, 8000)
    send(b, key(history, session="client-a"), [ws[1]])
    for j in range(10):
        question = key(HEAD + text(500 + j, 600), session=f"conv:q{j}")
        for record in a.commit(question, a.decide(question, [ws[1]])):
            b.apply_remote(record)
    assert send(b, key(history + text(401, 1600), session="client-a"), ws[:2]) == "w1"
