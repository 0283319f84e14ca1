"""Settings: TOML, then KVROUTE_* environment variables, then flags; clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.router_settings import ModelTable, Settings, SettingsError, WorkerSpec

TOML = """
port = 9000
admin_token = "from-file"
policy = "session"
retries = 1
worker_header = false

[[workers]]
url = "http://10.0.0.1:8000/"
id = "gpu0"
models = ["qwen3-4b"]
max_num_seqs = 32

[[workers]]
url = "http://10.0.0.2:8000"

[models."qwen3-4b"]
policy = "auto"
sticky = false
overflow = 8

[models.other]
overflow = "auto"
max_num_seqs = 64

[routing]
index_max_blocks = 1000
slack_steps = [100, 200]

[requests]
extra_session_headers = ["x-conversation"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvroute.toml"
    path.write_text(text)
    return path


def test_toml_file_is_read(tmp_path):
    s = Settings.load(write(tmp_path, TOML), env={})
    assert s.port == 9000 and s.admin_token == "from-file" and s.retries == 1 and s.worker_header is False
    assert s.workers == (WorkerSpec("http://10.0.0.1:8000", "gpu0", ("qwen3-4b",), 32),
                         WorkerSpec("http://10.0.0.2:8000"))
    assert s.models["qwen3-4b"] == ModelTable(policy="auto", sticky=False, overflow=8)
    routing = s.routing_config()
    assert routing.index_max_blocks == 1000
    assert routing.default.policy == "session" and routing.default.slack_steps == (100, 200)
    qwen = routing.settings_for("qwen3-4b")
    assert (qwen.policy, qwen.sticky, qwen.overflow, qwen.slack_steps) == ("auto", False, 8, (100, 200))
    assert routing.settings_for("other").max_num_seqs == 64
    assert routing.settings_for("unlisted") == routing.default
    assert "header:x-conversation" in s.request_options().sources()


def test_environment_overrides_the_file_and_flags_override_both(tmp_path):
    path = write(tmp_path, TOML)
    env = {"KVROUTE_CONFIG": str(path), "KVROUTE_PORT": "9100", "KVROUTE_ADMIN_TOKEN": "from-env",
           "KVROUTE_WORKER_HEADER": "yes", "KVROUTE_WORKERS": "http://a:1, http://b:2",
           "KVROUTE_LOG_PROMPTS": "1", "KVROUTE_PROBE_INTERVAL_S": "0.5"}
    s = Settings.load(env=env)
    assert s.port == 9100 and s.admin_token == "from-env" and s.worker_header is True
    assert [w.url for w in s.workers] == ["http://a:1", "http://b:2"]
    assert s.log_prompts is True and s.probe_interval_s == 0.5
    s = Settings.load(env=env, overrides={"port": 9200, "workers": ["http://c:3"], "policy": None})
    assert s.port == 9200 and [w.url for w in s.workers] == ["http://c:3"] and s.policy == "session"


def test_defaults_without_any_source():
    s = Settings.load(env={})
    assert (s.host, s.port, s.policy) == ("127.0.0.1", 8080, "auto")
    assert s.worker_header is True and s.log_prompts is False
    assert s.admin_token is None and s.redis_url is None and s.workers == ()
    assert Settings.load(env={"KVROUTE_ADMIN_TOKEN": ""}).admin_token is None


@pytest.mark.parametrize(("raw", "message"), [
    ({"prot": 1}, "unknown setting(s): prot"),
    ({"port": "eighty"}, "port must be an integer"),
    ({"port": 70000}, "port must be between"),
    ({"retries": -1}, "must not be negative"),
    ({"worker_header": "maybe"}, "worker_header must be true or false"),
    ({"max_body_bytes": 0}, "max_body_bytes must be positive"),
    ({"workers": [{"url": "10.0.0.1:8000"}]}, "must start with http"),
    ({"workers": [{"url": "http://x", "gpu": 1}]}, "unknown worker setting(s): gpu"),
    ({"models": {"m": {"overflow": "lots"}}}, "models.m.overflow must be an integer"),
    ({"models": {"m": {"overflow": -1}}}, "models.m.overflow must be 'auto' or a non-negative integer"),
    ({"models": {"m": {"stay_tokens": -5}}}, "models.m: stay_tokens must be a finite non-negative number"),
    ({"models": {"m": {"policy": "fastest"}}}, "models.m: unknown policy 'fastest'"),
    ({"models": {"m": {"colour": 1}}}, "unknown setting(s) in models.m: colour"),
    ({"policy": "fastest"}, "unknown policy 'fastest'"),
    ({"routing": {"index_max_blocks": 0}}, "index_max_blocks must be a positive"),
    ({"routing": {"nonsense": 1}}, "unknown setting(s) in [routing]: nonsense"),
    ({"requests": {"session_sources": ["cookie:x"]}}, "bad session source"),
])
def test_bad_settings_are_named(raw, message):
    with pytest.raises(SettingsError) as err:
        Settings.from_dict(raw)
    assert message in str(err.value)


def test_unreadable_or_invalid_files_are_reported(tmp_path):
    with pytest.raises(SettingsError, match="cannot read config file"):
        Settings.load(tmp_path / "missing.toml", env={})
    with pytest.raises(SettingsError, match="not valid TOML"):
        Settings.load(write(tmp_path, "port = = 1"), env={})


def test_client_limits_and_metrics_access_settings():
    s = Settings.load(env={"KVROUTE_MAX_HEADER_BYTES": "8192", "KVROUTE_HEADER_TIMEOUT_S": "2.5",
                           "KVROUTE_MAX_CONNECTIONS": "100", "KVROUTE_METRICS_ACCESS": "token",
                           "KVROUTE_METRICS_TOKEN": "m"})
    assert (s.max_header_bytes, s.header_timeout_s, s.max_connections) == (8192, 2.5, 100)
    assert (s.metrics_access, s.metrics_token) == ("token", "m")
    defaults = Settings()
    assert (defaults.max_header_bytes, defaults.max_headers) == (65536, 128)
    assert defaults.metrics_access == "loopback"
    with pytest.raises(SettingsError, match="metrics_access must be loopback, token or open"):
        Settings.from_dict({"metrics_access": "everyone"})
    with pytest.raises(SettingsError, match="needs metrics_token or admin_token"):
        Settings.from_dict({"metrics_access": "token"})
    with pytest.raises(SettingsError, match="keepalive_timeout_s must be positive"):
        Settings.from_dict({"keepalive_timeout_s": 0})
    with pytest.raises(SettingsError, match="max_connections must not be negative"):
        Settings.from_dict({"max_connections": -1})
