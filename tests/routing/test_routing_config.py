"""Policy settings: validation, seed 1's slack steps, seed 2's overflow threshold."""

from __future__ import annotations

import pytest

from kvroute.routing.config import ModelPolicy, RoutingConfig


@pytest.mark.parametrize(
    ("tokens", "slack"),
    [(0, 0), (900, 0), (1024, 1), (3000, 1), (4096, 2), (8192, 3), (12952, 3), (32767, 3), (32768, 4),
     (500_000, 4)],
)
def test_slack_grows_with_prompt_size(tokens: int, slack: int) -> None:
    # Seed 1: nothing extra below 1k tokens, up to four more above 32k; ~12952 tokens logged slack=3.
    assert ModelPolicy().slack_for(tokens) == slack


def test_overflow_threshold_is_a_quarter_of_max_num_seqs_by_default() -> None:
    assert ModelPolicy().overflow_threshold(32) == 8  # seed 2's four-card server
    assert ModelPolicy(max_num_seqs=64).overflow_threshold(None) == 16
    assert ModelPolicy().overflow_threshold(None) == 64  # vLLM's default of 256
    assert ModelPolicy(overflow=4).overflow_threshold(32) == 4


@pytest.mark.parametrize(
    "changes",
    [{"policy": "fastest"}, {"overflow": -1}, {"overflow": "sometimes"}, {"overflow": True},
     {"max_num_seqs": 0}, {"slack_steps": (4096, 1024)}, {"inflight_tokens": -1.0},
     {"prefill_s_per_token": 0.0}, {"session_spread": -1}, {"learn_alpha": 0.0}],
)
def test_bad_policies_are_rejected(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ModelPolicy(**changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "changes",
    [{"index_max_blocks": 0}, {"block_bytes": -512}, {"index_max_age_s": 0}, {"session_max": 1.5},
     {"tail_blocks": 0}, {"default": "auto"}, {"models": {"m": "session"}}],
)
def test_bad_routing_configs_are_rejected(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RoutingConfig(**changes)  # type: ignore[arg-type]


def test_policy_for_falls_back_to_default() -> None:
    config = RoutingConfig(models={"big": ModelPolicy(policy="session", sticky=False)})
    assert config.policy_for("big").policy == "session"
    assert config.policy_for("other") is config.default
    assert config.window_blocks == 64
