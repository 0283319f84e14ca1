"""deploy/compose/docker-compose.yml: valid against the Compose Specification's schema (the copy
check-jsonschema vendors, so this runs offline), and consistent: the routers' workers are the
simulated replicas' ports, their settings load, the commands parse."""

from __future__ import annotations

import subprocess
import sys
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_files import COMPOSE, ROOT, image_tag, parse_command, setting_env_names, settings_for

SPEC = yaml.safe_load(COMPOSE.read_text())
ROUTERS = [name for name, s in SPEC["services"].items() if "command" not in s]


def _check_jsonschema(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", path],
        capture_output=True, text=True, timeout=60)


def test_the_compose_file_is_valid_against_the_compose_spec():
    done = _check_jsonschema(str(COMPOSE))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_schema_check_catches_a_misplaced_field(tmp_path):
    broken = {**SPEC, "services": {**SPEC["services"], "redis": {**SPEC["services"]["redis"], "port": [1]}}}
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    done = _check_jsonschema(str(path))
    assert done.returncode != 0 and "port" in done.stdout + done.stderr


def _replica_ports() -> dict[str, list[int]]:
    """Service -> the ports its `kvroute sim` listens on."""
    out = {}
    for name, service in SPEC["services"].items():
        command = service.get("command")
        if command and command[0] == "sim":
            params = parse_command(command).params
            out[name] = [params["port"] + i for i in range(params["replicas"])]
            assert params["host"] == "0.0.0.0"  # reachable from the routers' containers
    return out


def test_two_routers_share_redis_in_front_of_every_simulated_replica():
    assert len(ROUTERS) == 2
    replicas = {f"http://{name}:{port}" for name, ports in _replica_ports().items() for port in ports}
    for name in ROUTERS:
        env: dict[str, Any] = SPEC["services"][name]["environment"]
        assert set(env) <= setting_env_names()
        # ${KVROUTE_ADMIN_TOKEN:-} is empty unless the user sets it: no admin token.
        resolved = {k: "" if str(v).startswith("${") else str(v) for k, v in env.items()}
        settings = settings_for(resolved, {})
        assert {w.url for w in settings.workers} == replicas
        assert settings.admin_token is None
        redis = urlsplit(settings.redis_url or "")
        assert redis.hostname in SPEC["services"] and redis.port == 6379
        depends = SPEC["services"][name]["depends_on"]
        assert {s: d["condition"] for s, d in depends.items()} == {
            "replicas": "service_healthy", "redis": "service_healthy"}


def test_routers_publish_the_default_port_on_loopback_only():
    published = [SPEC["services"][name]["ports"][0] for name in ROUTERS]
    settings = settings_for({"KVROUTE_HOST": "0.0.0.0"}, {})
    assert all(p.startswith("127.0.0.1:") and p.endswith(f":{settings.port}") for p in published)
    assert len({p.split(":")[1] for p in published}) == len(published)


def test_every_service_built_here_uses_this_repositorys_dockerfile_and_version():
    built = [s for s in SPEC["services"].values() if "build" in s]
    assert len(built) == 3
    for service in built:
        assert (COMPOSE.parent / service["build"]["context"]).resolve() == ROOT
        assert (ROOT / "Dockerfile").is_file() and service["image"] == image_tag()


@pytest.mark.parametrize("service", ["replicas", "redis"])
def test_the_dependencies_have_their_own_health_checks(service):
    # The image's HEALTHCHECK asks the router's /ready, which a replica or Redis does not serve.
    assert SPEC["services"][service]["healthcheck"]["test"][0] == "CMD"
