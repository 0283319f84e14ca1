"""Request bodies and headers -> RoutingKey, for every route the router serves."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from kvroute.api.errors import ApiError
from kvroute.api.requests import RequestHeaders, RequestOptions, parse_request

USER_X = [{"role": "user", "content": "x"}]
SID = "0f4c2b1e-8a53-4c2a-9e2e-3b7d1c9a5f10"


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def anthropic(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "claude", "max_tokens": 256, "messages": list(messages), **extra}


TOOLS_OPENAI = [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                                   "parameters": {"type": "object"}}}]
TOOLS_ANTHROPIC = [{"name": "Bash", "description": "Run", "input_schema": {"type": "object"}}]


# --- prefix stability: appending a turn only appends bytes -----------------------------------

def grown(route: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if route == "chat":
        a = chat({"role": "system", "content": "You are terse."}, {"role": "user", "content": "List files"},
                 tools=TOOLS_OPENAI)
        b = copy.deepcopy(a)
        b["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"p": "a"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "data"},
            {"role": "user", "content": [
                {"type": "text", "text": "and?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        ]
    elif route == "messages":
        a = anthropic({"role": "user", "content": [{"type": "text", "text": "hi",
                                                    "cache_control": {"type": "ephemeral"}}]},
                      system=[{"type": "text", "text": "You are Claude Code.",
                               "cache_control": {"type": "ephemeral"}}],
                      tools=TOOLS_ANTHROPIC)
        b = copy.deepcopy(a)
        # Claude Code moves its cache_control marker to the newest message on every turn.
        del b["messages"][0]["content"][0]["cache_control"]
        b["messages"] += [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"cmd": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a.txt"}],
                 "cache_control": {"type": "ephemeral"}}]},
        ]
    elif route == "completions":
        a = {"model": "m", "prompt": "Once upon a time"}
        b = {"model": "m", "prompt": "Once upon a time there was"}
    else:  # responses
        a = {"model": "m", "instructions": "Be brief.", "tools": TOOLS_OPENAI, "input": [
            {"role": "user", "content": "weather?"}]}
        b = copy.deepcopy(a)
        b["input"] += [
            {"type": "function_call", "call_id": "f1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "f1", "output": "sunny"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
        ]
    return a, b


@pytest.mark.parametrize("route", ["chat", "messages", "completions", "responses"])
def test_appending_a_turn_only_appends_bytes(route: str) -> None:
    a, b = grown(route)
    ka, kb = parse_request(route, a, {}), parse_request(route, b, {})
    assert len(kb.prefix) > len(ka.prefix)
    assert kb.prefix.startswith(ka.prefix)
    assert kb.est_prompt_tokens > ka.est_prompt_tokens


def test_tools_come_before_messages_and_count() -> None:
    with_tools = parse_request("chat", chat({"role": "user", "content": "x"}, tools=TOOLS_OPENAI), {})
    without = parse_request("chat", chat({"role": "user", "content": "x"}), {})
    assert with_tools.prefix.index(b"Read a file") < with_tools.prefix.index(b"\x1euser")
    assert with_tools.prefix != without.prefix


def test_content_differences_change_the_prefix() -> None:
    base = parse_request("chat", chat({"role": "user", "content": "x"}), {})
    assert parse_request("chat", chat({"role": "assistant", "content": "x"}), {}).prefix != base.prefix
    assert parse_request("chat", chat({"role": "user", "content": "y"}), {}).prefix != base.prefix
    img1 = chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,A" * 1000}}]})
    img2 = chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,B" * 1000}}]})
    k1, k2 = parse_request("chat", img1, {}), parse_request("chat", img2, {})
    assert k1.prefix != k2.prefix
    assert len(k1.prefix) < 100  # an image counts by its digest, not its bytes
    assert k1.est_prompt_tokens >= 1024


def test_tool_arguments_and_results_count() -> None:
    def call(args: str) -> dict[str, Any]:
        return chat({"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]})
    assert parse_request("chat", call('{"a":1}'), {}).prefix != parse_request(
        "chat", call('{"a":2}'), {}).prefix

    def result(text: str) -> dict[str, Any]:
        return anthropic({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                       "content": text}]})
    assert parse_request("messages", result("a"), {}).prefix != parse_request(
        "messages", result("b"), {}).prefix


def test_token_id_prompts_count_exactly() -> None:
    k = parse_request("completions", {"model": "m", "prompt": list(range(1000))}, {})
    assert 1000 <= k.est_prompt_tokens <= 1002  # the ids, plus a few marker bytes
    batch = parse_request("completions", {"model": "m", "prompt": [[1, 2], [3, 4]]}, {})
    assert 4 <= batch.est_prompt_tokens <= 6


def test_limits_and_outputs() -> None:
    k = parse_request("chat", chat({"role": "user", "content": "x" * 10_000}, max_completion_tokens=77,
                                   max_tokens=5, cache_salt="s1"), {})
    assert k.max_tokens == 77 and k.cache_salt == "s1" and k.est_prompt_tokens >= 2500
    assert parse_request("messages", anthropic({"role": "user", "content": "x"}), {}).max_tokens == 256
    responses = {"model": "m", "input": "x", "max_output_tokens": 9}
    assert parse_request("responses", responses, {}).max_tokens == 9
    big = parse_request("chat", chat({"role": "user", "content": "x" * 5000}), {},
                        RequestOptions(max_prefix_bytes=1024))
    assert len(big.prefix) == 1024 and big.est_prompt_tokens > 1250


def test_embeddings_and_token_counting_are_routed_but_not_cached() -> None:
    e = parse_request("embeddings", {"model": "e", "input": ["a" * 400, "b"]}, {})
    assert not e.cacheable and e.prefix == b"" and e.est_prompt_tokens >= 100
    c = parse_request("count_tokens", {"model": "claude", "messages": [{"role": "user", "content": "x"}]}, {})
    assert not c.cacheable and c.max_tokens == 0


# --- session id, in the documented order ------------------------------------------------------

def user_id_json(session: str) -> str:
    return orjson.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": session}).decode()


@pytest.mark.parametrize(
    ("headers", "body_extra", "expected"),
    [
        ({"X-Claude-Code-Session-Id": "hdr"}, {"metadata": {"user_id": user_id_json("meta")}}, "hdr"),
        ({}, {"metadata": {"user_id": user_id_json(SID)}}, SID),
        ({}, {"metadata": {"user_id": f"user_{'a' * 64}_account_{SID}_session_{SID[::-1]}"}}, SID[::-1]),
        ({"x-session-id": "xs"}, {"metadata": {"user_id": "user_abc"}}, "xs"),
        ({"X-Session-ID": "xs"}, {"prompt_cache_key": "pck"}, "xs"),
        ({}, {"prompt_cache_key": "pck"}, "pck"),
        ({}, {"metadata": {"user_id": "{not json"}}, None),
        ({}, {"metadata": {"user_id": 42}}, None),
        ({"x-session-id": "  "}, {}, None),
        ({"session_id": "codex"}, {"prompt_cache_key": "pck"}, "codex"),
        ({"Session-Id": "codex2"}, {"prompt_cache_key": "pck"}, "codex2"),
        ({"x-session-id": "xs", "session_id": "codex"}, {}, "xs"),
        ({}, {}, None),
    ],
)
def test_session_id_order(headers: dict[str, str], body_extra: dict[str, Any], expected: str | None) -> None:
    body = anthropic({"role": "user", "content": "x"}, **body_extra)
    sent_only = RequestOptions(derive_conversation_id=False)
    assert parse_request("messages", body, headers, sent_only).session_id == expected
    derived = parse_request("messages", body, headers).session_id
    assert derived == expected if expected is not None else derived.startswith("conv:")


def test_a_claude_code_subagent_is_a_conversation_of_its_own() -> None:
    body = anthropic({"role": "user", "content": "x"})
    parent = {"X-Claude-Code-Session-Id": SID}
    sub = {**parent, "x-claude-code-agent-id": "a1e3e86d28fbf4fcf",
           "x-claude-code-parent-agent-id": "p0"}
    assert parse_request("messages", body, parent).session_id == SID
    assert parse_request("messages", body, sub).session_id == f"{SID}/agent:a1e3e86d28fbf4fcf"
    with_parent = RequestOptions(agent_headers=())
    assert parse_request("messages", body, sub, with_parent).session_id == SID


def test_session_headers_are_case_insensitive_in_every_mapping() -> None:
    body = chat({"role": "user", "content": "x"})
    for headers in ({"x-claude-code-session-id": "a"}, {"X-CLAUDE-CODE-SESSION-ID": "a"},
                    CIMultiDictProxy(CIMultiDict({"X-Claude-Code-Session-Id": "a"}))):
        assert parse_request("chat", body, headers).session_id == "a"


def test_extra_session_sources_are_configurable() -> None:
    options = RequestOptions(extra_session_headers=("X-Conversation",),
                             extra_session_fields=("user", "metadata.thread"))
    body = chat({"role": "user", "content": "x"}, metadata={"thread": "th"})
    assert parse_request("chat", body, {"x-conversation": "conv"}, options).session_id == "conv"
    # As the listening side parses them (names lower-cased), read by the configured name in any case.
    parsed = RequestHeaders.of([(b"X-Conversation", b"conv"), (b"X-Agent-Id", b"a1")])
    assert parse_request("chat", body, parsed, options).session_id == "conv"
    with_agent = RequestOptions(extra_session_headers=("X-Conversation",), agent_headers=("X-Agent-Id",))
    assert parse_request("chat", body, parsed, with_agent).session_id == "conv/agent:a1"
    assert parse_request("chat", body, {}, options).session_id == "th"
    assert parse_request("chat", {**body, "user": "u1"}, {}, options).session_id == "u1"
    only = RequestOptions(session_sources=("field:prompt_cache_key",), derive_conversation_id=False)
    assert parse_request("chat", body, {"x-session-id": "ignored"}, only).session_id is None
    with pytest.raises(ValueError):
        RequestOptions(session_sources=("cookie:sid",))


# --- a conversation's identity without a session id -------------------------------------------

@pytest.mark.parametrize("route", ["chat", "messages", "responses"])
def test_derived_identity_is_the_same_on_every_turn(route: str) -> None:
    a, b = grown(route)
    ka, kb = parse_request(route, a, {}), parse_request(route, b, {})
    assert ka.session_id is not None and ka.session_id.startswith("conv:")
    assert ka.session_id == kb.session_id


def test_derived_identity_tells_conversations_apart_by_their_first_own_message() -> None:
    system = {"role": "system", "content": "You are a coding agent. " * 200}

    def first(text: str, head: dict[str, Any] = system) -> str | None:
        return parse_request("chat", chat(head, {"role": "user", "content": text}, tools=TOOLS_OPENAI),
                             {}).session_id

    # A first message shorter than one 512-byte block still tells two conversations apart.
    assert first("fix the parser") != first("fix the lexer")
    # The same first message under another app's head is another conversation...
    assert first("hi") != first("hi", {"role": "system", "content": "Another app."})
    # ...and under the same head the same conversation (the documented limit).
    assert first("hi") == first("hi")
    # Leading system messages are head; the first non-system message is the conversation's own.
    assert parse_request("chat", chat(system), {}).session_id is None
    two_systems = chat(system, {"role": "developer", "content": "d"}, {"role": "user", "content": "q"})
    grown_two = chat(*two_systems["messages"], {"role": "assistant", "content": "a"},
                     {"role": "user", "content": "q2"})
    same = parse_request("chat", grown_two, {}).session_id
    assert parse_request("chat", two_systems, {}).session_id == same


def test_a_sent_session_id_wins_and_derivation_can_be_switched_off() -> None:
    body = chat({"role": "user", "content": "x"})
    assert parse_request("chat", body, {"x-session-id": "s"}).session_id == "s"
    off = RequestOptions(derive_conversation_id=False)
    assert parse_request("chat", body, {}, off).session_id is None
    with pytest.raises(ValueError):
        RequestOptions(derive_conversation_id="yes")  # type: ignore[arg-type]


def test_requests_without_conversation_structure_get_no_derived_identity() -> None:
    assert parse_request("completions", {"model": "m", "prompt": "Once"}, {}).session_id is None
    assert parse_request("embeddings", {"model": "e", "input": "a"}, {}).session_id is None
    count = {"model": "claude", "messages": [{"role": "user", "content": "x"}]}
    assert parse_request("count_tokens", count, {}).session_id is None
    assert parse_request("responses", {"model": "m", "input": "q"}, {}).session_id is not None


# --- Claude Code's request shape (2.1.x): inline system messages, attribution block ----------

def claude_code_turns() -> tuple[dict[str, Any], dict[str, Any]]:
    """Turn 1 and turn 2 shaped as Claude Code 2.1.332 sends them in ``-p`` / ``-p --continue``."""
    def system(cch: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332; cch={cch};"},
                {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Instructions. " * 400, "cache_control": {"type": "ephemeral"}}]
    env = "# Environment\nPrimary working directory: /tmp/p\n" * 20
    extra = {"thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
             "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    first_user = {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
        {"type": "text", "text": "say hi"}]}
    one = anthropic(first_user, {"role": "system", "content": [
        {"type": "text", "text": env, "cache_control": {"type": "ephemeral"}}]},
        system=system("aaaa1"), tools=TOOLS_ANTHROPIC, **extra)
    two = anthropic(first_user, {"role": "system", "content": env},
                    {"role": "assistant", "content": [{"type": "text", "text": "hi there"}]},
                    {"role": "user", "content": [{"type": "text", "text": "and now bye",
                                                  "cache_control": {"type": "ephemeral"}}]},
                    system=system("bbbb2"), tools=TOOLS_ANTHROPIC, **extra)
    return one, two


def test_claude_code_turns_are_prefix_stable_and_one_conversation() -> None:
    one, two = claude_code_turns()
    k1, k2 = parse_request("messages", one, {}), parse_request("messages", two, {})
    # The per-request attribution hash is not part of the prompt...
    assert b"billing" not in k1.prefix and b"aaaa1" not in k1.prefix
    # ...the mid-conversation system message stays where it was sent...
    assert k1.prefix.index(b"say hi") < k1.prefix.index(b"# Environment")
    # ...so turn 2 starts with turn 1's bytes, and both are one conversation.
    assert k2.prefix.startswith(k1.prefix) and len(k2.prefix) > len(k1.prefix)
    assert k1.session_id == k2.session_id and k1.session_id is not None
    # A new system message in a later turn changes nothing before it.
    three = copy.deepcopy(two)
    three["messages"].append({"role": "system", "content": "reminder"})
    assert parse_request("messages", three, {}).prefix.startswith(k2.prefix)


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat", [], "body"),
        ("chat", {"messages": [{"role": "user", "content": "x"}]}, "model"),
        ("chat", {"model": "", "messages": []}, "model"),
        ("chat", {"model": 3, "messages": []}, "model"),
        ("chat", {"model": "m"}, "messages"),
        ("chat", {"model": "m", "messages": "hi"}, "messages"),
        ("chat", {"model": "m", "messages": []}, "messages"),
        ("chat", {"model": "m", "messages": ["hi"]}, "messages[0]"),
        ("chat", {"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0]"),
        ("chat", {"model": "m", "messages": USER_X, "tools": {}}, "tools"),
        ("chat", {"model": "m", "messages": USER_X, "max_tokens": -1}, "max_tokens"),
        ("chat", {"model": "m", "messages": USER_X, "max_tokens": "9"}, "max_tokens"),
        ("chat", {"model": "m", "messages": USER_X, "cache_salt": 1}, "cache_salt"),
        ("messages", {"model": "c", "messages": [{"role": "user", "content": {"a": 1}}]},
         "messages[0].content"),
        ("completions", {"model": "m"}, "prompt"),
        ("completions", {"model": "m", "prompt": 12}, "prompt"),
        ("completions", {"model": "m", "prompt": [1, -2]}, "prompt"),
        ("completions", {"model": "m", "prompt": []}, "prompt"),
        ("responses", {"model": "m", "input": 3}, "input"),
        ("responses", {"model": "m", "instructions": ["x"]}, "instructions"),
        ("embeddings", {"model": "e"}, "input"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(route: str, body: Any, param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_request(route, body, {})
    assert err.value.status == 400 and err.value.param == param and err.value.message


def test_unknown_route_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        parse_request("images", {"model": "m"}, {})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "model", "messages", "prompt", "input",
                         "tools", "system", "metadata", "user_id", "tool_calls", "function"]),
        inner, max_size=5),
    max_leaves=25,
)


@given(st.sampled_from(["chat", "completions", "messages", "count_tokens", "responses", "embeddings"]),
       json_values)
def test_any_json_body_parses_or_gets_a_400(route: str, body: Any) -> None:
    try:
        key = parse_request(route, body, {})
    except ApiError as err:
        assert err.status == 400
    else:
        assert isinstance(key.prefix, bytes) and key.est_prompt_tokens >= 0


@pytest.mark.parametrize(("extra", "answer"), [
    ({"max_tokens": 256, "ignore_eos": True}, 256),  # vLLM's ignore_eos: exactly max_tokens
    ({"max_tokens": 256, "min_tokens": 256}, 256),
    ({"max_completion_tokens": 64, "ignore_eos": True}, 64),
    ({"max_tokens": 256}, None),  # ends at its end-of-sequence token: unknown
    ({"max_tokens": 256, "min_tokens": 16}, None),
    ({"max_tokens": 256, "ignore_eos": False}, None),
    ({"ignore_eos": True}, None),  # no max_tokens: the engine's own limit, not the router's to tell
])
def test_an_answer_length_is_known_only_where_the_request_fixes_it(extra: dict[str, Any],
                                                                   answer: int | None) -> None:
    assert parse_request("chat", chat(*USER_X, **extra), {}).answer_tokens == answer
