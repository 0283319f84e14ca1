"""The block a request's tokens are hashed by before an engine's first KV event (docs/routing.md,
"Exact cache state"): the scraped ``cache_config_info`` says it until the events do, and the
events win where the two differ, so an exact worker's first turns are routed exactly."""

from __future__ import annotations

import pytest

from kvroute.routing.config import RoutingConfig
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.hashing import token_block_hashes
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

SCRAPED, TOLD = 4, 8


def fleet(told: int | None, scraped: int | None, synced: bool = True) -> tuple[Dispatcher, WorkerState]:
    """One worker "a" publishing KV events (synchronised or not), whose events told ``told`` (None:
    it stored nothing yet) and whose metrics said ``scraped`` (None: no scrape said it)."""
    clock = [100.0]
    sched = Scheduler(RoutingConfig(), clock=lambda: clock[0])
    dispatch = Dispatcher(sched, timer=lambda: clock[0])
    worker = WorkerState(id="a", url="http://a", models=frozenset({"m"}), epoch=1.0)
    sched.on_worker_epoch("a", 1.0)
    sched.exact.attach("a", [0])
    if synced:
        sched.exact.synced("a", 0, 0.0)
    if told is not None:
        sched.exact.stored("a", 0, [1], None, list(range(told)), told, None, 1.0)
    dispatch.scraped(worker, 0, 0, 0.0, 1000 if scraped else None, block_size=scraped)
    return dispatch, worker


@pytest.mark.parametrize(("told", "scraped", "synced", "block", "exact"), [
    (None, None, True, None, False),  # nothing says the block: the tokens cannot be hashed
    (None, SCRAPED, True, SCRAPED, True),  # the cold start: the metrics say it
    (TOLD, None, True, TOLD, True),
    (TOLD, SCRAPED, True, TOLD, True),  # the events win (a hybrid model's engine may differ)
    (None, SCRAPED, False, SCRAPED, False),  # known, but the events are not synchronised
])
def test_the_block_is_the_events_else_the_scraped_one(told: int | None, scraped: int | None, synced: bool,
                                                      block: int | None, exact: bool) -> None:
    dispatch, worker = fleet(told, scraped, synced)
    assert dispatch.scheduler.block_size(worker) == block
    assert (dispatch.scheduler.exact_worker("m", [worker]) is worker) is exact


@pytest.mark.parametrize("blocks", [1, 3])
def test_a_first_turn_before_any_event_is_routed_exactly(blocks: int) -> None:
    dispatch, worker = fleet(None, SCRAPED)
    block = dispatch.scheduler.block_size(worker)
    assert block == SCRAPED
    toks = list(range(blocks * block))
    key = RoutingKey(model="m", prefix=b"p" * 1024, est_prompt_tokens=len(toks),
                     token_hashes=tuple(token_block_hashes(toks, block)), token_block=block)
    d = dispatch.route(key, [worker])
    assert d.exact and d.matched_blocks == 0 and d.total_blocks == blocks
    dispatch.sent(key, d, worker)
    # The next request of the same prompt, before the engine has told anything: what was just
    # sent there is counted as held.
    again = dispatch.route(key, [worker])
    assert again.exact and again.matched_blocks == blocks
