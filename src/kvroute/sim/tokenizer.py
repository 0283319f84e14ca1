"""Pseudo-tokenizer and chat template of the simulator, shared with the benchmark workloads.

A request is rendered into one UTF-8 byte string by a simple chat template (system, tools, then the
messages in order, then an assistant-generation marker).  A *token* is 4 bytes of that rendering:
``count_tokens(data) == ceil(len(data) / 4)``.  Token ids are the little-endian ``uint32`` of those
4 bytes (the last one zero-padded), so ids can be turned back into bytes exactly.

Prefix stability: appending a turn only appends bytes.  The rendering of turn N (ending with the
generation marker) is a byte prefix of turn N+1's rendering, where the marker is the start of the
assistant message.  The assistant header is padded with spaces so that the assistant's content
starts on a 4-byte (token) boundary; generated text therefore tokenizes the same way in the reply
and when the client sends it back in the next turn, and its KV blocks can be reused like vLLM's.

The engine hashes blocks straight from byte slices (block ``i`` is ``data[i*T*4:(i+1)*T*4]`` for
``T`` tokens per block), chained with xxh3_64 from ``hash_seed`` (model name and ``cache_salt``) —
no per-token Python objects on the hot path.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

import orjson
import xxhash

from kvroute.api.anthropic_chat import AnthropicConversionError, anthropic_to_chat

BYTES_PER_TOKEN = 4

_START = b"<|im_start|>"
_END = b"<|im_end|>\n"
_ASSISTANT = b"<|im_start|>assistant"


class RenderError(ValueError):
    """The request body cannot be rendered (wrong shape); the message says which field."""


def count_tokens(data: bytes) -> int:
    """Number of pseudo-tokens in a rendering: one per 4 bytes, rounded up."""
    return -(-len(data) // BYTES_PER_TOKEN)


def hash_seed(model: str, cache_salt: str | None = None) -> int:
    """Seed of the block-hash chain: requests that may not share a cache never share a hash."""
    return xxhash.xxh3_64_intdigest(f"{model}\x00{cache_salt or ''}".encode())


def token_ids(data: bytes | memoryview) -> list[int]:
    """The pseudo-token ids of a rendering or of a token-aligned slice of one (``/tokenize``, the
    render endpoints and the token ids of KV events)."""
    pad = -len(data) % BYTES_PER_TOKEN
    padded = bytes(data) + b"\x00" * pad if pad else data
    return list(struct.unpack(f"<{len(padded) // BYTES_PER_TOKEN}I", padded))


def detokenize(ids: Iterable[int]) -> bytes:
    """Inverse of :func:`token_ids` (zero padding dropped)."""
    try:
        raw = b"".join(int(t).to_bytes(4, "little") for t in ids)
    except (OverflowError, ValueError, TypeError) as exc:
        raise RenderError(f"invalid token id: {exc}") from None
    return raw.rstrip(b"\x00")


def token_strs(data: bytes) -> list[str]:
    """Each token's text (invalid UTF-8 pieces replaced), for ``/tokenize`` with ``return_token_strs``."""
    return [data[i:i + 4].decode("utf-8", "replace") for i in range(0, len(data), 4)]


# --------------------------------------------------------------------------------------- rendering


class _Buffer:
    """Append-only byte builder that knows its length (the assistant header pads on it)."""

    __slots__ = ("length", "parts")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.length = 0

    def add(self, data: bytes) -> None:
        self.parts.append(data)
        self.length += len(data)

    def header(self, role: str) -> None:
        if role == "assistant":
            self.assistant_header()
        else:
            self.add(_START + role.encode() + b"\n")

    def assistant_header(self) -> None:
        # Pad so that the assistant content starts on a token boundary (see module docstring).
        pad = -(self.length + len(_ASSISTANT) + 1) % BYTES_PER_TOKEN
        self.add(_ASSISTANT + b" " * pad + b"\n")

    def text(self, value: str) -> None:
        self.add(value.encode("utf-8", "surrogatepass"))

    def result(self) -> bytes:
        return b"".join(self.parts)


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError as exc:
        raise RenderError(f"value cannot be serialized: {exc}") from None


def _openai_content(buf: _Buffer, content: Any, field: str) -> None:
    if content is None:
        return
    if isinstance(content, str):
        buf.text(content)
        return
    if not isinstance(content, list):
        raise RenderError(f"{field}: content must be a string or a list of parts")
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise RenderError(f"{field}[{i}]: content part must be an object")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise RenderError(f"{field}[{i}].text must be a string")
            buf.text(text)
        elif kind in ("image_url", "input_audio", "file", "video_url"):
            # Media is a placeholder plus a digest of its payload: equal media, equal tokens.
            buf.add(b"<media:" + xxhash.xxh3_64_hexdigest(_dumps(part)).encode() + b">")
        elif kind == "tool_reference":  # what vLLM makes of an Anthropic tool result's references
            buf.add(b"<tool_reference:" + str(part.get("name", "")).encode() + b">")
        else:
            raise RenderError(f"{field}[{i}]: unsupported content part type {kind!r}")


def _tool_calls(buf: _Buffer, calls: Any, field: str) -> None:
    if not isinstance(calls, list):
        raise RenderError(f"{field}.tool_calls must be a list")
    for i, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise RenderError(f"{field}.tool_calls[{i}] must be an object")
        fn = call.get("function") or {}
        buf.add(b"<tool_call>" + _dumps({"name": fn.get("name"), "arguments": fn.get("arguments")})
                + b"</tool_call>")


def chat_template_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)`` of a chat body, with vLLM's defaults
    (True, False) and its refusal of both at once."""
    add_gen = body.get("add_generation_prompt", True)
    cont = body.get("continue_final_message", False)
    if not isinstance(add_gen, bool) or not isinstance(cont, bool):
        raise RenderError("add_generation_prompt and continue_final_message must be booleans")
    if add_gen and cont:
        raise RenderError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    return add_gen, cont


def render_chat(body: Mapping[str, Any], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> bytes:
    """Render an OpenAI chat-completions body: leading system/developer messages, tools, messages.
    ``continue_final_message`` leaves the last message open (no end marker), for the model to go on."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RenderError("'messages' must be a non-empty list")
    buf = _Buffer()
    i = 0
    while i < len(messages) and isinstance(messages[i], Mapping) and \
            messages[i].get("role") in ("system", "developer"):
        buf.header("system")
        _openai_content(buf, messages[i].get("content"), f"messages[{i}]")
        buf.add(_END)
        i += 1
    tools = body.get("tools")
    if tools:
        buf.header("tools")
        buf.add(_dumps(tools))
        buf.add(_END)
    for j in range(i, len(messages)):
        msg = messages[j]
        field = f"messages[{j}]"
        if not isinstance(msg, Mapping):
            raise RenderError(f"{field} must be an object")
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool", "function"):
            raise RenderError(f"{field}.role {role!r} is not one of system, user, assistant, tool")
        buf.header("system" if role == "developer" else "tool" if role == "function" else role)
        _openai_content(buf, msg.get("content"), field)
        if role == "assistant" and msg.get("tool_calls"):
            _tool_calls(buf, msg["tool_calls"], field)
        if not (continue_final_message and j == len(messages) - 1):
            buf.add(_END)
    if add_generation_prompt:
        buf.assistant_header()
    return buf.result()


def render_completion(prompt: Any) -> bytes:
    """Render an OpenAI completions ``prompt`` (a string, or a list of token ids)."""
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return render_completion(prompt[0])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return detokenize(prompt)
    raise RenderError("'prompt' must be a string or a list of token ids")


# Content blocks only an Anthropic messages body has (OpenAI's parts are text, image_url, input_audio...).
_ANTHROPIC_ONLY_BLOCKS = frozenset(("tool_use", "tool_result", "thinking", "redacted_thinking", "image",
                                    "document", "tool_reference", "tool_addition", "tool_removal"))


def is_anthropic_body(body: Mapping[str, Any]) -> bool:
    """Whether a body with ``messages`` is an Anthropic messages request: a top-level ``system``, or
    a content block only Anthropic has.  Bodies in the subset both APIs share render the same
    either way, so this only has to tell apart what renders differently."""
    if "system" in body:
        return True
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for msg in messages:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list) and any(isinstance(block, Mapping)
                                             and block.get("type") in _ANTHROPIC_ONLY_BLOCKS
                                             for block in content):
            return True
    return False


# vLLM 0.32's ``AnthropicContentBlock.type``; tool_addition/tool_removal only in system messages.
_ANTHROPIC_BLOCK_TYPES = frozenset(("text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                                    "redacted_thinking", "tool_addition", "tool_removal"))
_TOOL_CHANGES = frozenset(("tool_addition", "tool_removal"))


def _check_blocks(content: Any, field: str, system_role: bool) -> None:
    """Validate content blocks as vLLM 0.32's pydantic models do, with the simulator's messages."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RenderError(f"{field}.content must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, Mapping):
            raise RenderError(f"{field}.content[{i}] must be an object")
        kind = block.get("type")
        if kind not in _ANTHROPIC_BLOCK_TYPES:
            raise RenderError(f"{field}.content[{i}]: unsupported content block type {kind!r}")
        if kind in _TOOL_CHANGES and not system_role:
            raise RenderError(f'{kind} blocks are only allowed in messages with role "system"')
        if kind == "text" and not isinstance(block.get("text"), str):
            raise RenderError(f"{field}.content[{i}].text must be a string")


def render_anthropic(body: Mapping[str, Any], add_generation_prompt: bool = True) -> bytes:
    """Render an Anthropic messages body as vLLM 0.32 does: converted into the chat request
    vLLM serves it as (api/anthropic_chat.py: a system message of the ``system`` prompt, tool
    calls and tool messages for ``tool_use`` / ``tool_result``, OpenAI tools), rendered by
    :func:`render_chat`.  The simulator's template accepts system messages after the first one,
    so an inline ``system`` message (Claude Code sends one after the first user turn) stays where
    it stands and a later one never changes the bytes of earlier turns.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RenderError("messages: field required (a non-empty list)")
    system = body.get("system")
    if system:
        _check_blocks(system, "system", system_role=False)
    for j, msg in enumerate(messages):
        field = f"messages.{j}"
        if not isinstance(msg, Mapping):
            raise RenderError(f"{field} must be an object")
        role = msg.get("role")
        if role not in ("user", "assistant", "system"):
            raise RenderError(f"{field}.role must be 'user', 'assistant' or 'system'")
        _check_blocks(msg.get("content"), field, system_role=role == "system")
    try:
        # The simulator's template renders no tool-call id, so the clock naming id-less ones is moot.
        chat = anthropic_to_chat(body, now=lambda: 0.0)
    except AnthropicConversionError as exc:
        raise RenderError(str(exc)) from None
    if not chat["messages"]:
        raise RenderError("messages: nothing to render (every message is empty)")
    return render_chat(chat, add_generation_prompt)


# ---------------------------------------------------------------------------------- prompt makers


class PseudoTokens:
    """The default way a replica turns a request into prompt bytes: this module's template and
    pseudo-tokenizer.  :class:`kvroute.sim.real_tokens.RealTokens` is the other (a model's own
    tokenizer and chat template); the server and the request parser take either."""

    def chat(self, body: Mapping[str, Any]) -> bytes:
        """A chat-completions body's prompt (its ``add_generation_prompt`` and
        ``continue_final_message`` as vLLM reads them)."""
        return render_chat(body, *chat_template_options(body))

    def anthropic(self, body: Mapping[str, Any]) -> bytes:
        """An Anthropic messages body's prompt."""
        return render_anthropic(body)

    def completion(self, prompt: Any) -> bytes:
        """A completions ``prompt``'s prompt."""
        return render_completion(prompt)

    def detokenize(self, ids: list[Any]) -> str:
        """``/detokenize``: the text of token ids."""
        return detokenize(ids).decode("utf-8", "replace")

    def token_strs(self, data: bytes) -> list[str]:
        """``/tokenize`` with ``return_token_strs``: each token's text."""
        return token_strs(data)

    def tail_text(self, prompt: bytes) -> bytes:
        """The text at the end of a prompt (the last few hundred bytes at least), where
        sim/answers.py looks for a question to answer."""
        return prompt
