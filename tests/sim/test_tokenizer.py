"""The pseudo-tokenizer and chat template: prefix stability, token arithmetic, hashes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.sim.tokenizer import (
    RenderError,
    count_tokens,
    detokenize,
    render_anthropic,
    render_chat,
    render_completion,
    token_ids,
)

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def test_token_is_four_bytes_rounded_up() -> None:
    assert count_tokens(b"") == 0
    assert count_tokens(b"abcd") == 1
    assert count_tokens(b"abcde") == 2


@given(st.lists(st.text(max_size=40), min_size=1, max_size=6))
def test_appending_a_turn_only_appends_bytes(turns: list[str]) -> None:
    messages: list[dict[str, object]] = [{"role": "system", "content": "be brief"}]
    previous = render_chat({"messages": [*messages, {"role": "user", "content": turns[0]}], "tools": TOOLS})
    messages.append({"role": "user", "content": turns[0]})
    for text in turns[1:]:
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": text[::-1]}]
        current = render_chat({"messages": messages, "tools": TOOLS})
        assert current.startswith(previous)
        previous = current


@given(st.text(max_size=30), st.text(alphabet="abc xyz", min_size=1, max_size=50))
def test_assistant_content_starts_on_a_token_boundary(prefix: str, reply: str) -> None:
    prompt = render_chat({"messages": [{"role": "user", "content": prefix}]})
    assert len(prompt) % 4 == 0
    longer = render_chat({"messages": [{"role": "user", "content": prefix},
                                       {"role": "assistant", "content": reply}]})
    assert longer[len(prompt):].startswith(reply.encode())


def test_tool_calls_and_results_render_in_order() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "list files"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "a.txt"},
    ]
    out = render_chat({"messages": messages, "tools": TOOLS})
    order = [out.index(part) for part in (b'"name":"read"', b"list files", b'"name":"ls"', b"a.txt")]
    assert order == sorted(order)
    assert out.endswith(b"\n") and b"<|im_start|>assistant" in out[-30:]


def test_anthropic_rendering_is_prefix_stable_with_blocks() -> None:
    base = {"system": [{"type": "text", "text": "sys"}], "tools": [{"name": "ls", "input_schema": {}}]}
    turn1 = [{"role": "user", "content": "hi"}]
    turn2 = [*turn1,
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "ls", "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]
    a = render_anthropic({**base, "messages": turn1})
    b = render_anthropic({**base, "messages": turn2})
    # As vLLM converts it: the tool result is a tool turn of its own, the tool use a tool call.
    assert b.startswith(a) and b"<|im_start|>tool\nx<|im_end|>" in b
    assert b'<tool_call>{"arguments":"{}","name":"ls"}</tool_call>' in b


@pytest.mark.parametrize("body", [{}, {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                                  {"messages": [{"role": "user", "content": 5}]}])
def test_bad_chat_bodies_raise_render_error(body: dict[str, object]) -> None:
    with pytest.raises(RenderError):
        render_chat(body)


def test_token_ids_round_trip_and_completion_prompts() -> None:
    data = "héllo wörld".encode()
    assert detokenize(token_ids(data)) == data
    assert render_completion(token_ids(b"abcdefgh")) == b"abcdefgh"
    assert render_completion("x") == b"x"
    with pytest.raises(RenderError):
        render_completion({"not": "a prompt"})
