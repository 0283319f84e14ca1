"""examples/kvroute.toml is a configuration the router accepts, and says what it means: loaded
through the real settings loader, with each table landing where its comment says."""

from __future__ import annotations

import tomllib
from pathlib import Path

from kvroute.router_settings import Settings

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvroute.toml"


def test_the_example_config_loads_through_the_settings_loader():
    settings = Settings.load(EXAMPLE, env={})
    raw = tomllib.loads(EXAMPLE.read_text())
    # Every top-level key is a setting of its own (a key written after a [table] header would
    # belong to that table, and the loader would reject it there).
    assert {k for k, v in raw.items() if not isinstance(v, dict | list)} <= set(Settings.__dataclass_fields__)
    assert (settings.host, settings.port, settings.policy) == ("0.0.0.0", 8080, "auto")
    assert settings.port == Settings().port  # the comment says it is the default
    assert [w.id for w in settings.workers] == ["gpu-a0", "gpu-a1", "gpu-b0", "gpu-b1"]
    assert {w.max_num_seqs for w in settings.workers} == {64}
    assert settings.admin_token is None and settings.redis_url is None
    config = settings.routing_config()
    model = config.settings_for("Qwen/Qwen3-4B")
    assert model.flow_queue_ttl_s == 30 and model.stay_tokens == 512
    assert config.default.flow_queue_ttl_s != 30  # the [models] table applies to its model only
    assert config.session_ttl_s == 3600
    assert "x-conversation-id" in settings.request_options().extra_session_headers
    assert dict(settings.aliases) == {"claude-*": "Qwen/Qwen3-4B"}


def test_the_environment_still_wins_over_the_example():
    settings = Settings.load(EXAMPLE, env={"KVROUTE_PORT": "9000", "KVROUTE_ADMIN_TOKEN": "t"})
    assert settings.port == 9000 and settings.admin_token == "t"
