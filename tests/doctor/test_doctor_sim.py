"""The doctor against simulated replicas configured each way the prefix-hashing
design describes, over loopback HTTP."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import aiohttp
import pytest

from kvroute.doctor.checks import compare_fleet, diagnose
from kvroute.doctor.endpoint import EndpointBundle, facts_for_endpoint
from kvroute.doctor.facts import EngineFacts, MergedFacts
from kvroute.doctor.finding import Severity
from kvroute.doctor.report import TargetReport
from kvroute.doctor.session import DoctorOptions, run_doctor
from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import start_router
from kvroute.sim.server import SimFleet, start_sim_fleet

SimFactory = Callable[..., AbstractAsyncContextManager[SimFleet]]

ALIGN = {"enable_prefix_caching": True, "mamba_cache_mode": "align"}


def codes(target: TargetReport) -> dict[str, Severity]:
    return {f.code: f.severity for f in target.findings}


def fix(target: TargetReport, code: str) -> str | None:
    return next(f.fix for f in target.findings if f.code == code)


async def doctor(urls: list[str], **options: object) -> list[TargetReport]:
    report = await run_doctor(DoctorOptions(urls=tuple(urls), **options))  # type: ignore[arg-type]
    return report.targets


async def test_hybrid_defaults_caching_off(sim: SimFactory) -> None:
    async with sim("hybrid-27b") as fleet:
        [target] = await doctor(fleet.urls, probe=True)
    found = codes(target)
    assert found["prefix-caching-off-hybrid"] is Severity.ERROR
    assert fix(target, "prefix-caching-off-hybrid") == "--enable-prefix-caching --mamba-cache-mode align"
    assert found["probe-no-hit"] is Severity.ERROR
    assert target.merged.facts.hybrid is not None and target.merged.facts.hybrid.value is True


async def test_hybrid_caching_with_mode_none(sim: SimFactory) -> None:
    async with sim("hybrid-27b", enable_prefix_caching=True) as fleet:
        [target] = await doctor(fleet.urls, probe=True)
    found = codes(target)
    assert found["mamba-mode-none"] is Severity.ERROR
    assert fix(target, "mamba-mode-none") == "--mamba-cache-mode align"
    assert "prefix-caching-off-hybrid" not in found
    # The probe's own lookups show up in the counters: all misses.
    assert found["hit-rate-zero"] is Severity.WARNING
    assert found["probe-no-hit"] is Severity.ERROR


async def test_hybrid_align_with_1600_block(sim: SimFactory) -> None:
    async with sim("hybrid-27b", **ALIGN) as fleet:
        [target] = await doctor(fleet.urls, probe=True)
    found = codes(target)
    assert target.merged.facts.block_size is not None and target.merged.facts.block_size.value == 1600
    assert found["match-unit-coarse"] is Severity.WARNING
    assert fix(target, "match-unit-coarse") == "--prefix-match-unit 32"
    assert found["fp8-kv-cache"] is Severity.INFO
    assert found["mamba-align-experimental"] is Severity.INFO
    assert found["probe-repeat-hit"] is Severity.OK
    # Evidence of the block problem from requests: turns reuse only whole 1600-token blocks.
    assert found["probe-conversation-partial"] is Severity.WARNING
    assert fix(target, "probe-conversation-partial") == "--prefix-match-unit 32"


async def test_hybrid_align_with_match_unit_32(sim: SimFactory) -> None:
    async with sim("hybrid-27b", prefix_match_unit=32, **ALIGN) as fleet:
        [target] = await doctor(fleet.urls, probe=True)
    found = codes(target)
    assert "match-unit-coarse" not in found
    assert found["match-unit-fine"] is Severity.OK
    assert found["probe-conversation-hit"] is Severity.OK
    assert max(s.rank for s in found.values()) < Severity.WARNING.rank


async def test_hybrid_without_fp8_gets_800_token_blocks(sim: SimFactory) -> None:
    # Without fp8 the card has 127 Mamba blocks, so max_num_seqs must come down to start at all.
    async with sim("hybrid-27b", kv_cache_dtype="auto", max_num_seqs=127, **ALIGN) as fleet:
        [target] = await doctor(fleet.urls)
    facts = target.merged.facts
    assert facts.block_size is not None and facts.block_size.value == 800
    assert facts.cache_dtype is not None and facts.cache_dtype.value == "auto"
    found = codes(target)
    assert "fp8-kv-cache" not in found
    assert found["match-unit-coarse"] is Severity.WARNING
    assert found["mamba-slots"] is Severity.INFO


async def test_max_num_seqs_above_mamba_blocks_as_a_startup_log() -> None:
    # The simulator refuses to start exactly as vLLM does; its error, as a log line, is diagnosed.
    with pytest.raises(ValueError, match="exceeds available Mamba cache blocks") as refused:
        await start_sim_fleet("hybrid-27b", 1, kv_cache_dtype="auto", **ALIGN)
    log = f"(EngineCore_DP0 pid=7) ERROR 05-14 09:14:04 [core.py:946] ValueError: {refused.value}\n"
    merged, _ = facts_for_endpoint(None, log)
    top = diagnose(merged)[0]
    assert top.code == "mamba-blocks-below-max-num-seqs"
    assert top.fix is not None and top.fix.startswith("--max-num-seqs 127")


async def test_dense_model_is_healthy_and_probe_hits(sim: SimFactory) -> None:
    async with sim("dense-3b") as fleet:
        [target] = await doctor(fleet.urls, probe=True, probe_tokens=1200)
    found = codes(target)
    assert found["prefix-caching-on"] is Severity.OK
    assert found["probe-repeat-hit"] is Severity.OK
    assert found["probe-conversation-hit"] is Severity.OK
    assert max(s.rank for s in found.values()) < Severity.WARNING.rank
    assert target.merged.facts.hybrid is not None and target.merged.facts.hybrid.value is False
    assert target.probe[1].cached_tokens and target.probe[1].cached_tokens > 1000


async def test_the_odd_replica_is_named(sim: SimFactory) -> None:
    async with sim("hybrid-27b", 2, prefix_match_unit=32, **ALIGN) as good, sim("hybrid-27b", **ALIGN) as odd:
        report = await run_doctor(DoctorOptions(urls=(*good.urls, *odd.urls)))
    differ = [f for f in report.fleet if f.code == "fleet-differs"]
    assert [f.title for f in differ] == [f"prefix_match_unit differs on {odd.urls[0]} (the rest: 32)"]


async def test_through_the_router(sim: SimFactory) -> None:
    async with sim("hybrid-27b", 2, prefix_match_unit=32, **ALIGN) as good, sim("hybrid-27b", **ALIGN) as odd:
        urls = [*good.urls, *odd.urls]
        settings = Settings(workers=tuple(WorkerSpec(u) for u in urls), admin_token="s3cret")
        router = await start_router(settings)
        try:
            with_token = await run_doctor(DoctorOptions(urls=(router.url,), admin_token="s3cret"))
            without = await run_doctor(DoctorOptions(urls=(router.url,)))
        finally:
            await router.close()
    assert sorted(t.name for t in with_token.targets) == sorted(urls)
    assert all(t.kind == "worker" and t.via == router.url for t in with_token.targets)
    odd_target = next(t for t in with_token.targets if t.name == odd.urls[0])
    assert "match-unit-coarse" in codes(odd_target)
    assert [f.code for f in with_token.fleet] == ["fleet-differs"]
    assert odd.urls[0] in with_token.fleet[0].title
    # Without the token the doctor says how to get the worker list.
    locked = [f for f in without.fleet if f.code == "router-admin-locked"]
    assert locked and "--admin-token" in (locked[0].fix or "")


async def _as_real_vllm(url: str) -> EngineFacts:
    """What the doctor knows of a simulated replica from what real vLLM also serves: /metrics and
    /v1/models (vLLM answers /server_info with 404)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics") as resp:
            metrics = await resp.text()
        async with http.get(f"{url}/v1/models") as resp:
            models = await resp.json()
    merged, _ = facts_for_endpoint(EndpointBundle(url, metrics_text=metrics, models=models))
    return merged.facts


@pytest.mark.parametrize(("preset", "overrides", "hybrid", "expected"), [
    ("hybrid-27b", {}, True, "prefix-caching-off-hybrid"),
    ("hybrid-27b", {"enable_prefix_caching": True}, True, "mamba-mode-none"),
    ("hybrid-27b", ALIGN, True, "match-unit-coarse"),
    ("hybrid-27b", {**ALIGN, "prefix_match_unit": 32}, True, "match-unit-fine"),
    ("dense-3b", {}, False, "prefix-caching-on"),
])
async def test_findings_need_only_what_real_vllm_exposes(sim: SimFactory, preset: str,
                                                         overrides: dict[str, object], hybrid: bool,
                                                         expected: str) -> None:
    async with sim(preset, **overrides) as fleet:
        facts = await _as_real_vllm(fleet.urls[0])
    assert facts.hybrid is not None and facts.hybrid.value is hybrid
    assert facts.hybrid.source.startswith("/metrics vllm:cache_config_info mamba_block_size=")
    found = {f.code for f in diagnose(MergedFacts(facts))}
    assert expected in found


async def test_a_replica_without_the_match_unit_stands_out_on_metrics_alone(sim: SimFactory) -> None:
    async with sim("hybrid-27b", prefix_match_unit=32, **ALIGN) as good, sim("hybrid-27b", **ALIGN) as odd:
        engines = [(url, await _as_real_vllm(url)) for url in (good.urls[0], odd.urls[0])]
    [differ] = [f for f in compare_fleet(engines) if f.code == "fleet-differs"]
    assert differ.title.startswith(f"prefix_match_unit differs on {odd.urls[0]}")
