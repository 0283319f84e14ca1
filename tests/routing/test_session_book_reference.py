"""SessionBook's bookkeeping (routing/session_admission.py) against a brute-force reference: the
book keeps the quiet sessions in a heap and the sizes in a sorted list so that the door's reads
cost what expires, not what is served; the reference rescans every session, as the book first did.
Random sequences of a door's calls must get the same answers, and forgetting N idle sessions among
many busy ones must look at those N only."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.routing import session_admission
from kvroute.routing.key import RoutingKey
from kvroute.routing.session_admission import RULES, Rule, ServedSession, SessionBook

MODEL = "m"


@dataclass
class ReferenceBook:
    """The book as a plain rescan of every session (its first version)."""

    sessions: dict[str, ServedSession] = field(default_factory=dict)
    peaks: deque[int] = field(default_factory=lambda: deque(maxlen=64))
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=256))

    def keep(self, rule: Rule, idle_s: float) -> float:
        if not rule.learns or len(self.gaps) < 8:
            return idle_s
        return min(idle_s, max(1.0, 1.5 * max(self.gaps)))

    def keeps(self, e: ServedSession, rule: Rule, idle_s: float) -> float:
        """How long quiet ``e`` is kept: the fleet's pauses, or sooner its own."""
        keep = self.keep(rule, idle_s)
        if rule.learns and e.pause is not None and e.pauses >= session_admission.OWN_SAMPLES:
            keep = min(keep, max(1.0, session_admission.OWN_PAUSES * e.pause))
        return keep

    def expected(self, rule: Rule) -> int:
        return 0 if not rule.learns or len(self.peaks) < 8 else int(statistics.median(self.peaks))

    def arrived(self, sid: str, now: float) -> None:
        e = self.sessions.get(sid)
        if e is not None and e.quiet():
            gap = max(0.0, now - e.ended)
            self.gaps.append(gap)
            e.pause = gap if e.pause is None else max(e.pause, gap)
            e.pauses += 1

    def queued(self, sid: str, delta: int) -> None:
        e = self.sessions.get(sid)
        if e is not None:
            e.queued = max(0, e.queued + delta)

    def sent(self, key: RoutingKey, prefill: int, rule: str, worker: str = "") -> None:
        assert key.session_id is not None
        e = self.sessions.get(key.session_id)
        if e is None:
            e = self.sessions[key.session_id] = ServedSession(0, max(0, key.est_prompt_tokens - prefill))
        e.tokens = RULES[rule].tokens(key, e.shared)
        e.worker = worker
        e.inflight += 1

    def finished(self, sid: str, now: float) -> None:
        e = self.sessions.get(sid)
        if e is not None:
            e.inflight -= 1
            e.ended = now

    def forget_idle(self, now: float, idle_s: float, rule: str) -> None:
        for sid, e in list(self.sessions.items()):
            if e.quiet() and now - e.ended > self.keeps(e, RULES[rule], idle_s):
                del self.sessions[sid]
                self.peaks.append(e.tokens)

    def live(self, now: float, idle_s: float, rule: str) -> int:
        return sum(1 for e in self.sessions.values()
                   if not (e.quiet() and now - e.ended > self.keeps(e, RULES[rule], idle_s)))

    def working_set(self, now: float, idle_s: float, rule: str) -> int:
        self.forget_idle(now, idle_s, rule)
        expected = self.expected(RULES[rule])
        return sum(max(e.tokens, expected) for e in self.sessions.values())

    def placed(self, worker: str, now: float, idle_s: float, rule: str) -> int:
        self.forget_idle(now, idle_s, rule)
        expected = self.expected(RULES[rule])
        return sum(max(e.tokens, expected) for e in self.sessions.values() if e.worker == worker)


SIDS = [f"s{i}" for i in range(12)]
WORKERS = ["w0", "w1", "w2"]
OPS = st.one_of(
    st.tuples(st.just("sent"), st.sampled_from(SIDS), st.integers(0, 3000), st.integers(0, 3000),
              st.integers(0, 300), st.sampled_from(sorted(RULES)), st.sampled_from(WORKERS)),
    st.tuples(st.just("finished"), st.sampled_from(SIDS)),
    st.tuples(st.just("queued"), st.sampled_from(SIDS), st.sampled_from([1, -1])),
    st.tuples(st.just("arrived"), st.sampled_from(SIDS)),
    st.tuples(st.just("working_set"), st.sampled_from([1.0, 3.0, 15.0]), st.sampled_from(sorted(RULES))),
    st.tuples(st.just("live"), st.sampled_from([1.0, 3.0, 15.0]), st.sampled_from(sorted(RULES))),
    st.tuples(st.just("wait"), st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.5, 4.0, 20.0])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=200))
def test_the_book_answers_as_the_rescan_does(ops: list[tuple[Any, ...]]) -> None:
    book, ref = SessionBook(), ReferenceBook()
    now = 0.0
    for op in ops:
        name = op[0]
        if name == "wait":
            now += op[1]
        elif name == "sent":
            _, sid, prompt, prefill, max_tokens, rule, worker = op
            k = RoutingKey(MODEL, b"", sid, prompt, max_tokens)
            book.sent(k, prefill, rule, worker)
            ref.sent(k, prefill, rule, worker)
        elif name == "finished":
            book.finished(op[1], now)
            ref.finished(op[1], now)
        elif name == "queued":
            book.queued(op[1], op[2])
            ref.queued(op[1], op[2])
        elif name == "arrived":
            book.arrived(op[1], now)
            ref.arrived(op[1], now)
        elif name == "live":
            idle_s, rule = op[1], op[2]
            assert book.live(now, idle_s, rule) == ref.live(now, idle_s, rule)
        else:
            idle_s, rule = op[1], op[2]
            assert book.working_set(now, idle_s, rule) == ref.working_set(now, idle_s, rule)
            for worker in WORKERS:  # each replica's part, the session on the one it was last sent to
                assert book.placed(worker, now, idle_s, rule) == ref.placed(worker, now, idle_s, rule)
        assert set(book.sessions) == set(ref.sessions)
        assert list(book.peaks[True]) == list(ref.peaks) and list(book.gaps) == list(ref.gaps)
    assert book.working_set(now + 100.0, 15.0, "unique") == ref.working_set(now + 100.0, 15.0, "unique")


def test_many_sessions_forgotten_at_once_keep_the_reference_order() -> None:
    """More than ``peaks`` holds expire in one pass: the sizes kept are those of the sessions that
    entered the book last, as the rescan appended them, whatever order they ended in."""
    book, ref = SessionBook(), ReferenceBook()
    for i in range(100):
        k = RoutingKey(MODEL, b"", f"s{i}", 100 + i)
        book.sent(k, 100 + i, "unique")
        ref.sent(k, 100 + i, "unique")
    for i in reversed(range(100)):
        book.finished(f"s{i}", float(i % 7))
        ref.finished(f"s{i}", float(i % 7))
    assert book.working_set(100.0, 15.0, "unique") == ref.working_set(100.0, 15.0, "unique") == 0
    assert list(book.peaks[True]) == list(ref.peaks)


def test_forgetting_idle_sessions_looks_at_those_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 sessions busy, 500 quiet and recent, 10 quiet past what is kept: the door's reads ask
    whether a session is quiet of the 10 only (the rescan asked it of all 1,510)."""
    book = SessionBook()
    for i in range(1510):
        book.sent(RoutingKey(MODEL, b"", f"s{i}", 100), 100, "footprint")
    for i in range(10):
        book.finished(f"s{i}", 0.0)  # idle since 0
    for i in range(10, 510):
        book.finished(f"s{i}", 10.0)  # quiet, recent
    asked: list[ServedSession] = []
    quiet = ServedSession.quiet

    def counted(entry: ServedSession) -> bool:
        asked.append(entry)
        return bool(quiet(entry))

    monkeypatch.setattr(ServedSession, "quiet", counted)
    assert book.live(16.0, 15.0, "footprint") == 1500
    assert len(asked) == 10
    asked.clear()
    assert book.working_set(16.0, 15.0, "footprint") == 1500 * 100
    assert len(asked) == 10 and len(book) == 1500
    asked.clear()
    assert book.working_set(16.5, 15.0, "footprint") == 1500 * 100  # nothing more expired
    assert asked == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(-5, 60), st.integers(-5, 70)), max_size=300))
def test_the_sizes_sum_as_a_plain_list_does(ops: list[tuple[bool, int, int]]) -> None:
    """The book's sorted runs of sizes (split small here, so that runs split and empty often)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(session_admission, "_RUN", 2)
        sizes, plain = session_admission._Sizes(), list[int]()
        for add, size, floor in ops:
            if add or not plain:
                sizes.add(size)
                plain.append(size)
            else:
                gone = plain.pop(size % len(plain))
                sizes.remove(gone)
            assert sizes.raised_to(floor) == sum(max(x, floor) for x in plain)
            assert [x for run in sizes.runs for x in run] == sorted(plain)
            assert all(len(run) <= 4 for run in sizes.runs)
