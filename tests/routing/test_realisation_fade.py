"""The learned cache realisation does not outlive the evidence behind it: its deficit fades with the
time since the engine's last report (``learn_realisation_fade_s``), a report after a gap counts for
what faded, and a report that confirms the deficit restores it.  The figure of the reports alone
(``realised``, the drift alarm's) does not fade."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from routing_helpers import Clock, fleet, key, text

from kvroute.routing.config import ModelSettings
from kvroute.routing.learning import LearningSettings, WorkerLearning
from kvroute.routing.scheduler import Scheduler

FADE = 120.0
PREDICTED = 0.9  # the index's predicted hit share of every request below


def learnt(ratio: float, *, every_s: float = 1.0, n: int = 40,
           fade_s: float = FADE) -> tuple[WorkerLearning, float]:
    """A worker whose engine reported ``ratio`` of the predicted hits on ``n`` requests, one every
    ``every_s`` seconds; returns it and the time of its last report."""
    w = WorkerLearning(realisation_fade_s=fade_s)
    t = 0.0
    for i in range(n):
        t = i * every_s
        w.on_sent(t, 1e-4, 100.0, PREDICTED, 900.0)
        w.on_finished(t, 1000, round(1000 * PREDICTED * ratio), None)
    return w, t


@pytest.mark.parametrize(("silence_s", "fade_s", "expected"), [
    (0.0, FADE, 0.5),
    (FADE, FADE, 1 - 0.5 * math.exp(-1)),
    (3 * FADE, FADE, 1 - 0.5 * math.exp(-3)),
    (600.0, 0.0, 0.5),  # no fade: the figure of the reports alone, however old
])
def test_the_deficit_fades_with_the_time_since_the_last_report(silence_s: float, fade_s: float,
                                                                expected: float) -> None:
    w, last = learnt(0.5, fade_s=fade_s)
    assert w.realisation(last + silence_s) == pytest.approx(expected, rel=1e-9)
    assert w.realised == pytest.approx(0.5, rel=1e-9)  # the alarm's figure does not fade


@pytest.mark.parametrize(("report", "expected"), [
    # After 120 s of silence: a report of every predicted hit takes what had faded, where a
    # per-sample weight (0.05) would have brought the old deficit back (0.525).
    (1.0, 1 - 0.5 * math.exp(-2)),
    # A report that confirms the deficit restores it.
    (0.5, 0.5),
])
def test_a_report_after_a_gap_counts_for_what_faded(report: float, expected: float) -> None:
    w, last = learnt(0.5)
    now = last + 2 * FADE
    w.on_sent(now, 1e-4, 100.0, PREDICTED, 900.0)
    w.on_finished(now, 1000, round(1000 * PREDICTED * report), None)
    assert w.realisation(now) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("every_s", [1.0, 30.0, 120.0])
def test_steady_evidence_keeps_its_figure_however_sparse(every_s: float) -> None:
    w, last = learnt(0.4, every_s=every_s)
    assert w.realisation(last) == pytest.approx(0.4, rel=1e-3)


def test_the_setting_reaches_every_workers_figures_and_is_validated() -> None:
    assert WorkerLearning.from_settings(LearningSettings()).realisation_fade_s == FADE
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            ModelSettings(learn_realisation_fade_s=bad)


def sidelined(make_scheduler: Callable[..., Scheduler], clock: Clock,
              **settings: object) -> tuple[Scheduler, str]:
    """A scheduler whose worker w0 holds a shared prompt but whose engine reported none of the hits
    the index predicted there: the last report is now."""
    s = make_scheduler("auto", **settings)
    w0 = fleet(1)[0]
    s.commit(key(text(1, 40_000)), s.decide(key(text(1, 40_000)), [w0]))
    repeated = key(text(10, 4096))
    for _ in range(40):
        clock.advance(5)
        s.commit(repeated, s.decide(repeated, [w0]))
        s.on_finished("w0", prompt_tokens=1000, cached_tokens=0, ttft_s=None)
    return s, "w0"


@pytest.mark.parametrize(("silence_s", "fade_s", "to_holder"), [
    (0.0, FADE, False),  # just learnt: the holder's match counts for nothing, the idle worker wins
    (600.0, FADE, True),  # ten minutes without a report: the holder's cache counts again
    (600.0, 0.0, False),  # without the fade the figure learnt ten minutes ago still rules
])
def test_auto_returns_to_a_holder_once_its_deficit_has_faded(
        make_scheduler: Callable[..., Scheduler], clock: Clock, silence_s: float, fade_s: float,
        to_holder: bool) -> None:
    s, holder = sidelined(make_scheduler, clock, learn_realisation_fade_s=fade_s)
    clock.advance(silence_s)
    ws = fleet(2)
    ws[0].inflight = 2  # the holder is busier: only its cache can make it the cheaper
    d = s.decide(key(text(1, 40_000) + text(2, 600)), ws)
    assert (d.worker_id == holder) is to_holder, d.reason
    # What /admin/workers and the saturation reading see is the figure the cost used.
    assert s.stats()["workers"][holder]["cache_realisation"] == s.realisation(holder)
    expected = 1 - math.exp(-silence_s / fade_s) if fade_s else 0.0
    assert s.realisation(holder) == pytest.approx(expected, abs=1e-9)
