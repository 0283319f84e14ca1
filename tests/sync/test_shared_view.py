"""Epoch agreement and held facts, with the real registry and scheduler (no Redis: facts are
handed from one instance's view to the other's by the test)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvroute.fleet.registry import Registry
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.sync_record import PrefixRecord, SessionRecord, SyncRecord, WorkerEpochRecord
from kvroute.sync.messages import LoadMessage, WorkerLoad
from kvroute.sync.metrics import SyncMetrics
from kvroute.sync.peer_load import PeerLoads
from kvroute.sync.shared_view import SharedView

URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(3)]
PROMPT = ("<system prompt of a long conversation> " * 200).encode()


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Instance:
    """One router instance's routing state wired as the server wires it, minus the network."""

    def __init__(self, now: float, *, max_pending: int = 20_000) -> None:
        self.clock = Clock(now)
        self.registry = Registry(clock=self.clock)
        self.scheduler = Scheduler(clock=self.clock)
        self.peers = PeerLoads()
        self.prometheus = CollectorRegistry()
        self.metrics = SyncMetrics(self.prometheus)
        self.view = SharedView(self.registry, self.scheduler, self.peers, self.metrics,
                               max_pending=max_pending, clock=self.clock)
        self.outbox: list[SyncRecord] = []
        self.registry.subscribe(self)

    # The server's registry listener: tell the scheduler, publish what is news.
    def on_worker_epoch(self, worker_id: str, epoch: float) -> None:
        self.publish(self.scheduler.on_worker_epoch(worker_id, epoch))

    def on_worker_removed(self, worker_id: str) -> None:
        self.scheduler.on_worker_removed(worker_id)

    def publish(self, records: list[SyncRecord]) -> None:
        self.outbox.extend(r for r in records if self.view.local(r))

    def register_all(self) -> None:
        for url in URLS:
            self.registry.add(url, models=["m"])

    def send(self, key: RoutingKey) -> tuple[str, int]:
        d = self.scheduler.decide(key, self.registry.states())
        assert d.worker_id is not None
        self.publish(self.scheduler.commit(key, d))
        return d.worker_id, d.matched_blocks

    def sent(self) -> list[SyncRecord]:
        """Drain the outbox as the bus would send it."""
        out = [o for r in self.outbox if (o := self.view.outgoing(r)) is not None]
        self.outbox.clear()
        return out


def _key(extra: bytes = b"", session: str | None = None) -> RoutingKey:
    prefix = PROMPT + extra
    return RoutingKey("m", prefix, session_id=session, est_prompt_tokens=len(prefix) // 4)


def _started(now: float) -> Instance:
    inst = Instance(now)
    inst.register_all()
    inst.view.finish_catch_up()
    return inst


def test_an_instance_started_later_adopts_the_cluster_epoch_and_routes_warm() -> None:
    a = _started(1000.0)
    home, _ = a.send(_key(b" turn 1", session="s1"))
    facts = a.sent()
    assert {type(r) for r in facts} == {WorkerEpochRecord, PrefixRecord, SessionRecord}

    # B catches up before its configured workers are registered: the facts are held...
    b = Instance(2000.0)
    for r in facts:
        assert not b.view.receive(r)
    assert b.view.pending == len(facts)
    # ...and applied when it registers them, under the epoch the cluster already uses.
    b.register_all()
    b.view.finish_catch_up()
    assert b.view.pending == 0
    assert [s.epoch for s in b.registry.states()] == [s.epoch for s in a.registry.states()]
    worker, matched = b.send(_key(b" turn 1 turn 2", session="s1"))
    assert (worker, matched > 0) == (home, True)
    # B's registration announcements are not news: nothing but B's own decision goes out.
    assert not any(isinstance(r, WorkerEpochRecord) for r in b.sent())


def test_a_registration_settles_against_live_peers_heartbeats() -> None:
    b = Instance(2000.0)
    b.view.finish_catch_up()
    b.peers.update(LoadMessage("a", 2000.0, 1.0, {"127.0.0.1:9000": WorkerLoad(2, 1000.0)}), now=0.0)
    b.register_all()
    epochs = {s.id: s.epoch for s in b.registry.states()}
    assert epochs["127.0.0.1:9000"] == 1000.0  # adopted from the peer
    assert epochs["127.0.0.1:9001"] == 2000.0  # nobody knew it: B's epoch becomes the cluster's
    announced = {r.worker_id for r in b.sent() if isinstance(r, WorkerEpochRecord)}
    assert announced == {"127.0.0.1:9001", "127.0.0.1:9002"}


def test_a_newer_remote_epoch_is_followed_and_older_facts_stop_matching() -> None:
    a, b = _started(1000.0), _started(1000.0)
    home, _ = a.send(_key(b" x"))
    for r in a.sent():
        b.view.receive(r)
    assert b.send(_key(b" x y"))[1] > 0
    # Another instance saw the worker restart.
    b.view.receive(WorkerEpochRecord(home, 1500.0))
    assert b.registry.get(home).state.epoch == 1500.0  # type: ignore[union-attr]
    assert b.view.agreed_epoch(home) == 1500.0
    assert b.send(_key(b" x y z"))[1] == 0


def test_heartbeat_epochs_are_followed_forward_only() -> None:
    b = _started(1000.0)
    wid = b.registry.states()[0].id
    b.view.peer_epochs({wid: 900.0})
    assert b.view.agreed_epoch(wid) == 1000.0
    b.view.peer_epochs({wid: 1100.0})
    assert b.registry.get(wid).state.epoch == 1100.0  # type: ignore[union-attr]


def test_facts_queued_under_a_given_up_epoch_go_out_under_the_adopted_one() -> None:
    b = Instance(2000.0)
    b.register_all()  # Redis was down at start: not caught up, local epochs in use
    b.send(_key(b" early"))
    b.peers.update(LoadMessage("a", 2000.0, 1.0, {u.removeprefix("http://"): WorkerLoad(0, 1000.0)
                                                  for u in URLS}), now=0.0)
    b.view.finish_catch_up()
    out = b.sent()
    assert not any(isinstance(r, WorkerEpochRecord) for r in out)
    assert [r.epoch for r in out if isinstance(r, PrefixRecord)] == [1000.0]


def test_a_re_registration_is_news_but_a_removed_and_re_added_worker_settles_again() -> None:
    a = _started(1000.0)
    a.sent()
    a.clock.now = 1200.0
    a.registry.add(URLS[0], models=["m"])  # re-registration: a new epoch for the whole cluster
    assert [r.epoch for r in a.sent() if isinstance(r, WorkerEpochRecord)] == [1200.0]
    wid = a.registry.states()[1].id
    a.peers.update(LoadMessage("p", 1200.0, 1.0, {wid: WorkerLoad(0, 1000.0)}), now=0.0)
    a.registry.remove(wid)
    a.clock.now = 1300.0
    a.registry.add(URLS[1], models=["m"])
    assert a.registry.get(wid).state.epoch == 1000.0  # type: ignore[union-attr]
    assert not a.sent()


def test_remote_facts_are_applied_unchanged() -> None:
    b = _started(2000.0)
    applied: list[SyncRecord] = []
    b.view.apply = applied.append
    wid = b.registry.states()[0].id
    record = PrefixRecord(wid, 2000.0, 1990.0, (1, 2), prefill_tokens=500)
    b.view.receive(record)  # the scheduler discounts its age (tests/routing/test_backlog_bounds.py)
    assert [r for r in applied if isinstance(r, PrefixRecord)] == [record]
    assert b.prometheus.get_sample_value("kvroute_sync_applied_total", {"kind": "prefix"}) == 1


def test_held_facts_are_bounded() -> None:
    b = Instance(2000.0, max_pending=3)
    for i in range(5):
        b.view.receive(SessionRecord(i, "unknown:1", 2000.0))
    assert b.view.pending == 3
    assert b.prometheus.get_sample_value("kvroute_sync_dropped_total", {"reason": "pending_full"}) == 2
