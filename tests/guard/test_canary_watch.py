"""The canary's pure decisions (guard/canary_watch.py) on a virtual clock: the bound, the
fleet comparison, drain and release, the budget."""

from __future__ import annotations

import math

import pytest

from kvroute.canary.binomial_bound import binomial_cdf, upper_bound
from kvroute.canary.questions import Verdict
from kvroute.guard.canary_watch import (
    CanaryAnswer,
    CanaryRound,
    CanarySettings,
    CanaryWatch,
    drain_threshold,
    is_fault,
    release_rounds,
    rounds_to_drain,
)
from kvroute.routing.worker import WorkerState

MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fleet(n: int = 4) -> list[WorkerState]:
    return [WorkerState(id=f"w{i}", url=f"http://w{i}", models=frozenset({MODEL})) for i in range(n)]


def watch(clock: Clock, **settings: object) -> tuple[CanaryWatch, CanarySettings]:
    s = CanarySettings(**settings)  # type: ignore[arg-type]
    return CanaryWatch(lambda model: s, nonce="n0", clock=clock), s


def prefix(tokens: int, nonce: str) -> str:
    return f"prefix {nonce} {tokens}"


def answer(verdict: Verdict, *, prompt: int = 100, cached: int = 90, completion: int = 3) -> CanaryAnswer:
    return CanaryAnswer(verdict, prompt, cached, completion)


def next_round(w: CanaryWatch, clock: Clock, workers: list[WorkerState], step: float = 1.0) -> CanaryRound:
    """Advance the clock until a round is due (bounded) and return it."""
    for _ in range(1000):
        rounds = w.due(workers, lambda state: 1e6, prefix)
        if rounds:
            assert len(rounds) == 1
            return rounds[0]
        clock.now += step
    raise AssertionError("no round became due")


def test_the_threshold_is_the_binomial_quantile_at_the_tolerated_rate() -> None:
    s = CanarySettings()
    for n in (1, 2, 10, 150, 600):
        k = drain_threshold(n, s)
        assert binomial_cdf(k, n, s.canary_tolerated_rate) >= s.canary_confidence
        if k > 0:
            assert binomial_cdf(k - 1, n, s.canary_tolerated_rate) < s.canary_confidence
    assert drain_threshold(s.canary_window, s) == 6  # 7 faults in 600 rounds drain at the defaults


def test_release_needs_a_clean_run_that_bounds_the_rate() -> None:
    s = CanarySettings(canary_release_rate=0.01)
    n = release_rounds(s)
    assert upper_bound(0, n, 0.95) <= 0.01 < upper_bound(0, n - 1, 0.95)
    assert n == math.ceil(math.log(0.05) / math.log(0.99))  # 299: the rule of three's 300, exactly


def test_rounds_to_drain_follow_the_bound() -> None:
    s = CanarySettings()
    assert rounds_to_drain(1.0, s) == drain_threshold(s.canary_window, s) + 1
    fast, slow = rounds_to_drain(0.5, s), rounds_to_drain(0.05, s)
    assert fast is not None and slow is not None and fast < slow
    assert rounds_to_drain(0.001, s) is None  # below the tolerated rate: never with certainty


@pytest.mark.parametrize(("verdict", "others_right", "fault"), [
    (Verdict.CORRECT, False, False),
    (Verdict.EMPTY, False, True),  # the corruption signature counts on its own
    (Verdict.MALFORMED, False, True),
    (Verdict.WRONG, True, True),  # wrong where another replica was right
    (Verdict.WRONG, False, None),  # the model cannot do it: says nothing about the replica
    (Verdict.TRUNCATED, True, True),
    (Verdict.ERROR, True, None),  # the breaker's business
])
def test_what_counts_against_a_replica(verdict: Verdict, others_right: bool, fault: bool | None) -> None:
    assert is_fault(verdict, others_right) is fault


def test_a_corrupt_replica_is_held_then_released_after_a_clean_run() -> None:
    clock = Clock()
    w, s = watch(clock, canary_budget=1.0, canary_release_rate=0.1)
    workers = fleet()
    for _ in range(rounds_to_drain(1.0, s) or 0):
        rnd = next_round(w, clock, workers)
        changes = w.finish(rnd, {"w0": answer(Verdict.EMPTY), "w1": answer(Verdict.CORRECT),
                                 "w2": answer(Verdict.CORRECT), "w3": answer(Verdict.CORRECT)})
    assert [(c.worker_id, c.hold) for c in changes] == [("w0", True)]
    record = w.replica("w0")
    assert record is not None and record.held and record.held_after == rounds_to_drain(1.0, s)
    # Held, it is still asked (held replicas are in the round) until a clean run releases it.
    workers[0].guard_holds = frozenset({"canary"})
    needed = release_rounds(s)
    for i in range(needed):
        rnd = next_round(w, clock, workers)
        assert "w0" in [a.worker_id for a in rnd.asks]
        changes = w.finish(rnd, {a.worker_id: answer(Verdict.CORRECT) for a in rnd.asks})
        assert [(c.worker_id, c.hold) for c in changes] == ([("w0", False)] if i == needed - 1 else [])
    assert not w.replica("w0").held  # type: ignore[union-attr]


def test_a_few_early_faults_do_not_drain_a_replica_asked_only_a_few_times() -> None:
    clock = Clock()
    w, s = watch(clock, canary_budget=1.0)
    workers = fleet(2)
    limit = drain_threshold(s.canary_window, s)
    for i in range(limit + 5):
        rnd = next_round(w, clock, workers)
        verdict = Verdict.WRONG if i < limit else Verdict.CORRECT  # `limit` faults in a row, first thing
        assert w.finish(rnd, {"w0": answer(verdict), "w1": answer(Verdict.CORRECT)}) == []
    record = w.replica("w0")
    assert record is not None and record.wrong == limit and not record.held


def test_a_question_the_model_gets_wrong_everywhere_drains_nobody() -> None:
    clock = Clock()
    w, _ = watch(clock, canary_budget=1.0)
    workers = fleet()
    for _ in range(50):
        rnd = next_round(w, clock, workers)
        assert w.finish(rnd, {a.worker_id: answer(Verdict.WRONG) for a in rnd.asks}) == []
    record = w.replica("w1")
    assert record is not None and record.unjudged == 50 and record.wrong == 0


def test_the_budget_caps_what_rounds_cost() -> None:
    clock = Clock()
    s = CanarySettings(canary_budget=0.01, canary_interval_s=0.1, canary_burst_s=10.0,
                       canary_prefix_tokens=1000)
    w = CanaryWatch(lambda model: s, nonce="n", clock=clock)
    workers = fleet(2)
    capacity = 1000.0  # tokens/s per replica: the budget is 20 tokens/s for the model
    rounds = 0
    for _ in range(3000):  # 300 s
        for rnd in w.due(workers, lambda state: capacity, prefix):
            rounds += 1
            # The first answer of each replica computes the prefix, the rest hit the cache.
            cached = 0 if rounds == 1 else 1040
            w.finish(rnd, {a.worker_id: answer(Verdict.CORRECT, prompt=1050, cached=cached, completion=3)
                           for a in rnd.asks})
        clock.now += 0.1
    budget = w.budgets()[MODEL]
    assert budget["allowed_tokens"] == pytest.approx(0.01 * 2 * capacity * 299.9, rel=1e-3)
    # What was spent never runs ahead of what was earned, even with the first, uncached answers.
    assert budget["spent_tokens"] <= budget["allowed_tokens"]
    # ... and the budget, not the interval, set the pace: it spent all but the reserve a round's
    # worst case (both replicas computing the whole prompt) keeps in the bucket.
    worst = 2 * (1000 + 64 + s.canary_max_tokens)
    assert budget["spent_tokens"] >= budget["allowed_tokens"] - 2 * worst
    assert budget["skipped_rounds"] > 0 and 50 < rounds < 300 / s.canary_interval_s


def test_a_restarted_replica_is_estimated_at_the_full_prefix_again() -> None:
    clock = Clock()
    w, s = watch(clock, canary_budget=1.0)
    workers = fleet(1)
    rnd = next_round(w, clock, workers)
    assert rnd.asks[0].estimate == s.canary_prefix_tokens + 64 + s.canary_max_tokens
    w.finish(rnd, {"w0": answer(Verdict.CORRECT, prompt=4200, cached=4190, completion=2)})
    second = next_round(w, clock, workers)
    assert second.asks[0].estimate == 12  # what the last answer cost: the prefix came from the cache
    w.finish(second, {"w0": answer(Verdict.CORRECT, prompt=4200, cached=4190, completion=2)})
    workers[0].epoch = 5.0  # restarted: its cache is empty
    assert next_round(w, clock, workers).asks[0].estimate == rnd.asks[0].estimate


def test_off_switch_and_unserved_replicas() -> None:
    clock = Clock()
    w, _ = watch(clock, canary=False)
    assert w.due(fleet(), lambda state: 1e6, prefix) == []
    w2, _ = watch(clock, canary_budget=1.0)
    down = fleet(3)
    down[0].healthy, down[1].draining = False, True
    down[2].models = frozenset()
    clock.now = 100.0
    assert w2.due(down, lambda state: 1e6, prefix) == []


def test_canary_settings_are_routing_settings_and_are_validated() -> None:
    from kvroute.router_settings import Settings, SettingsError

    config = Settings.from_dict({"routing": {"canary_budget": 0.005},
                                 "models": {"big": {"canary": False}}}).routing_config()
    assert config.settings_for("small").block(CanarySettings).canary_budget == 0.005
    assert config.settings_for("big").block(CanarySettings).canary is False
    for bad in ({"canary_budget": 2.0}, {"canary_interval_s": 0}, {"canary_tolerated_rate": 0.0}):
        with pytest.raises(SettingsError, match=next(iter(bad))):
            Settings.from_dict({"routing": bad})


def test_the_spent_counter_only_grows_and_a_replica_gone_stays_gone() -> None:
    """Rounds are charged to the bucket at their estimate but counted as spent only when they are
    settled (a Prometheus counter must not go down when the real, cached cost comes in); a replica
    removed during a round is not brought back by its answer."""
    clock = Clock()
    w, _ = watch(clock, canary_budget=1.0)
    workers = fleet(2)
    seen = [0.0]
    for n in range(4):
        rnd = next_round(w, clock, workers)
        seen.append(w.budgets()[MODEL]["spent_tokens"])
        if n == 3:
            w.forget("w1")
        w.finish(rnd, {a.worker_id: answer(Verdict.CORRECT) for a in rnd.asks})
        seen.append(w.budgets()[MODEL]["spent_tokens"])
    assert seen == sorted(seen) and seen[-1] > 0
    assert "w1" not in w.replicas()
