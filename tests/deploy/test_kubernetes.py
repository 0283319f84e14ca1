"""deploy/kubernetes/: every resource valid against Kubernetes' own schemas (kubernetes-validate
ships them, so this runs offline), and what a schema cannot see: labels that select the pods they
mean, ports and probes that name real ports, a configuration the router's loader accepts, a
command line the real CLI parses, and a discovery name that is the headless Service's."""

from __future__ import annotations

import posixpath
import tomllib
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
from deploy_files import (
    ROOT,
    image_tag,
    kubernetes_documents,
    parse_command,
    pod_containers,
    setting_env_names,
    settings_for,
)

DOCS = kubernetes_documents()
# The oldest Kubernetes minor still widely run, and the newest the package ships.
VERSIONS = ("1.29", kubernetes_validate.latest_version())


def _name(doc: dict[str, Any]) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in DOCS if doc["kind"] == kind}


def _router() -> tuple[dict[str, Any], dict[str, Any]]:
    [found] = [(d, c) for d, c in pod_containers(DOCS) if c["name"] == "kvroute"]
    return found


def _pods_selected(selector: dict[str, str]) -> list[dict[str, Any]]:
    return [d["spec"]["template"] for d in _by_kind("Deployment").values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]


def test_the_manifest_set_is_complete():
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in DOCS}
    assert {("Namespace", "kvroute"), ("ConfigMap", "kvroute-config"), ("Deployment", "kvroute"),
            ("Service", "kvroute"), ("Service", "vllm-headless"), ("ConfigMap", "kvroute-redis"),
            ("Deployment", "kvroute-redis"), ("Service", "kvroute-redis"),
            ("Deployment", "vllm-simulated"), ("Deployment", "vllm")} <= kinds


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("path", "doc"), DOCS, ids=[f"{p.name}:{_name(d)}" for p, d in DOCS])
def test_every_resource_is_valid_against_the_kubernetes_schema(path, doc, version):
    # strict: a misspelt or misplaced field is an error, not silently ignored by the API server.
    kubernetes_validate.validate(doc, version, strict=True)


def test_a_misspelt_field_is_caught():
    deployment, _ = _router()
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_everything_is_in_one_namespace():
    namespaces = {doc["metadata"].get("namespace") for _, doc in DOCS if doc["kind"] != "Namespace"}
    assert namespaces == set(_by_kind("Namespace"))


@pytest.mark.parametrize("deployment", _by_kind("Deployment").values(), ids=_name)
def test_deployments_select_their_own_pods_and_probe_named_ports(deployment):
    template = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    for container in template["spec"]["containers"]:
        names = {p["name"] for p in container.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            action = container.get(probe, {})
            port = (action.get("httpGet") or action.get("tcpSocket") or {}).get("port")
            assert port is None or port in names, f"{container['name']}.{probe} names port {port!r}"


@pytest.mark.parametrize("service", _by_kind("Service").values(), ids=_name)
def test_services_select_pods_that_have_their_target_port(service):
    pods = _pods_selected(service["spec"]["selector"])
    assert pods, f"{_name(service)} selects no pod of these manifests"
    for pod in pods:
        ports = [p for c in pod["spec"]["containers"] for p in c.get("ports", [])]
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert any(target in (p.get("name"), p["containerPort"]) for p in ports), \
                f"{_name(service)}: no container port {target!r}"


def test_the_router_finds_the_vllm_pods_through_the_headless_service():
    _, container = _router()
    args = container["args"]
    context = parse_command(args)  # the real `kvroute serve` accepts this command line
    assert context.info_name == "serve"
    discover = [urlsplit(u) for u in context.params["discover"]]
    [url] = discover
    headless = _by_kind("Service")["vllm-headless"]
    assert headless["spec"]["clusterIP"] == "None"
    assert url.scheme == "dns"
    assert url.hostname == f"vllm-headless.{headless['metadata']['namespace']}.svc.cluster.local"
    assert url.port in [p["port"] for p in headless["spec"]["ports"]]
    # The replicas the Service selects listen on that port.
    for pod in _pods_selected(headless["spec"]["selector"]):
        assert url.port in [p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]]


def _router_env(with_redis: bool) -> dict[str, str]:
    _, container = _router()
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    if with_redis:
        for source in container["envFrom"]:
            env.update(_by_kind("ConfigMap")[source["configMapRef"]["name"]]["data"])
    return env


def _mounted_files(deployment: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """Path -> content of every ConfigMap key mounted into ``container``."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    files = {}
    for mount in container["volumeMounts"]:
        source = volumes[mount["name"]].get("configMap")
        if source:
            for key, text in _by_kind("ConfigMap")[source["name"]]["data"].items():
                files[posixpath.join(mount["mountPath"], key)] = text
    return files


@pytest.mark.parametrize("with_redis", [False, True], ids=["one-router", "with-redis.yaml"])
def test_the_router_configuration_loads_through_the_settings_loader(with_redis):
    deployment, container = _router()
    env = _router_env(with_redis)
    assert set(env) | {e["name"] for e in container["env"]} <= setting_env_names()
    settings = settings_for(env, _mounted_files(deployment, container))
    assert settings.host == "0.0.0.0"
    assert settings.port == next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    # Prometheus scrapes from another pod, at the port and path the annotations say.
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert settings.metrics_access == "open" and annotations["prometheus.io/port"] == str(settings.port)
    # SIGTERM: the preStop pause, then in-flight requests finish before the kubelet's SIGKILL.
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pause + settings.shutdown_timeout_s < deployment["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    if with_redis:
        redis = _by_kind("Service")["kvroute-redis"]
        url = urlsplit(settings.redis_url or "")
        assert url.hostname == f"kvroute-redis.{redis['metadata']['namespace']}.svc.cluster.local"
        assert url.port == redis["spec"]["ports"][0]["port"]
    else:
        assert settings.redis_url is None


def test_the_config_file_is_plain_toml_the_router_reads_whole():
    text = _by_kind("ConfigMap")["kvroute-config"]["data"]["kvroute.toml"]
    raw = tomllib.loads(text)
    deployment, container = _router()
    settings = settings_for(_router_env(False), _mounted_files(deployment, container))
    assert settings.routing == raw["routing"] and settings.policy == raw["policy"]


def test_the_router_pod_runs_as_the_images_user_with_a_writable_tmp():
    deployment, container = _router()
    pod = deployment["spec"]["template"]["spec"]
    user = next(line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines()
                if line.startswith("USER "))
    assert f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}" == user
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The router's listener talks to its admin/metrics side over a Unix socket in a temporary dir.
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


def test_kvroute_containers_run_the_image_of_this_version():
    images = {c["image"] for _, c in pod_containers(DOCS) if c["image"].startswith("kvroute")}
    assert images == {image_tag()}


def test_the_simulated_replicas_command_line_parses_and_listens_where_the_probes_ask():
    deployment = _by_kind("Deployment")["vllm-simulated"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    context = parse_command(container["args"])
    assert context.info_name == "sim" and context.params["host"] == "0.0.0.0"
    assert context.params["port"] == container["ports"][0]["containerPort"]
