"""Request parsing and response bodies of the simulator's vLLM-compatible endpoints.

Three APIs share one engine: OpenAI chat completions, OpenAI completions and Anthropic messages.
:func:`parse_generation_request` turns a body into a :class:`GenerationRequest` (raising ``ApiError`` with
vLLM's messages for bad input); :class:`Reply` renders the final JSON or the stream events of each
API from the engine's token stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from kvroute.api.errors import ApiError
from kvroute.sim.tokenizer import PseudoTokens, RenderError, count_tokens

Api = Literal["chat", "completions", "messages"]

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated generation request, independent of the API it came through."""

    api: Api
    model: str
    prompt: bytes
    prompt_tokens: int
    max_tokens: int | None          # None: up to the natural reply length (bounded by the context)
    ignore_eos: bool
    stream: bool
    include_usage: bool
    cache_salt: str | None


def _positive_int(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"{name} must be at least 1, got {value}.", param=name)
        return value
    return None


# vLLM 0.32's AnthropicThinkingConfig / AnthropicOutputConfig literals.
_THINKING_TYPES = ("enabled", "disabled", "adaptive")
_THINKING_DISPLAYS = (None, "summarized", "omitted", "updates")
_EFFORTS = (None, "low", "medium", "high", "xhigh", "max")


def _check_anthropic_options(body: Mapping[str, Any], max_tokens: int) -> None:
    """The fields of vLLM 0.32's ``AnthropicMessagesRequest`` that it validates beyond their type;
    fields it does not declare (``context_management``, ...) are ignored, as pydantic does."""
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in _THINKING_TYPES:
            raise ApiError(400, "thinking.type must be one of 'enabled', 'disabled', 'adaptive'.",
                           param="thinking")
        if kind != "disabled" and thinking.get("display") not in _THINKING_DISPLAYS:
            raise ApiError(400, "thinking.display must be 'summarized', 'omitted' or 'updates'.",
                           param="thinking")
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
                raise ApiError(400, "thinking.budget_tokens must be an integer of at least 1024.",
                               param="thinking")
            if budget >= max_tokens:
                raise ApiError(400, "thinking.budget_tokens must be less than max_tokens", param="thinking")
    output = body.get("output_config")
    if output is not None and (not isinstance(output, dict) or output.get("effort") not in _EFFORTS):
        raise ApiError(400, "output_config.effort must be one of low, medium, high, xhigh, max.",
                       param="output_config")


_PSEUDO = PseudoTokens()


def parse_generation_request(api: Api, body: Any, served_model: str,
                             tokens: PseudoTokens = _PSEUDO) -> GenerationRequest:
    """Validate a request body and render its prompt with ``tokens`` (the pseudo-tokenizer, or a
    model's own: sim/real_tokens.py); ``ApiError`` (400/404) on bad input."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model") or served_model
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
    try:
        if api == "chat":
            prompt = tokens.chat(body)
        elif api == "completions":
            if "prompt" not in body:
                raise ApiError(400, "Field required: 'prompt'.", param="prompt")
            prompt = tokens.completion(body["prompt"])
        else:
            prompt = tokens.anthropic(body)
    except RenderError as exc:
        raise ApiError(400, str(exc)) from None
    if not prompt:
        raise ApiError(400, "The prompt cannot be empty.", param="prompt")
    if api == "chat":
        max_tokens = _positive_int(body, "max_completion_tokens", "max_tokens")
    elif api == "completions":
        max_tokens = _positive_int(body, "max_tokens") or 16
    else:
        max_tokens = _positive_int(body, "max_tokens")
        if max_tokens is None:
            raise ApiError(400, "max_tokens: Field required", param="max_tokens")
        _check_anthropic_options(body, max_tokens)
    if body.get("n", 1) != 1:
        raise ApiError(400, "Only n=1 is supported by the simulator.", param="n")
    options = body.get("stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(400, "cache_salt must be a non-empty string.", param="cache_salt")
    return GenerationRequest(
        api=api,
        model=model,
        prompt=prompt,
        prompt_tokens=count_tokens(prompt),
        max_tokens=max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=bool(body.get("stream", False)),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        cache_salt=salt,
    )


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _event(name: str, data: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class Reply:
    """Builds one request's response in its API's format, streamed or whole."""

    __slots__ = ("api", "created", "id", "model", "req")

    def __init__(self, req: GenerationRequest) -> None:
        self.req = req
        self.api = req.api
        self.model = req.model
        self.created = int(time.time())
        prefix = {"chat": "chatcmpl-", "completions": "cmpl-", "messages": "msg_"}[req.api]
        self.id = prefix + uuid.uuid4().hex

    def usage(self, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        """The ``usage`` object of this API (Anthropic counts cache reads apart from input)."""
        prompt = self.req.prompt_tokens
        if self.api == "messages":
            return {"input_tokens": prompt - cached_tokens, "output_tokens": completion_tokens,
                    "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def body(self, text: str, finish_reason: str, completion_tokens: int, cached_tokens: int) -> bytes:
        """The whole (non-streamed) response body."""
        usage = self.usage(completion_tokens, cached_tokens)
        if self.api == "messages":
            return orjson.dumps({
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": _STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None,
                "usage": usage,
            })
        if self.api == "completions":
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                      "finish_reason": finish_reason, "stop_reason": None}
            obj = "text_completion"
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            obj = "chat.completion"
        return orjson.dumps({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                             "choices": [choice], "usage": usage})

    def _chunk(self, delta_text: str | None, finish_reason: str | None, role: bool = False) -> bytes:
        if self.api == "completions":
            choice: dict[str, Any] = {"index": 0, "text": delta_text or "", "logprobs": None,
                                      "finish_reason": finish_reason, "stop_reason": None}
            obj = "text_completion"
        else:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if delta_text:
                delta["content"] = delta_text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            obj = "chat.completion.chunk"
        return _sse({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                     "choices": [choice]})

    def stream_start(self, cached_tokens: int) -> bytes:
        """Bytes sent with the first token, before its text."""
        if self.api == "messages":
            return _event("message_start", {"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.req.prompt_tokens - cached_tokens, "output_tokens": 0,
                          "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0},
            }}) + _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})
        if self.api == "chat":
            return self._chunk(None, None, role=True)
        return b""

    def stream_delta(self, text: str) -> bytes:
        """One piece of generated text."""
        if not text:
            return b""
        if self.api == "messages":
            return _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                  "delta": {"type": "text_delta", "text": text}})
        return self._chunk(text, None)

    def stream_end(self, finish_reason: str, completion_tokens: int, cached_tokens: int) -> bytes:
        """The closing events: finish reason, usage (when asked for), terminator."""
        if self.api == "messages":
            return (
                _event("content_block_stop", {"type": "content_block_stop", "index": 0})
                + _event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": _STOP_REASONS.get(finish_reason, "end_turn"),
                              "stop_sequence": None},
                    "usage": {"output_tokens": completion_tokens}})
                + _event("message_stop", {"type": "message_stop"})
            )
        out = self._chunk(None, finish_reason)
        if self.req.include_usage:
            obj = "text_completion" if self.api == "completions" else "chat.completion.chunk"
            out += _sse({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                         "choices": [], "usage": self.usage(completion_tokens, cached_tokens)})
        return out + b"data: [DONE]\n\n"
