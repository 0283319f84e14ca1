"""The token-exact index: engine events in, matches and modes out (pure, clock passed in)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.routing.config import ModelSettings, RoutingConfig
from kvroute.routing.exact_index import ExactIndex
from kvroute.routing.hashing import token_block_hashes
from kvroute.routing.key import DERIVED_SESSION_PREFIX, RoutingKey
from kvroute.routing.policies.auto import copied_evicting, evicted_tokens
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.token_chains import TokenChains
from kvroute.routing.view import Candidate
from kvroute.routing.worker import WorkerState

BS = 4


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def live(index: ExactIndex, *workers: str, ranks: tuple[int, ...] = (0,)) -> None:
    for w in workers:
        index.attach(w, ranks)
        for r in ranks:
            index.synced(w, r, 0.0)


def test_stored_blocks_match_the_requests_own_hashes() -> None:
    index = ExactIndex()
    live(index, "a")
    toks = tokens(6)
    index.stored("a", 0, [101, 102, 103], None, toks[:3 * BS], BS, None, 1.0)
    index.stored("a", 0, [104, 105], 103, toks[3 * BS:5 * BS], BS, None, 1.0)
    request = token_block_hashes(toks, BS)
    assert index.match(request, ["a"], 1.0) == {"a": 5}
    # A prompt that diverges in block 2 matches only the first two.
    other = toks[:2 * BS] + [999] * (4 * BS)
    assert index.match(token_block_hashes(other, BS), ["a"], 1.0) == {"a": 2}


def test_removal_by_engine_hash_ends_the_match_there() -> None:
    index = ExactIndex()
    live(index, "a")
    toks = tokens(4)
    index.stored("a", 0, [1, 2, 3, 4], None, toks, BS, None, 1.0)
    applied = index.removed("a", 0, [3, 77], 2.0)  # 77: stored before the router listened
    assert applied.removed == 1
    assert index.match(token_block_hashes(toks, BS), ["a"], 2.0) == {"a": 2}
    assert len(index) == 3


def test_unknown_parent_is_an_orphan_not_a_guess() -> None:
    index = ExactIndex()
    live(index, "a")
    applied = index.stored("a", 0, [5, 6], 4, tokens(2, 8), BS, None, 1.0)
    assert applied.orphans == 2 and len(index) == 0


def test_blocks_with_extra_keys_never_match_a_plain_prompt() -> None:
    index = ExactIndex()
    live(index, "a")
    toks = tokens(2)
    index.stored("a", 0, [1, 2], None, toks, BS, [b"salt", None], 1.0)
    assert index.match(token_block_hashes(toks, BS), ["a"], 1.0) == {"a": 0}


def test_clear_and_lost_stream_forget_everything() -> None:
    index = ExactIndex()
    live(index, "a", "b")
    toks = tokens(3)
    for w in ("a", "b"):
        index.stored(w, 0, [1, 2, 3], None, toks, BS, None, 1.0)
    assert index.cleared("a", 0, 2.0).removed == 3
    index.lost("b", 0)
    h = token_block_hashes(toks, BS)
    assert index.match(h, ["a", "b"], 2.0) == {"a": 0, "b": 0}
    assert index.mode("a", 2.0) == "exact"  # a clear is an event: the stream is live
    assert index.mode("b", 2.0) == "approximate"  # until its stream is synchronised again
    assert len(index) == 0


def test_speculative_entries_count_until_their_ttl() -> None:
    index = ExactIndex(speculative_ttl_s=2.0)
    live(index, "a")
    h = token_block_hashes(tokens(3), BS)
    index.speculate("a", h, 10.0)
    assert index.match(h, ["a"], 11.9) == {"a": 3}
    assert index.match(h, ["a"], 12.1) == {"a": 0}


def test_overdue_events_make_a_worker_approximate_until_the_next_event() -> None:
    index = ExactIndex(stale_s=5.0)
    index.attach("a", [0])
    assert index.mode("a", 0.0) == "approximate"  # not synchronised yet
    index.synced("a", 0, 0.0)
    index.expect("a", 1.0)
    assert index.mode("a", 5.9) == "exact"
    assert index.mode("a", 6.1) == "approximate"
    index.stored("a", 0, [1], None, tokens(1), BS, None, 7.0)
    assert index.mode("a", 7.0) == "exact"


def test_more_blocks_than_any_engine_holds_resets_the_source() -> None:
    index = ExactIndex(max_blocks=3)
    live(index, "a")
    applied = index.stored("a", 0, [1, 2, 3, 4], None, tokens(4), BS, None, 1.0)
    assert applied.cleared and len(index) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 2), st.integers(1, 4)), max_size=40))
def test_index_agrees_with_a_plain_model_of_the_engines_cache(ops: list[tuple[bool, int, int]]) -> None:
    """Three conversations' chains stored and evicted at random (a block stored again is a second
    copy, as vLLM keeps them): the index's match is always the leading run of blocks the engine
    holds at least one copy of (model: a count of copies per engine hash)."""
    index = ExactIndex()
    live(index, "a")
    convs = [tokens(4, 1000 * k) for k in range(3)]
    present: Counter[int] = Counter()
    for store, conv, depth in ops:
        engine = [conv * 10 + i for i in range(depth)]
        if store:
            index.stored("a", 0, engine, None, convs[conv][:depth * BS], BS, None, 1.0)
            present.update(engine)
        else:
            index.removed("a", 0, engine[-1:], 1.0)
            if present[engine[-1]]:
                present[engine[-1]] -= 1
    for conv in range(3):
        expected = 0
        while expected < 4 and present[conv * 10 + expected] > 0:
            expected += 1
        assert index.match(token_block_hashes(convs[conv], BS), ["a"], 1.0) == {"a": expected}


def _fleet() -> list[WorkerState]:
    return [WorkerState(id=w, url=f"http://{w}", models=frozenset({"m"}), epoch=1.0) for w in ("a", "b")]


def test_scheduler_routes_on_the_exact_state_and_says_so() -> None:
    clock = [100.0]
    sched = Scheduler(RoutingConfig(), clock=lambda: clock[0])
    workers = _fleet()
    for w in workers:
        sched.on_worker_epoch(w.id, 1.0)
    live(sched.exact, "a", "b")
    toks = tokens(64)
    # "b" really holds the prompt (its events say so); the approximate index knows nothing.
    sched.exact.stored("b", 0, list(range(64)), None, toks, BS, None, 100.0)
    key = RoutingKey(model="m", prefix=b"p" * 1024, est_prompt_tokens=len(toks),
                     token_hashes=tuple(token_block_hashes(toks, BS)), token_block=BS)
    d = sched.decide(key, workers)
    assert d.worker_id == "b" and d.exact and d.matched_blocks == 64 and d.total_blocks == 64
    assert d.held_tokens == len(toks) and "64/64 blocks (exact)" in d.reason
    assert sched.cache_mode("b") == "exact"
    # Committing speculates on the chosen worker before its events arrive.
    sched.commit(key, d)
    assert sched.exact.stats("b")["speculative"] == 64


def test_scheduler_falls_back_to_the_approximate_index_when_events_are_overdue() -> None:
    clock = [100.0]
    sched = Scheduler(RoutingConfig(kv_events_stale_s=5.0), clock=lambda: clock[0])
    workers = _fleet()
    for w in workers:
        sched.on_worker_epoch(w.id, 1.0)
    live(sched.exact, "a", "b")
    toks = tokens(64)
    key = RoutingKey(model="m", prefix=b"q" * 4096, est_prompt_tokens=len(toks),
                     token_hashes=tuple(token_block_hashes(toks, BS)), token_block=BS)
    first = sched.decide(key, workers)
    sched.commit(key, first)  # the approximate index records it too
    sched.on_first_byte(first)  # the prompt was computed: events are due
    clock[0] += 6.0  # none came
    assert sched.cache_mode(first.worker_id or "") == "approximate"
    again = sched.decide(key, workers)
    assert again.worker_id == first.worker_id and not again.exact and again.matched_blocks > 0


def test_a_conversations_next_turn_hashes_only_its_tail() -> None:
    chains = TokenChains()
    turn1 = tokens(10)
    turn2 = turn1 + list(range(5000, 5000 + 3 * BS + 2))
    first = chains.hashes(7, turn1, BS)
    second = chains.hashes(7, turn2, BS)
    assert second == tuple(token_block_hashes(turn2, BS)) and second[:10] == first
    # A fork that rewrites block 4 on shares blocks 0-3 only, and still hashes right.
    fork = turn1[:4 * BS + 1] + [9999] * (7 * BS)
    assert chains.hashes(7, fork, BS) == tuple(token_block_hashes(fork, BS))
    # Without a conversation nothing is remembered.
    assert chains.hashes(None, turn1, BS) == first and len(chains) == 1


def test_the_chains_remembered_are_bounded_by_tokens_too() -> None:
    chains = TokenChains(max_entries=100, max_tokens=10 * BS)
    for conv in range(5):  # four blocks each: the oldest are forgotten past ten blocks in all
        chains.hashes(conv, tokens(4, start=100 * conv), BS)
    assert len(chains) == 2 and chains.tokens == 8 * BS
    huge = tokens(11)  # alone over the budget: hashed right, not remembered
    assert chains.hashes(9, huge, BS) == tuple(token_block_hashes(huge, BS))
    assert len(chains) == 2 and chains.tokens == 8 * BS
    # A conversation's next turn replaces its previous one in the count.
    chains.hashes(4, tokens(5, start=400), BS)
    assert len(chains) == 2 and chains.tokens == 9 * BS


def test_a_block_stored_twice_stays_held_until_both_copies_are_evicted() -> None:
    index = ExactIndex()
    live(index, "a")
    toks = tokens(1)
    index.stored("a", 0, [1], None, toks, BS, None, 1.0)
    index.stored("a", 0, [1], None, toks, BS, None, 1.0)  # a second request cached the same block
    index.removed("a", 0, [1], 2.0)
    assert held_by(index, toks) == 1
    index.removed("a", 0, [1], 2.0)
    assert held_by(index, toks) == 0


def held_by(index: ExactIndex, toks: list[int]) -> int:
    return index.match(token_block_hashes(toks, BS), ["a"], 0.0)["a"]


def test_whether_a_match_is_read_here_is_one_predicate() -> None:
    index = ExactIndex(stale_s=5.0)
    assert not index.readable("a", 0.0, BS) and not index.readable("a", 0.0)  # no events at all
    index.attach("a", [0, 1])
    index.synced("a", 0, 0.0)
    assert not index.readable("a", 0.0, BS)  # rank 1 is not synchronised yet
    index.synced("a", 1, 0.0)
    # Synchronised, nothing stored: its match is truly empty, but its block size is not told.
    assert index.readable("a", 0.0, BS) and index.readable("a", 0.0, 2 * BS)
    assert not index.readable("a", 0.0)
    index.stored("a", 0, [1], None, tokens(1), BS, None, 1.0)
    assert index.readable("a", 1.0, BS) and index.readable("a", 1.0)
    assert not index.readable("a", 1.0, 2 * BS)  # another tokenization's blocks never match
    index.expect("a", 2.0)
    assert index.readable("a", 6.9, BS) and not index.readable("a", 7.1, BS)
    assert index.mode("a", 7.1) == "approximate"


def test_holders_count_speculative_entries() -> None:
    index = ExactIndex(speculative_ttl_s=2.0)
    live(index, "a", "b")
    h = token_block_hashes(tokens(2), BS)
    index.stored("b", 0, [7, 8], None, tokens(2), BS, None, 0.0)
    index.speculate("a", h, 10.0)
    assert index.holders(h[0], 11.0) == {"a", "b"}
    assert index.holders(h[0], 12.5) == {"b"}


def test_evicted_tokens_are_what_a_prefill_pushes_out_of_a_full_cache() -> None:
    w = WorkerState(id="a", url="http://a", kv_tokens=1000)
    cases = [  # (cached tokens, uncached tokens of the request, evicted)
        (None, 500, 0.0),  # the cache is not known (approximate): nothing is charged
        (0.0, 500, 0.0),
        (400.0, 600, 0.0),  # fits exactly beside what is cached
        (700.0, 600, 300.0),
        (1000.0, 600, 600.0),  # a full cache gives up as much as the prefill needs
        (1000.0, 0, 0.0),
    ]
    for cached, uncached, evicted in cases:
        c = Candidate(w, 0, 0, 0, cached_tokens=cached)
        assert evicted_tokens(c, uncached) == evicted, (cached, uncached)
    unknown_size = Candidate(WorkerState(id="b", url="http://b"), 0, 0, 0, cached_tokens=5000.0)
    assert evicted_tokens(unknown_size, 500) == 0.0
    full = Candidate(w, 0, 0, 0, cached_tokens=1000.0)
    assert copied_evicting(full, 600, 0.0) == 0.0  # nobody holds it: a first copy, not charged
    assert copied_evicting(full, 600, 250.0) == 250.0  # only the part another worker holds
    assert copied_evicting(Candidate(w, 0, 0, 0, cached_tokens=0.0), 600, 600.0) == 0.0  # room


def _holder_queued_and_another_cache(other_kv_tokens: int, weight: float,
                                     session_id: str | None = None) -> tuple[str | None, str]:
    """Worker "a" holds the prompt (1,100 blocks) with two requests waiting in its engine; "b" is
    idle and its cache holds 1,100 blocks of another prompt, in a KV cache of ``other_kv_tokens``."""
    clock = [100.0]
    sched = Scheduler(RoutingConfig(default=ModelSettings(evicted_cache_weight=weight)),
                      clock=lambda: clock[0])
    a, b = _fleet()
    b.kv_tokens = other_kv_tokens
    for w in (a, b):
        sched.on_worker_epoch(w.id, 1.0)
    live(sched.exact, "a", "b")
    toks = tokens(1100)
    sched.exact.stored("a", 0, list(range(1100)), None, toks, BS, None, 100.0)
    sched.exact.stored("b", 0, list(range(5000, 6100)), None, tokens(1100, start=10**6), BS, None, 100.0)
    a.waiting = 2
    key = RoutingKey(model="m", prefix=b"e" * 1024, est_prompt_tokens=len(toks), session_id=session_id,
                     token_hashes=tuple(token_block_hashes(toks, BS)), token_block=BS)
    d = sched.decide(key, [a, b])
    return d.worker_id, d.reason


def test_a_cold_prefill_that_would_evict_a_full_cache_waits_for_the_holder_instead() -> None:
    # b's cache is full (1,100 blocks of 4 tokens in 4,400): going there evicts a prompt's worth.
    assert _holder_queued_and_another_cache(4400, 7.0)[0] == "a"
    # Without the weight the shorter queue wins (the prefill's own cost is below a's queue).
    assert _holder_queued_and_another_cache(4400, 0.0)[0] == "b"
    # With room in b's cache the prefill evicts nothing: preference, never a queue.
    assert _holder_queued_and_another_cache(100_000, 7.0)[0] == "b"
    # A session the router derived is charged; one the client named is left to stickiness.
    assert _holder_queued_and_another_cache(4400, 7.0, DERIVED_SESSION_PREFIX + "x")[0] == "a"
    assert _holder_queued_and_another_cache(4400, 7.0, "client-session")[0] == "b"
