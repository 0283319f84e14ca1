"""The scheduler's contract: filters, no-worker decisions, commit/apply_remote, fleet hooks."""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest
from routing_helpers import Clock, fleet, key, send, text

from kvroute.routing.decision import DecisionKind
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.sync_record import PrefixRecord, SessionRecord, WorkerEpochRecord, record_from_dict

MakeScheduler = Callable[..., Scheduler]
ALL = ["round-robin", "p2c", "least-loaded", "prefix", "session", "auto"]


@pytest.mark.parametrize("policy", ALL)
def test_filters_apply_to_every_policy(make_scheduler: MakeScheduler, policy: str) -> None:
    s, ws = make_scheduler(policy), fleet(5)
    ws[0].healthy = False
    ws[1].draining = True
    ws[2].models = frozenset({"other"})
    ws[3].inflight = 3  # the only worker left, however loaded
    chosen = {s.decide(key(text(i, 3000), session=f"s{i}"), ws, exclude={"w4"}).worker_id for i in range(8)}
    assert chosen == {"w3"}
    d = s.decide(key("x"), ws, exclude={"w3", "w4"})
    assert d.worker_id is None and d.kind is DecisionKind.NO_WORKER
    assert "passed serves_model" in d.reason  # w2 is ready but serves another model
    assert "passed ready" in s.decide(key("x"), ws[:2]).reason


def test_unknown_model_names_the_filter(make_scheduler: MakeScheduler) -> None:
    d = make_scheduler().decide(key("x", model="nope"), fleet(2))
    assert d.kind is DecisionKind.NO_WORKER and "serves_model" in d.reason and "'nope'" in d.reason
    assert make_scheduler().commit(key("x", model="nope"), d) == []


def test_context_window_must_fit_prompt_and_output(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("least-loaded"), fleet(2)
    ws[0].max_model_len, ws[1].max_model_len = 4096, 32768
    ws[1].inflight = 5
    assert s.decide(key(text(1, 8000), max_tokens=1000), ws).worker_id == "w0"
    assert s.decide(key(text(1, 8000), max_tokens=3000), ws).worker_id == "w1"
    # Fits nowhere: every worker stays a candidate and the engine gives its own exact error.
    assert s.decide(key(text(1, 400_000)), ws).worker_id == "w0"


def test_full_workers_are_skipped_unless_all_are_full(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("prefix"), fleet(2, max_num_seqs=4)
    prompt = key(text(1, 200_000))
    home = send(s, prompt, ws)
    hot, cold = (ws[0], ws[1]) if home == "w0" else (ws[1], ws[0])
    hot.running, cold.inflight = 4, 3  # engine says no slot left, slack would allow it
    assert s.decide(prompt, ws).worker_id == cold.id
    cold.inflight = 4
    assert s.decide(prompt, ws).worker_id == hot.id


def test_cache_salt_and_model_separate_prefixes(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("prefix"), fleet(2)
    ws[0].models = ws[1].models = frozenset({"m", "m2"})
    body = text(1, 20_000)
    send(s, key(body, salt="tenant-a"), ws)
    assert s.decide(key(body, salt="tenant-a"), ws).matched_blocks == 39
    assert s.decide(key(body, salt="tenant-b"), ws).matched_blocks == 0
    assert s.decide(key(body), ws).matched_blocks == 0
    assert s.decide(key(body, model="m2", salt="tenant-a"), ws).matched_blocks == 0


def test_restarted_worker_stops_matching(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("prefix"), fleet(2)
    prompt = key(text(1, 20_000))
    home = send(s, prompt, ws)
    w = next(x for x in ws if x.id == home)
    w.epoch = 2.0  # the registry saw a new process start time
    assert s.decide(prompt, ws).matched_blocks == 0
    assert s.on_worker_epoch(home, 2.0) == [WorkerEpochRecord(home, 2.0)]
    assert s.on_worker_epoch(home, 2.0) == []
    send(s, prompt, [w])
    assert s.decide(prompt, ws).worker_id == home


def test_removed_worker_loses_prefixes_and_sessions(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("session"), fleet(2)
    k = key(text(1, 5000), session="s")
    home = send(s, k, ws)
    s.on_worker_removed(home)
    d = s.decide(k, ws)
    assert d.kind is DecisionKind.COLD and d.matched_blocks == 0
    assert home not in s.stats()["workers"]


@pytest.mark.parametrize("policy", ["prefix", "session", "auto"])
def test_facts_published_by_one_instance_route_the_other(policy: str, clock: Clock) -> None:
    from kvroute.routing.config import ModelSettings, RoutingConfig

    config = RoutingConfig(default=ModelSettings(policy=policy))
    a, b = Scheduler(config, clock=clock), Scheduler(config, clock=clock)
    ws = fleet(4)
    conv = text(1, 30_000)
    da = a.decide(key(conv, session="s"), ws)
    records = a.commit(key(conv, session="s"), da)
    for r in records:  # through JSON, as the Redis bus will carry them
        b.apply_remote(record_from_dict(orjson.loads(orjson.dumps(r.to_dict()))))
    clock.advance(20)
    db = b.decide(key(conv + text(2, 800), session="s"), ws)
    assert db.worker_id == da.worker_id and db.kind in (DecisionKind.STICKY, DecisionKind.PREFIX_HIT)
    kinds = {type(r) for r in records}
    assert PrefixRecord in kinds and (SessionRecord in kinds) == (policy != "prefix")


@pytest.mark.parametrize("policy", ["prefix", "session", "auto"])
def test_without_a_listener_commit_makes_no_facts_and_records_the_same(policy: str, clock: Clock) -> None:
    from kvroute.routing.config import ModelSettings, RoutingConfig

    config = RoutingConfig(default=ModelSettings(policy=policy))
    told, alone = Scheduler(config, clock=clock), Scheduler(config, clock=clock)
    alone.publishes = False
    ws = fleet(4)
    turns = [key(text(1, 30_000) + text(2, 800 * i), session="s") for i in range(3)]
    for k in turns:
        d, d_alone = told.decide(k, ws), alone.decide(k, ws)
        assert (d_alone.worker_id, d_alone.kind, d_alone.matched_blocks) == \
            (d.worker_id, d.kind, d.matched_blocks)
        assert told.commit(k, d)
        assert alone.commit(k, d_alone) == []
        clock.advance(5)
    assert alone.stats() == told.stats()


def test_remote_record_for_an_older_epoch_is_ignored(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("prefix"), fleet(2)
    s.on_worker_epoch("w0", 1.0)
    prompt = key(text(1, 5000))
    hashes = s.hashes(prompt)
    ws[0].epoch = 2.0
    s.apply_remote(WorkerEpochRecord("w0", 2.0))
    s.apply_remote(PrefixRecord("w0", 1.0, 1_700_000_000.0, hashes))
    assert s.decide(prompt, ws).matched_blocks == 0
    s.apply_remote(PrefixRecord("w0", 2.0, 1_700_000_000.0, hashes))
    assert s.decide(prompt, ws).matched_blocks == len(hashes)


@pytest.mark.parametrize("policy", ALL)
def test_reason_never_contains_prompt_text(make_scheduler: MakeScheduler, policy: str) -> None:
    s, ws = make_scheduler(policy), fleet(3)
    secret = "TOP-SECRET-PROMPT-" * 2000
    k = key(secret, session="my-session-id-123")
    for _ in range(3):
        d = s.decide(k, ws)
        s.commit(k, d)
        assert "SECRET" not in d.reason and "my-session-id" not in d.reason
        assert d.reason.startswith(f"[{policy.upper()}]")


def test_decision_carries_loads_and_hashes_for_commit(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("prefix"), fleet(3)
    ws[1].inflight, ws[2].peer_inflight = 2, 5
    d = s.decide(key(text(1, 5000)), ws)
    assert d.loads == (("w0", 0), ("w1", 2), ("w2", 5))
    assert d.total_blocks == len(d.block_hashes) == 9 and d.est_tokens == 1250


def test_stats_count_decisions_per_worker(make_scheduler: MakeScheduler) -> None:
    s, ws = make_scheduler("session"), fleet(2)
    for i in range(3):
        send(s, key("hi", session=f"s{i}"), ws)
    send(s, key("hi", session="s0"), ws)
    stats = s.stats()
    assert stats["sessions"] == 3 and stats["index_blocks"] == 0
    assert sum(w["cold"] for w in stats["workers"].values()) == 3
    assert sum(w["sticky"] for w in stats["workers"].values()) == 1


def test_uncacheable_requests_are_routed_but_not_indexed(make_scheduler: MakeScheduler) -> None:
    from kvroute.routing.key import RoutingKey

    s, ws = make_scheduler("prefix"), fleet(2)
    k = RoutingKey(model="m", prefix=text(1, 5000).encode(), est_prompt_tokens=1250, cacheable=False)
    assert s.commit(k, s.decide(k, ws)) == []
    assert s.stats()["index_blocks"] == 0


@pytest.mark.parametrize("policy", ["round-robin", "p2c", "least-loaded"])
def test_foreseeing_a_decision_leaves_the_next_ones_where_they_were(make_scheduler: MakeScheduler,
                                                                    policy: str) -> None:
    # Flow control asks where a queued request would go; that must not move the pickers' turn or
    # their random source, or every question shifts where the requests really sent go.
    plain, asked, ws = make_scheduler(policy), make_scheduler(policy), fleet(4)
    sent = [plain.decide(key(text(i, 2000)), ws).worker_id for i in range(12)]
    seen = []
    for i in range(12):
        asked.foresee(key(text(100 + i, 2000)), ws)
        seen.append(asked.decide(key(text(i, 2000)), ws).worker_id)
    assert seen == sent
    assert len(set(sent)) > 1  # the pickers do move between decisions: the check means something
