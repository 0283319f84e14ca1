"""An Anthropic messages request as the chat request vLLM 0.32 serves it as (api/anthropic_chat.py).
The expected bodies are what ``AnthropicServingMessages.to_chat_completion_request`` makes of
each request; tests/vllm/test_anthropic_real.py runs vLLM's own function over the same cases."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvroute.api.anthropic_chat import AnthropicConversionError, anthropic_to_chat, has_inline_system

BILLING = "x-anthropic-billing-header: cc_version=2.1.3; cch=7f3a;"


def test_a_system_string_becomes_the_leading_system_message() -> None:
    body = {"system": "Be terse.", "messages": [{"role": "user", "content": "Hi"}]}
    assert anthropic_to_chat(body) == {"messages": [{"role": "system", "content": "Be terse."},
                                                    {"role": "user", "content": "Hi"}]}


def test_system_blocks_are_joined_without_a_separator_and_lose_claude_codes_attribution() -> None:
    body = {"system": [{"type": "text", "text": BILLING}, {"type": "text", "text": "You are Claude Code."},
                       {"type": "text", "text": "", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": " Be terse.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert anthropic_to_chat(body)["messages"] == [
        {"role": "system", "content": "You are Claude Code. Be terse."}, {"role": "user", "content": "Hi"}]
    # Only blocks are filtered: a system string is kept as sent, and an empty one is no message.
    kept = anthropic_to_chat({**body, "system": BILLING})["messages"][0]
    assert kept == {"role": "system", "content": BILLING}
    assert anthropic_to_chat({**body, "system": ""})["messages"] == [{"role": "user", "content": "Hi"}]


def test_a_multi_turn_conversation_keeps_one_text_block_as_a_string_and_several_as_parts() -> None:
    body = {"messages": [
        {"role": "user", "content": "First?"},
        {"role": "assistant", "content": [{"type": "text", "text": "One."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
                                     {"type": "text", "text": "b"}]}]}
    assert anthropic_to_chat(body)["messages"] == [
        {"role": "user", "content": "First?"}, {"role": "assistant", "content": "One."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]


def test_tool_use_and_tool_result_become_tool_calls_and_tool_messages() -> None:
    body = {"messages": [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call ls.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Calling ls."},
            {"type": "tool_use", "id": "toolu_1", "name": "ls",
             "input": {"path": "/tmp", "all": True, "n": 1.5}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "a.txt"}, {"type": "text", "text": "b.txt"}]},
            {"type": "text", "text": "Which is newer?"}]}]}
    assert anthropic_to_chat(body)["messages"] == [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "reasoning": "I should call ls.", "content": "Calling ls.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "ls", "arguments": json.dumps({"path": "/tmp", "all": True, "n": 1.5})}}]},
        # The tool message comes first: vLLM appends it while it converts the user message's blocks.
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt\nb.txt"},
        {"role": "user", "content": "Which is newer?"}]
    # Python's json.dumps, spaces included, as vLLM writes the arguments.
    assert anthropic_to_chat(body)["messages"][1]["tool_calls"][0]["function"]["arguments"] \
        == '{"path": "/tmp", "all": true, "n": 1.5}'


def test_a_user_message_of_tool_results_only_is_no_message_of_its_own() -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
        {"type": "tool_result", "tool_use_id": "t2"}]}]}
    assert anthropic_to_chat(body)["messages"] == [
        {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        {"role": "tool", "tool_call_id": "t2", "content": ""}]


def test_an_assistant_tool_result_is_text_and_an_assistant_of_tool_calls_only_has_no_content() -> None:
    body = {"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "x"}]}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "ls"}]}]}
    out = anthropic_to_chat(body)["messages"]
    assert out[0] == {"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': 'x'}]"}
    assert out[1] == {"role": "assistant", "tool_calls": [
        {"id": "t2", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]}


def test_a_tool_use_without_an_id_is_named_by_the_clock_given_or_refused() -> None:
    body = {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "ls", "input": {}}]}]}
    with pytest.raises(AnthropicConversionError, match="clock"):
        anthropic_to_chat(body)
    assert anthropic_to_chat(body, now=lambda: 1234.9)["messages"][0]["tool_calls"][0]["id"] == "call_1234"


def test_images_become_image_url_parts_as_vllm_converts_them() -> None:
    png = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    body = {"messages": [
        {"role": "user", "content": [{"type": "image", "source": png},
                                     {"type": "text", "text": "What is it?"}]},
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.jpg"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"data": "BBBB"}},
            {"type": "tool_reference", "tool_name": "grep"}]}]}]}
    assert anthropic_to_chat(body)["messages"] == [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "What is it?"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.jpg"}}]},
        {"role": "tool", "tool_call_id": "t", "content": ""},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BBBB"}}]},
        {"role": "tool", "tool_call_id": "t", "content": [{"type": "tool_reference", "name": "grep"}]}]


def test_inline_system_messages_stay_in_place_or_merge_into_the_leading_one() -> None:
    body = {"system": "Lead.", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": [{"type": "text", "text": BILLING},
                                       {"type": "text", "text": " Reminder."}]},
        {"role": "system", "content": BILLING},
        {"role": "user", "content": "Again"}]}
    assert has_inline_system(body) and not has_inline_system({"messages": body["messages"][:1]})
    assert anthropic_to_chat(body)["messages"] == [
        {"role": "system", "content": "Lead."}, {"role": "user", "content": "Hi"},
        {"role": "system", "content": " Reminder."}, {"role": "user", "content": "Again"}]
    assert anthropic_to_chat(body, merge_inline_system=True)["messages"] == [
        {"role": "system", "content": "Lead. Reminder."}, {"role": "user", "content": "Hi"},
        {"role": "user", "content": "Again"}]


def test_tools_become_openai_tools_after_the_system_messages_tool_changes() -> None:
    tools = [{"name": "ls", "description": "List.", "input_schema": {"properties": {}},
              "cache_control": {"type": "ephemeral"}},
             {"name": "grep", "input_schema": {"type": "object"}, "defer_loading": True}]
    body = {"tools": tools, "messages": [{"role": "user", "content": "Hi"}]}
    assert anthropic_to_chat(body)["tools"] == [
        {"type": "function", "function": {"name": "ls", "description": "List.",
                                          "parameters": {"properties": {}, "type": "object"},
                                          "strict": None, "defer_loading": None}},
        {"type": "function", "function": {"name": "grep", "description": None,
                                          "parameters": {"type": "object"},
                                          "strict": None, "defer_loading": True}}]
    changes = {**body, "messages": [*body["messages"], {"role": "system", "content": [
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "ls"}},
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "grep"}},
        {"type": "tool_addition", "tool": {"type": "tool_definition",
                                           "definition": {"name": "cat", "input_schema": {}}}}]}]}
    got = anthropic_to_chat(changes)
    assert [(t["function"]["name"], t["function"]["defer_loading"]) for t in got["tools"]] \
        == [("grep", None), ("cat", None)]
    assert "tools" not in anthropic_to_chat({"messages": body["messages"]})
    with pytest.raises(AnthropicConversionError, match="not declared"):
        anthropic_to_chat({**changes, "tools": None})


def test_the_reasoning_effort_reaches_the_template_as_build_chat_params_hands_it_over() -> None:
    base: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}]}
    assert "chat_template_kwargs" not in anthropic_to_chat({**base, "thinking": {"type": "enabled",
                                                                                 "budget_tokens": 2048}})
    assert anthropic_to_chat({**base, "output_config": {"effort": "high"}})["chat_template_kwargs"] == {
        "reasoning_effort": "high", "enable_thinking": True}
    disabled = {**base, "output_config": {"effort": "high"}, "thinking": {"type": "disabled"},
                "chat_template_kwargs": {"enable_thinking": True, "x": 1}}
    assert anthropic_to_chat(disabled)["chat_template_kwargs"] == {
        "reasoning_effort": "none", "enable_thinking": True, "x": 1}
    assert anthropic_to_chat(disabled, disabled_thinking_effort="low")["chat_template_kwargs"][
        "reasoning_effort"] == "low"


@pytest.mark.parametrize("body", [
    {},
    {"messages": [{"role": "tool", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "document"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_addition", "tool": {
        "type": "tool_reference", "name": "x"}}]}]},
    {"system": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "x"}}], "messages": []},
    {"messages": [], "tools": [{"name": "x"}]},
])
def test_what_vllms_request_models_reject_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(AnthropicConversionError):
        anthropic_to_chat(body)
