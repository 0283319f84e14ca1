"""An Anthropic messages request as the chat-completion request vLLM serves it as.

vLLM 0.32 answers ``/v1/messages`` by converting the request into a chat-completion request
(``AnthropicServingMessages.to_chat_completion_request`` in ``vllm/entrypoints/anthropic/serving.py``)
and rendering that with the chat template, so the tokens it caches for an Anthropic request are
those of the converted chat request.  :func:`anthropic_to_chat` is that conversion, restricted to
the fields that reach the template: the router tokenizes an Anthropic request for exact mode
through it (server/engine_tokens.py), and the simulator renders ``/v1/messages`` through it
(sim/tokenizer.py), so both see the messages vLLM's template sees.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

_BILLING_HEADER = "x-anthropic-billing-header"
_BLOCK_TYPES = frozenset(("text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                          "redacted_thinking", "tool_addition", "tool_removal"))
_TOOL_CHANGES = ("tool_addition", "tool_removal")
# What vLLM hands the template for each Anthropic effort (``ChatCompletionRequest.build_chat_params``).
_EFFORTS = frozenset(("low", "medium", "high", "xhigh", "max"))


class AnthropicConversionError(ValueError):
    """The request is not one vLLM converts (its pydantic models reject it), or its conversion
    depends on the engine (a ``tool_use`` without an id is named by the engine's clock)."""


def _str_or_none(block: Mapping[str, Any], name: str, where: str) -> str | None:
    value = block.get(name)
    if value is not None and not isinstance(value, str):
        raise AnthropicConversionError(f"{where}.{name} must be a string")
    return value


def _blocks(content: Any, where: str, system_role: bool) -> list[Mapping[str, Any]]:
    """Content blocks validated as vLLM's ``AnthropicContentBlock`` (extra fields ignored)."""
    if not isinstance(content, list):
        raise AnthropicConversionError(f"{where} must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, Mapping) or block.get("type") not in _BLOCK_TYPES:
            raise AnthropicConversionError(f"{where}.{i}: not a content block vLLM accepts")
        if block["type"] in _TOOL_CHANGES and not system_role:
            raise AnthropicConversionError(
                f'{block["type"]} blocks are only allowed in messages with role "system"')
        for name in ("text", "id", "tool_use_id", "name", "thinking"):
            _str_or_none(block, name, f"{where}.{i}")
    return content


def _system_text(content: Any, where: str) -> str | None:
    """``_extract_system_text``: a system message's text, Claude Code's attribution left out."""
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    parts = [b["text"] for b in _blocks(content, where, system_role=True)
             if b["type"] == "text" and b.get("text") and not b["text"].startswith(_BILLING_HEADER)]
    return "".join(parts) if parts else None


def _image_url(source: Any) -> str:
    """``_convert_image_source_to_url``: a URL source as it is, anything else as a data URI."""
    source = source if isinstance(source, Mapping) else {}
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _user_tool_result(block: Mapping[str, Any], out: list[dict[str, Any]]) -> None:
    """``_convert_user_tool_result``: a tool message, then the result's images as a user message
    and its tool references as another tool message."""
    content = block.get("content")
    text = ""
    images: list[str] = []
    references: list[dict[str, Any]] = []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts: list[str] = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                if url := _image_url(item.get("source", {})):
                    images.append(url)
            elif kind == "tool_reference" and (name := item.get("tool_name") or item.get("name")):
                references.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if images:
        out.append({"role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if references:
        out.append({"role": "tool", "tool_call_id": call_id, "content": references})


def _message(msg: Mapping[str, Any], blocks: list[Mapping[str, Any]], out: list[dict[str, Any]],
             now: Callable[[], float] | None) -> None:
    """``_convert_message_content`` and ``_convert_block`` for one user or assistant message."""
    role = msg["role"]
    item: dict[str, Any] = {"role": role}
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            arguments = block.get("input")
            if arguments is not None and not isinstance(arguments, Mapping):
                raise AnthropicConversionError("tool_use.input must be an object")
            call_id = block.get("id")
            if not call_id:
                if now is None:
                    raise AnthropicConversionError("a tool_use without an id is named by the engine's clock")
                call_id = f"call_{int(now())}"
            function = {"name": block.get("name") or "", "arguments": json.dumps(arguments or {})}
            calls.append({"id": call_id, "type": "function", "function": function})
        elif kind == "tool_result":
            if role == "user":
                _user_tool_result(block, out)
            else:
                content = block.get("content")
                if content is not None and not isinstance(content, str | list):
                    raise AnthropicConversionError("tool_result.content must be a string or a list")
                parts.append({"type": "text", "text": f"Tool result: {str(content) if content else ''}"})
        # redacted_thinking and tool_reference render nothing (vLLM accepts and skips them).
    if reasoning:
        item["reasoning"] = "".join(reasoning)
    if calls:
        item["tool_calls"] = calls
    if parts:
        item["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if not (role == "user" and "content" not in item):
        out.append(item)


def _tool(tool: Any, where: str) -> dict[str, Any]:
    """An ``AnthropicTool`` (its ``input_schema`` typed ``object`` unless it says otherwise)."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str) \
            or not isinstance(tool.get("input_schema"), Mapping):
        raise AnthropicConversionError(f"{where}: a tool needs a name and an input_schema object")
    schema = dict(tool["input_schema"])
    schema.setdefault("type", "object")
    return {"name": tool["name"], "description": tool.get("description"), "input_schema": schema,
            "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading")}


def _resolved_tools(body: Mapping[str, Any], messages: list[Any]) -> list[dict[str, Any]] | None:
    """``_resolve_tools``: the request's tools after the tool_addition / tool_removal blocks of
    its system messages, in the order vLLM keeps them."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise AnthropicConversionError("tools must be a list")
    tools = None if raw is None else [_tool(t, f"tools.{i}") for i, t in enumerate(raw)]
    changes = [b for m in messages if isinstance(m.get("content"), list)
               for b in m["content"] if b["type"] in _TOOL_CHANGES]
    if not changes:
        return tools
    by_name = {t["name"]: t for t in tools or []}
    removed: set[str] = set()
    for block in changes:
        change = block.get("tool")
        allowed = ("tool_reference",) + (("tool_definition",) if block["type"] == "tool_addition" else ())
        if not isinstance(change, Mapping) or change.get("type") not in allowed:
            raise AnthropicConversionError(f"{block['type']}: tool must be one of {', '.join(allowed)}")
        if change["type"] == "tool_definition":
            definition = _tool(change.get("definition"), f"{block['type']}.tool.definition")
            name = definition["name"]
            by_name[name] = definition
        else:
            name = change.get("name")
            if not isinstance(name, str) or name not in by_name:
                raise AnthropicConversionError(
                    f"{block['type']} references tool {name!r}, which is not declared in tools")
            if block["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if block["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for name, t in by_name.items() if name not in removed]


def anthropic_to_chat(body: Mapping[str, Any], *, merge_inline_system: bool = False,
                      disabled_thinking_effort: str = "none",
                      now: Callable[[], float] | None = None) -> dict[str, Any]:
    """The chat-completion body vLLM 0.32 renders an Anthropic messages ``body`` as: its
    ``messages``, ``tools`` (where the request has any) and ``chat_template_kwargs`` (the
    request's own, with the reasoning effort its ``thinking`` / ``output_config`` set, as
    ``build_chat_params`` hands it to the template).  ``AnthropicServingMessages
    .to_chat_completion_request`` in vllm/entrypoints/anthropic/serving.py.

    ``merge_inline_system``: the engine's chat template requires the system prompt first (vLLM
    probes the template: :func:`kvroute.api.local_tokens.merges_inline_system`), so system
    messages inside ``messages`` join the leading one.  ``disabled_thinking_effort``: the effort
    vLLM maps ``thinking: {"type": "disabled"}`` to ("none", or "low" where the template ignores
    "none").  ``now``: the clock vLLM names an id-less ``tool_use`` by; None raises instead.
    Raises :class:`AnthropicConversionError` where vLLM's request models reject the body.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise AnthropicConversionError("messages: field required (a list)")
    checked: list[tuple[Mapping[str, Any], list[Mapping[str, Any]] | None]] = []
    for j, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or msg.get("role") not in ("user", "assistant", "system"):
            raise AnthropicConversionError(f"messages.{j}.role must be 'user', 'assistant' or 'system'")
        content = msg.get("content")
        checked.append((msg, None if isinstance(content, str)
                        else _blocks(content, f"messages.{j}.content", msg["role"] == "system")))
    out: list[dict[str, Any]] = []
    system = body.get("system")
    parts: list[str] = []
    if system:
        if isinstance(system, str):
            parts.append(system)
        else:
            system_blocks = _blocks(system, "system", system_role=False)
            parts.extend(b["text"] for b in system_blocks if b["type"] == "text" and b.get("text")
                         and not b["text"].startswith(_BILLING_HEADER))
    if merge_inline_system:
        parts.extend(text for msg, _ in checked if msg["role"] == "system"
                     and (text := _system_text(msg["content"], "system")))
    if parts:
        out.append({"role": "system", "content": "".join(parts)})
    for msg, blocks in checked:
        if msg["role"] == "system":
            if not merge_inline_system and (text := _system_text(msg["content"], "system")):
                out.append({"role": "system", "content": text})
        elif blocks is None:
            out.append({"role": msg["role"], "content": msg["content"]})
        else:
            _message(msg, blocks, out, now)
    chat: dict[str, Any] = {"messages": out}
    tools = _resolved_tools(body, messages)
    if tools is not None:
        chat["tools"] = [{"type": "function", "function": {
            "name": t["name"], "description": t["description"], "parameters": t["input_schema"],
            "strict": t["strict"], "defer_loading": t["defer_loading"]}} for t in tools]
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise AnthropicConversionError("chat_template_kwargs must be an object")
    effort = _effort(body, disabled_thinking_effort)
    if effort is not None:
        kwargs = {**(kwargs or {}), "reasoning_effort": effort,
                  **({} if kwargs and "enable_thinking" in kwargs else {"enable_thinking": effort != "none"})}
    if kwargs is not None:
        chat["chat_template_kwargs"] = dict(kwargs)
    return chat


def _effort(body: Mapping[str, Any], disabled: str) -> str | None:
    """The ``reasoning_effort`` vLLM sets: ``output_config.effort``, then ``thinking`` disabled
    (``_handle_output_config`` runs before ``_handle_thinking``, so the latter wins)."""
    effort = None
    output = body.get("output_config")
    if isinstance(output, Mapping) and output.get("effort") is not None:
        if output["effort"] not in _EFFORTS:
            raise AnthropicConversionError(f"output_config.effort must be one of {sorted(_EFFORTS)}")
        effort = output["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        effort = disabled
    return str(effort) if effort is not None else None


def has_inline_system(body: Mapping[str, Any]) -> bool:
    """Whether ``body`` has system messages inside ``messages``, whose place in the converted
    request depends on the engine's chat template (``merge_inline_system``)."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(isinstance(m, Mapping) and m.get("role") == "system"
                                              for m in messages)
