"""One non-streaming chat completion, reduced to what the probe and the canary judge."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from kvroute.engine_client.http import Reply, Target, request

_MAX_ERROR_CHARS = 300


@dataclass(frozen=True, slots=True)
class ChatOutcome:
    """What came back.  ``error`` is set for transport failures, non-200 statuses and bodies that
    are not a chat completion (those also set ``not_an_answer``: the replica answered 200 with
    something else, which is its fault, unlike a failed request); ``content`` is "" for an empty
    reply and None only with an error."""

    seconds: float
    status: int | None
    content: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    completion_tokens: int | None = None
    not_an_answer: bool = False


def outcome_from_reply(reply: Reply) -> ChatOutcome:
    """Interpret a ``/v1/chat/completions`` response."""
    if reply.status is None:
        return ChatOutcome(reply.seconds, None, error=reply.error)
    body = reply.json()
    if reply.status != 200:
        return ChatOutcome(reply.seconds, reply.status, error=f"HTTP {reply.status}: {_message(body, reply)}")
    choices = body.get("choices") if isinstance(body, Mapping) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        why = "no choices" if isinstance(body, Mapping) else "not JSON" if body is None else "not an object"
        return ChatOutcome(reply.seconds, reply.status, error=f"not a chat completion: {why}",
                           not_an_answer=True)
    choice = choices[0]
    message = choice.get("message")
    content = message.get("content") if isinstance(message, Mapping) else None
    usage = body.get("usage") if isinstance(body, Mapping) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    return ChatOutcome(
        seconds=reply.seconds,
        status=reply.status,
        content=content if isinstance(content, str) else "",
        finish_reason=choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else None,
        prompt_tokens=_int(usage.get("prompt_tokens")) if isinstance(usage, Mapping) else None,
        cached_tokens=_int(details.get("cached_tokens")) if isinstance(details, Mapping) else None,
        completion_tokens=_int(usage.get("completion_tokens")) if isinstance(usage, Mapping) else None,
    )


async def send_chat(session: aiohttp.ClientSession, target: Target, model: str,
                    messages: Sequence[Mapping[str, str]], max_tokens: int) -> ChatOutcome:
    """POST one greedy, non-streaming chat completion and interpret the response."""
    body = {"model": model, "messages": list(messages), "max_tokens": max_tokens, "temperature": 0,
            "stream": False}
    reply = await request(session, "POST", target.url("/v1/chat/completions"), timeout_s=target.timeout_s,
                          headers=target.headers(), body=body)
    return outcome_from_reply(reply)


def _message(body: object, reply: Reply) -> str:
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and isinstance(err.get("message"), str):
            return str(err["message"])[:_MAX_ERROR_CHARS]
        if isinstance(body.get("message"), str):
            return str(body["message"])[:_MAX_ERROR_CHARS]
    return reply.body[:_MAX_ERROR_CHARS].decode("utf-8", "replace")


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
