"""The per-model setting ``tokenizer``: where exact mode tokenizes a request (api/local_tokens.py
does the work; this is what configuration reads, below the server)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from kvroute.routing.settings import setting

EXTRA = "pip install 'kvroute[tokenizer]'"


def extra_missing() -> str | None:
    """What of ``kvroute[tokenizer]`` is not installed (None: both are)."""
    missing = [name for name in ("tokenizers", "jinja2") if find_spec(name) is None]
    return ", ".join(missing) if missing else None


@dataclass(frozen=True, slots=True)
class TokenizerSettings:
    """How the router tokenizes a request for exact mode."""

    tokenizer: str = setting(
        "", "exact mode: the model's folder (tokenizer.json, and the chat template in "
            "tokenizer_config.json or chat_template.jinja) to tokenize requests in the router instead "
            "of a round trip to an engine's /tokenize ('': the engine's); needs kvroute[tokenizer]")

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str):
            raise ValueError("tokenizer must be the path of a model's folder")
        if not self.tokenizer:
            return
        missing = extra_missing()
        if missing is not None:
            raise ValueError(f"tokenizer is set but {missing} is not installed: {EXTRA}")
        if not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {self.tokenizer}")
