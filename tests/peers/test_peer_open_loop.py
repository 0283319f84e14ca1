"""``peers.py --rates``: the shared-prefix open loop through a real router process in front of real
simulated replicas, reported as the open loop's table."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from peers.routers import parse_router

from kvroute.bench.results import BenchResult


def _script() -> ModuleType:
    # benchmarks/peers.py shares its name with the package benchmarks/peers/: load it by path.
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"
    spec = importlib.util.spec_from_file_location("peers_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers_script"] = module
    spec.loader.exec_module(module)
    return module


def test_rates_must_be_positive() -> None:
    script = _script()
    opts, _, _ = script.parse_args(["--rates", "2,4.5", "--skip-cost"])
    assert opts.rates == (2.0, 4.5)
    with pytest.raises(SystemExit):
        script.parse_args(["--rates", "0", "--skip-cost"])


async def test_open_loop_through_kvroute_is_one_record_per_arrival_and_its_own_table(tmp_path: Path) -> None:
    script = _script()
    # The drain only bounds the wait for requests in flight (the step ends once they have): at
    # --speed 30 its wall time is a 30th, so it is generous for a loaded 2-core machine.
    opts, _, _ = script.parse_args(["--rates", "2", "--skip-cost", "--speed", "30", "--duration", "40",
                                    "--drain", "300", "--out", str(tmp_path), "--routers", "none"])
    opts = dataclasses.replace(opts, routers=(parse_router("kvroute:auto"),))
    run, attribution = await script.quality_run(opts.routers[0], opts, {})
    assert attribution == {}
    (step,) = run.steps
    assert step.rate == 2.0 and step.sessions == 0
    assert step.requests > 0 and step.errors == 0 and step.unfinished == 0
    assert step.completed_per_s is not None and step.completed_per_s > 0
    assert step.ttfb_p50_s is not None and step.prefix_hit_pct is not None
    doc = {"meta": {"cpus": 2, "cost_plan": dataclasses.asdict(opts.cost_plan)},
           "quality": BenchResult({}, [run]).as_dict(), "attribution": {}, "cost": [], "cost_rounds": []}
    text = script.write_outputs(doc, tmp_path, None)
    assert "### Shared-prefix open loop" in text and "Rate (req/s)" in text and "Every step" not in text
