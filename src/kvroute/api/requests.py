"""Request body + headers -> ``RoutingKey``: canonical prompt bytes, session id, token estimates.

The canonical bytes are *prefix-stable*: a later turn of the same conversation renders to the same
bytes followed by more.  Each section (system, tools, one message) starts with ``\\x1e`` and its
role, parts are separated by ``\\x1f``; text is copied as UTF-8, tool calls and results by name,
id and arguments, and images, audio and files by a 128-bit digest of their data.  Fields that
clients move from turn to turn without changing the prompt (Anthropic ``cache_control``) are left
out.  The parts are collected in a list and joined once.

Prompt tokens are estimated as canonical bytes / 4 (``EST_BYTES_PER_TOKEN``) plus a fixed
``image_tokens`` per image; token-id prompts count exactly.  The estimate drives slack, context
fit and predicted prefill, where being off by tens of percent is harmless.

Session id, first found wins (configurable, see ``RequestOptions``): the ``X-Claude-Code-Session-Id``
header; the ``session_id`` inside Anthropic ``metadata.user_id`` (a JSON string, or the older
``user_<hash>_account_<uuid>_session_<uuid>`` form); the ``x-session-id`` header (OpenCode); Codex's
``session_id`` / ``session-id`` header; OpenAI ``prompt_cache_key``; then the configured extra
headers and body fields.  A Claude Code subagent (``x-claude-code-agent-id``) sends its parent's
session id; the agent id is appended to it, so each subagent is a conversation of its own.

Without any of these, the conversation's identity is derived from the prompt itself: a digest of
the canonical bytes of the shared head (system prompt, tools, leading system messages) followed by
the conversation's first own message, which every later turn repeats unchanged.  It is returned as
``session_id = "conv:<32 hex>"``, so placement, stickiness, overflow, the session table, the
dashboard and Redis sharing treat it exactly like a session id.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash
from multidict import CIMultiDict, CIMultiDictProxy

from kvroute.api.errors import ApiError
from kvroute.routing.key import DERIVED_SESSION_PREFIX, EST_BYTES_PER_TOKEN, RoutingKey

ROUTES: tuple[str, ...] = ("chat", "completions", "messages", "count_tokens", "responses", "embeddings")

DEFAULT_SESSION_SOURCES: tuple[str, ...] = (
    "header:x-claude-code-session-id",
    "anthropic-user-id",
    "header:x-session-id",
    "header:session_id",
    "header:session-id",
    "field:prompt_cache_key",
)
# Claude Code sends a subagent's requests with its parent's session id plus this header.
DEFAULT_AGENT_HEADERS: tuple[str, ...] = ("x-claude-code-agent-id",)
# Prefix of a session id derived from the prompt (no client-sent id); see ``conversation_id``.
# Claude Code's first system block carries a per-request attribution hash in some versions; vLLM
# drops it before rendering (``x-anthropic-billing-header``), and so do we, or no two requests of
# a conversation would share a prefix.
_BILLING_HEADER = "x-anthropic-billing-header"

# Roles whose leading messages belong to the shared head (the app's instructions), not to one
# conversation.
_HEAD_ROLES = frozenset(("system", "developer"))

_SECTION = b"\x1e"
# orjson writes at most 254 nested levels, and the router re-serialises tools, content parts, tool
# inputs and items into canonical bytes: a field nested deeper is refused with a 400 naming it.
MAX_JSON_DEPTH = 254
# Path components named in that 400 (the field, not all 255 levels of it).
_MAX_NAMED_DEPTH = 6
_PART = b"\x1f"
_MAX_SESSION_ID = 1024


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How requests are read.

    ``session_sources`` is the ordered list of places a session id is looked for:
    ``header:<name>``, ``field:<dotted.path>`` in the body, or ``anthropic-user-id`` (the
    ``session_id`` inside ``metadata.user_id``).  ``extra_session_headers`` and
    ``extra_session_fields`` are appended after them.  ``agent_headers`` name headers whose value
    is appended to a found session id (a subagent sharing its parent's id becomes a conversation
    of its own; ``()`` keeps subagents with their parent).  ``derive_conversation_id`` (on by
    default) gives requests without any session id one derived from their prompt.  Only the first
    ``max_prefix_bytes`` of the canonical prompt are kept.
    """

    session_sources: tuple[str, ...] = DEFAULT_SESSION_SOURCES
    extra_session_headers: tuple[str, ...] = ()
    extra_session_fields: tuple[str, ...] = ()
    agent_headers: tuple[str, ...] = DEFAULT_AGENT_HEADERS
    derive_conversation_id: bool = True
    max_prefix_bytes: int = 4 * 1024 * 1024
    image_tokens: int = 1024

    def __post_init__(self) -> None:
        for spec in self.session_sources:
            kind, _, name = spec.partition(":")
            if not (spec == "anthropic-user-id" or (kind in ("header", "field") and name)):
                raise ValueError(f"bad session source {spec!r}: use header:<name>, field:<path> "
                                 "or anthropic-user-id")
        if self.max_prefix_bytes <= 0 or self.image_tokens < 0:
            raise ValueError("max_prefix_bytes must be positive and image_tokens non-negative")
        if not isinstance(self.derive_conversation_id, bool):
            raise ValueError("derive_conversation_id must be true or false")
        if not all(isinstance(h, str) and h for h in self.agent_headers):
            raise ValueError("agent_headers must be a list of header names")

    def sources(self) -> tuple[str, ...]:
        """Every session source in lookup order."""
        return (*self.session_sources, *(f"header:{h}" for h in self.extra_session_headers),
                *(f"field:{f}" for f in self.extra_session_fields))

    def parsed_sources(self) -> tuple[tuple[str, str], ...]:
        """``sources()`` as (kind, name) pairs, split once per options object."""
        return _parsed_sources(self)


@functools.lru_cache(maxsize=64)
def _parsed_sources(options: RequestOptions) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for spec in options.sources():
        kind, _, name = spec.partition(":")
        # Header names lower-cased once here: a request's headers are read by lower-case name.
        if spec == "anthropic-user-id":
            out.append((spec, ""))
        else:
            out.append((kind, name.lower() if kind == "header" else name))
    return tuple(out)


_DEFAULT_OPTIONS = RequestOptions()


class _Canon:
    """Collects canonical byte parts; joined once at the end.

    ``first_turn_parts`` is the number of parts that make up the shared head and the
    conversation's first own message (0 until a renderer finds that message): the bytes a
    conversation's identity is derived from.
    """

    __slots__ = ("extra_tokens", "first_turn_parts", "image_tokens", "parts")

    def __init__(self, image_tokens: int) -> None:
        self.parts: list[bytes] = []
        self.extra_tokens = 0
        self.image_tokens = image_tokens
        self.first_turn_parts = 0

    def end_of_first_own_message(self) -> None:
        """Called after each message that is not part of the shared head; the first call counts."""
        if not self.first_turn_parts:
            self.first_turn_parts = len(self.parts)

    def section(self, role: str) -> None:
        self.parts.append(_SECTION + role.encode())

    def text(self, s: str) -> None:
        self.parts.append(_PART)
        self.parts.append(s.encode())

    def digest(self, tag: str, data: Any, image: bool = False) -> None:
        raw = data.encode() if isinstance(data, str) else orjson.dumps(data)
        self.parts.append(f"\x1f{tag}:{xxhash.xxh3_128_hexdigest(raw)}".encode())
        if image:
            self.extra_tokens += self.image_tokens

    def json(self, value: Any) -> None:
        self.parts.append(_PART)
        self.parts.append(orjson.dumps(value))

    def value(self, value: Any) -> None:
        """A string as text (tool arguments usually arrive JSON-encoded already), else as JSON."""
        if isinstance(value, str):
            self.text(value)
        else:
            self.json(value)

    def tokens(self, ids: list[Any], param: str) -> None:
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in ids):
            raise ApiError(400, f"{param} must contain token ids (non-negative integers)", param=param)
        self.parts.append(_PART)
        # Four bytes per id: bytes / 4 counts them exactly.
        self.parts.append(array("I", ids).tobytes())


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _without_cache_control(value: Any) -> Any:
    if isinstance(value, dict) and "cache_control" in value:
        return {k: v for k, v in value.items() if k != "cache_control"}
    return value


# --- content renderers ---------------------------------------------------------------------------

def _openai_part(c: _Canon, part: Any, param: str) -> None:
    if not isinstance(part, dict):
        raise _bad(f"{param} must be an object", param)
    kind = part.get("type")
    if kind in ("text", "input_text", "output_text", "refusal"):
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise _bad(f"{param}.text must be a string", param)
        c.text(text)
    elif kind in ("image_url", "input_image"):
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        c.digest("image", url if url is not None else part.get("file_id", part), image=True)
    elif kind in ("input_audio", "file", "input_file"):
        c.digest(str(kind), part.get(str(kind), part.get("file_data", part.get("file_id", part))))
    else:
        c.json(part)


def _content(c: _Canon, content: Any, param: str, item: Callable[[_Canon, Any, str], None],
             noun: str) -> None:
    """A message's content in either API: absent, a string, or a list of parts/blocks."""
    if content is None:
        return
    if isinstance(content, str):
        c.text(content)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            item(c, part, f"{param}[{j}]")
    else:
        raise _bad(f"{param} must be a string or a list of {noun}", param)


def _openai_content(c: _Canon, content: Any, param: str) -> None:
    _content(c, content, param, _openai_part, "content parts")


def _anthropic_block(c: _Canon, block: Any, param: str) -> None:
    if isinstance(block, str):
        c.text(block)
        return
    if not isinstance(block, dict):
        raise _bad(f"{param} must be an object", param)
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise _bad(f"{param}.text must be a string", param)
        c.text(text)
    elif kind in ("image", "document"):
        source = block.get("source")
        data = source.get("data", source.get("url", source)) if isinstance(source, dict) else source
        c.digest(str(kind), data, image=kind == "image")
    elif kind == "tool_use":
        c.text(f"tool_use:{block.get('id', '')}:{block.get('name', '')}")
        c.json(block.get("input"))
    elif kind == "tool_result":
        c.text(f"tool_result:{block.get('tool_use_id', '')}:{bool(block.get('is_error'))}")
        _anthropic_content(c, block.get("content"), f"{param}.content")
    elif kind == "thinking":
        thinking = block.get("thinking")
        if isinstance(thinking, str):
            c.text(thinking)
    elif kind == "redacted_thinking":
        c.digest("redacted", block.get("data", ""))
    else:
        c.json(_without_cache_control(block))


def _anthropic_content(c: _Canon, content: Any, param: str) -> None:
    _content(c, content, param, _anthropic_block, "content blocks")


def _tools(c: _Canon, body: Mapping[str, Any], name: str, anthropic: bool) -> None:
    tools = body.get(name)
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _bad(f"{name} must be a list", name)
    c.section(name)
    c.json([_without_cache_control(t) for t in tools] if anthropic else tools)


def _messages(body: Mapping[str, Any]) -> list[Any]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages is required", "messages")
    if not isinstance(messages, list):
        raise _bad("messages must be a list", "messages")
    if not messages:
        raise _bad("messages must not be empty", "messages")
    return messages


def _role(message: Any, param: str) -> str:
    if not isinstance(message, dict):
        raise _bad(f"{param} must be an object", param)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise _bad(f"{param}.role must be a non-empty string", f"{param}.role")
    return role


# --- routes -------------------------------------------------------------------------------------

def _render_chat(c: _Canon, body: Mapping[str, Any]) -> None:
    messages = _messages(body)
    _tools(c, body, "tools", anthropic=False)
    _tools(c, body, "functions", anthropic=False)
    in_head = True
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        role = _role(m, param)
        c.section(role)
        _openai_content(c, m.get("content"), f"{param}.content")
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    c.text(f"tool_call:{call.get('id', '')}:{fn.get('name', '')}")
                    c.value(fn.get("arguments"))
        if isinstance(m.get("tool_call_id"), str):
            c.text(f"tool_call_id:{m['tool_call_id']}")
        # Leading system/developer messages are the app's shared head, not the conversation's own.
        in_head = in_head and role in _HEAD_ROLES
        if not in_head:
            c.end_of_first_own_message()


def _without_billing_header(content: Any) -> Any:
    """System content minus Claude Code's per-request attribution block (vLLM drops it too)."""
    if isinstance(content, str):
        return "" if content.startswith(_BILLING_HEADER) else content
    if isinstance(content, list):
        return [b for b in content if not (isinstance(b, dict) and b.get("type") == "text"
                                           and isinstance(b.get("text"), str)
                                           and b["text"].startswith(_BILLING_HEADER))]
    return content


def _render_messages(c: _Canon, body: Mapping[str, Any]) -> None:
    messages = _messages(body)
    system = body.get("system")
    if system is not None:
        c.section("system")
        _anthropic_content(c, _without_billing_header(system), "system")
    _tools(c, body, "tools", anthropic=True)
    in_head = True
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        role = _role(m, param)
        c.section(role)
        content = m.get("content")
        # A system message inside ``messages`` (Claude Code sends one after the first user turn)
        # stays where it is: hoisting it into the head would change every earlier turn's bytes.
        _anthropic_content(c, _without_billing_header(content) if role == "system" else content,
                           f"{param}.content")
        in_head = in_head and role in _HEAD_ROLES
        if not in_head:
            c.end_of_first_own_message()


def _render_prompt(c: _Canon, prompt: Any, param: str) -> None:
    if isinstance(prompt, str):
        c.text(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        for p in prompt:
            c.text(p)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        for j, p in enumerate(prompt):
            c.tokens(p, f"{param}[{j}]")
    elif isinstance(prompt, list) and prompt:
        c.tokens(prompt, param)
    else:
        raise _bad(f"{param} must be a string, a list of strings or a list of token ids", param)


def _render_completions(c: _Canon, body: Mapping[str, Any]) -> None:
    if "prompt" not in body:
        raise _bad("prompt is required", "prompt")
    c.section("prompt")
    _render_prompt(c, body["prompt"], "prompt")


def _render_responses(c: _Canon, body: Mapping[str, Any]) -> None:
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions must be a string", "instructions")
        c.section("instructions")
        c.text(instructions)
    _tools(c, body, "tools", anthropic=False)
    items = body.get("input")
    if items is None:
        return
    if isinstance(items, str):
        c.section("user")
        c.text(items)
        c.end_of_first_own_message()
        return
    if not isinstance(items, list):
        raise _bad("input must be a string or a list of items", "input")
    in_head = True
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{param} must be an object", param)
        kind = item.get("type", "message")
        role = _role(item, param) if kind == "message" else str(kind)
        in_head = in_head and role in _HEAD_ROLES
        if kind == "message":
            c.section(role)
            _openai_content(c, item.get("content"), f"{param}.content")
        elif kind == "function_call":
            c.section("function_call")
            c.text(f"{item.get('call_id', '')}:{item.get('name', '')}")
            c.value(item.get("arguments"))
        elif kind == "function_call_output":
            c.section("function_call_output")
            c.text(str(item.get("call_id", "")))
            c.value(item.get("output"))
        else:
            c.section(str(kind))
            c.json(item)
        if not in_head:
            c.end_of_first_own_message()


def _render_embeddings(c: _Canon, body: Mapping[str, Any]) -> None:
    if "input" not in body:
        raise _bad("input is required", "input")
    _render_prompt(c, body["input"], "input")


_RENDERERS: dict[str, Callable[[_Canon, Mapping[str, Any]], None]] = {
    "chat": _render_chat,
    "completions": _render_completions,
    "messages": _render_messages,
    "count_tokens": _render_messages,
    "responses": _render_responses,
    "embeddings": _render_embeddings,
}
# Requests that leave nothing in an engine's prefix cache: routed, but their blocks are not indexed.
_NOT_CACHED = frozenset(("count_tokens", "embeddings"))


# --- nesting -------------------------------------------------------------------------------------

def nesting_error(body: Any, limit: int = MAX_JSON_DEPTH) -> ApiError | None:
    """A 400 naming the first field of ``body`` nested more than ``limit`` levels deep (the body
    itself is level 1), or None.  Walked only after rendering failed, so requests pay nothing."""
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(body, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if depth > limit:
            name = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
            if len(path) >= _MAX_NAMED_DEPTH:
                name += "..."
            return ApiError(400, f"{name or 'body'} is nested more than {limit} levels deep",
                            param=name or "body")
        children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(
            value, list) else ()
        for key, child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1, (*path, key) if len(path) < _MAX_NAMED_DEPTH else path))
    return None


# --- session id, tokens -------------------------------------------------------------------------

class RequestHeaders(dict[str, str]):
    """A request's headers as ``parse_request`` reads them, from the raw pairs the listening side
    parsed: names lower-cased, a repeated name's first value (what a multidict's ``get`` gives).
    A plain dict costs about half a ``CIMultiDict``'s time to build and to ask, once per request."""

    __slots__ = ()

    @classmethod
    def of(cls, pairs: Sequence[tuple[bytes, bytes]]) -> RequestHeaders:
        """The headers of ``pairs`` (names and values as sent, latin-1)."""
        headers = cls()
        for name, value in reversed(pairs):  # the first of a repeated name is set last
            headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        return headers


def _header(headers: Mapping[str, str], name: str) -> str | None:
    if type(headers) is RequestHeaders:
        return headers.get(name.lower())
    return _other_header(headers, name)


def _reader(headers: Mapping[str, str]) -> Callable[[str], str | None]:
    """How to read ``headers`` by a lower-case name: a request's parsed headers are a dict of
    lower-case names, read by its own ``get`` (a request reads ~10 names: a Python call and a
    lower-cased copy of the name each, ~1,400 instructions, were most of the read)."""
    if type(headers) is RequestHeaders:
        return headers.get
    return functools.partial(_other_header, headers)


def _other_header(headers: Mapping[str, str], name: str) -> str | None:
    if isinstance(headers, CIMultiDictProxy | CIMultiDict):
        return headers.get(name)
    value = headers.get(name)
    if value is None:
        lname = name.lower()
        value = next((v for k, v in headers.items() if k.lower() == lname), None)
    return value


def _field(body: Mapping[str, Any], path: str) -> Any:
    value: Any = body
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _from_user_id(body: Mapping[str, Any]) -> str | None:
    user_id = _field(body, "metadata.user_id")
    if not isinstance(user_id, str):
        return None
    if user_id.startswith("{"):
        try:
            parsed = orjson.loads(user_id)
        except orjson.JSONDecodeError:
            return None
        sid = parsed.get("session_id") if isinstance(parsed, dict) else None
        return sid if isinstance(sid, str) else None
    _, found, sid = user_id.rpartition("_session_")
    return sid if found else None


def _usable(value: Any) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= _MAX_SESSION_ID and value.strip():
        return value.strip()
    return None


def session_id_of(body: Mapping[str, Any], headers: Mapping[str, str], options: RequestOptions) -> str | None:
    """The request's session id from the first configured source that has one.

    A subagent's agent id (``options.agent_headers``) is appended, so a subagent that sends its
    parent's session id is a conversation of its own.
    """
    header = _reader(headers)
    for kind, name in options.parsed_sources():
        if kind == "anthropic-user-id":
            value: Any = _from_user_id(body)
        else:
            value = header(name) if kind == "header" else _field(body, name)
        found = _usable(value)
        if found is not None:
            for name in options.agent_headers:
                agent = _usable(header(name.lower()))
                if agent is not None:
                    return f"{found}/agent:{agent}"
            return found
    return None


PRIORITY_HEADER = "x-kvroute-priority"
_PRIORITIES = {"high": 1, "normal": 0, "low": -1, "1": 1, "0": 0, "-1": -1}
# The tenant flow control shares the fleet fairly between: kvroute's own header, then llm-d's
# (Gateway API Inference Extension) fairness id, then the API key (hashed).
TENANT_HEADERS = ("x-kvroute-tenant", "x-gateway-inference-fairness-id")
_MAX_TENANT = 128
# Names the client of a session (an agent, a user's app): its new conversation frees its old one.
CLIENT_HEADER = "x-kvroute-client"


def priority_of(headers: Mapping[str, str]) -> int:
    """The request's priority class from ``x-kvroute-priority``: ``high`` 1, ``normal`` (or no
    header) 0, ``low`` -1; the integers 1 / 0 / -1 also.  Anything else is a 400."""
    value = _header(headers, PRIORITY_HEADER)
    if value is None:
        return 0
    found = _PRIORITIES.get(value.strip().lower())
    if found is None:
        raise ApiError(400, f"{PRIORITY_HEADER} must be one of high, normal, low (or 1, 0, -1), "
                            f"not {value[:40]!r}", param=PRIORITY_HEADER)
    return found


def tenant_of(headers: Mapping[str, str]) -> str | None:
    """Whose request this is, for flow control's fair share: ``x-kvroute-tenant``, else
    ``x-gateway-inference-fairness-id``, else ``key:`` and a 64-bit hash of the API key
    (``Authorization: Bearer ...`` or ``x-api-key``: the key itself is never kept), else None
    (the default tenant)."""
    header = _reader(headers)
    for name in TENANT_HEADERS:
        value = header(name)
        if value is not None and value.strip():
            return value.strip()[:_MAX_TENANT]
    api_key = header("x-api-key")
    if not api_key:
        auth = header("authorization")
        if auth is not None and auth[:7].lower() == "bearer ":
            api_key = auth[7:].strip()
    if api_key:
        return "key:" + xxhash.xxh3_64_hexdigest(api_key.encode("utf-8", "replace"))
    return None


def client_of(headers: Mapping[str, str]) -> str | None:
    """The client that sends the request's session, from ``x-kvroute-client`` (opt-in; None
    without it): when it starts another session, session admission counts its previous one as
    ended."""
    value = _header(headers, CLIENT_HEADER)
    if value is None or not value.strip():
        return None
    return value.strip()[:_MAX_TENANT]


def conversation_id(first_turn: bytes | memoryview) -> str:
    """The identity of a conversation that sent no session id, from the canonical bytes of its
    shared head and its first own message (``conv:`` and a 128-bit digest, never the text)."""
    return DERIVED_SESSION_PREFIX + xxhash.xxh3_128_hexdigest(first_turn)


def _max_tokens(body: Mapping[str, Any], route: str) -> int:
    names = {"chat": ("max_completion_tokens", "max_tokens"), "responses": ("max_output_tokens",)}
    for name in names.get(route, ("max_tokens",)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _bad(f"{name} must be a non-negative integer", name)
        return value
    return 0


def _answer_tokens(body: Mapping[str, Any], max_tokens: int) -> int | None:
    """The answer's length where the request fixes it: ``max_tokens`` with vLLM's ``ignore_eos``
    or with ``min_tokens`` equal to it; None otherwise (it ends at its end-of-sequence token)."""
    if max_tokens <= 0:
        return None
    if body.get("ignore_eos") is True or body.get("min_tokens") == max_tokens:
        return max_tokens
    return None


def parse_request(route: str, body: Any, headers: Mapping[str, str],
                  options: RequestOptions | None = None) -> RoutingKey:
    """Reduce one API request to its ``RoutingKey``.

    ``route`` is one of ``ROUTES``: ``chat`` (/v1/chat/completions), ``completions``, ``messages``
    (Anthropic), ``count_tokens``, ``responses`` (OpenAI Responses) or ``embeddings``.  ``body`` is
    the already-parsed JSON.  Raises ``ApiError(400)`` naming the offending field.
    """
    renderer = _RENDERERS.get(route)
    if renderer is None:
        raise ValueError(f"unknown route {route!r}; expected one of {', '.join(ROUTES)}")
    opts = options or _DEFAULT_OPTIONS
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body")
    model = body.get("model")
    if model is None:
        raise _bad("model is required", "model")
    if not isinstance(model, str) or not model:
        raise _bad("model must be a non-empty string", "model")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad("cache_salt must be a non-empty string", "cache_salt")
    canon = _Canon(opts.image_tokens)
    try:
        renderer(canon, body)
    except (TypeError, RecursionError):  # orjson's "Recursion limit reached" is a TypeError
        error = nesting_error(body)
        if error is None:
            raise
        raise error from None
    prefix = b"".join(canon.parts)
    est = len(prefix) // EST_BYTES_PER_TOKEN + canon.extra_tokens
    cacheable = route not in _NOT_CACHED
    session_id = session_id_of(body, headers, opts)
    if session_id is None and opts.derive_conversation_id and cacheable and canon.first_turn_parts:
        first_turn_bytes = sum(len(p) for p in canon.parts[:canon.first_turn_parts])
        # A view, not a copy of what may be most of the prompt.
        session_id = conversation_id(memoryview(prefix)[:first_turn_bytes])
    if len(prefix) > opts.max_prefix_bytes:
        prefix = prefix[:opts.max_prefix_bytes]
    max_tokens = _max_tokens(body, route)
    return RoutingKey(
        model=model,
        prefix=prefix if cacheable else b"",
        session_id=session_id,
        est_prompt_tokens=est,
        max_tokens=max_tokens,
        answer_tokens=_answer_tokens(body, max_tokens),
        cache_salt=salt,
        cacheable=cacheable,
        stream=body.get("stream") is True,
        priority=priority_of(headers),
        tenant=tenant_of(headers),
        client=client_of(headers),
    )
