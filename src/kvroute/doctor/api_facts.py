"""``/v1/models`` and ``/server_info`` bodies -> partial ``EngineFacts``."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from kvroute.doctor.config_text import parse_int, split_config_dump
from kvroute.doctor.facts import EngineFacts, Observed
from kvroute.doctor.settings import facts_from_settings

# Nested settings kept whole rather than flattened: their own keys (``method``, ``model``) would
# otherwise shadow the engine's.
_KEEP_WHOLE = frozenset({"speculative_config"})


def facts_from_models(body: object) -> EngineFacts:
    """The first served model's id and ``max_model_len`` from an OpenAI ``/v1/models`` body."""
    data = body.get("data") if isinstance(body, Mapping) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], Mapping):
        return EngineFacts()
    card = data[0]
    found: dict[str, Observed[object]] = {}
    if isinstance(card.get("id"), str):
        found["model"] = Observed(card["id"], "/v1/models id")
    max_len = parse_int(card.get("max_model_len"))
    if max_len is not None:
        found["max_model_len"] = Observed(max_len, "/v1/models max_model_len")
    return EngineFacts(**found)  # type: ignore[arg-type]


def facts_from_server_info(body: object) -> EngineFacts:
    """Settings from ``/server_info``: vLLM's ``vllm_config`` (text or JSON) or a flat config."""
    if not isinstance(body, Mapping):
        return EngineFacts()
    return facts_from_settings(flatten_settings(body), "/server_info")


def flatten_settings(body: Mapping[str, object]) -> dict[str, object]:
    """Every leaf setting of a nested config, shallowest first; ``str(VllmConfig)`` text expanded."""
    flat: dict[str, object] = {}
    queue: deque[Mapping[str, object]] = deque([body])
    while queue:
        node = queue.popleft()
        for key, value in node.items():
            if isinstance(value, Mapping) and key not in _KEEP_WHOLE:
                queue.append(value)
            elif isinstance(value, str) and "enable_prefix_caching=" in value:
                queue.append(split_config_dump(value))
            else:
                flat.setdefault(key, value)
    return flat
