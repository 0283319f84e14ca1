"""The Dockerfile: read with Docker's own parser (the `dockerfile` package wraps BuildKit's), its
health check run against real routers on loopback, and, where a Docker daemon answers, the image
built and run: a router container in front of a simulated replica's container, asked through the
OpenAI SDK, healthy by its HEALTHCHECK, stopped cleanly by SIGTERM."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import dockerfile
import pytest
from deploy_files import ROOT

from kvroute.router_settings import Settings
from kvroute.server.app import start_router

INSTRUCTIONS = dockerfile.parse_file(str(ROOT / "Dockerfile"))


def _final_stage() -> list[dockerfile.Command]:
    last_from = max(i for i, c in enumerate(INSTRUCTIONS) if c.cmd == "FROM")
    return list(INSTRUCTIONS[last_from:])


def _one(cmd: str) -> dockerfile.Command:
    [found] = [c for c in _final_stage() if c.cmd == cmd]
    return found


def _env() -> dict[str, str]:
    values: dict[str, str] = {}
    for c in _final_stage():
        if c.cmd == "ENV":
            values.update(zip(c.value[::2], c.value[1::2], strict=True))
    return values


def test_the_image_runs_kvroute_serve_as_an_unprivileged_user_on_the_default_port():
    default = Settings()
    assert _one("ENTRYPOINT").value == ("kvroute",) and _one("CMD").value == ("serve",)
    assert _one("EXPOSE").value == (str(default.port),)
    env = _env()
    assert env["KVROUTE_PORT"] == str(default.port) and env["KVROUTE_HOST"] == "0.0.0.0"
    user, _, group = _one("USER").value[0].partition(":")
    assert user.isdigit() and int(user) != 0 and group.isdigit()  # numeric: runAsNonRoot can check it
    assert any(c.cmd == "RUN" and f"--uid {user}" in c.value[0] for c in _final_stage())


def test_the_build_stage_copies_what_the_dockerignore_lets_through():
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    copied = [src for c in INSTRUCTIONS if c.cmd == "COPY" and not c.flags for src in c.value[:-1]]
    assert copied and set(copied) <= allowed
    assert all((ROOT / src).exists() for src in copied)


def _healthcheck_argv() -> list[str]:
    check = _one("HEALTHCHECK")
    assert check.value[0] == "CMD" and check.value[1] == "python3"
    return [sys.executable, *check.value[2:]]


def _port(url: str) -> int:
    return int(url.rpartition(":")[2])


async def _healthcheck(port: int) -> int:
    process = await asyncio.create_subprocess_exec(
        *_healthcheck_argv(), env={**os.environ, "KVROUTE_PORT": str(port)},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(process.wait(), 30)


async def test_the_health_check_passes_while_a_worker_is_ready_and_fails_without_one(sim_fleet):
    fleet = await sim_fleet(1)
    ready = await start_router(Settings.from_dict({"workers": fleet.urls, "probe_interval_s": 0.1}))
    # A worker nobody listens on: the router runs, but /ready answers 503.
    idle = await start_router(Settings.from_dict({"workers": ["http://127.0.0.1:9"],
                                                  "probe_interval_s": 0.1}))
    try:
        assert await _healthcheck(_port(ready.url)) == 0
        assert await _healthcheck(_port(idle.url)) != 0
    finally:
        await ready.close()
        await idle.close()


# --- the image itself, where a Docker daemon answers -------------------------------------------

def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _docker(*args: str, timeout: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"docker {' '.join(args)}: {done.stdout}{done.stderr}"
    return done.stdout.strip()


@pytest.fixture
def image() -> Iterator[str]:
    """The image built from this checkout on $KVROUTE_TEST_PYTHON_IMAGE, else on the Dockerfile's
    own base image (pulled from its registry unless it is here already)."""
    if not _docker_answers():
        pytest.skip("no Docker daemon answers `docker info`: the image is not built here")
    [default] = [c.value[0].partition("=")[2] for c in INSTRUCTIONS
                 if c.cmd == "ARG" and c.value[0].startswith("PYTHON_IMAGE=")]
    base = os.environ.get("KVROUTE_TEST_PYTHON_IMAGE") or default
    have = subprocess.run(["docker", "image", "inspect", base], capture_output=True, timeout=60)
    if have.returncode != 0 and subprocess.run(["docker", "pull", "-q", base], capture_output=True,
                                               timeout=600).returncode != 0:
        pytest.skip(f"the base image {base} is neither here nor pullable (no registry?); "
                    "KVROUTE_TEST_PYTHON_IMAGE names another")
    tag = f"kvroute-test:{secrets.token_hex(4)}"
    _docker("build", "-q", "-t", tag, "--build-arg", f"PYTHON_IMAGE={base}", str(ROOT), timeout=900)
    yield tag
    subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.timeout(1200)
def test_the_image_routes_to_a_simulated_replica_and_stops_cleanly(image):
    from openai import OpenAI

    name = f"kvroute-test-{secrets.token_hex(4)}"
    network = _docker("network", "create", name)
    try:
        _docker("run", "-d", "--name", f"{name}-sim", "--network", network, "--read-only", image,
                "sim", "--host", "0.0.0.0", "--port", "8000", "--answer-mode")
        _docker("run", "-d", "--name", f"{name}-router", "--network", network, "--read-only",
                "--tmpfs", "/tmp", "--cap-drop", "ALL", "-p", "127.0.0.1::8080",
                image, "serve", "--worker", f"http://{name}-sim:8000")
        port = _docker("port", f"{name}-router", "8080/tcp").splitlines()[0].rpartition(":")[2]
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)

        def answered() -> bool:
            try:
                return client.models.list().data[0].id == "qwen3-4b"
            except Exception:
                return False

        _wait_for(answered, 60, "the router to list the replica's model")
        reply = client.chat.completions.with_raw_response.create(
            model="qwen3-4b", max_tokens=8, messages=[{"role": "user", "content": "What is 19+23?"}])
        assert reply.headers["x-kvroute-worker"] == f"{name}-sim:8000"
        assert reply.parse().choices[0].message.content == "42"
        assert _docker("exec", f"{name}-router", "id", "-u") != "0"

        def healthy() -> bool:
            return _docker("inspect", "-f", "{{.State.Health.Status}}", f"{name}-router") == "healthy"

        _wait_for(healthy, 60, "the HEALTHCHECK to pass")
        _docker("stop", "-t", "40", f"{name}-router", timeout=60)
        assert _docker("inspect", "-f", "{{.State.ExitCode}}", f"{name}-router") == "0"
        logs = subprocess.run(["docker", "logs", f"{name}-router"], capture_output=True, text=True,
                              timeout=30)
        assert "shut down cleanly" in logs.stdout + logs.stderr
    finally:
        for container in (f"{name}-router", f"{name}-sim"):
            subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60)
        subprocess.run(["docker", "network", "rm", name], capture_output=True, timeout=60)
