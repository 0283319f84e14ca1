"""The fleet registry: registration epochs, restarts, health, in-flight accounting, history."""

from __future__ import annotations

from kvroute.fleet.registry import ProbeResult, Registry, worker_id_for
from kvroute.fleet.vllm_metrics import EngineMetrics
from kvroute.routing.view import Candidate


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Listener:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, float | None]] = []

    def on_worker_epoch(self, worker_id: str, epoch: float) -> None:
        self.events.append(("epoch", worker_id, epoch))

    def on_worker_removed(self, worker_id: str) -> None:
        self.events.append(("removed", worker_id, None))


def make(**kwargs) -> tuple[Registry, Clock, Listener]:
    clock, listener = Clock(), Listener()
    registry = Registry(clock=clock, **kwargs)
    registry.subscribe(listener)
    return registry, clock, listener


def ok(**metrics) -> ProbeResult:
    return ProbeResult(reachable=True, healthy=True, metrics=EngineMetrics(**metrics) if metrics else None)


def test_default_ids_are_the_same_on_every_instance():
    assert worker_id_for("http://10.0.0.5:8000/") == "10.0.0.5:8000"
    assert worker_id_for("https://gpu.example/v") == "gpu.example:443/v"
    assert worker_id_for("http://gpu.example") == "gpu.example:80"


def test_registration_time_is_the_epoch_and_re_registering_starts_a_new_one():
    registry, clock, listener = make()
    record = registry.add("http://a:1", models=["m"], max_num_seqs=8)
    assert record.id == "a:1" and record.state.epoch == 1000.0 and record.state.models == {"m"}
    state = record.state
    state.inflight += 1  # a request the dispatcher sent (routing/dispatch.py)
    clock.t = 1000.0  # same instant: the epoch must still move forward
    again = registry.add("http://a:1")
    assert again.state is state  # requests in flight keep decrementing the same object
    assert state.epoch > 1000.0 and state.inflight == 1 and state.max_num_seqs is None
    assert [e[0] for e in listener.events] == ["epoch", "epoch"]
    assert listener.events[1][2] == state.epoch
    assert registry.remove("a:1") and not registry.remove("a:1")
    assert listener.events[-1] == ("removed", "a:1", None)
    assert registry.states() == () and len(registry) == 0


def test_a_changed_engine_start_time_is_a_restart():
    registry, clock, listener = make()
    record = registry.add("http://a:1")
    registry.apply_probe("a:1", ok(process_start_time=500.0))
    assert record.state.epoch == 1000.0 and record.restarts == 0  # first sighting: no restart
    clock.t = 2000.0
    registry.apply_probe("a:1", ok(process_start_time=1990.0))
    assert record.restarts == 1 and record.state.epoch == 1990.0  # the engine's own start time
    assert listener.events[-1] == ("epoch", "a:1", 1990.0)
    registry.apply_probe("a:1", ok(process_start_time=1500.0))  # engine clock behind the router's
    assert record.restarts == 2 and record.state.epoch > 1990.0


def test_probe_figures_fill_the_state_and_the_history_is_bounded():
    registry, clock, _ = make(history_len=3)
    record = registry.add("http://a:1")
    for i in range(5):
        clock.t += 1
        registry.apply_probe("a:1", ok(running=i, waiting=1, kv_usage=0.5, prefix_hits=10.0 * i,
                                       prefix_queries=20.0 * i, prompt_tokens=20.0 * i))
    s = record.state
    assert (s.running, s.waiting, s.kv_usage) == (4, 1, 0.5)
    assert [h.prefix_hits for h in record.history] == [20.0, 30.0, 40.0]
    assert list(record.history)[-1].time == clock.t


def test_models_and_limits_come_from_the_probe_unless_declared():
    registry, _, _ = make()
    found = registry.add("http://a:1")
    declared = registry.add("http://b:1", models=["alias"], max_num_seqs=4)
    cards = ({"id": "m1", "max_model_len": 4096}, {"id": "m2", "max_model_len": 2048})
    for wid in ("a:1", "b:1"):
        registry.apply_probe(wid, ProbeResult(reachable=True, healthy=True, models=cards, max_num_seqs=64))
    assert found.state.models == {"m1", "m2"} and found.state.max_model_len == 2048
    assert found.state.max_num_seqs == 64
    assert declared.state.models == {"alias"} and declared.state.max_num_seqs == 4
    assert sorted(registry.model_cards()) == ["alias", "m1", "m2"]


def test_health_from_probes_and_from_failed_requests():
    registry, _, _ = make(failure_threshold=2)
    s = registry.add("http://a:1").state
    sick = ProbeResult(reachable=True, healthy=False, error="/health answered 503")
    registry.apply_probe("a:1", sick)
    assert s.healthy  # one bad answer is not enough
    registry.apply_probe("a:1", sick)
    assert not s.healthy
    registry.apply_probe("a:1", ok())
    assert s.healthy
    registry.apply_probe("a:1", ProbeResult(reachable=False, healthy=False, error="refused"))
    assert not s.healthy  # nothing listening: out at once
    registry.apply_probe("a:1", ok())
    registry.mark_failure("a:1", "http_500")
    registry.mark_success("a:1")
    registry.mark_failure("a:1", "http_500")
    assert s.ready  # success in between resets the streak
    registry.mark_failure("a:1", "http_500")
    assert s.healthy and not s.ready  # request failures open the breaker; /health is not asked
    registry.apply_probe("a:1", ok())
    assert not s.ready  # /health answering does not close it (a hung engine often answers it)
    registry.mark_failure("a:1", "connect", unreachable=True)
    assert not s.healthy


def test_each_error_is_cleared_by_its_own_kind_of_success():
    registry, _, _ = make()
    record = registry.add("http://a:1")
    registry.mark_failure("a:1", "midstream stream_idle_timeout")
    registry.apply_probe("a:1", ok())
    assert record.last_error == "midstream stream_idle_timeout"  # /health answering says nothing of it
    registry.mark_success("a:1")
    assert record.last_error is None
    registry.apply_probe("a:1", ProbeResult(reachable=True, healthy=False, error="/health answered 503"))
    registry.mark_success("a:1")
    assert record.last_error == "/health answered 503"  # a served request does not make /health answer
    registry.apply_probe("a:1", ok())
    assert record.last_error is None


def test_draining_and_request_counts():
    registry, _, _ = make()
    record = registry.add("http://a:1")
    assert registry.set_draining("a:1").state.draining
    assert not registry.set_draining("a:1", False).state.draining
    assert registry.set_draining("nope") is None
    registry.count_request("a:1", "sticky")
    registry.count_request("a:1", "sticky")
    assert record.to_json()["requests"] == {"sticky": 2}


def test_a_request_that_ended_while_metrics_were_read_is_not_foreign_load() -> None:
    registry, _, _ = make()
    registry.add("http://a:1", worker_id="a")
    state = registry.get("a").state  # type: ignore[union-attr]
    # The read began with one request of ours in flight; the engine still ran it then, and it
    # ended (the router saw the response end) before the answer to /metrics arrived.
    running = EngineMetrics(running=1, waiting=0)
    registry.apply_probe("a", ProbeResult(reachable=True, healthy=True, metrics=running, inflight_at_start=1))
    assert state.inflight == 0 and Candidate.of(state).busy == 0
    # Without knowing when the read began, the same figures read as one request from elsewhere.
    registry.apply_probe("a", ProbeResult(reachable=True, healthy=True, metrics=running))
    assert Candidate.of(state).busy == 1


def test_health_and_breaker_transitions_are_logged_once_each(caplog):
    from kvroute.fleet.breaker import BreakerSettings

    registry, clock, _ = make(failure_threshold=2, breaker=BreakerSettings(failures=2, cooldown_s=10.0))
    record = registry.add("http://a:8000")
    wid = record.id
    caplog.set_level("INFO", logger="kvroute.fleet")

    def lines() -> list[tuple[str, str]]:
        out = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kvroute.fleet"]
        caplog.clear()
        return out

    down = ProbeResult(reachable=True, healthy=False, error="/health answered 503")
    registry.apply_probe(wid, down)
    assert lines() == []  # one failed probe is below failure_threshold
    for _ in range(3):
        registry.apply_probe(wid, down)
    assert lines() == [("WARNING", "worker a:8000 unhealthy: /health answered 503")]
    for _ in range(3):
        registry.apply_probe(wid, ok())
    assert lines() == [("INFO", "worker a:8000 healthy again")]
    registry.mark_failure(wid, "connect: refused", unreachable=True)
    registry.mark_failure(wid, "connect: refused", unreachable=True)
    assert lines() == [("WARNING", "worker a:8000 unhealthy: unreachable (connect: refused)"),
                       ("WARNING", "worker a:8000 ejected for 10 s: failures: connect: refused")]
    registry.apply_probe(wid, ok())
    assert lines() == [("INFO", "worker a:8000 healthy again")]
    clock.t += 11
    registry.apply_probe(wid, ok())
    registry.apply_probe(wid, ok())
    assert lines() == [("INFO", "worker a:8000: cool-down over; one trial request decides whether it "
                                "comes back")]
    registry.sending(record)
    registry.mark_failure(wid, "http_500")
    assert lines() == [("WARNING", "worker a:8000 ejected again (its trial request failed) for 20 s: "
                                   "trial: http_500")]
    clock.t += 21
    registry.apply_probe(wid, ok())
    registry.sending(record)
    registry.mark_success(wid)
    registry.mark_success(wid)
    assert [m for _, m in lines()] == ["worker a:8000: cool-down over; one trial request decides whether "
                                       "it comes back", "worker a:8000 back in rotation: its trial request "
                                       "succeeded"]
