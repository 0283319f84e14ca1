"""What the engine evicts before a request is scheduled, as the exact index predicts it: the prefill
this router sent and the engine has not computed yet evicts the least recently used blocks no
request in flight uses, a released sequence tail first (pure, clock passed in)."""

from __future__ import annotations

import pytest

from kvroute.routing.config import RoutingConfig
from kvroute.routing.exact_index import ExactIndex
from kvroute.routing.hashing import token_block_hashes
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

BS = 4
X = list(range(0, 4 * BS))  # conversation X: four blocks, engine hashes 10-13
Y = list(range(1000, 1000 + 4 * BS))  # conversation Y: four blocks, engine hashes 20-23
X_HASHES = tuple(token_block_hashes(X, BS))
Y_HASHES = tuple(token_block_hashes(Y, BS))
ANSWER = list(range(5000, 5000 + BS))  # one block of an answer, generated after Y's prompt


def served(index: ExactIndex, hashes: tuple[int, ...], engine: list[int], toks: list[int],
           now: float, answer: bool = False) -> None:
    """A request of ``hashes`` sent to "a", computed (its events), answered and ended; with
    ``answer`` its answer's block is stored while it runs."""
    index.speculate("a", hashes, now)
    index.stored("a", 0, engine, None, toks, BS, None, now)
    index.answered("a", hashes)
    if answer:
        index.stored("a", 0, [engine[-1] + 100], engine[-1], ANSWER, BS, None, now)
    index.released("a", hashes)


def fleet(order: str) -> ExactIndex:
    """"a" holds X and Y (eight blocks), the conversation named first released first."""
    index = ExactIndex()
    index.attach("a", [0])
    index.synced("a", 0, 0.0)
    runs = {"X": (X_HASHES, [10, 11, 12, 13], X), "Y": (Y_HASHES, [20, 21, 22, 23], Y)}
    for t, name in enumerate(order):
        served(index, *runs[name], float(t))
    return index


def queue(index: ExactIndex, blocks: int, first: int = 900) -> tuple[int, ...]:
    """A request of ``blocks`` blocks "a" holds none of, not computed yet."""
    hashes = tuple(range(first, first + blocks))
    index.speculate("a", hashes, 5.0)
    return hashes


@pytest.mark.parametrize(("order", "room", "queued", "x_depth"), [
    ("XY", 8, 0, 4),  # nothing queued: the blocks stay
    ("XY", 8, 1, 3),  # a full cache: the queue takes X's last block (X let go first, tail first)
    ("XY", 8, 3, 1),
    ("XY", 8, 5, 0),  # X gone, then Y's tail
    ("YX", 8, 3, 4),  # Y was let go first: it goes before X
    ("XY", 10, 2, 4),  # two blocks hold nothing cached: the queue fills those first
    ("XY", 10, 3, 3),
])
def test_a_queued_prefill_evicts_the_least_recently_let_go_blocks(order: str, room: int, queued: int,
                                                                   x_depth: int) -> None:
    index = fleet(order)
    queue(index, queued)
    assert index.match(X_HASHES, ["a"], 6.0, {"a": room}) == {"a": x_depth}
    assert index.match(X_HASHES, ["a"], 6.0) == {"a": 4}  # without the cache's size: as held


def test_blocks_in_use_and_answers_being_generated_are_not_evicted() -> None:
    index = fleet("XY")
    # A request continuing X is in flight: X's blocks are in use, Y's tail goes instead.
    index.speculate("a", X_HASHES, 6.0)
    queue(index, 2)
    assert index.match(X_HASHES, ["a"], 6.0, {"a": 8}) == {"a": 4}
    assert index.match(Y_HASHES, ["a"], 6.0, {"a": 8}) == {"a": 2}
    index.released("a", X_HASHES)  # it ended: X is now the most recently let go
    assert index.match(Y_HASHES, ["a"], 6.0, {"a": 8}) == {"a": 2}
    assert index.match(X_HASHES, ["a"], 6.0, {"a": 8}) == {"a": 4}


def test_an_answer_is_in_use_until_its_request_ends_then_goes_before_its_prompt() -> None:
    index = ExactIndex()
    index.attach("a", [0])
    index.synced("a", 0, 0.0)
    # A request of Y is running and has generated one block of its answer (stored after Y's last).
    index.speculate("a", Y_HASHES, 1.0)
    index.stored("a", 0, [20, 21, 22, 23], None, Y, BS, None, 1.0)
    index.answered("a", Y_HASHES)
    index.stored("a", 0, [123], 23, ANSWER, BS, None, 1.5)
    served(index, X_HASHES, [10, 11, 12, 13], X, 2.0)  # X is let go after the answer was stored
    queue(index, 1)
    # Nine blocks held, nine of room: one must go; the answer is older but in use: X's tail goes.
    assert index.match(X_HASHES, ["a"], 2.5, {"a": 9}) == {"a": 3}
    index.released("a", Y_HASHES)  # the answer, then Y's prompt tail first, join after X
    queue(index, 3, first=950)  # four blocks queued in all: X's four, not the answer
    assert index.match(X_HASHES, ["a"], 3.0, {"a": 9}) == {"a": 0}
    assert index.match(Y_HASHES, ["a"], 3.0, {"a": 9}) == {"a": 4}
    queue(index, 2, first=990)  # six: the answer, then Y's last block
    assert index.match(Y_HASHES, ["a"], 3.0, {"a": 9}) == {"a": 3}


@pytest.mark.parametrize(("stored", "answered", "ended", "x_depth"), [
    (0, False, False, 1),  # queued: three blocks to allocate evict X's tail
    (2, False, False, 1),  # two computed, evicting X's last two (told): one more block goes, not 3
    (0, True, False, 4),  # computed: nothing more to allocate
    (0, False, True, 4),  # ended before its first token (aborted): neither
])
def test_a_prompt_is_ahead_until_computed_answered_or_ended(stored: int, answered: bool, ended: bool,
                                                            x_depth: int) -> None:
    index = fleet("XY")
    toks = list(range(3000, 3000 + 3 * BS))
    hashes = tuple(token_block_hashes(toks, BS))
    index.speculate("a", hashes, 5.0)
    if stored:  # the engine evicted X's last blocks for them and said so
        index.removed("a", 0, [13, 12][:stored], 5.5)
        index.stored("a", 0, [30, 31][:stored], None, toks[:stored * BS], BS, None, 5.5)
    if answered:
        index.answered("a", hashes)
    if ended:
        index.released("a", hashes, answered=answered)
    assert index.match(X_HASHES, ["a"], 6.0, {"a": 8}) == {"a": x_depth}


def exact_worker(kv_blocks: int) -> tuple[Scheduler, WorkerState]:
    """A scheduler at t=100 s with one exact worker "a" of ``kv_blocks`` blocks holding X."""
    sched = Scheduler(RoutingConfig(), clock=lambda: 100.0)
    worker = WorkerState(id="a", url="http://a", models=frozenset({"m"}), epoch=1.0,
                         kv_tokens=kv_blocks * BS)
    sched.on_worker_epoch("a", 1.0)
    sched.exact.attach("a", [0])
    sched.exact.synced("a", 0, 0.0)
    sched.exact.stored("a", 0, [10, 11, 12, 13], None, X, BS, None, 100.0)
    return sched, worker


def test_the_decision_predicts_what_the_queue_leaves_of_the_prompt() -> None:
    sched, worker = exact_worker(8)
    sched.exact.stored("a", 0, [20, 21, 22, 23], None, Y, BS, None, 100.0)

    def key(toks: list[int]) -> RoutingKey:
        return RoutingKey(model="m", prefix=str(toks[:8]).encode(), est_prompt_tokens=len(toks),
                          token_hashes=tuple(token_block_hashes(toks, BS)), token_block=BS)

    cold = list(range(7000, 7000 + 3 * BS))  # three blocks to compute, nothing cached
    first = sched.decide(key(cold), [worker])
    sched.commit(key(cold), first)
    worker.inflight += 1
    # The cache is full (eight blocks held of eight, one partly filled by the request in flight):
    # the queued prefill of three blocks evicts the first three of X (stored first) before the turn.
    turn = X + list(range(8000, 8000 + 2 * BS))
    d = sched.decide(key(turn), [worker])
    assert d.exact and d.matched_blocks == 0 and d.held_tokens == 0.0
    sched.on_first_byte(first)  # computed: nothing is ahead any more
    d = sched.decide(key(turn), [worker])
    assert d.matched_blocks == 4 and d.held_tokens == len(X)


def running(answer: int | None, told: int = 0) -> ExactIndex:
    """"a" holds X (let go) and Y, whose request is running: its prompt computed and answered, its
    answer ``answer`` tokens long (None: not fixed), ``told`` blocks of it stored so far."""
    index = ExactIndex()
    index.attach("a", [0])
    index.synced("a", 0, 0.0)
    served(index, X_HASHES, [10, 11, 12, 13], X, 1.0)
    index.speculate("a", Y_HASHES, 2.0, prompt_tokens=len(Y), answer_tokens=answer)
    index.stored("a", 0, [20, 21, 22, 23], None, Y, BS, None, 2.0)
    index.answered("a", Y_HASHES)
    parent = 23
    for i in range(told):
        toks = list(range(6000 + i * BS, 6000 + (i + 1) * BS))
        index.stored("a", 0, [130 + i], parent, toks, BS, None, 2.5)
        parent = 130 + i
    return index


TURN = X_HASHES + tuple(range(700, 702))  # X continued by two blocks: three to allocate (one partial)


@pytest.mark.parametrize(("answer", "told", "room", "depth"), [
    # Eight blocks held of eight: X's four are free but the turn's own, so no free block holds its
    # three: it waits for Y's end, while Y's answer grows a block every four tokens from the head of
    # the free list, X's tail.  Y has done its prompt and half a block of answer (18 of 24 tokens):
    (8, 0, 8, 3),  # its answer ends in 6 tokens, crossing one block boundary: X's last block
    (16, 0, 8, 1),  # 14 tokens to go (three blocks)
    (16, 1, 8, 2),  # one block of it told already: 10 tokens to go, two blocks
    (None, 0, 8, 4),  # the answer is not fixed: when Y ends cannot be told, nothing is predicted
    (16, 0, 11, 4),  # three blocks hold nothing: the turn is admitted at once
    (16, 0, 10, 3),  # two hold nothing: it still waits; Y's growth takes them, then X's last block
])
def test_a_turn_waiting_for_room_loses_what_running_answers_grow_meanwhile(
        answer: int | None, told: int, room: int, depth: int) -> None:
    index = running(answer, told)
    assert index.match(TURN, ["a"], 3.0, {"a": room}) == {"a": depth}
    assert index.match(TURN, ["a"], 3.0) == {"a": 4}  # without the cache's size: as held
    index.released("a", Y_HASHES)  # Y ended: its blocks are free, nothing waits for it any more
    assert index.match(TURN, ["a"], 3.0, {"a": room}) == {"a": 4}


@pytest.mark.parametrize(("answer", "matched"), [(16, 0), (None, 4)])
def test_the_decision_predicts_what_running_answers_leave_of_a_waiting_turn(answer: int | None,
                                                                           matched: int) -> None:
    sched, worker = exact_worker(9)

    def key(toks: list[int]) -> RoutingKey:
        return RoutingKey(model="m", prefix=str(toks[:8]).encode(), est_prompt_tokens=len(toks),
                          token_hashes=tuple(token_block_hashes(toks, BS)), token_block=BS,
                          max_tokens=16, answer_tokens=answer)

    # Y runs: its prompt computed and answered, its answer (16 tokens if fixed) being generated.
    first = sched.decide(key(Y), [worker])
    sched.commit(key(Y), first)
    worker.inflight += 1
    sched.exact.stored("a", 0, [20, 21, 22, 23], None, Y, BS, None, 100.0)
    sched.on_first_byte(first)
    # Eight blocks held of nine, one partly filled by Y: the turn's three blocks do not fit beside
    # X's four, so it waits for Y's end while Y's answer takes three more blocks, the least recently
    # used: X's first three (stored in order, never let go by a request of this router), so the
    # turn finds none of X.  With Y's answer open-ended, when it ends is not known: X as held.
    turn = X + list(range(8000, 8000 + 2 * BS))
    d = sched.decide(key(turn), [worker])
    assert d.exact and d.matched_blocks == matched and d.held_tokens == matched * BS
    sched.released(first, answered=True)  # Y ended: nothing grows any more
    assert sched.decide(key(turn), [worker]).matched_blocks == 4
