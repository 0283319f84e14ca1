"""Each pipeline stage on its own, table-driven: a view and candidates in, kept candidates or
scores out.  The behavioural tests (test_policies.py, test_scheduler.py) drive whole decisions."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvroute.routing import filters, scorers
from kvroute.routing.config import ModelSettings
from kvroute.routing.key import RoutingKey
from kvroute.routing.policies import auto, prefix, session
from kvroute.routing.stages import Filter, Scorer
from kvroute.routing.view import Candidate, View
from kvroute.routing.worker import WorkerState


def cand(wid: str, *, load: int = 0, busy: int | None = None, matched: int = 0, sessions: int = 0,
         realisation: float = 1.0, backlog: float = 0.0, **worker: Any) -> Candidate:
    """A candidate with the figures a producer would have filled (128 tokens a matched block)."""
    w = WorkerState(**{"id": wid, "url": f"http://{wid}", "models": frozenset({"m"}), **worker})
    return Candidate(w, load, load if busy is None else busy, load, matched_blocks=matched,
                     held_tokens=128.0 * matched,
                     active_sessions=sessions, s_per_token=1e-3, realisation=realisation,
                     backlog_tokens=backlog)


def view(*, tokens: int = 1000, max_tokens: int = 0, session: int | None = None, bound: str | None = None,
         **settings: Any) -> View:
    key = RoutingKey(model="m", prefix=b"x" * (tokens * 4), est_prompt_tokens=tokens, max_tokens=max_tokens)
    policy = ModelSettings(**settings)
    return View(key, policy, policy.placement, 0.0, tokens // 128, 128.0, session, bound)


def kept(stage: Filter, v: View, cands: list[Candidate]) -> list[str]:
    return [c.worker.id for c in stage.keep(v, cands)]


@pytest.mark.parametrize(("stage", "v", "cands", "expected"), [
    (filters.ready, view(), [cand("a"), cand("b", healthy=False), cand("c", draining=True),
                             cand("d", ejected=True)], ["a"]),
    (filters.ready, view(), [cand("b", healthy=False)], []),  # hard: may leave nothing
    (filters.serves_model, view(), [cand("a"), cand("b", models=frozenset({"other"}))], ["a"]),
    (filters.serves_model, view(), [cand("a", models=frozenset())], ["a"]),  # not yet known: accepted
    (filters.context_fits, view(tokens=1000, max_tokens=100),
     [cand("a", max_model_len=1100), cand("b", max_model_len=1099), cand("c")], ["a", "c"]),
    (filters.context_fits, view(tokens=5000), [cand("a", max_model_len=100)], ["a"]),  # soft
    (filters.free_slot, view(),
     [cand("a", busy=3, max_num_seqs=4), cand("b", busy=4, max_num_seqs=4)], ["a"]),
    (filters.free_slot, view(max_num_seqs=2), [cand("a", busy=2), cand("b", busy=1)], ["b"]),
    (filters.free_slot, view(), [cand("a", busy=9, max_num_seqs=4)], ["a"]),  # soft: all full
    # prompt-size slack: 1000 tokens -> 0 extra, 4096 tokens -> 2 extra (steps 1024, 4096)
    (filters.load_within_slack, view(tokens=1000), [cand("a", busy=1), cand("b", busy=2)], ["a"]),
    (filters.load_within_slack, view(tokens=4096),
     [cand("a", busy=1), cand("b", busy=3), cand("c", busy=4)], ["a", "b"]),
    (filters.load_within_slack, view(tokens=1000, session=7, bound="b"),
     [cand("a", busy=0), cand("b", busy=9)], ["a", "b"]),  # the session's worker is exempt
    (auto.balanced_sessions, view(session=7), [cand("a", sessions=1), cand("b", sessions=3),
                                               cand("c", sessions=4)], ["a", "b"]),
    (auto.balanced_sessions, view(session=None), [cand("a", sessions=0), cand("b", sessions=9)], ["a", "b"]),
    (auto.balanced_sessions, view(session=7, session_spread=None),
     [cand("a", sessions=0), cand("b", sessions=9)], ["a", "b"]),
])
def test_filters(stage: Filter, v: View, cands: list[Candidate], expected: list[str]) -> None:
    assert kept(stage, v, cands) == expected


@pytest.mark.parametrize(("stage", "v", "cands", "expected"), [
    (scorers.inflight, view(), [cand("a", load=2), cand("b", load=0)], [2.0, 0.0]),
    (scorers.active_sessions, view(), [cand("a", sessions=2), cand("b")], [2.0, 0.0]),
    (scorers.kv_usage, view(), [cand("a", kv_usage=0.5), cand("b")], [0.5, 0.0]),
    (scorers.deepest_match, view(), [cand("a", matched=5), cand("b")], [-5.0, -0.0]),
    # within the slack of the freest (load 0, 1000 tokens: slack 0) only a's match counts
    (prefix.cache_within_slack, view(), [cand("a", matched=5), cand("b", load=1, matched=9), cand("c")],
     [-5.0, 0.0, 0.0]),
    (session.session_affinity, view(session=7, bound="a", overflow=2),
     [cand("a", load=2), cand("b")], [0.0, 1.0]),
    (session.session_affinity, view(session=7, bound="a", overflow=2),
     [cand("a", load=3), cand("b")], [1.0, 1.0]),  # past its threshold: no preference
])
def test_scorers(stage: Scorer, v: View, cands: list[Candidate], expected: list[float]) -> None:
    assert stage.score(v, cands) == expected


def test_engine_load_is_what_candidate_of_computed() -> None:
    w = WorkerState(id="a", url="http://a", inflight=2, running=3, waiting=1, scraped_inflight=1)
    c = Candidate.of(w)
    assert (c.load, c.busy, c.engine_load) == (2, 5, 8)  # 2 + (3 + 1 - 1); 2 + 4*1 + 3 - 1
    assert scorers.engine_load.score(view(), [c]) == [8.0]


# auto's cost, term by term: s_per_token 1e-3, 1000-token prompt, 128 tokens per block.
@pytest.mark.parametrize(("c", "v", "expected"), [
    # nothing cached, nothing queued: (1 + prefill_penalty) * 1000 tokens
    (cand("a"), view(), 2.0),
    # 4 blocks = 512 tokens held: 2 * 488
    (cand("a", matched=4), view(), 0.976),
    # half of what the index predicts survives (realisation 0.5, trust 1): 256 held
    (cand("a", matched=4, realisation=0.5), view(), 2 * 0.744),
    # two busy requests (256 tokens each) and 1000 tokens of backlog (weight 1 + eviction 0)
    (cand("a", busy=2, backlog=1000.0), view(), 0.512 + 1.0 + 2.0),
    # one other session active there (8192 tokens) for a request with a session
    (cand("a", sessions=1), view(session=7), 8.192 + 2.0),
    # the session's own worker: its own session does not count, and stay_tokens (512) is credited
    (cand("a", sessions=1), view(session=7, bound="a"), 2.0 - 0.512),
    # past a numeric overflow the session's worker is never kept
    (cand("a", load=3), view(session=7, bound="a", overflow=2), math.inf),
])
def test_auto_cost(c: Candidate, v: View, expected: float) -> None:
    assert auto.predicted_ttft.score(v, [c])[0] == pytest.approx(expected)


def test_auto_cost_declares_what_it_reads() -> None:
    assert {s.value for s in auto.predicted_ttft.needs} == {"prefix", "learned", "sessions", "binding"}
    assert auto.POLICY.needs >= auto.predicted_ttft.needs
