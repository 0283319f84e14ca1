"""The fleet guard's canary at its default settings, in virtual time: how fast it drains a replica
that corrupts a share of its answers, what share of the fleet's capacity it spends, and whether it
ever drains a healthy one.

    python benchmarks/canary_guard.py                       # 2 % corruption on 1 of 4 replicas
    python benchmarks/canary_guard.py --corrupt-rate 0.05 --runs 100 --healthy-runs 10
    python benchmarks/canary_guard.py --set canary_interval_s=1.0

What is real and what is simulated: the canary's own logic is the router's (``CanaryWatch`` from
guard/canary_watch.py: its schedule, budget, fleet comparison, bound, holds and releases),
driven by a virtual clock ticking like the router's background task.  The replicas are simulated
answers, drawn per reply:

* the corrupt replica answers empty or with a run of ``!`` with probability ``--corrupt-rate``,
  as the simulator's ``--corrupt-rate`` does (sim/server.py ``_reply_text``);
* a healthy replica answers right, except that the *model* gets a share of questions wrong on
  every replica alike (``--model-wrong``: a real model at temperature 0 does), and each reply is
  wrong on its own with probability ``--flip-rate`` (nondeterminism between replicas);
* usage as vLLM reports it: the prompt is the shared prefix plus the question; the cached part is
  the prefix up to a whole 16-token block once a replica has seen it, and a replica evicts it
  before a round with probability ``--evict-rate`` (then the whole prompt is computed again);
  four completion tokens; each round's answers come back ``--reply-s`` later.
* capacity is the router's default prefill speed (1.5e-4 s per token: 6,667 tokens/s per replica),
  the figure the router assumes until it learns the engines' own speed from their answers.

Detection runs start with the fault present (a cold router: the budget starts empty and the first
answer of each replica computes the whole prefix) and stop at the drain or after ``--minutes``.
Healthy runs last ``--healthy-minutes`` with every replica healthy; any hold is a false drain.
"""

from __future__ import annotations

import argparse
import ast
import random
import statistics
import sys
from dataclasses import dataclass, replace
from typing import Any

from kvroute.canary.questions import Verdict
from kvroute.guard.canary_watch import (
    CanaryAnswer,
    CanaryRound,
    CanarySettings,
    CanaryWatch,
    drain_threshold,
    release_rounds,
)
from kvroute.routing.learning import LearningSettings
from kvroute.routing.worker import WorkerState

MODEL = "m"
BLOCK = 16
# The instruction, the question and the chat template around the prefix, in tokens.
QUESTION_TOKENS = 30
COMPLETION_TOKENS = 4
TICK_S = 0.25  # how often the router's task looks at the schedule (canary_runner._MAX_TICK_S)


@dataclass(frozen=True, slots=True)
class Scenario:
    replicas: int
    corrupt: int | None
    corrupt_rate: float
    model_wrong: float
    flip_rate: float
    evict_rate: float
    reply_s: float
    seconds: float
    settings: CanarySettings


@dataclass(frozen=True, slots=True)
class Outcome:
    held_at_s: float | None  # the corrupt replica's first hold
    false_holds: int  # holds of healthy replicas
    spent: float
    capacity_tokens: float  # capacity x time run
    rounds: int


def _prefix(tokens: int, nonce: str) -> str:
    return nonce


def run(scenario: Scenario, seed: int) -> Outcome:
    """One virtual-time run of the canary against simulated answers."""
    rng = random.Random(seed)
    s = scenario.settings
    now = [0.0]
    watch = CanaryWatch(lambda model: s, nonce=f"bench{seed}", clock=lambda: now[0])
    workers = [WorkerState(id=f"r{i}", url=f"http://r{i}", models=frozenset({MODEL}))
               for i in range(scenario.replicas)]
    capacity = 1.0 / LearningSettings().prefill_s_per_token
    prompt = s.canary_prefix_tokens + QUESTION_TOKENS
    cacheable = s.canary_prefix_tokens // BLOCK * BLOCK
    cached: set[str] = set()
    pending: list[tuple[float, CanaryRound]] = []
    held_at: float | None = None
    false_holds = 0
    rounds = 0
    while now[0] < scenario.seconds:
        for due_at, rnd in [p for p in pending if p[0] <= now[0]]:
            pending.remove((due_at, rnd))
            hard = rng.random() < scenario.model_wrong  # this question is beyond the model
            answers = {}
            for ask in rnd.asks:
                if rng.random() < scenario.evict_rate:
                    cached.discard(ask.worker_id)
                hit = cacheable if ask.worker_id in cached else 0
                cached.add(ask.worker_id)
                if ask.worker_id == f"r{scenario.corrupt}" and rng.random() < scenario.corrupt_rate:
                    verdict = Verdict.EMPTY if rng.random() < 0.5 else Verdict.MALFORMED
                elif hard or rng.random() < scenario.flip_rate:
                    verdict = Verdict.WRONG
                else:
                    verdict = Verdict.CORRECT
                answers[ask.worker_id] = CanaryAnswer(verdict, prompt, hit, COMPLETION_TOKENS)
            for change in watch.finish(rnd, answers):
                if not change.hold:
                    continue
                if change.worker_id == f"r{scenario.corrupt}":
                    held_at = now[0] if held_at is None else held_at
                else:
                    false_holds += 1
        if held_at is not None:
            break
        for rnd in watch.due(workers, lambda state: capacity, _prefix):
            rounds += 1
            pending.append((now[0] + scenario.reply_s, rnd))
        now[0] += TICK_S
    budget = watch.budgets().get(MODEL, {"spent_tokens": 0.0})
    capacity_tokens = capacity * scenario.replicas * now[0]
    return Outcome(held_at, false_holds, budget["spent_tokens"], capacity_tokens, rounds)


def _settings(pairs: list[str]) -> CanarySettings:
    values: dict[str, Any] = {}
    for pair in pairs:
        name, _, raw = pair.partition("=")
        try:
            values[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            values[name] = raw
    return replace(CanarySettings(), **values)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--corrupt-rate", type=float, default=0.02)
    p.add_argument("--model-wrong", type=float, default=0.03)
    p.add_argument("--flip-rate", type=float, default=0.001)
    p.add_argument("--evict-rate", type=float, default=0.01)
    p.add_argument("--reply-s", type=float, default=0.2)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--healthy-minutes", type=float, default=30.0)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--healthy-runs", type=int, default=20)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a canary setting")
    a = p.parse_args(argv)
    s = _settings(a.set)
    base = Scenario(a.replicas, 0, a.corrupt_rate, a.model_wrong, a.flip_rate, a.evict_rate, a.reply_s,
                    a.minutes * 60, s)
    print(f"canary: interval {s.canary_interval_s:g} s, budget {s.canary_budget:.1%}, prefix "
          f"{s.canary_prefix_tokens} tokens, window {s.canary_window} (drains above "
          f"{drain_threshold(s.canary_window, s)} faults in a full window), tolerated "
          f"{s.canary_tolerated_rate:.2%} at {s.canary_confidence:g}, release after {release_rounds(s)} "
          "clean rounds")
    print(f"simulated: {a.replicas} replicas, one corrupting {a.corrupt_rate:.1%} of answers; model wrong on "
          f"{a.model_wrong:.0%} of questions everywhere; {a.flip_rate:.2%} per-reply flips; "
          f"{a.evict_rate:.0%} evictions; replies after {a.reply_s:g} s")
    detect = [run(base, seed) for seed in range(a.runs)]
    times = sorted(o.held_at_s for o in detect if o.held_at_s is not None)
    missed = sum(1 for o in detect if o.held_at_s is None)
    share = [o.spent / o.capacity_tokens for o in detect if o.capacity_tokens > 0]
    print(f"\ndetection of {a.corrupt_rate:.1%} corruption, {a.runs} runs of up to {a.minutes:g} min:")
    if times:
        q = statistics.quantiles(times, n=20) if len(times) >= 2 else [times[0]] * 19
        print(f"  drained in {len(times)}/{a.runs} runs; median {statistics.median(times):.0f} s, "
              f"p95 {q[18]:.0f} s, max {times[-1]:.0f} s")
    print(f"  not drained within {a.minutes:g} min: {missed}")
    print(f"  false drains of healthy replicas meanwhile: {sum(o.false_holds for o in detect)}")
    print(f"  canary share of capacity: mean {statistics.fmean(share):.3%}, max {max(share):.3%}")
    healthy = replace(base, corrupt=None, seconds=a.healthy_minutes * 60)
    calm = [run(healthy, 10_000 + seed) for seed in range(a.healthy_runs)]
    print(f"\nhealthy fleet, {a.healthy_runs} runs of {a.healthy_minutes:g} min "
          f"({a.healthy_runs * a.replicas * a.healthy_minutes / 60:g} replica-hours):")
    print(f"  false drains: {sum(o.false_holds for o in calm)}")
    calm_share = [o.spent / o.capacity_tokens for o in calm]
    print(f"  canary share of capacity: mean {statistics.fmean(calm_share):.3%}, "
          f"max {max(calm_share):.3%}; rounds per run "
          f"{statistics.fmean(o.rounds for o in calm):.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
