"""What the fleet guard's doctor and drift parts cost a router (docs/fleet-guard.md#costs).

    python benchmarks/bench_guard.py

* **drift tick**: one ``DriftWatch.tick`` over a registry of N workers with learned figures,
  beside one probe round's own bookkeeping (``Registry.apply_probe`` of each worker with a parsed
  ``/metrics``), both in microseconds per worker: the tick runs once per probe interval.
* **doctor check**: the wall time and bytes read of one check (``examine_engine``) against a
  simulated replica on loopback, beside one probe round of the same replica (``Prober.probe_once``):
  the check runs once per epoch, the probe every interval.
* **restart flagged**: a router over 3 simulated replicas at the default probe interval (1 s);
  one is restarted on its port with ``--no-enable-prefix-caching``: the seconds from the new
  process to the router's new epoch (the probe noticing), and from the new epoch to the doctor's
  ``prefix-caching-off`` finding (polled every 5 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp

from kvroute.doctor.session import examine_engine
from kvroute.engine_client.http import Target
from kvroute.fleet.probe import Prober
from kvroute.fleet.registry import ProbeResult, Registry
from kvroute.fleet.vllm_metrics import parse_vllm_metrics
from kvroute.guard.drift_watch import DriftWatch
from kvroute.routing.dispatch import Dispatcher
from kvroute.routing.scheduler import Scheduler
from kvroute.sim.server import start_sim_fleet


def drift_tick(workers: int, rounds: int) -> tuple[float, float]:
    """µs per worker of a drift tick and of applying a probe result."""
    scheduler = Scheduler()
    registry = Registry(dispatch=Dispatcher(scheduler))
    for i in range(workers):
        registry.add(f"http://10.0.{i // 250}.1:{8000 + i % 250}")
    for record in registry.records():
        scheduler.on_finished(record.id, prompt_tokens=2000, cached_tokens=1500)
        learned = scheduler.learned(record.id)
        assert learned is not None
        for _ in range(10):  # figures learned, as after some traffic
            learned.on_sent(0.0, 1e-4, 100.0, 0.8, 1600.0)
            learned.on_finished(2000, 1500, None)
    text = ("vllm:num_requests_running 3\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.4\n"
            "vllm:prefix_cache_hits_total 1000\nvllm:prefix_cache_queries_total 2000\n")
    result = ProbeResult(reachable=True, healthy=True, metrics=parse_vllm_metrics(text))
    watch = DriftWatch(registry, scheduler)
    ticks, probes = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        watch.tick()
        ticks.append(time.perf_counter() - start)
        start = time.perf_counter()
        for record in registry.records():
            registry.apply_probe(record.id, result)
        probes.append(time.perf_counter() - start)
    return (statistics.median(ticks) / workers * 1e6, statistics.median(probes) / workers * 1e6)


async def doctor_check(rounds: int) -> tuple[float, float, int]:
    """Median seconds of one doctor check and of one probe round, and the bytes the check reads."""
    fleet = await start_sim_fleet("a4000-qwen3-4b", 1, speed=20.0)
    registry = Registry()
    record = registry.add(fleet.urls[0])
    prober = Prober(registry, timeout_s=5.0)
    checks, probes = [], []
    size = 0
    try:
        async with aiohttp.ClientSession() as session:
            target = Target(fleet.urls[0], None, 10.0)
            for _ in range(rounds):
                start = time.perf_counter()
                await examine_engine(session, target)
                checks.append(time.perf_counter() - start)
                start = time.perf_counter()
                await prober.probe_once(record.id, with_models=False)
                probes.append(time.perf_counter() - start)
            for path in ("/metrics", "/v1/models", "/server_info"):
                async with session.get(target.url(path)) as resp:
                    size += len(await resp.read())
    finally:
        await prober.close()
        await fleet.close()
    return statistics.median(checks), statistics.median(probes), size


async def restart_flagged(rounds: int) -> tuple[list[float], list[float]]:
    """Seconds from a restart with prefix caching off to the new epoch, and from there to the finding."""
    from kvroute.router_settings import Settings, WorkerSpec
    from kvroute.server.app import start_router

    fleet = await start_sim_fleet("a4000-qwen3-4b", 3, speed=20.0)
    settings = Settings(workers=tuple(WorkerSpec(url=u) for u in fleet.urls))
    router = await start_router(settings)
    to_epoch, to_finding = [], []
    try:
        watch = router.router.doctor_watch
        assert watch is not None
        record = router.registry.records()[0]
        for i in range(rounds):
            restarts = record.restarts
            started = time.perf_counter()
            await fleet.restart_with(0, enable_prefix_caching=i % 2 == 1)
            while record.restarts == restarts:
                await asyncio.sleep(0.005)
            seen = time.perf_counter()
            while (check := watch.to_json(record.id)) is None or check["epoch"] != record.state.epoch:
                await asyncio.sleep(0.005)
            if i % 2 == 0:  # the restarts with caching off
                assert any(f["code"] == "prefix-caching-off" for f in check["findings"])
                to_epoch.append(seen - started)
                to_finding.append(time.perf_counter() - seen)
    finally:
        await router.close()
        await fleet.close()
    return to_epoch, to_finding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--restarts", type=int, default=5, help="restarts with caching off (and back)")
    args = parser.parse_args()
    tick, probe = drift_tick(args.workers, args.rounds)
    check, probe_round, size = asyncio.run(doctor_check(min(args.rounds, 20)))
    to_epoch, to_finding = asyncio.run(restart_flagged(args.restarts * 2))
    print("| part | measured | beside it | ratio |")
    print("|---|---|---|---|")
    print(f"| drift tick, per worker ({args.workers} workers) | {tick:.1f} µs | applying one probe result: "
          f"{probe:.1f} µs | {tick / probe:.2f}× |")
    print(f"| doctor check of one sim replica (once per epoch) | {check * 1e3:.1f} ms, {size:,} bytes | "
          f"one probe round: {probe_round * 1e3:.1f} ms | {check / probe_round:.1f}× |")
    print(f"| restart with caching off -> new epoch (median of {len(to_epoch)}) | "
          f"{statistics.median(to_epoch):.2f} s | probe interval: 1 s | {statistics.median(to_epoch):.2f}× |")
    median, worst = statistics.median(to_finding), max(to_finding)
    print(f"| new epoch -> prefix-caching-off finding (median, max of {len(to_finding)}) | "
          f"{median * 1e3:.0f} ms, {worst * 1e3:.0f} ms | probe interval: 1 s | {median:.3f}× |")


if __name__ == "__main__":
    main()
