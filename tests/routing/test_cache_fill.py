"""The estimate of an approximate worker's cache: how full it is and what it has pushed out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.routing.cache_fill import CacheFill
from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.decision import Decision, DecisionKind
from kvroute.routing.key import DERIVED_SESSION_PREFIX, RoutingKey
from kvroute.routing.prefix_index import PrefixIndex
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState


def test_nothing_is_evicted_until_a_pool_was_computed() -> None:
    fill = CacheFill()
    fill.computed("a", 1.0, 10.2, 600)
    fill.computed("a", 1.0, 10.9, 300)  # same second
    fill.computed("a", 1.0, 12.0, 200)
    assert fill.horizon("a", 1.0, 1200) is None  # 1,100 computed < a 1,200-token pool
    assert fill.fill("a", 1.0, 1200) == 1100.0
    assert fill.horizon("a", 1.0, 1000) == 10  # only what came before second 10 is gone
    assert fill.horizon("a", 1.0, 200) == 12  # 200 computed after second 10: it is gone
    assert fill.horizon("a", 1.0, 1000, pinned=850) == 12  # running requests shrink the pool
    assert fill.horizon("a", 1.0, 1000, pinned=1000) == 13  # a pinned KV keeps nothing
    assert fill.fill("a", 1.0, 1000) == 1000.0  # full
    assert fill.horizon("a", 1.0, None) is None and fill.fill("a", 1.0, None) is None


def test_a_new_epoch_starts_empty_and_an_older_one_is_ignored() -> None:
    fill = CacheFill()
    fill.computed("a", 1.0, 10.0, 5000)
    assert fill.fill("a", 1.0, 1000) == 1000.0
    assert fill.fill("a", 2.0, 1000) == 0.0 and fill.horizon("a", 2.0, 1000) is None
    fill.computed("a", 2.0, 11.0, 100)
    fill.computed("a", 1.0, 12.0, 5000)  # a late report from before the restart
    assert fill.fill("a", 2.0, 1000) == 100.0
    assert fill.fill("a", 1.0, 1000) == 0.0  # the old epoch's count is gone
    fill.forget("a")
    assert fill.fill("a", 2.0, 1000) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 400)), min_size=1, max_size=60),
       st.integers(1, 3000), st.integers(0, 3000))
def test_horizon_agrees_with_counting_every_second(steps: list[tuple[int, int]], kv: int,
                                                   pinned: int) -> None:
    # Reference: a second t is gone once a pool's worth was computed after its end; the horizon is
    # the first second after the last gone one (asked after every report, as routing does).
    fill, now = CacheFill(), 100
    per_second: dict[int, int] = {}
    for gap, tokens in steps:
        now += gap
        fill.computed("a", 1.0, now + 0.5, tokens)
        per_second[now] = per_second.get(now, 0) + tokens
        total, pool = sum(per_second.values()), max(kv - pinned, 0)
        gone = [t for t in range(99, now + 1)
                if total - sum(v for s, v in per_second.items() if s <= t) >= pool]
        expected = max(gone) + 1 if total >= pool and gone else None
        assert fill.horizon("a", 1.0, kv, pinned) == expected


def test_matches_older_than_a_slots_horizon_are_not_counted() -> None:
    index = PrefixIndex()
    for w in ("a", "b"):
        index.register(w, 1.0)
    index.record([1, 2, 3], "a", 1.0, 10.0)
    index.record([1, 2, 3], "b", 1.0, 10.0)
    index.record([1, 2], "a", 1.0, 20.0)  # a served the first two blocks again later
    slots = index.slots_of([("a", 1.0), ("b", 1.0)])
    a, b = (slot for slot, i in sorted(slots.items(), key=lambda kv: kv[1]))
    assert index.match([1, 2, 3], slots, 30.0) == {a: 3, b: 3}
    assert index.match([1, 2, 3], slots, 30.0, {a: 15}) == {a: 2, b: 3}
    assert index.match([1, 2, 3], slots, 30.0, {a: 15, b: 11}) == {a: 2}
    assert index.match([1, 2, 3], slots, 30.0, {}) == index.match([1, 2, 3], slots, 30.0)


def _fleet() -> list[WorkerState]:
    return [WorkerState(id=w, url=f"http://{w}", models=frozenset({"m"}), epoch=1.0, kv_tokens=40_000)
            for w in ("a", "b")]


def _sent(sched: Scheduler, key: RoutingKey, worker: str, prefill: int) -> None:
    hashes = sched.hashes(key)
    sched.commit(key, Decision(worker_id=worker, kind=DecisionKind.COLD, policy="auto", reason="",
                               block_hashes=hashes, worker_epoch=1.0, prefill_tokens=prefill,
                               est_tokens=key.est_prompt_tokens))


def _key(prefix: bytes, session_id: str | None = None) -> RoutingKey:
    return RoutingKey(model="m", prefix=prefix, est_prompt_tokens=len(prefix) // 4, session_id=session_id)


def _scheduler(**values: object) -> tuple[Scheduler, list[float], list[WorkerState]]:
    clock = [100.0]
    sched = Scheduler(RoutingConfig(default=ModelSettings(**values)), clock=lambda: clock[0])
    workers = _fleet()
    for w in workers:
        sched.on_worker_epoch(w.id, 1.0)
    return sched, clock, workers


def test_a_prefix_served_before_a_pool_of_computing_is_taken_as_evicted() -> None:
    sched, clock, (a, _) = _scheduler()
    prompt = b"s" * 24_000  # ~6,000 tokens
    _sent(sched, _key(prompt), "a", 6000)
    clock[0] = 101.0
    assert sched.decide(_key(prompt), [a]).matched_blocks > 0
    # a then computes 40,000 tokens of other prompts: the KV's worth.
    for i in range(8):
        clock[0] = 102.0 + i
        _sent(sched, _key(bytes([65 + i]) * 20_000), "a", 5000)
    clock[0] = 120.0
    assert sched.decide(_key(prompt), [a]).matched_blocks == 0
    # A client's session is left to the cache-survival discount; so is everything when off.
    assert sched.decide(_key(prompt, "client-session"), [a]).matched_blocks > 0
    off, clock_off, (a_off, _) = _scheduler(approximate_eviction=False)
    _sent(off, _key(prompt), "a", 6000)
    for i in range(8):
        clock_off[0] = 102.0 + i
        _sent(off, _key(bytes([65 + i]) * 20_000), "a", 5000)
    clock_off[0] = 120.0
    assert off.decide(_key(prompt), [a_off]).matched_blocks > 0


def test_finished_requests_count_what_they_computed_beyond_the_prediction() -> None:
    sched, clock, (a, _) = _scheduler()
    prompt = b"s" * 24_000
    key = _key(prompt)
    _sent(sched, key, "a", 100)  # predicted mostly cached ...
    decision = Decision(worker_id="a", kind=DecisionKind.PREFIX_HIT, policy="auto", reason="",
                        worker_epoch=1.0, prefill_tokens=100)
    # ... the engine computed it all, and generated 34,000 tokens.
    clock[0] = 101.0
    sched.on_finished("a", prompt_tokens=6000, cached_tokens=0, output_tokens=34_000, decision=decision)
    assert sched.decide(key, [a]).matched_blocks > 0  # 39,900 since the prompt: still held
    clock[0] = 102.0
    sched.on_finished("a", prompt_tokens=6000, cached_tokens=2000, output_tokens=0, decision=decision)
    assert sched.decide(key, [a]).matched_blocks == 0  # 3,900 more: past the KV's 40,000


def _holder_queued_and_another_full(b_computed: int, session_id: str | None = None,
                                    **values: object) -> str | None:
    """"a" served the prompt and has two requests waiting in its engine; "b" is idle and computed
    ``b_computed`` tokens of other prompts (its KV holds 40,000)."""
    sched, clock, (a, b) = _scheduler(**values)
    prompt = b"p" * 24_000
    _sent(sched, _key(prompt), "a", 6000)
    for i in range(b_computed // 5000):
        _sent(sched, _key(bytes([65 + i]) * 20_000), "b", 5000)
    a.waiting = 2
    clock[0] = 101.0
    return sched.decide(_key(prompt, session_id), [a, b]).worker_id


def test_a_copy_into_an_estimated_full_cache_waits_for_the_holder_instead() -> None:
    assert _holder_queued_and_another_full(40_000) == "a"
    assert _holder_queued_and_another_full(40_000, DERIVED_SESSION_PREFIX + "x") == "a"
    # With room in b's cache, or the estimate off, or a client's session: the shorter queue.
    assert _holder_queued_and_another_full(10_000) == "b"
    assert _holder_queued_and_another_full(40_000, approximate_eviction=False) == "b"
    assert _holder_queued_and_another_full(40_000, "client-session") == "b"


@pytest.mark.parametrize("before, after, second, pinned, expected", [
    (0, 0, 101, 0, 1.0),  # nothing computed: nothing can have been evicted
    (20_000, 0, 101, 0, 1.0),  # 26,000 < the 40,000-token pool: still room
    (40_000, 0, 101, 0, 34_000 / 40_000),  # full: the match's own 6,000 since
    (40_000, 20_000, 101, 0, 14_000 / 40_000),  # 26,000 of the pool computed since
    (40_000, 20_000, 102, 0, 20_000 / 40_000),  # served again with the 20,000 since
    (40_000, 20_000, 103, 0, 1.0),  # served again after everything computed
    (40_000, 20_000, 101, 10_000, 4_000 / 30_000),  # running requests shrink the pool
    (40_000, 40_000, 101, 0, 0.0),  # a pool's worth since: the least recently used, gone
])
def test_a_match_survives_by_the_share_of_the_pool_not_computed_since(
        before: int, after: int, second: int, pinned: int, expected: float) -> None:
    fill = CacheFill()
    fill.computed("a", 1.0, 100.0, before)
    fill.computed("a", 1.0, 101.0, 6000)  # the match's own prefill
    fill.computed("a", 1.0, 102.0, after)
    assert fill.survival("a", 1.0, 40_000, pinned, second) == pytest.approx(expected)


def test_the_index_tells_the_second_each_slot_last_served_its_match() -> None:
    index = PrefixIndex()
    for w in ("a", "b"):
        index.register(w, 1.0)
    index.record([1, 2, 3], "a", 1.0, 10.0)
    index.record([1, 2, 3], "b", 1.0, 12.0)
    index.record([1, 2], "a", 1.0, 20.0)  # a served only the shared head again
    slots = index.slots_of([("a", 1.0), ("b", 1.0)])
    a, b = (slot for slot, i in sorted(slots.items(), key=lambda kv: kv[1]))
    stamps: dict[int, int] = {}
    assert index.match([1, 2, 3], slots, 30.0, None, stamps) == {a: 3, b: 3}
    assert stamps == {a: 10, b: 12}
    stamps.clear()
    assert index.match([1, 2, 4], slots, 30.0, None, stamps) == {a: 2, b: 2}
    assert stamps == {a: 20, b: 12}


def _two_holders(a_queued: int, b_after: int, **values: object) -> str | None:
    """Both full workers served the prompt at second 101; "a" served it again at 110 and has
    ``a_queued`` tokens of another prompt in flight to prefill; "b" computed ``b_after`` tokens of other
    prompts since 101 and has nothing queued."""
    sched, clock, (a, b) = _scheduler(**values)
    prompt = b"p" * 24_000
    for w in ("a", "b"):
        _sent(sched, _key(bytes([97]) * 20_000 + w.encode()), w, 20_000)
        _sent(sched, _key(bytes([98]) * 20_000 + w.encode()), w, 20_000)
    clock[0] = 101.0
    _sent(sched, _key(prompt), "a", 6000)
    _sent(sched, _key(prompt), "b", 6000)
    clock[0] = 102.0
    for i in range(b_after // 2000):
        _sent(sched, _key(bytes([65 + i]) * 8_000), "b", 2000)
    clock[0] = 110.0
    _sent(sched, _key(prompt + b"q"), "a", 0)
    clock[0] = 300.0  # the backlogs drained; then a is sent another prompt
    _sent(sched, _key(b"z" * 4 * a_queued), "a", a_queued)
    a.inflight = 1
    return sched.decide(_key(prompt + b"r"), [a, b]).worker_id


@pytest.mark.parametrize("a_queued, b_after, values, expected", [
    (3000, 20_000, {}, "a"),  # b's copy is 26,000 tokens old: priced as the prefill it may be
    (3000, 20_000, {"approximate_survival": False}, "b"),  # before: the shorter queue
    (3000, 2_000, {}, "b"),  # a copy b used recently still takes the load
    (500, 2_000, {}, "a"),  # ... unless the queues are close
    (12_000, 20_000, {}, "b"),  # a queue long enough moves even a group's seldom-used copy
    (3000, 20_000, {"approximate_eviction": False}, "b"),  # nothing estimated: no ageing either
])
def test_a_group_stays_with_the_holder_that_serves_it_most(a_queued: int, b_after: int,
                                                           values: dict[str, object],
                                                           expected: str) -> None:
    assert _two_holders(a_queued, b_after, **values) == expected
