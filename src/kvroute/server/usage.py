"""Picking the engine's token usage out of a response as it streams past, for the scheduler's
learning (``Scheduler.on_finished``).  Only events that mention ``"usage"`` are parsed; a plain
body is parsed once by the proxy (to check it is an answer) and handed over whole."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import orjson

_USAGE = b'"usage"'


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _usage(doc: Any) -> Mapping[str, Any] | None:
    """The ``usage`` object of an OpenAI, Responses or Anthropic body or event, if any."""
    if not isinstance(doc, Mapping):
        return None
    usage = doc.get("usage")
    for holder in ("message", "response"):  # Anthropic message_start, Responses response.completed
        inner = doc.get(holder)
        if usage is None and isinstance(inner, Mapping):
            usage = inner.get("usage")
    return usage if isinstance(usage, Mapping) else None


def output_tokens_of(doc: Any) -> int | None:
    """The answer's tokens so far from a body or event: OpenAI ``completion_tokens``, Anthropic
    and Responses ``output_tokens`` (Anthropic streams repeat it, growing, in ``message_delta``)."""
    usage = _usage(doc)
    return None if usage is None else _output(usage)


def usage_of(doc: Any) -> tuple[int | None, int | None]:
    """``(prompt_tokens, cached_tokens)`` from an OpenAI, Responses or Anthropic body or event."""
    usage = _usage(doc)
    return (None, None) if usage is None else _prompt_and_cached(usage)


def _output(usage: Mapping[str, Any]) -> int | None:
    return _int(usage.get("completion_tokens", usage.get("output_tokens")))


def _prompt_and_cached(usage: Mapping[str, Any]) -> tuple[int | None, int | None]:
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
        return _int(usage.get("prompt_tokens")), _int(cached)
    if "input_tokens" in usage:
        read = _int(usage.get("cache_read_input_tokens"))
        created = _int(usage.get("cache_creation_input_tokens")) or 0
        details = usage.get("input_tokens_details")
        if read is None and isinstance(details, Mapping):  # Responses API: input includes cached
            return _int(usage.get("input_tokens")), _int(details.get("cached_tokens"))
        fresh = _int(usage.get("input_tokens"))
        if fresh is None:
            return None, read
        return fresh + (read or 0) + created, read
    return None, None


class UsageSniffer:
    """Collects usage from a response: event by event for a stream, from the parsed body otherwise."""

    def __init__(self, sse: bool) -> None:
        self._sse = sse
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.output_tokens: int | None = None

    def feed(self, data: bytes) -> None:
        """See the next piece of the response: whole events of a stream (a plain body's pieces are
        not looked at; its parsed document comes through ``take``)."""
        if self._sse and _USAGE in data:
            for line in data.splitlines():
                if line.startswith(b"data:") and _USAGE in line:
                    with contextlib.suppress(orjson.JSONDecodeError):
                        self.take(orjson.loads(line[5:]))

    def take(self, doc: Any) -> None:
        """Read the usage of one parsed body or event, if it has one."""
        usage = _usage(doc)
        if usage is None:
            return
        prompt, cached = _prompt_and_cached(usage)
        if prompt is not None:
            self.prompt_tokens = prompt
        if cached is not None:
            self.cached_tokens = cached
        output = _output(usage)
        if output is not None:  # the last report wins: Anthropic's message_start says 1
            self.output_tokens = output
