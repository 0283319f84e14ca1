"""The simulator must expose what real vLLM exposes, under the same names and shapes.

The offline tests diff a live simulator against the answers recorded from vLLM 0.32.0-CPU in
``fixtures/`` (so they run everywhere); the ``vllm``-marked ones check that live replicas still
answer exactly what was recorded, and diff the simulator against them directly.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from vllm_helpers import FIXTURES, get_json, get_text
from vllm_shape import (
    Exposition,
    exposition_drift,
    json_shape,
    parse_exposition,
    shape_drift,
    used_metric_names,
)

from kvroute.sim.server import start_sim_fleet
from kvroute_dev.vllm_env import SERVED_MODEL_NAME
from kvroute_dev.vllm_replicas import ReplicaFleet

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "src" / "kvroute"


def recorded_metrics() -> str:
    return (FIXTURES / "metrics_after_chat.prom").read_text(encoding="utf-8")


def recorded_models() -> object:
    return json.loads((FIXTURES / "v1_models.json").read_text(encoding="utf-8"))


def engine_part(exposition: Exposition) -> dict[str, set[frozenset[str]]]:
    """The engine's own series (``vllm:*`` and the process start time), not the HTTP server's."""
    return {
        name: keys
        for name, keys in exposition.labels.items()
        if name.startswith("vllm:") or name == "process_start_time_seconds"
    }


@pytest.fixture
async def sim_answers() -> AsyncIterator[tuple[str, object]]:
    """``/metrics`` and ``/v1/models`` of a simulated dense replica after one chat request."""
    async with await start_sim_fleet("dense-3b", 1, model=SERVED_MODEL_NAME, speed=1000.0) as fleet:
        url = fleet.urls[0]
        async with aiohttp.ClientSession() as session:
            messages = [{"role": "user", "content": "hi"}]
            body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": 4}
            async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
            async with session.get(f"{url}/metrics") as response:
                metrics = await response.text()
            async with session.get(f"{url}/v1/models") as response:
                models = await response.json()
        yield metrics, models


def assert_sim_matches(real_metrics: str, real_models: object, sim_metrics: str, sim_models: object) -> None:
    used = used_metric_names(PACKAGE_ROOT)
    drift = exposition_drift(parse_exposition(real_metrics), parse_exposition(sim_metrics), used)
    drift += [f"/v1/models {p}" for p in shape_drift(json_shape(real_models), json_shape(sim_models))]
    assert not drift, "the simulator drifted from vLLM 0.32.0:\n  " + "\n  ".join(drift)


def test_the_names_kvroute_reads_are_found_in_its_source() -> None:
    # Guards the source scan itself: if it found nothing, the drift test below would check nothing.
    used = used_metric_names(PACKAGE_ROOT)
    assert {"vllm:num_requests_running", "vllm:cache_config_info", "process_start_time_seconds"} <= used


def test_drift_is_reported_for_a_missing_name_and_an_invented_label() -> None:
    real = parse_exposition('# TYPE vllm:a gauge\nvllm:a{engine="0"} 1\nvllm:b{engine="0"} 1\n')
    sim = parse_exposition('# TYPE vllm:a gauge\nvllm:a{engine="0",extra="x"} 1\n')
    drift = exposition_drift(real, sim, {"vllm:b"})
    assert any(p.startswith("missing vllm:b") for p in drift)
    assert any("sim adds ['extra']" in p for p in drift)
    assert shape_drift(json_shape({"a": 1, "b": [{"c": "x"}]}), json_shape({"a": 1, "b": []})) == [
        "$.b: vLLM non-empty list"
    ]


async def test_sim_matches_recorded_vllm(sim_answers: tuple[str, object]) -> None:
    sim_metrics, sim_models = sim_answers
    assert_sim_matches(recorded_metrics(), recorded_models(), sim_metrics, sim_models)


@pytest.mark.vllm
@pytest.mark.timeout(420)
def test_recorded_answers_are_what_live_vllm_says(vllm_fleet: ReplicaFleet) -> None:
    recorded = engine_part(parse_exposition(recorded_metrics()))
    for url in vllm_fleet.urls:
        live = engine_part(parse_exposition(get_text(f"{url}/metrics")))
        assert live == recorded, f"{url}/metrics no longer matches fixtures/metrics_after_chat.prom"
        models = get_json(f"{url}/v1/models")
        assert shape_drift(json_shape(recorded_models()), json_shape(models)) == []


@pytest.mark.vllm
@pytest.mark.timeout(420)
async def test_sim_matches_live_vllm(vllm_fleet: ReplicaFleet, sim_answers: tuple[str, object]) -> None:
    url = vllm_fleet.urls[0]
    sim_metrics, sim_models = sim_answers
    assert_sim_matches(get_text(f"{url}/metrics"), get_json(f"{url}/v1/models"), sim_metrics, sim_models)
