"""What the scheduler needs to know about one request, extracted once on the hot path."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """A request reduced to what routing needs.

    ``prefix`` is the canonical, prefix-stable rendering of the prompt: appending a turn to a
    conversation appends bytes to it and leaves every earlier byte unchanged.  The prefix index
    hashes it; nothing else reads it.  ``cache_scope`` (model name and vLLM ``cache_salt``) seeds
    the hash chain, so requests that an engine would never let share a cache never match.
    """

    model: str
    prefix: bytes
    session_id: str | None = None
    est_prompt_tokens: int = 0
    max_tokens: int = 0
    cache_salt: str | None = None

    @property
    def cache_scope(self) -> bytes:
        """Bytes that seed the block-hash chain: model and salt, never shared across either."""
        return f"{self.model}\x00{self.cache_salt or ''}".encode()
