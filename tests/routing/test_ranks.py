"""Routing to a data-parallel rank (docs/routing.md, "Exact cache state"): where a worker's ranks
publish KV events and its state is exact, its match is the best of its ranks' and the decision
pins the rank holding it; ties go to the rank with the fewest of this router's requests in flight
(counted by the dispatcher until the request finishes), then to the emptier cache; speculative
entries go to that rank only; an approximate worker gets no rank."""

from __future__ import annotations

from kvroute.routing.config import RoutingConfig
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.exact_index import ExactIndex, pick_rank
from kvroute.routing.hashing import token_block_hashes
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

BS = 4


def tokens(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def live(index: ExactIndex, worker: str, ranks: tuple[int, ...]) -> None:
    index.attach(worker, ranks)
    for r in ranks:
        index.synced(worker, r, 0.0)


def key_of(toks: list[int], prefix: bytes = b"p" * 1024) -> RoutingKey:
    return RoutingKey(model="m", prefix=prefix, est_prompt_tokens=len(toks),
                      token_hashes=tuple(token_block_hashes(toks, BS)), token_block=BS)


def setup(ranks: tuple[int, ...] = (0, 1), workers: tuple[str, ...] = ("a",)) -> tuple[
        list[float], Dispatcher, list[WorkerState]]:
    clock = [100.0]
    sched = Scheduler(RoutingConfig(), clock=lambda: clock[0])
    fleet = [WorkerState(id=w, url=f"http://{w}", models=frozenset({"m"}), epoch=1.0) for w in workers]
    for w in fleet:
        sched.on_worker_epoch(w.id, 1.0)
        live(sched.exact, w.id, ranks)
    return clock, Dispatcher(sched, timer=lambda: clock[0]), fleet


def test_a_worker_matches_the_best_of_its_ranks() -> None:
    index = ExactIndex()
    live(index, "a", (0, 1))
    toks = tokens(4)
    index.stored("a", 0, [1, 2], None, toks[:2 * BS], BS, None, 1.0)
    index.stored("a", 1, [11, 12, 13, 14], None, toks, BS, None, 1.0)
    hashes = token_block_hashes(toks, BS)
    assert index.match(hashes, ["a"], 1.0) == {"a": 4}
    assert index.rank_figures(hashes, "a", 1.0) == {0: (2, 2), 1: (4, 4)}
    assert index.ranks("a") == 2


def test_the_rank_holding_the_longest_match_is_picked() -> None:
    assert pick_rank({0: (2, 10), 1: (5, 10), 2: (0, 0)}, {}, 0) == 1
    # Ties to the fewest in flight, then to the emptier cache, then to the lowest rank.
    assert pick_rank({0: (3, 10), 1: (3, 10)}, {0: 2, 1: 1}, 5) == 1
    assert pick_rank({0: (0, 40), 1: (0, 12)}, {}, 0) == 1
    assert pick_rank({0: (0, 12), 1: (0, 12)}, {}, 0) == 0


def test_a_shared_prefix_does_not_pile_every_request_on_one_rank() -> None:
    # Rank 0 holds the prefix but carries more than the slack beyond rank 1: rank 1 gets it.
    assert pick_rank({0: (8, 8), 1: (0, 0)}, {0: 2, 1: 0}, 1) == 1
    assert pick_rank({0: (8, 8), 1: (0, 0)}, {0: 1, 1: 0}, 1) == 0


def test_the_decision_pins_the_rank_holding_the_history_and_speculates_there() -> None:
    clock, dispatch, fleet = setup()
    sched = dispatch.scheduler
    toks = tokens(16)
    sched.exact.stored("a", 1, list(range(16)), None, toks, BS, None, clock[0])
    key = key_of(toks + tokens(2, 900))
    d = dispatch.route(key, fleet)
    assert d.worker_id == "a" and d.exact and d.rank == 1 and d.matched_blocks == 16
    assert "rank=1" in d.reason
    flight, _ = dispatch.sent(key, d, fleet[0])
    assert fleet[0].rank_inflight == {1: 1}
    # The speculative entries are rank 1's: rank 0 still matches nothing.
    figures = sched.exact.rank_figures(key.token_hashes, "a", clock[0])
    assert figures[0][0] == 0 and figures[1][0] == len(key.token_hashes)
    dispatch.finished(flight, ok=False)
    dispatch.finished(flight, ok=False)   # idempotent: counted down once
    assert fleet[0].rank_inflight == {}


def test_new_conversations_on_an_idle_worker_spread_over_its_ranks() -> None:
    clock, dispatch, fleet = setup()
    first = key_of(tokens(8, 0), b"x" * 1024)
    d1 = dispatch.route(first, fleet)
    flight, _ = dispatch.sent(first, d1, fleet[0])
    second = key_of(tokens(8, 5000), b"y" * 1024)
    d2 = dispatch.route(second, fleet)
    assert {d1.rank, d2.rank} == {0, 1}
    # Once the first has finished, its rank's cache holds it: a third goes to the emptier rank.
    dispatch.finished(flight, ok=True)
    assert d1.rank is not None
    sched = dispatch.scheduler
    sched.exact.stored("a", d1.rank, list(range(8)), None, tokens(8, 0), BS, None, clock[0])
    clock[0] += 10.0     # speculative entries gone
    third = key_of(tokens(8, 9000), b"z" * 1024)
    assert dispatch.route(third, fleet).rank == 1 - d1.rank


def test_one_rank_or_approximate_state_pins_no_rank() -> None:
    _, dispatch, fleet = setup(ranks=(0,))
    key = key_of(tokens(8))
    d = dispatch.route(key, fleet)
    assert d.exact and d.rank is None and "rank=" not in d.reason
    # Two ranks, one not synchronised: the worker is approximate, its engine balances.
    _, dispatch, fleet = setup()
    dispatch.scheduler.exact.lost("a", 1)
    d = dispatch.route(key, fleet)
    assert not d.exact and d.rank is None
    dispatch.sent(key, d, fleet[0])
    assert fleet[0].rank_inflight == {} and fleet[0].inflight == 1
