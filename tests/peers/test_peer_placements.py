"""The replicas' placement log: what it reads from a request body, how it attributes client records,
and that the simulated replicas really keep it."""

from __future__ import annotations

import aiohttp
import orjson
from peers.placements import Placement, attribute, identify, placement_map
from peers.simfleet import start_fleet
from peers.workload import KeyedWorkload

from kvroute.bench.results import RequestRecord
from kvroute.bench.stats import stayed_share
from kvroute.bench.workloads import AgentWorkload, AgentWorkloadConfig

SMALL = AgentWorkloadConfig(system_tokens=60, first_tokens=80, rounds=2, round_tokens=20,
                            max_output_tokens=4, min_output_tokens=4, jitter=0.0)


def test_identify_reads_session_and_round_from_any_serialisation() -> None:
    script = AgentWorkload(SMALL, seed=1).session(0)
    for req in script.requests:
        expected = (script.session_id, req.round)
        assert identify(orjson.dumps(req.openai_body("m"))) == expected
        assert identify(orjson.dumps(req.anthropic_body("m"), option=orjson.OPT_INDENT_2)) == expected
    assert identify(b'{"messages": [{"role": "user", "content": "hello"}]}') is None


def test_keyed_workload_sends_every_session_header_and_the_same_bodies() -> None:
    plain, keyed = AgentWorkload(SMALL, seed=2), KeyedWorkload(AgentWorkload(SMALL, seed=2))
    a, b = plain.session(5), keyed.session(5)
    assert [r.openai_body("m") for r in a.requests] == [r.openai_body("m") for r in b.requests]
    headers = b.requests[1].headers()
    assert set(headers) == {"X-Claude-Code-Session-Id", "X-Session-ID", "x-smg-routing-key"}
    assert set(headers.values()) == {a.session_id}


def test_attribution_feeds_the_stayed_share() -> None:
    records = [RequestRecord("s1", r, 0.0) for r in range(3)]
    records += [RequestRecord("s2", r, 0.0) for r in range(2)]
    records[0].worker = "h:2"   # what a router said; the log says h:1
    log = [Placement("s1", 0, "h:9"), Placement("s1", 0, "h:1"),  # a retry: the last one served it
           Placement("s1", 1, "h:1"), Placement("s1", 2, "h:2"), Placement("s2", 0, "h:3")]
    result = attribute(records, placement_map(log))
    assert (result.attributed, result.missing, result.disagreed) == (4, 1, 1)
    assert result.per_replica == {"h:1": 2, "h:2": 1, "h:3": 1}
    assert [r.worker for r in records] == ["h:1", "h:1", "h:2", "h:3", None]
    assert stayed_share(records) == 50.0   # s1: 0->1 stayed, 1->2 moved; s2's round 1 is unknown
    turned_away = RequestRecord("s3", 0, 0.0, error="HTTP 429: queue full", shed=True)
    assert attribute([turned_away], placement_map(log)).missing == 0   # it reached no replica


async def test_simulated_replicas_log_where_each_round_went() -> None:
    fleet, log = await start_fleet("a4000-qwen3-4b", 2, 0, 200.0, {})
    script = AgentWorkload(SMALL, seed=3).session(0)
    try:
        async with aiohttp.ClientSession() as http:
            for req, replica in zip(script.requests, (0, 1, 1), strict=True):
                body = orjson.dumps(req.openai_body("qwen3-4b", stream=False))
                async with http.post(fleet[replica].url + "/v1/chat/completions", data=body) as resp:
                    assert resp.status == 200
            async with http.post(fleet[0].url + "/v1/chat/completions/render", data=body) as resp:
                assert resp.status == 200   # rendering is not serving: not logged
            async with http.get(fleet[1].url + "/peers/placements") as resp:
                served = [tuple(p) for p in await resp.json()]
    finally:
        for r in fleet:
            await r.close()
    names = [r.url.removeprefix("http://") for r in fleet]
    expected = [(script.session_id, i, names[k]) for i, k in enumerate((0, 1, 1))]
    assert served == expected
    assert [(p.session_id, p.round, p.replica) for p in log] == expected
