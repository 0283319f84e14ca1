"""The canary on a schedule, as pure decisions: what to ask which replica when, within what budget,
and the verdict — drain a replica whose wrong answers exceed the binomial bound, bring it back after
a clean run.

A *round* asks every replica of one model the same arithmetic question (``canary/questions.py``)
behind the same long prefix, so from the second round on the prefix is served from each replica's
prefix cache: the path where corruption showed upstream.  Each reply is judged against the exact
answer *and* against the fleet:

* an empty reply or a run of ``!`` (the corruption seen upstream), or a 200 that is not a chat
  completion at all, is a fault on its own;
* a wrong number is a fault only when another replica answered the same question right — a model
  that gets a question wrong at temperature 0 gets it wrong everywhere, and that says nothing
  about any one replica (a fleet of one therefore only ever counts the corruption signature);
* a transport failure or an HTTP error is not judged here (the circuit breaker's business).

The verdict uses the canary's own statistics (``canary/binomial_bound.py``): in ``canary_window``
judged rounds, a replica whose fault rate were ``canary_tolerated_rate`` would show at most
``drain_threshold(canary_window)`` faults with probability ``canary_confidence``; more than that
among its last ``canary_window`` rounds drains it (fewer rounds asked count as a window padded
with clean ones).  A held replica keeps being asked; once ``release_rounds`` rounds in a row are
clean (enough that the exact 95 % upper bound on its fault rate is below ``canary_release_rate``)
it is released.

The budget is a token bucket per model, in engine work (uncached prompt tokens plus completion
tokens, as each reply's usage reports them), refilled at ``canary_budget`` of the model's measured
capacity (the caller's figure: the router's learned prefill speed of each replica).  A round goes
only when the bucket holds its worst case (every replica computing the whole prompt, as large as
the engines have reported it) and is charged its estimate (what the replica's last answer cost),
settled when the usage arrives: so the tokens spent never exceed the tokens the budget has granted
(before the first answers, a prompt counts at its nominal size).  The clock is
injected; nothing here does I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvroute.canary.binomial_bound import binomial_cdf, upper_bound
from kvroute.canary.questions import Question, Verdict, make_questions
from kvroute.routing.settings import check_non_negative, setting
from kvroute.routing.worker import WorkerState

# The release bound's confidence: the usual one-sided 95 % (the drain's is a setting).
RELEASE_CONFIDENCE = 0.95
# What a reply adds to the prompt beyond the shared prefix before any usage is known: the
# instruction, the question and the chat template's markers (generous, so the first estimate is high).
_QUESTION_TOKENS = 64
_SIGNATURE = frozenset((Verdict.EMPTY, Verdict.MALFORMED))
_COMPARED = frozenset((Verdict.WRONG, Verdict.TRUNCATED))


@dataclass(frozen=True, slots=True)
class CanarySettings:
    """The fleet guard's canary (docs/fleet-guard.md): per model, like every routing block."""

    canary: bool = setting(
        True, "ask every replica an arithmetic question behind a long shared prefix on a schedule, "
              "and hold out a replica whose answers are wrong (false: off)")
    canary_interval_s: float = setting(0.5, "seconds between two canary rounds (one question per replica)")
    canary_budget: float = setting(
        0.01, "share of the replicas' measured prefill capacity the canary may spend (hard cap)")
    canary_burst_s: float = setting(120.0, "seconds of unspent canary budget that may be saved up")
    canary_prefix_tokens: int = setting(2048, "length of the prefix every canary question shares")
    canary_max_tokens: int = setting(16, "reply length limit of a canary question")
    canary_timeout_s: float = setting(30.0, "seconds a canary question may take")
    canary_window: int = setting(600, "judged rounds per replica the drain decision looks at")
    canary_tolerated_rate: float = setting(
        0.002, "fault rate a healthy replica may show (faults: empty or '!!!' replies, and wrong "
               "numbers where another replica was right)")
    canary_confidence: float = setting(
        0.999, "drain when the faults exceed what a replica at the tolerated rate shows with this "
               "probability")
    canary_release_rate: float = setting(
        0.01, "a held replica returns after enough clean rounds in a row to bound its fault rate "
              "below this (95% one-sided)")

    def __post_init__(self) -> None:
        for name in ("canary_interval_s", "canary_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        check_non_negative(self, "canary_burst_s", "canary_prefix_tokens")
        if not 0.0 <= self.canary_budget <= 1.0:
            raise ValueError("canary_budget must be between 0 and 1")
        if self.canary_max_tokens < 1 or self.canary_window < 1:
            raise ValueError("canary_max_tokens and canary_window must be at least 1")
        for name in ("canary_tolerated_rate", "canary_confidence", "canary_release_rate"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be between 0 and 1 (exclusive)")


# --- the bound -------------------------------------------------------------------------------------

_THRESHOLDS: dict[tuple[int, float, float], int] = {}


def drain_threshold(rounds: int, s: CanarySettings) -> int:
    """The most faults a replica at the tolerated rate shows in ``rounds`` judged rounds with
    probability ``canary_confidence``: one more drains it."""
    key = (rounds, s.canary_tolerated_rate, s.canary_confidence)
    cached = _THRESHOLDS.get(key)
    if cached is None:
        cached = 0
        while cached < rounds and binomial_cdf(cached, rounds, s.canary_tolerated_rate) < s.canary_confidence:
            cached += 1
        _THRESHOLDS[key] = cached
    return cached


def release_rounds(s: CanarySettings) -> int:
    """Clean rounds in a row after which the exact 95 % upper bound on the fault rate is below
    ``canary_release_rate`` (with the rule of three: about 3 / rate)."""
    # 1 - 0.05^(1/n) <= rate  <=>  n >= ln 0.05 / ln(1 - rate); nudge up past float rounding.
    n = max(1, math.ceil(math.log(1.0 - RELEASE_CONFIDENCE) / math.log1p(-s.canary_release_rate) - 1e-9))
    while upper_bound(0, n, RELEASE_CONFIDENCE) > s.canary_release_rate:
        n += 1
    return n


def rounds_to_drain(fault_rate: float, s: CanarySettings, certainty: float = 0.999) -> int | None:
    """Judged rounds after which a replica whose faults start at ``fault_rate`` has been drained
    with probability at least ``certainty`` (drained at exactly that round: a lower bound on
    being drained by then); None if the window is too short for that."""
    limit = drain_threshold(s.canary_window, s)
    for m in range(limit + 1, s.canary_window + 1):
        if 1.0 - binomial_cdf(limit, m, fault_rate) >= certainty:
            return m
    return None


def is_fault(verdict: Verdict, others_right: bool) -> bool | None:
    """Whether a reply counts against its replica: True, False, or None when it says nothing about
    the replica (a transport error; a wrong number nobody else got right either)."""
    if verdict is Verdict.CORRECT:
        return False
    if verdict in _SIGNATURE:
        return True
    if verdict in _COMPARED:
        return True if others_right else None
    return None


# --- rounds ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CanaryAsk:
    """One replica asked in a round, and the cost charged for it in advance."""

    worker_id: str
    url: str
    estimate: float


@dataclass(frozen=True, slots=True)
class CanaryRound:
    """One question to every asked replica of ``model``."""

    number: int
    model: str
    question: Question
    prefix: str
    asks: tuple[CanaryAsk, ...]
    max_tokens: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class CanaryAnswer:
    """One replica's reply as judged (``usage`` figures are None when the engine did not say)."""

    verdict: Verdict
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    excerpt: str = ""

    def cost(self) -> float | None:
        """Engine work the reply took: uncached prompt plus completion tokens (None if unknown)."""
        if self.prompt_tokens is None:
            return None
        return max(0, self.prompt_tokens - (self.cached_tokens or 0)) + (self.completion_tokens or 0)


@dataclass(frozen=True, slots=True)
class CanaryChange:
    """A replica to hold out (``hold``) or release, and why (for the log)."""

    worker_id: str
    hold: bool
    detail: str


@dataclass(slots=True)
class ReplicaRecord:
    """What the canary knows about one replica."""

    window: deque[bool] = field(default_factory=deque)
    faults: int = 0  # in the window
    questions: int = 0
    wrong: int = 0  # faults, ever
    unjudged: int = 0
    holds: int = 0
    held: bool = False
    held_after: int | None = None  # questions answered when it was last held
    clean_run: int = 0
    estimate: float | None = None
    epoch: float = 0.0
    last_verdict: str | None = None
    last_reply: str = ""
    last_at: float | None = None

    def as_dict(self, s: CanarySettings) -> dict[str, Any]:
        """JSON-ready (admin API, dashboard)."""
        n = len(self.window)
        return {
            "held": self.held, "held_after": self.held_after, "questions": self.questions,
            "wrong": self.wrong, "unjudged": self.unjudged, "holds": self.holds,
            "window_rounds": n, "window_faults": self.faults,
            "drain_above": drain_threshold(s.canary_window, s),
            "clean_run": self.clean_run, "release_after": release_rounds(s) if self.held else None,
            "last_verdict": self.last_verdict, "last_reply": self.last_reply, "last_at": self.last_at,
        }


@dataclass(slots=True)
class _Budget:
    """One model's token bucket and what it has spent."""

    level: float = 0.0  # starts empty: nothing is spent before it has been earned
    at: float | None = None
    allowed: float = 0.0  # tokens the budget granted so far
    spent: float = 0.0  # tokens the finished rounds cost (estimates for asks with no usage)
    next_at: float = 0.0
    busy: bool = False
    skipped: int = 0  # times a due round waited for the budget
    largest_prompt: int = 0  # the largest prompt (tokens) a replica reported for a canary question


class CanaryWatch:
    """Schedules canary rounds and judges their answers (see the module's docstring).

    ``settings_for(model)`` is that model's ``CanarySettings``; ``share`` divides the budget among
    router processes that each run a canary on the same fleet."""

    def __init__(self, settings_for: Callable[[str], CanarySettings], *, nonce: str,
                 clock: Callable[[], float], share: float = 1.0) -> None:
        self._settings_for = settings_for
        self._nonce = nonce
        self._clock = clock
        self._share = share
        self._seed = xxhash.xxh3_64_intdigest(nonce.encode())
        self._rounds = 0
        self._replicas: dict[str, ReplicaRecord] = {}
        self._budgets: dict[str, _Budget] = {}
        self._prefixes: dict[int, str] = {}

    # -- what to send -------------------------------------------------------------------------
    def due(self, workers: Sequence[WorkerState], capacity: Callable[[WorkerState], float],
            prefix_of: Callable[[int, str], str]) -> list[CanaryRound]:
        """The rounds to send now, one per model whose interval has passed, whose previous round
        has finished and whose budget could pay for the round's worst case.  ``capacity(state)`` is a
        replica's prefill tokens per second; ``prefix_of(tokens, nonce)`` builds the shared prefix."""
        now = self._clock()
        groups: dict[str, list[WorkerState]] = {}
        for state in workers:
            if state.healthy and not state.draining and not state.ejected and state.models:
                groups.setdefault(min(state.models), []).append(state)
        rounds = []
        for model, states in groups.items():
            s = self._settings_for(model)
            if not s.canary:
                continue
            budget = self._budgets.setdefault(model, _Budget(next_at=now))
            rate = s.canary_budget * self._share * sum(capacity(w) for w in states)
            # The most a round can cost: every replica computes the whole prompt (a cache miss), as
            # long as the engines' tokenizer has been seen, else the prompt's nominal size.
            prompt = max(s.canary_prefix_tokens + _QUESTION_TOKENS, budget.largest_prompt)
            worst = len(states) * float(prompt + s.canary_max_tokens)
            if budget.at is not None:
                earned = rate * max(0.0, now - budget.at)
                budget.allowed += earned
                budget.level = min(budget.level + earned, max(rate * s.canary_burst_s, worst))
            budget.at = now
            if budget.busy or now < budget.next_at:
                continue
            # A round goes only when the bucket could pay for its worst case, so that what it
            # really costs never overdraws the budget; it is charged its estimate until it is known.
            if budget.level < worst or rate <= 0:
                budget.skipped += 1
                continue
            asks = tuple(CanaryAsk(w.id, w.url, self._estimate(w, s)) for w in states)
            budget.level -= sum(a.estimate for a in asks)
            budget.busy = True
            budget.next_at = now + s.canary_interval_s
            self._rounds += 1
            rounds.append(CanaryRound(
                number=self._rounds, model=model,
                question=make_questions(1, self._seed + self._rounds)[0],
                prefix=self._prefix(s.canary_prefix_tokens, prefix_of), asks=asks,
                max_tokens=s.canary_max_tokens, timeout_s=s.canary_timeout_s))
        return rounds

    def _estimate(self, state: WorkerState, s: CanarySettings) -> float:
        record = self._replicas.setdefault(state.id, ReplicaRecord(epoch=state.epoch))
        if record.epoch != state.epoch:
            # Re-registered or restarted: its cache (and what a reply costs) starts over.
            record.epoch, record.estimate = state.epoch, None
        if record.estimate is None:
            return float(s.canary_prefix_tokens + _QUESTION_TOKENS + s.canary_max_tokens)
        return record.estimate

    def _prefix(self, tokens: int, prefix_of: Callable[[int, str], str]) -> str:
        text = self._prefixes.get(tokens)
        if text is None:
            text = self._prefixes[tokens] = prefix_of(tokens, self._nonce)
        return text

    # -- the verdict --------------------------------------------------------------------------
    def finish(self, rnd: CanaryRound, answers: Mapping[str, CanaryAnswer]) -> list[CanaryChange]:
        """Judge a round's answers (by worker id; an ask with no answer was not sent or lost),
        settle the budget, and return the replicas to hold out or release."""
        now = self._clock()
        s = self._settings_for(rnd.model)
        budget = self._budgets.setdefault(rnd.model, _Budget())
        budget.busy = False
        right = {wid for wid, a in answers.items() if a.verdict is Verdict.CORRECT}
        changes: list[CanaryChange] = []
        for ask in rnd.asks:
            answer = answers.get(ask.worker_id)
            cost = answer.cost() if answer is not None else None
            # Settled here, once, so the spent counter only grows: what the engine reported, else
            # the estimate the bucket was charged (an ask unanswered may have cost it).
            if cost is not None:
                budget.level -= cost - ask.estimate
            budget.spent += ask.estimate if cost is None else cost
            record = self._replicas.get(ask.worker_id)
            if answer is None or record is None:  # no answer, or the replica left during the round
                continue
            if answer.prompt_tokens is not None:
                budget.largest_prompt = max(budget.largest_prompt, answer.prompt_tokens)
            if cost is not None:
                record.estimate = cost
            record.questions += 1
            record.last_verdict, record.last_reply, record.last_at = answer.verdict.value, answer.excerpt, now
            fault = is_fault(answer.verdict, bool(right - {ask.worker_id}))
            if fault is None:
                record.unjudged += 1
                continue
            change = self._judged(ask.worker_id, record, fault, s)
            if change is not None:
                changes.append(change)
        return changes

    def _judged(self, wid: str, record: ReplicaRecord, fault: bool, s: CanarySettings) -> CanaryChange | None:
        record.window.append(fault)
        record.faults += fault
        while len(record.window) > s.canary_window:
            record.faults -= record.window.popleft()
        record.wrong += fault
        record.clean_run = 0 if fault else record.clean_run + 1
        n = len(record.window)
        if not record.held:
            # A window not yet full counts as full of clean rounds: judged after every round, a
            # short window's lower threshold would add up to false drains (two flips early on).
            limit = drain_threshold(s.canary_window, s)
            if record.faults > limit:
                record.held = True
                record.holds += 1
                record.held_after = record.questions
                return CanaryChange(wid, True, f"{record.faults} faults in the last {n} canary rounds "
                                               f"(a replica at {s.canary_tolerated_rate:.2%} shows at most "
                                               f"{limit} with probability {s.canary_confidence:g})")
            return None
        needed = release_rounds(s)
        if record.clean_run >= needed:
            record.held = False
            record.window.clear()
            record.faults = 0
            return CanaryChange(wid, False, f"{record.clean_run} clean canary rounds in a row (fault rate "
                                            f"< {s.canary_release_rate:.2%} at 95%)")
        return None

    # -- reading ------------------------------------------------------------------------------
    def forget(self, worker_id: str) -> None:
        """A worker left the fleet."""
        self._replicas.pop(worker_id, None)

    def replica(self, worker_id: str) -> ReplicaRecord | None:
        """What the canary knows about ``worker_id`` (None before its first round)."""
        return self._replicas.get(worker_id)

    def replicas(self) -> dict[str, ReplicaRecord]:
        """Every replica the canary has asked, by worker id."""
        return dict(self._replicas)

    def replica_json(self, worker_id: str, model: str | None) -> dict[str, Any] | None:
        """``worker_id``'s canary state for the admin API and the dashboard."""
        record = self._replicas.get(worker_id)
        if record is None:
            return None
        return record.as_dict(self._settings_for(model or ""))

    def budgets(self) -> dict[str, dict[str, float]]:
        """Per model: tokens the budget allowed so far, tokens spent, times a round waited for it."""
        return {m: {"allowed_tokens": b.allowed, "spent_tokens": b.spent, "skipped_rounds": b.skipped}
                for m, b in self._budgets.items()}

