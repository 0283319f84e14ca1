"""Two hot loops write a rule out inline rather than call it (they run for every worker of every
decision): ``auto``'s cost computes each candidate's predicted time to first token beside its cost,
and the scheduler's learned-figures producer computes each worker's cost rate and drain speed.
The written-out copies must stay the very same floating-point operations as the rules they copy:
``_Prices.predicted`` and ``WorkerLearning.cost_rate`` / ``drain_rate`` / ``drain``."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.routing.config import ModelSettings
from kvroute.routing.key import DERIVED_SESSION_PREFIX, RoutingKey
from kvroute.routing.learning import LearningSettings, WorkerLearning
from kvroute.routing.policies import auto
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.view import Candidate, View
from kvroute.routing.worker import WorkerState

_figure = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
_candidate = st.fixed_dictionaries({
    "load": st.integers(0, 64), "busy": st.integers(0, 64), "waiting": st.none() | st.integers(0, 64),
    "held": _figure, "exact": st.booleans(), "realisation": st.floats(0.0, 1.0),
    "backlog": _figure, "spt": st.floats(1e-6, 1e-2), "sessions": st.integers(0, 16),
})


def _cand(i: int, f: dict[str, object]) -> Candidate:
    w = WorkerState(id=f"w{i}", url=f"http://w{i}", models=frozenset({"m"}), waiting=f["waiting"])  # type: ignore[arg-type]
    return Candidate(w, f["load"], f["busy"], f["load"], matched_blocks=1, held_tokens=f["held"],  # type: ignore[arg-type]
                     exact=f["exact"], active_sessions=f["sessions"], s_per_token=f["spt"],  # type: ignore[arg-type]
                     realisation=f["realisation"], backlog_tokens=f["backlog"])  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(_candidate, min_size=1, max_size=6), st.integers(1, 50_000), st.booleans(),
       st.booleans(), st.floats(0.0, 1.0), st.floats(0.0, 4.0))
def test_autos_cost_predicts_exactly_what_predicted_computes(
        figures: list[dict[str, object]], tokens: int, session: bool, client: bool, trust: float,
        eviction: float) -> None:
    sid = ("client" if client else DERIVED_SESSION_PREFIX + "x") if session else None
    key = RoutingKey(model="m", prefix=b"x" * 64, est_prompt_tokens=tokens, max_tokens=16, session_id=sid)
    policy = ModelSettings(realisation_weight=trust, eviction_weight=eviction)
    v = View(key, policy, policy.placement, 0.0, max(1, tokens // 128), 128.0,
             1 if session else None, "w0" if session else None)
    cands = [_cand(i, f) for i, f in enumerate(figures)]
    auto.predicted_ttft.score(v, cands)
    prices = v.derived(auto._Prices.of)
    assert prices.predicted_all(cands) == [prices.predicted(c) for c in cands]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(100, 50_000), st.floats(0.0, 1.0), st.floats(0.01, 20.0)),
                max_size=12),
       st.integers(0, 32), st.booleans(), st.booleans())
def test_the_learned_producer_computes_what_worker_learning_computes(
        requests: list[tuple[int, float, float]], load: int, learn_rate: bool, learn_speed: bool) -> None:
    learning = LearningSettings(learn_rate=learn_rate, learn_prefill_speed=learn_speed, learn_min_samples=2)
    learned = WorkerLearning.from_settings(learning)
    t = 0.0
    for prompt, hit, ttft in requests:  # sent, then answered: every figure the producer reads
        cached = int(prompt * hit)
        learned.on_sent(t, learned.drain_rate(learning), prompt - cached, hit, cached)
        t += ttft / 2
        learned.on_finished(t, prompt, cached, ttft)
    expected = copy.deepcopy(learned)
    scheduler = Scheduler(clock=lambda: t)
    scheduler._learning["w"] = learned
    c = Candidate(WorkerState(id="w", url="http://w", models=frozenset({"m"})), load, load, load)
    scheduler._learned([c], learning, t)
    assert c.s_per_token == expected.cost_rate(learning)
    assert c.backlog_tokens == expected.drain(t, expected.drain_rate(learning), load)
    assert c.realisation == expected.realisation(t)
