"""Reading the deployment files (deploy/, Dockerfile) for the tests: YAML documents, the kvroute
command line a container runs, the environment it gets, and the router settings that result."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import typer
import yaml

from kvroute.cli import app
from kvroute.router_settings import Settings

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
COMPOSE = ROOT / "deploy" / "compose" / "docker-compose.yml"


def image_tag() -> str:
    """The tag the deployment files give kvroute's image: the package's version."""
    import tomllib

    return f"kvroute:{tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['version']}"


def kubernetes_documents() -> list[tuple[Path, dict[str, Any]]]:
    """Every resource of every manifest, with the file it comes from."""
    out = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        out.extend((path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None)
    return out


def parse_command(argv: list[str]) -> Any:
    """``kvroute ARGV`` parsed by the real command line (options checked, nothing run): the click
    context, whose ``params`` are the parsed values."""
    group: Any = typer.main.get_command(app)
    name, *rest = argv
    command = group.commands.get(name)
    assert command is not None, f"kvroute has no command {name!r}"
    return command.make_context(name, list(rest))


Resource = dict[str, Any]


def pod_containers(docs: list[tuple[Path, Resource]]) -> Iterator[tuple[Resource, Resource]]:
    """(the Deployment, one of its containers) for every container of every Deployment."""
    for _, doc in docs:
        if doc["kind"] == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, container


def settings_for(env: Mapping[str, str], files: Mapping[str, str]) -> Settings:
    """The router settings a process with environment ``env`` reads, ``files`` (path -> text)
    standing in for the files mounted where ``KVROUTE_CONFIG`` points."""
    env = dict(env)
    with tempfile.TemporaryDirectory() as tmp:
        if "KVROUTE_CONFIG" in env:
            local = Path(tmp) / "kvroute.toml"
            local.write_text(files[env["KVROUTE_CONFIG"]])
            env["KVROUTE_CONFIG"] = str(local)
        return Settings.load(env=env)


def setting_env_names() -> set[str]:
    """Every ``KVROUTE_*`` variable the settings loader reads."""
    import dataclasses

    tables = {"models", "routing", "requests"}  # TOML only
    return {f"KVROUTE_{f.name.upper()}" for f in dataclasses.fields(Settings) if f.name not in tables} | {
        "KVROUTE_CONFIG"}
