"""Per-model settings: validation, seed 1's slack steps, seed 2's overflow threshold, the groups
they are registered and listed in."""

from __future__ import annotations

import pytest

from kvroute.routing.config import ModelSettings, RoutingConfig


@pytest.mark.parametrize(
    ("tokens", "slack"),
    [(0, 0), (900, 0), (1024, 1), (3000, 1), (4096, 2), (8192, 3), (12952, 3), (32767, 3), (32768, 4),
     (500_000, 4)],
)
def test_slack_grows_with_prompt_size(tokens: int, slack: int) -> None:
    # Seed 1: nothing extra below 1k tokens, up to four more above 32k; ~12952 tokens logged slack=3.
    assert ModelSettings().slack_for(tokens) == slack


def test_overflow_threshold_is_a_quarter_of_max_num_seqs_by_default() -> None:
    assert ModelSettings().overflow_threshold(32) == 8  # seed 2's four-card server
    assert ModelSettings(max_num_seqs=64).overflow_threshold(None) == 16
    assert ModelSettings().overflow_threshold(None) == 64  # vLLM's default of 256
    assert ModelSettings(overflow=4).overflow_threshold(32) == 4


@pytest.mark.parametrize(
    "changes",
    [{"policy": "fastest"}, {"overflow": -1}, {"overflow": "sometimes"}, {"overflow": True},
     {"max_num_seqs": 0}, {"slack_steps": (4096, 1024)}, {"inflight_tokens": -1.0},
     {"prefill_s_per_token": 0.0}, {"session_spread": -1}, {"learn_alpha": 0.0}],
)
def test_bad_policies_are_rejected(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ModelSettings(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [{"index_max_blocks": 0}, {"block_bytes": -512}, {"index_max_age_s": 0}, {"session_max": 1.5},
     {"tail_blocks": 0}, {"default": "auto"}, {"models": {"m": "session"}}],
)
def test_bad_routing_configs_are_rejected(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RoutingConfig(**changes)  # type: ignore[arg-type]


def test_settings_for_falls_back_to_default() -> None:
    config = RoutingConfig(models={"big": ModelSettings(policy="session", sticky=False)})
    assert config.settings_for("big").policy == "session"
    assert config.settings_for("other") is config.default
    assert config.window_blocks == 64


def test_every_setting_is_declared_once_with_its_help_and_reads_flat() -> None:
    from kvroute.routing.config import setting_infos
    from kvroute.routing.learning import LearningSettings
    from kvroute.routing.policies.auto import AutoSettings

    infos = setting_infos()
    names = [i.name for i in infos]
    assert len(names) == len(set(names))
    assert all(i.help for i in infos), [i.name for i in infos if not i.help]
    p = ModelSettings(stay_tokens=64.0, learn_alpha=0.5, overflow=0)
    assert p.block(AutoSettings).stay_tokens == p.stay_tokens == 64.0
    assert p.block(LearningSettings).learn_alpha == 0.5 and p.overflow == 0
    assert p.replace(policy="session") == ModelSettings(stay_tokens=64.0, learn_alpha=0.5, overflow=0,
                                                     policy="session")
    with pytest.raises(ValueError, match="unknown routing setting 'colour'"):
        ModelSettings(colour=1)


def test_cli_help_and_docs_name_every_setting_and_policy() -> None:
    from pathlib import Path

    from typer.testing import CliRunner

    from kvroute.cli import app
    from kvroute.router_settings import settings_groups
    from kvroute.routing.config import policy_names, setting_infos, settings_markdown

    out = CliRunner().invoke(app, ["serve", "--help-settings"], env={"COLUMNS": "200"}).output
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    docs = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    # Regenerate the tables in docs/server.md when this fails (scripts/ has no generator: the
    # region between the two markers there is settings_markdown(settings_groups())).
    assert settings_markdown(settings_groups()) in docs
    for info in setting_infos(settings_groups()):
        assert info.name in out, info.name
    for name in policy_names():
        assert name in out and name in help_text, name


def test_serve_set_reads_values_as_toml_and_names_bad_settings() -> None:
    from typer.testing import CliRunner

    from kvroute.cli import app
    from kvroute.server.cli import _routing_overrides

    pairs = ["stay_tokens=1024", "overflow=auto", "slack_steps=[1, 2]", "sticky=false"]
    assert _routing_overrides(pairs) == {"stay_tokens": 1024, "overflow": "auto", "slack_steps": [1, 2],
                                         "sticky": False}
    with pytest.raises(ValueError, match="expected NAME=VALUE"):
        _routing_overrides(["stay_tokens"])
    result = CliRunner().invoke(app, ["serve", "--worker", "http://127.0.0.1:9", "--set", "colour=1"])
    assert result.exit_code == 2 and "colour" in result.output


def test_groups_are_registered_explicitly_and_defaults_come_from_them() -> None:
    import kvroute.guard.blocks  # noqa: F401  (importing it registers nothing)
    from kvroute.router_settings import model_settings, settings_groups
    from kvroute.routing.config import defaults, setting_infos

    routing = defaults()
    everything = defaults(settings_groups())
    assert "canary" not in routing and "guard_drift_below" not in routing
    assert everything["canary"] is True and everything["guard_drift_below"] == 0.3
    assert routing.items() <= everything.items()
    assert [g.name for g in settings_groups()] == ["placement", "cache", "overload", "guard"]
    # Each group lists its few most-tuned settings first.
    names = [i.name for i in setting_infos(settings_groups())]
    assert names[:4] == ["policy", "sticky", "overflow", "max_num_seqs"]
    assert names.index("flow_control") < names.index("flow_kv_fill")
    with pytest.raises(ValueError, match="guard_drift_recover"):
        model_settings(guard_drift_recover=1.5)
    with pytest.raises(ValueError, match="unknown routing setting 'canary'"):
        ModelSettings(canary=False)  # the routing core alone does not carry the guard's blocks
    assert model_settings(canary=False).replace(sticky=False).canary is False
    # A changed guard setting shows (the defaults fixed at import lacked the guard's).
    assert repr(model_settings(canary=False, sticky=False)) == "ModelSettings(sticky=False, canary=False)"


def test_model_settings_stay_frozen() -> None:
    from dataclasses import dataclass

    from kvroute.routing.settings import setting

    @dataclass(frozen=True, slots=True)
    class Elsewhere:
        colour: str = setting("blue", "a block this model does not carry")

    p = ModelSettings(stay_tokens=64.0)
    before, digest = p.as_dict(), hash(p)
    assert p.block(Elsewhere).colour == "blue" and p.block(Elsewhere) is p.block(Elsewhere)
    assert p.as_dict() == before and hash(p) == digest and "colour" not in before
    with pytest.raises(AttributeError):
        p.colour  # noqa: B018
    with pytest.raises(AttributeError, match="immutable"):
        p.stay_tokens = 1.0
    assert repr(p) == "ModelSettings(stay_tokens=64.0)"


def test_none_is_accepted_only_where_a_setting_says_so() -> None:
    assert ModelSettings(session_spread=None).session_spread is None  # setting(2, ..., optional=True)
    assert ModelSettings(max_num_seqs=None).max_num_seqs is None  # its default is None
    with pytest.raises(ValueError, match="stay_tokens must be set"):
        ModelSettings(stay_tokens=None)


def test_optional_settings_agree_with_their_annotations() -> None:
    # ``takes_none`` reads ``setting(..., optional=True)`` because a block compiled by mypyc loses its
    # annotations' text; where the text is still there (the pure-Python build), the two must agree.
    import dataclasses

    from kvroute.router_settings import settings_groups
    from kvroute.routing.config import blocks_of
    from kvroute.routing.settings import takes_none

    checked = 0
    for kind in blocks_of(settings_groups()):
        for f in dataclasses.fields(kind):
            if isinstance(f.type, str):
                checked += 1
                assert takes_none(f) == ("None" in f.type), f"{kind.__name__}.{f.name}"
    assert checked > 0
