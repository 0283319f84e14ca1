"""The cache-drift alarm's rule (guard/drift.py) and the doctor's hold rule
(guard/doctor_hold.py), on readings and findings made up here: no server, the clock is ours."""

from __future__ import annotations

import pytest

from kvroute.doctor.finding import Finding, Severity
from kvroute.fleet.registry import Registry
from kvroute.guard.doctor_hold import (
    DoctorGuardSettings,
    about_configuration,
    combined,
    holds_out,
    last_to_serve,
    new_findings,
)
from kvroute.guard.drift import DriftAlarms, DriftChange, DriftReading, DriftSettings
from kvroute.guard.drift_watch import DriftWatch
from kvroute.routing.config import RoutingConfig
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.key import RoutingKey
from kvroute.routing.learning import WorkerLearning
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState

S = DriftSettings(guard_drift_below=0.3, guard_drift_recover=0.6, guard_drift_for_s=60.0,
                  guard_drift_min_tokens=10_000)


class Feed:
    """Readings of one worker at times we choose."""

    def __init__(self, settings: DriftSettings = S) -> None:
        self.alarms = DriftAlarms()
        self.settings = settings
        self.tokens = 0.0
        self.epoch = 1.0

    def at(self, now: float, realised: float, add_tokens: float = 0.0) -> DriftChange | None:
        self.tokens += add_tokens
        return self.alarms.update(DriftReading("w", self.epoch, realised, self.tokens), self.settings, now)

    @property
    def alarmed(self) -> bool:
        state = self.alarms.state("w")
        return state is not None and state.alarmed


def test_low_realisation_under_traffic_raises_after_the_duration() -> None:
    f = Feed()
    assert f.at(0.0, 1.0) is None
    assert f.at(10.0, 0.1, 6_000) is None  # low from here; the tokens that brought it down count
    assert f.at(69.0, 0.1, 6_000) is None  # 12k tokens but only 59 s
    assert f.at(70.0, 0.05) is DriftChange.RAISED
    assert f.alarmed
    assert f.at(71.0, 0.0, 50_000) is None  # raised once


def test_an_idle_replica_never_alarms_however_low_and_long() -> None:
    f = Feed()
    f.at(0.0, 1.0)
    for t in range(1, 3600, 10):
        assert f.at(float(t), 0.0, 20) is None  # a trickle: 7k tokens in an hour
    assert not f.alarmed


def test_recovery_needs_the_higher_threshold() -> None:
    f = Feed()
    f.at(0.0, 1.0)
    f.at(1.0, 0.0, 20_000)
    assert f.at(61.0, 0.0) is DriftChange.RAISED
    assert f.at(62.0, 0.5, 5_000) is None  # between the thresholds: still up
    assert f.alarmed
    assert f.at(63.0, 0.7, 5_000) is DriftChange.RECOVERED
    assert not f.alarmed


def test_between_thresholds_the_clock_restarts() -> None:
    f = Feed()
    f.at(0.0, 1.0)
    f.at(1.0, 0.2, 20_000)
    f.at(40.0, 0.45)  # not low enough: the stretch ends
    f.at(41.0, 0.2, 20_000)
    assert f.at(90.0, 0.2) is None  # 49 s of the new stretch
    assert f.at(101.0, 0.2) is DriftChange.RAISED


def test_a_new_epoch_clears_the_alarm_and_starts_counting_again() -> None:
    f = Feed()
    f.at(0.0, 1.0)
    f.at(1.0, 0.0, 20_000)
    assert f.at(61.0, 0.0) is DriftChange.RAISED
    f.epoch = 2.0
    assert f.at(62.0, 0.0) is DriftChange.NEW_EPOCH
    assert not f.alarmed
    assert f.at(200.0, 0.0) is None  # the old epoch's tokens do not count
    assert f.at(201.0, 0.0, 10_000) is DriftChange.RAISED


def test_turned_off_it_clears_and_stays_quiet() -> None:
    f = Feed()
    f.at(0.0, 1.0)
    f.at(1.0, 0.0, 20_000)
    f.at(61.0, 0.0)
    f.settings = DriftSettings(guard_drift=False)
    assert f.at(62.0, 0.0, 20_000) is DriftChange.TURNED_OFF
    assert f.at(200.0, 0.0, 20_000) is None
    assert not f.alarmed


@pytest.mark.parametrize("bad", [{"guard_drift_below": 0.7, "guard_drift_recover": 0.6},
                                 {"guard_drift_recover": 1.5}, {"guard_drift_for_s": -1.0},
                                 {"guard_drift_min_tokens": -5}])
def test_drift_settings_are_validated_through_the_model_settings(bad: dict[str, float]) -> None:
    from kvroute.router_settings import model_settings

    with pytest.raises(ValueError):
        model_settings(**bad)


def test_the_learning_counts_predicted_tokens_and_forgets_realisation_at_a_new_epoch() -> None:
    learned = WorkerLearning(min_samples=2)
    for _ in range(3):
        learned.on_sent(0.0, 1e-4, 100.0, 0.9, 900.0)
        learned.on_finished(0.0, 1000, 0, None)
    assert learned.realised == 0.0 and learned.predicted_cached_tokens == 2700.0
    learned.new_epoch()
    assert learned.realised == 1.0 and learned.backlog_tokens == 0.0
    learned.on_sent(0.0, 1e-4, 100.0, 0.9, 900.0)
    learned.on_finished(0.0, 1000, 900, None)
    assert learned.realised == 1.0  # one sample: not learned yet, the old zeros are gone
    assert learned.predicted_cached_tokens == 3600.0


def key_for(n_bytes: int) -> RoutingKey:
    """A request for model ``m`` whose prompt is ``n_bytes`` of one shared text."""
    raw = (b"shared system prompt " * (n_bytes // 21 + 1))[:n_bytes]
    return RoutingKey(model="m", prefix=raw, est_prompt_tokens=n_bytes // 4, max_tokens=0)


def finding(severity: Severity, code: str) -> Finding:
    return Finding(severity, code, code, "")


@pytest.mark.parametrize(("findings", "action", "held"), [
    ([finding(Severity.ERROR, "prefix-caching-off")], "exclude", True),
    ([finding(Severity.ERROR, "prefix-caching-off")], "warn", False),
    ([finding(Severity.WARNING, "hit-rate-zero"), finding(Severity.OK, "prefix-caching-on")], "exclude",
     False),
    ([finding(Severity.ERROR, "unreachable")], "exclude", False),  # retried, never a reason to hold
    ([], "exclude", False),
])
def test_the_doctor_holds_only_on_configuration_errors_and_only_with_exclude(
        findings: list[Finding], action: str, held: bool) -> None:
    assert holds_out(findings, action) is held


def test_a_worker_serving_several_models_takes_the_strictest_settings() -> None:
    both = combined([DoctorGuardSettings(guard_doctor=False),
                     DoctorGuardSettings(guard_doctor_action="exclude")])
    assert both.guard_doctor and both.guard_doctor_action == "exclude" and not both.guard_doctor_probe
    with pytest.raises(ValueError):
        DoctorGuardSettings(guard_doctor_action="drain")  # type: ignore[arg-type]


def test_only_new_findings_are_logged_again() -> None:
    before = [finding(Severity.WARNING, "hit-rate-zero"), finding(Severity.ERROR, "prefix-caching-off")]
    now = [finding(Severity.ERROR, "prefix-caching-off"), finding(Severity.ERROR, "hit-rate-zero"),
           finding(Severity.OK, "kv-capacity"), finding(Severity.INFO, "fp8-kv-cache")]
    assert [(f.code, f.severity) for f in new_findings(before, now)] == [
        ("hit-rate-zero", Severity.ERROR), ("fp8-kv-cache", Severity.INFO)]


def test_a_new_hold_spares_the_last_ready_worker_of_a_model() -> None:
    a = WorkerState("a", "http://a", models=frozenset({"m"}))
    b = WorkerState("b", "http://b", models=frozenset({"m"}))
    c = WorkerState("c", "http://c", models=frozenset({"other"}))
    assert not last_to_serve(a, [a, b, c])
    b.draining = True
    assert last_to_serve(a, [a, b, c])  # c serves another model
    unknown = WorkerState("u", "http://u")
    assert not last_to_serve(unknown, [unknown, c]) and last_to_serve(unknown, [unknown])


def test_a_check_at_a_new_epoch_keeps_configuration_not_the_hit_rate_so_far() -> None:
    found = [finding(Severity.WARNING, "hit-rate-zero"), finding(Severity.ERROR, "prefix-caching-off"),
             finding(Severity.INFO, "hit-rate"), finding(Severity.INFO, "hit-rate-no-traffic"),
             finding(Severity.WARNING, "match-unit-coarse")]
    assert [f.code for f in about_configuration(found)] == ["prefix-caching-off", "match-unit-coarse"]


def test_the_drift_alarm_stays_up_while_the_worker_gets_no_traffic() -> None:
    """Routing's figure fades back to 1 on a worker that gets no reports; the alarm reads the reports
    alone, and clears when they show the cache delivering again."""
    now = [1_000.0]
    from kvroute.router_settings import model_settings

    scheduler = Scheduler(RoutingConfig(default=model_settings(
        guard_drift_for_s=10.0, guard_drift_min_tokens=1_000)), clock=lambda: now[0])
    registry = Registry(clock=lambda: now[0], dispatch=Dispatcher(scheduler))
    record = registry.add("http://127.0.0.1:9", worker_id="w", models=["m"])
    watch = DriftWatch(registry, scheduler, clock=lambda: now[0])
    shared = key_for(40_000)

    def serve(cached_share: float, n: int) -> None:
        for _ in range(n):
            now[0] += 1.0
            scheduler.commit(shared, scheduler.decide(shared, [record.state]))
            scheduler.on_finished("w", prompt_tokens=1000, cached_tokens=round(1000 * cached_share))
            watch.tick()

    serve(0.0, 30)
    assert watch.alarms.state("w").alarmed  # type: ignore[union-attr]
    now[0] += 600.0  # ten minutes without a request
    watch.tick()
    assert scheduler.realisation("w") > 0.99  # routing counts on the cache again ...
    assert watch.alarms.state("w").alarmed  # type: ignore[union-attr]  # ... the alarm does not
    gauge = {m.name: m.samples[0].value for m in watch.families()}
    assert gauge["kvroute_worker_cache_realisation"] == scheduler.realisation("w")
    serve(1.0, 40)  # the engine delivers again
    assert not watch.alarms.state("w").alarmed  # type: ignore[union-attr]
