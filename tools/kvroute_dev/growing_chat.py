"""A growing conversation sent to an OpenAI-compatible endpoint, with the engine's own account of
what it reused (``usage.prompt_tokens_details.cached_tokens``) and the worker that answered.

Shared by the real-engine tests and the real-engine benchmark table so both send the same traffic.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

WORKER_HEADER = "x-kvroute-worker"
_WORDS = (
    "amber", "basil", "cedar", "delta", "ember", "fjord", "grove", "harbor", "iris", "juniper", "kelp",
    "lumen", "meadow", "nectar", "onyx", "pebble", "quartz", "river", "saffron", "tundra", "umber",
    "velvet", "willow", "xenon", "yarrow", "zephyr",
)


class ChatError(Exception):
    """The endpoint answered something other than a chat completion."""


@dataclass(frozen=True)
class ChatAnswer:
    """One answered request: who served it and how much of its prompt the engine had cached."""

    worker: str | None
    prompt_tokens: int
    cached_tokens: int
    seconds: float
    reply: str


def filler(conversation: str, turn: int, words: int) -> str:
    """Deterministic text unique to ``conversation`` and ``turn`` (about 4.7 tokens per word for
    SmolLM2's tokenizer); it starts with the conversation's name so no two conversations share a block."""
    seed = sum(ord(c) for c in conversation) * 7 + turn * 13
    body = " ".join(
        f"{_WORDS[(seed + i * 5) % len(_WORDS)]}{(seed * 3 + i * 11) % 997}" for i in range(words)
    )
    return f"[{conversation} turn {turn}] {body}"


@dataclass
class GrowingChat:
    """A conversation that grows by one user turn (and the model's reply) at a time; the default
    turn is about 500 tokens, so four turns make prompts of about 500, 1,000, 1,500 and 2,000 tokens."""

    conversation: str
    words_per_turn: int = 106
    system: str = "You are a terse assistant."
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages.append({"role": "system", "content": self.system})

    @property
    def turns(self) -> int:
        """User turns asked so far."""
        return sum(1 for m in self.messages if m["role"] == "user")

    def ask(self) -> list[dict[str, str]]:
        """Append the next user turn; returns the messages to send (a copy)."""
        text = filler(self.conversation, self.turns, self.words_per_turn)
        self.messages.append({"role": "user", "content": text})
        return [dict(m) for m in self.messages]

    def answer(self, reply: str) -> None:
        """Record the model's reply, so the next turn's prompt extends this one."""
        self.messages.append({"role": "assistant", "content": reply})


async def send_chat(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    messages: list[dict[str, str]],
    *,
    max_tokens: int = 4,
    extra: Mapping[str, Any] | None = None,
) -> ChatAnswer:
    """POST one greedy ``/v1/chat/completions`` and read its usage; raises ``ChatError`` otherwise."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **(extra or {})}
    started = time.perf_counter()
    async with session.post(f"{base_url.rstrip('/')}/v1/chat/completions", json=body) as response:
        text = await response.text()
        seconds = time.perf_counter() - started
        if response.status != 200:
            raise ChatError(f"{base_url} answered {response.status}: {text[:500]}")
        worker = response.headers.get(WORKER_HEADER)
    try:
        doc = json.loads(text)
        usage = doc["usage"]
        details = usage.get("prompt_tokens_details") or {}
        return ChatAnswer(
            worker=worker,
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=int(details.get("cached_tokens") or 0),
            seconds=seconds,
            reply=str(doc["choices"][0]["message"]["content"] or ""),
        )
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ChatError(f"{base_url} answered an unreadable completion ({exc}): {text[:500]}") from exc
