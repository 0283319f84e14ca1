"""The peer routers start on loopback only: their command lines, and (when the cached peer
environments exist) the sockets the real processes actually listen on."""

from __future__ import annotations

import asyncio
import os
import tomllib
from pathlib import Path

import pytest
from peers.procs import Proc, wait_serving
from peers.routers import (
    DEFAULT_ROUTERS,
    KVROUTE,
    LOOPBACK,
    PEER_VERSIONS,
    SGLANG_ROUTER,
    VLLM_ROUTER,
    Ports,
    RouterSpec,
    flow_routers,
    kvroute_config,
    kvroute_launch,
    parse_router,
    peer_launch,
)
from peers.venvs import DEFAULT_CACHE, installed

from kvroute.router_settings import Settings
from kvroute.routing.flow import FlowSettings
from kvroute.sim.server import start_sim_fleet
from kvroute.sync.local_redis import free_port

WORKERS = ("http://127.0.0.1:8101", "http://127.0.0.1:8102")


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("family", [VLLM_ROUTER, SGLANG_ROUTER])
def test_peer_command_binds_api_and_metrics_to_loopback(family: str) -> None:
    launch = peer_launch(RouterSpec(family, "cache_aware"), Path("/venv"), WORKERS, Ports(9001, 9002),
                         closed_port=9003)
    argv = launch.argv
    assert _flag(argv, "--host") == LOOPBACK
    assert _flag(argv, "--prometheus-host") == LOOPBACK
    assert (_flag(argv, "--port"), _flag(argv, "--prometheus-port")) == ("9001", "9002")
    assert _flag(argv, "--policy") == "cache_aware"
    start = argv.index("--worker-urls") + 1
    assert argv[start:start + len(WORKERS)] == WORKERS
    assert not any("0.0.0.0" in a for a in argv)
    assert launch.url == "http://127.0.0.1:9001"
    assert argv[0].startswith("/venv/bin/")


def test_sglang_cannot_reach_the_hub() -> None:
    launch = peer_launch(RouterSpec(SGLANG_ROUTER, "manual"), Path("/venv"), WORKERS, Ports(1, 2),
                         closed_port=9003)
    assert launch.argv[1] == "launch"
    assert launch.env["HF_ENDPOINT"] == "http://127.0.0.1:9003"
    assert launch.env["HF_HUB_OFFLINE"] == "1"


def test_kvroute_command() -> None:
    spec = RouterSpec(KVROUTE, "auto", processes=2)
    launch = kvroute_launch("/py", spec, WORKERS, 9010, Path("/run/kvroute.toml"), "redis://127.0.0.1:7/0")
    argv = launch.argv
    assert _flag(argv, "--host") == LOOPBACK
    assert _flag(argv, "--policy") == "auto"
    assert _flag(argv, "--redis") == "redis://127.0.0.1:7/0"
    assert _flag(argv, "--processes") == "2"
    assert "--processes" not in kvroute_launch("/py", RouterSpec(KVROUTE, "auto"), WORKERS, 9010,
                                               Path("/run/kvroute.toml")).argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--worker"] == list(WORKERS)
    assert launch.url == "http://127.0.0.1:9010"
    with pytest.raises(ValueError):
        kvroute_launch("/py", RouterSpec(VLLM_ROUTER, "round_robin"), WORKERS, 1, Path("x"))
    with pytest.raises(ValueError):
        peer_launch(spec, Path("/venv"), WORKERS, Ports(1, 2), closed_port=3)


def test_router_specs() -> None:
    assert DEFAULT_ROUTERS[0] == RouterSpec(KVROUTE, "auto")
    assert parse_router("kvroute:auto:3") == RouterSpec(KVROUTE, "auto", 3)
    assert parse_router("sglang-router:manual").label == "sglang-router manual"
    assert RouterSpec(KVROUTE, "auto", 2).label == "kvroute auto ×2"
    for bad in ("kvroute", "nginx:rr", "vllm-router:round_robin:2", "kvroute:auto:0"):
        with pytest.raises(ValueError):
            parse_router(bad)


def test_router_settings_and_variants() -> None:
    spec = parse_router("kvroute:auto/sessions+flow_control=true+flow_session_admission=true")
    assert (spec.policy, spec.variant) == ("auto", "sessions")
    assert spec.label == "kvroute auto/sessions"
    assert spec.settings == (("flow_control", "true"), ("flow_session_admission", "true"))
    argv = kvroute_launch("/py", spec, WORKERS, 9010, Path("/run/kvroute.toml")).argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--set"] == [
        "flow_control=true", "flow_session_admission=true"]
    assert parse_router("kvroute:auto+flow_control=false").label == "kvroute auto +flow_control=false"
    peer = parse_router("sglang-router:cache_aware/queue+queue-size=32+queue-timeout-secs=6")
    launch = peer_launch(peer, Path("/venv"), WORKERS, Ports(1, 2), closed_port=3)
    assert _flag(launch.argv, "--queue-size") == "32"
    assert _flag(launch.argv, "--queue-timeout-secs") == "6"
    assert _flag(launch.argv, "--policy") == "cache_aware"
    for bad in ("kvroute:auto+flow_control", "kvroute:auto+=1", "kvroute:auto/x:0"):
        with pytest.raises(ValueError):
            parse_router(bad)


def test_flow_routers_start_with_auto_off_and_scale_sglang_timeout() -> None:
    routers = flow_routers(5.0)
    assert routers[0].label == "kvroute auto/off"
    assert [r.label for r in routers] == [
        "kvroute auto/off", "kvroute auto/flow", "kvroute auto/sessions", "kvroute least-loaded/off",
        "kvroute session/off", "vllm-router sticky_least_loaded", "sglang-router cache_aware/queue"]
    assert dict(routers[-1].settings)["queue-timeout-secs"] == "12"   # 60 model s at speed 5
    assert dict(flow_routers(1000.0)[-1].settings)["queue-timeout-secs"] == "1"


def test_kvroute_config_scales_flow_durations_and_serve_reads_it() -> None:
    text = kvroute_config(0.1, time_scale=10.0)
    raw = tomllib.loads(text)
    settings = Settings.from_dict(raw)
    assert settings.probe_interval_s == 0.1
    defaults = FlowSettings()
    # Model seconds at speed 10 are a tenth of the defaults in the router's wall clock.
    assert raw["routing"] == {"flow_aging_s": defaults.flow_aging_s / 10,
                              "flow_queue_ttl_s": defaults.flow_queue_ttl_s / 10,
                              "flow_session_idle_s": defaults.flow_session_idle_s / 10}
    policy = settings.routing_config().default
    assert policy.flow_queue_ttl_s == pytest.approx(defaults.flow_queue_ttl_s / 10)
    with pytest.raises(ValueError):
        kvroute_config(1.0, time_scale=0)


def _listening(pid: int) -> set[tuple[str, int]]:
    """Addresses the process listens on (TCP over IPv4 and IPv6), from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:   # 0A: LISTEN
                continue
            host_hex, port_hex = local.split(":")
            if table == "tcp":
                host = ".".join(str(b) for b in reversed(bytes.fromhex(host_hex)))
            else:
                host = "::1" if host_hex == "0" * 24 + "01000000" else host_hex
            found.add((host, int(port_hex, 16)))
    return found


@pytest.mark.parametrize("family", [VLLM_ROUTER, SGLANG_ROUTER])
async def test_real_peer_listens_on_loopback_only(family: str, tmp_path: Path) -> None:
    venv = DEFAULT_CACHE / family
    if not installed(venv, family, PEER_VERSIONS[family]):
        pytest.skip(f"{family} {PEER_VERSIONS[family]} not in {venv} (benchmarks/peers.py installs it)")
    fleet = await start_sim_fleet("a4000-qwen3-4b", 1, speed=50.0)
    policy = "manual" if family == SGLANG_ROUTER else "consistent_hash"
    launch = peer_launch(RouterSpec(family, policy), venv, fleet.urls, Ports(free_port(), free_port()),
                         closed_port=free_port())
    proc = await Proc.start("router", launch.argv, tmp_path, env=launch.env)
    try:
        await wait_serving(launch, proc, "qwen3-4b", timeout_s=60)
        await asyncio.sleep(0.3)   # the metrics listener may open just after the API one
        addresses = _listening(proc.process.pid)
        assert addresses, "the router listens on nothing"
        assert {host for host, _ in addresses} == {LOOPBACK}, addresses
    finally:
        await proc.stop()
        await fleet.close()
