"""The router-cost load counts only its measured window, and the tables show ratios to kvroute."""

from __future__ import annotations

import os

from peers.cost import CostPlan, CostResult, median_of, request_bodies, run_cost
from peers.report import cost_markdown, quality_markdown

from kvroute.bench.results import BenchResult, PolicyRun, StepResult
from kvroute.sim.server import start_sim_fleet


def test_request_bodies_are_deterministic_and_distinct() -> None:
    plan = CostPlan(distinct_prompts=8, prompt_tokens=16, max_tokens=4)
    bodies = request_bodies("m", plan, stream=True, seed=1)
    assert bodies == request_bodies("m", plan, stream=True, seed=1)
    assert len(set(bodies)) == 8
    assert bodies != request_bodies("m", plan, stream=True, seed=2)


async def test_closed_loop_against_replicas() -> None:
    fleet = await start_sim_fleet("a4000-qwen3-4b", 2, speed=200.0)
    plan = CostPlan(clients=4, duration_s=0.6, warmup_s=0.2, prompt_tokens=16, max_tokens=4,
                    distinct_prompts=16)
    try:
        results = [await run_cost("direct", fleet.urls, "qwen3-4b", plan, stream=stream,
                                  meters={"client": [os.getpid()]})
                   for stream in (False, True)]
    finally:
        await fleet.close()
    for r in results:
        assert r.errors == 0 and r.requests > 0, r.first_error
        assert r.requests_per_s == r.requests / plan.duration_s
        assert r.p50_ms is not None and r.p99_ms is not None and r.p50_ms <= r.p99_ms
        assert r.cpu_s["client"] > 0
        assert r.cpu_ms_per_request("client") == 1000 * r.cpu_s["client"] / r.requests
        assert r.cpu_ms_per_request("router") is None


def _step(policy: str, sessions: int, p50: float, tokens: float) -> StepResult:
    return StepResult(policy, sessions, 60.0, 10, 0, 1, 60.0, tokens, p50, 2 * p50, 4.0, 50.0, 90.0,
                      preemptions=3, ttfb_p99_s=3 * p50)


def test_tables_give_ratios_to_kvroute() -> None:
    queued = _step("kvroute auto/flow", 4, 0.25, 1500.0)
    queued.queue_wait_p50_s, queued.queue_wait_p95_s, queued.shed, queued.router_shed = 0.0, 1.5, 2, 3
    result = BenchResult({}, [PolicyRun("kvroute auto", [_step("kvroute auto", 4, 0.5, 1000.0)]),
                              PolicyRun("kvroute auto/flow", [queued]),
                              PolicyRun("peer rr", [_step("peer rr", 4, 1.0, 500.0)])])
    text = quality_markdown(result, "kvroute auto")
    assert "| 4 | kvroute auto | 10 | 0.50 | 1.00 | 1.50 | 1,000 | 50.0 | 90.0 | 3 | — | 0 | 0 |" in text
    assert ("| 4 | peer rr | 10 | 1.00 (×2.00) | 2.00 (×2.00) | 3.00 (×2.00) | 500 (×0.50) | 50.0 | 90.0 "
            "| 3 | — | 0 | 0 |") in text
    # The client's count of overload answers, and the router's own where it differs.
    assert "| 1,500 (×1.50) | 50.0 | 90.0 | 3 | 0.00 / 1.50 | 2 (router 3) | 0 |" in text
    costs = [CostResult("kvroute auto", False, 100, 0, 1.0, 100.0, 5.0, 9.0),
             CostResult("peer rr", False, 300, 1, 1.0, 300.0, 2.0, 4.0, cpu_s={"router": 0.03})]
    table = cost_markdown(costs, "kvroute auto")
    assert "| peer rr | 300 (×3.00) | 2.0 | 4.0 | 0.10 | — | — | — | — | 1 |" in table


def test_median_over_rounds_pools_requests_and_cpu() -> None:
    def result(rps: float, p99: float, cpu: float, stream: bool = False) -> CostResult:
        return CostResult("r", stream, int(rps), 0, 1.0, rps, rps / 10, p99, cpu_s={"router": cpu})

    rounds = [[result(100, 9, 0.05), result(50, 20, 0.05, True)],
              [result(300, 5, 0.15)],
              [result(200, 7, 0.10)]]
    whole, stream = median_of(rounds)
    assert (whole.requests_per_s, whole.p50_ms, whole.p99_ms) == (200, 20, 7)
    assert (whole.requests, whole.duration_s) == (600, 3.0)
    assert abs(whole.cpu_ms_per_request("router") - 0.5) < 1e-9   # 0.30 s over 600 requests
    assert (stream.stream, stream.requests_per_s) == (True, 50)
