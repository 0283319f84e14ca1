"""The local tokenizer (api/local_tokens.py): the tail rule, table-driven, on a small real
tokenizer: whatever the next turn changes, its ids equal a whole re-encoding, and only what follows
the last shared special token is encoded again; the template's environment is transformers'."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from tiny_tokenizer import TOOL_TEMPLATE, write_tokenizer

from kvroute.api import tokenizer_settings
from kvroute.api.local_tokens import ChatTokenizer, TemplateError, merges_inline_system, shared_cut
from kvroute.router_settings import Settings, SettingsError
from kvroute.routing.token_chains import Rendering, TokenChains

SYSTEM = {"role": "system", "content": "You review pull requests for a storage engine; be terse."}
U1 = {"role": "user", "content": "What is the capital of France?"}
A1 = {"role": "assistant", "content": "Paris."}
U2 = {"role": "user", "content": "And of Italy? 12345"}
A2 = {"role": "assistant", "content": "Rome."}
U3 = {"role": "user", "content": "def route(request): return min(workers)"}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "find a <page> & more",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer(write_tokenizer(tmp_path_factory.mktemp("tok")))


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": list(messages), **extra}


# (previous turn, next turn, what the next turn keeps: "all" of the previous rendering up to its
# last special token, or "some" of it; every rendering starts with the bos token, so some is kept)
CASES = [
    ("a turn appended", chat(SYSTEM, U1), chat(SYSTEM, U1, A1, U2), "all"),
    ("two turns appended", chat(SYSTEM, U1, A1, U2), chat(SYSTEM, U1, A1, U2, A2, U3), "all"),
    ("the same request again", chat(SYSTEM, U1), chat(SYSTEM, U1), "all"),
    ("the last message edited", chat(SYSTEM, U1, A1, U2), chat(SYSTEM, U1, A1, U3), "some"),
    ("a reply regenerated (shorter)", chat(SYSTEM, U1, A1, U2), chat(SYSTEM, U1), "some"),
    ("an earlier message edited", chat(SYSTEM, U1, A1, U2), chat(SYSTEM, U3, A1, U2), "some"),
    ("the system prompt changed", chat(SYSTEM, U1), chat({**SYSTEM, "content": "Be kind."}, U1, A1, U2),
     "some"),  # the bos token before it is still shared
    ("tools added", chat(SYSTEM, U1), chat(SYSTEM, U1, A1, U2, tools=TOOLS), "some"),
    ("a message's text grows", chat(SYSTEM, U1),
     chat(SYSTEM, {**U1, "content": U1["content"] + " ok"}), "some"),
    # Text added right where a special token was: the words on either side merge differently.
    ("a word grows into the next turn",
     chat({**U2, "content": "And of Italy? 1234"}, add_generation_prompt=False),
     chat(U2, add_generation_prompt=False), "some"),
    ("no generation prompt, then one", chat(SYSTEM, U1, add_generation_prompt=False),
     chat(SYSTEM, U1, A1, U2), "all"),
]


@pytest.mark.parametrize(("name", "before", "after", "keeps"), CASES, ids=[c[0] for c in CASES])
def test_a_next_turn_encodes_only_its_tail_and_equals_a_whole_encoding(
        tok: ChatTokenizer, name: str, before: dict[str, Any], after: dict[str, Any], keeps: str) -> None:
    first = tok.tokens(before, None)
    assert first is not None
    ids, rendering, kept = first
    assert kept == 0
    got = tok.tokens(after, (ids, rendering))
    assert got is not None
    new_ids, new_rendering, kept = got
    text = tok.render(after)
    assert text is not None and new_rendering is not None and new_rendering.text == text
    whole, whole_cuts = tok.encode(text)
    assert list(new_ids) == list(whole), name
    assert list(new_rendering.cuts) == list(whole_cuts), name
    last_cut = rendering.cuts[-1]  # the previous rendering's last special token (the generation prompt)
    if keeps == "all":
        assert kept == last_cut
    else:
        assert 0 < kept < last_cut


def r(text: str, *cuts: tuple[int, int, int]) -> Rendering:
    return Rendering(text, array("q", [v for c in cuts for v in c]))


SHARED_CUT = [
    # (previous rendering, next text, the cut kept)
    (r("<s>ab<e>", (0, 3, 0), (5, 8, 2)), "<s>ab<e>cd", 1),
    (r("<s>ab<e>", (0, 3, 0), (5, 8, 2)), "<s>ab<e", 0),  # the last special token is not whole
    (r("<s>ab<e>", (0, 3, 0), (5, 8, 2)), "<s>ax<e>", 0),  # text before it differs
    (r("<s>ab<e>", (0, 3, 0), (5, 8, 2)), "x<s>ab<e>", -1),
    (r("abc"), "abc", -1),  # no special tokens: nothing can be kept
    (r("<s>a<s>b<s>c<s>", (0, 3, 0), (4, 7, 2), (8, 11, 4), (12, 15, 6)), "<s>a<s>b<s>X<s>", 2),
    (r("<s>a<s>b<s>c<s>", (0, 3, 0), (4, 7, 2), (8, 11, 4), (12, 15, 6)), "<s>a<s>", 1),
]


@pytest.mark.parametrize(("previous", "text", "cut"), SHARED_CUT)
def test_the_last_shared_cut(previous: Rendering, text: str, cut: int) -> None:
    assert shared_cut(previous, text) == cut


def test_the_template_gets_what_transformers_gives_it(tok: ChatTokenizer) -> None:
    text = tok.render(chat(U1, tools=TOOLS))
    assert text is not None
    # bos_token by name; tojson without HTML escaping, non-ASCII kept, tools in vLLM's shape.
    assert text.startswith("<|im_start|><|im_start|>system\nTools: [")
    assert '"description": "find a <page> & more"' in text
    # raise_exception: the template refuses; the engine is left to answer (with its reason).
    assert tok.render(chat({"role": "critic", "content": "x"})) is None


@pytest.mark.parametrize("doc", [
    chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}),
    # Tool calls vLLM's request model or its _postprocess_messages refuses.
    *(chat(U1, {**A1, "tool_calls": [call]}) for call in (
        {"id": "1", "type": "custom", "custom": {"name": "f", "input": "x"}},
        {"type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
        {"id": "1", "type": "function", "function": {"name": "f"}},
        {"id": 1, "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "1", "function": {"name": "f", "arguments": "{}"}})),
    chat({**U1, "tool_calls": [{"id": "1", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]}),
    chat({"role": "tool", "tool_call_id": 7, "content": "x"}),
    chat({"role": "user", "content": None}),
    chat(U1, tools=[]),
    chat(U1, chat_template="{{ messages }}"),
    chat(U1, A1, add_generation_prompt=False, continue_final_message=True),
    chat({"role": "developer", "content": "be terse"}, U1),
    chat({"role": "system", "content": "x-anthropic-billing-header: cch=1\nbe terse"}, U1),
    {"messages": []},
])
def test_what_it_cannot_vouch_for_is_left_to_the_engine(tok: ChatTokenizer, doc: dict[str, Any]) -> None:
    assert tok.tokens(doc, None) is None


def test_text_parts_are_joined_as_vllm_joins_them(tok: ChatTokenizer) -> None:
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]
    assert tok.render(chat({"role": "user", "content": parts})) == \
        tok.render(chat({"role": "user", "content": "What is\nthe capital?"}))


def test_a_template_that_loops_over_content_gets_parts(tmp_path: Path) -> None:
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for part in m['content'] %}"
                "[{{ part['text'] }}]{% endfor %}<|im_end|>\n{% endfor %}")
    tok = ChatTokenizer(write_tokenizer(tmp_path, template))
    assert tok.render(chat(U1, add_generation_prompt=False)) == \
        "<|im_start|>user\n[What is the capital of France?]<|im_end|>\n"
    # An assistant's tool-call turn without text: no parts.
    assert tok.render(chat({"role": "assistant", "content": None}, add_generation_prompt=False)) == \
        "<|im_start|>assistant\n<|im_end|>\n"
    # vLLM keeps a part's other fields (cache_control, ...) for such a template, after its own
    # validation: left to the engine.
    marked = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    assert tok.render(chat({"role": "user", "content": [marked]})) is None


def test_the_chains_carry_the_rendering_to_the_next_turn(tok: ChatTokenizer) -> None:
    chains = TokenChains()
    first = tok.tokens(chat(SYSTEM, U1), chains.previous(7))
    assert first is not None and first[2] == 0
    chains.hashes(7, first[0], 4, first[1])
    previous = chains.previous(7)
    assert previous is not None and previous[1] is first[1]
    second = tok.tokens(chat(SYSTEM, U1, A1, U2), previous)
    assert second is not None and second[2] > 0
    assert chains.previous(None) is None and chains.previous(8) is None


def test_a_folder_without_a_template_is_refused(tmp_path: Path) -> None:
    write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(TemplateError, match="chat template"):
        ChatTokenizer(tmp_path)


def test_the_setting_names_a_folder_and_needs_the_extra(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_tokenizer(tmp_path / "model")
    config = Settings(models={}, routing={"tokenizer": str(folder)}).routing_config()
    assert config.default.tokenizer == str(folder)
    with pytest.raises(SettingsError, match=r"no tokenizer\.json"):
        Settings(routing={"tokenizer": str(tmp_path)}).routing_config()
    monkeypatch.setattr(tokenizer_settings, "find_spec",
                        lambda name: None if name == "tokenizers" else object())
    missing = r"tokenizers is not installed: pip install 'kvroute\[tokenizer\]'"
    with pytest.raises(SettingsError, match=missing):
        Settings(routing={"tokenizer": str(folder)}).routing_config()


LONG_SYSTEM = {"role": "system", "content": "The storage engine keeps pages in a buffer pool. " * 30}
OTHER_SYSTEM = {"role": "system", "content": "You review pull requests for a storage engine. " * 30}
QUESTIONS = [{"role": "user", "content": q} for q in (
    "What is the capital of France?", "And of Italy? 12345", "def route(request): return min(workers)")]


@pytest.fixture
def fresh(tmp_path: Path) -> ChatTokenizer:
    """A tokenizer whose shared heads start empty."""
    return ChatTokenizer(write_tokenizer(tmp_path))


def whole(tok: ChatTokenizer, doc: dict[str, Any]) -> list[int]:
    text = tok.render(doc)
    assert text is not None
    return list(tok.encode(text)[0])


def test_new_conversations_with_one_system_prompt_encode_it_once(fresh: ChatTokenizer) -> None:
    first = fresh.tokens(chat(LONG_SYSTEM, QUESTIONS[0]), None)
    assert first is not None and first[2] == 0 and len(fresh.heads) > 0
    # Its cuts: the bos token, the system turn's opening token, its closing one.
    system_tokens = first[1].cuts[3 * 2 + 2] if first[1] is not None else 0
    for question in QUESTIONS[1:]:
        doc = chat(LONG_SYSTEM, question)
        got = fresh.tokens(doc, None)
        assert got is not None
        ids, rendering, kept = got
        assert list(ids) == whole(fresh, doc)
        assert rendering is not None and list(rendering.cuts) == list(fresh.encode(rendering.text)[1])
        assert kept >= system_tokens > 100  # the system prompt's tokens came from the first turn
    # Another system prompt shares nothing long enough to keep: encoded whole, and right.
    doc = chat(OTHER_SYSTEM, QUESTIONS[0])
    got = fresh.tokens(doc, None)
    assert got is not None and got[2] == 0 and list(got[0]) == whole(fresh, doc)


def test_short_heads_are_not_kept(fresh: ChatTokenizer) -> None:
    assert fresh.tokens(chat(SYSTEM, U1), None) is not None
    assert len(fresh.heads) == 0 and fresh.heads.chars == 0


def test_a_head_found_by_a_colliding_hash_is_checked_before_use(fresh: ChatTokenizer) -> None:
    # Every key of the kept heads made to point at another system prompt's heads: what ``find``
    # returns is only a candidate, and the text decides what of it is used.
    first = fresh.tokens(chat(OTHER_SYSTEM, QUESTIONS[0]), None)
    assert first is not None
    text = fresh.render(chat(LONG_SYSTEM, QUESTIONS[1]))
    assert text is not None
    wrong = next(iter(fresh.heads._heads.values()))
    for end in range(1, len(text) + 1):
        fresh.heads._heads[hash(text[:end])] = wrong
    doc = chat(LONG_SYSTEM, QUESTIONS[1])
    got = fresh.tokens(doc, None)
    assert got is not None and list(got[0]) == whole(fresh, doc)


def test_the_kept_heads_are_bounded_by_their_text(fresh: ChatTokenizer) -> None:
    fresh.heads.max_chars = 5_000
    for i in range(20):
        system = {"role": "system", "content": f"Group {i}: " + "the engine keeps pages. " * 40}
        doc = chat(system, QUESTIONS[i % 3])
        got = fresh.tokens(doc, None)
        assert got is not None and list(got[0]) == whole(fresh, doc)
        assert fresh.heads.chars <= fresh.heads.max_chars
    assert fresh.heads.chars == sum(len(r.text) for _, r in fresh.heads._heads.values())
    # The most recent group's heads are the ones kept.
    again = fresh.tokens(chat({"role": "system", "content": "Group 19: " + "the engine keeps pages. " * 40},
                              QUESTIONS[0]), None)
    assert again is not None and again[2] > 0


# Qwen's guard: a system message anywhere but first is refused.
SYSTEM_FIRST = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}")


def test_the_inline_system_probe_is_vllms() -> None:
    from tiny_tokenizer import TEMPLATE

    assert not merges_inline_system(TEMPLATE)
    assert merges_inline_system(SYSTEM_FIRST) and merges_inline_system(None) and merges_inline_system("")
    # vLLM probes in a bare sandbox: what transformers adds is not there, so a template that calls
    # it, or uses its {% generation %} tag, is judged to require the system prompt first.
    assert merges_inline_system("{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert merges_inline_system("{% for m in messages %}{% generation %}x{% endgeneration %}{% endfor %}")


def test_an_anthropic_request_is_converted_for_the_folders_template(tmp_path: Path) -> None:
    body = {"system": "Lead.", "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Reminder."},
                         {"role": "user", "content": "Again"}]}
    accepting = ChatTokenizer(write_tokenizer(tmp_path / "a"))
    chat = accepting.anthropic_chat(body)
    assert chat is not None and [m["role"] for m in chat["messages"]] == ["system", "user", "system", "user"]
    # The template ignores the effort: vLLM maps disabled thinking to "low".
    assert chat["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}
    merging = ChatTokenizer(write_tokenizer(tmp_path / "b", SYSTEM_FIRST))
    chat = merging.anthropic_chat(body)
    assert chat is not None and chat["messages"][0] == {"role": "system", "content": "Lead.Reminder."}
    got = merging.tokens(chat, None)
    assert got is not None and merging.render(chat) == (
        "<|im_start|>system\nLead.Reminder.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n")
    thinking = ChatTokenizer(write_tokenizer(tmp_path / "c", THINKING))
    assert thinking.disabled_thinking_effort() == "none"
    rendered = thinking.render(thinking.anthropic_chat(body) or {})
    assert rendered is not None and rendered.endswith("<think></think>")
    assert accepting.anthropic_chat({"messages": [{"role": "wizard", "content": "x"}]}) is None


# --------------------------------------------------------------------------- tool calls and results

PATH = {"type": "object", "properties": {"path": {"type": "string"}}}
READ = {"type": "function",
        "function": {"name": "read_file", "description": "Read a file.", "parameters": PATH}}


def call(call_id: str, arguments: str, name: str = "read_file") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_TURN = [
    {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Read pool.c"},
    {"role": "assistant", "content": None, "tool_calls": [call("c1", '{"path": "pool.c", "lines": [1, 2]}')]},
    {"role": "tool", "tool_call_id": "c1", "content": "int x;"}]


@pytest.fixture(scope="module")
def tool_tok(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer(write_tokenizer(tmp_path_factory.mktemp("tools"), TOOL_TEMPLATE))


def test_tool_calls_and_results_reach_the_template_as_vllm_hands_them_over(tool_tok: ChatTokenizer) -> None:
    text = tool_tok.render(chat(*TOOL_TURN, tools=[READ]))
    # Checked by hand: the arguments a dict (through tojson, not the client's string), the null
    # content of the call's turn no text, the result under its call's id, the tools as vLLM dumps them.
    assert text == (
        '<|im_start|>system\nBe terse.\n\n# Tools\n<tools>\n{"type": "function", "function": {"name": '
        '"read_file", "description": "Read a file.", "parameters": {"type": "object", "properties": '
        '{"path": {"type": "string"}}}}}\n</tools><|im_end|>\n'
        '<|im_start|>user\nRead pool.c<|im_end|>\n'
        '<|im_start|>assistant\n<tool_call id="c1">\n{"name": "read_file", "arguments": {"path": "pool.c", '
        '"lines": [1, 2]}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response id="c1">\nint x;\n</tool_response><|im_end|>\n'
        '<|im_start|>assistant\n')
    got = tool_tok.tokens(chat(*TOOL_TURN, tools=[READ]), None)
    assert got is not None and list(got[0]) == list(tool_tok.encode(text)[0])


@pytest.mark.parametrize(("arguments", "rendered"), [
    ('{"b": 1, "a": "ü"}', '{"b": 1, "a": "ü"}'),  # the client's key order, non-ASCII as it is
    ("", "{}"),                  # empty: vLLM substitutes an empty object
    ("not json {", "{}"),        # not JSON: the same (a bad call must not fail every later turn)
    ("[1, 2]", "{}"),            # JSON, but not an object
    ("null", "{}"),
])
def test_a_calls_arguments_are_decoded_as_vllm_decodes_them(tool_tok: ChatTokenizer, arguments: str,
                                                            rendered: str) -> None:
    messages = [*TOOL_TURN[:2], {"role": "assistant", "tool_calls": [call("c9", arguments)]}]
    text = tool_tok.render(chat(*messages))
    assert text is not None and f'"arguments": {rendered}}}' in text


def test_a_calls_other_fields_come_after_the_declared_ones(tmp_path: Path) -> None:
    # Pydantic rebuilds a call with its TypedDict's fields first, in their order, then the rest.
    tok = ChatTokenizer(write_tokenizer(tmp_path, "{{ (messages[1].tool_calls or []) | tojson }}"))
    odd = {"index": 0, "function": {"name": "f", "x": 1, "arguments": "{}"}, "type": "function", "id": "c1"}
    assert tok.render(chat(U1, {"role": "assistant", "tool_calls": [odd]})) == (
        '[{"id": "c1", "function": {"arguments": {}, "name": "f", "x": 1}, "type": "function", "index": 0}]')


def test_an_empty_list_of_calls_is_a_plain_assistant_turn(tool_tok: ChatTokenizer) -> None:
    assert tool_tok.render(chat(U1, {**A1, "tool_calls": []}, U2)) == tool_tok.render(chat(U1, A1, U2))
    assert tool_tok.render(chat(U1, {**A1, "tool_calls": None}, U2)) == tool_tok.render(chat(U1, A1, U2))


def test_tool_choice_does_not_change_the_rendering(tool_tok: ChatTokenizer) -> None:
    # vLLM hands the tools to the template whatever tool_choice says (unless the engine runs with
    # --exclude-tools-when-tool-choice-none, which the router cannot see and /tokenize ignores).
    plain = tool_tok.render(chat(*TOOL_TURN, tools=[READ]))
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "read_file"}}):
        assert tool_tok.render(chat(*TOOL_TURN, tools=[READ], tool_choice=choice)) == plain


def test_a_folders_tool_use_template_is_left_to_the_engine(tmp_path: Path) -> None:
    folder = write_tokenizer(tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "{{ tools | tojson }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = ChatTokenizer(folder)
    assert tok.render(chat(U1)) == U1["content"]
    assert tok.render(chat(U1, tools=[READ])) is None  # transformers would pick "tool_use"


TOOL_CASES = [
    ("a call's result appended", chat(*TOOL_TURN[:3], tools=[READ]), chat(*TOOL_TURN, tools=[READ])),
    ("the answer after a result", chat(*TOOL_TURN, tools=[READ]),
     chat(*TOOL_TURN, {"role": "assistant", "content": "It declares x."}, U2, tools=[READ])),
    ("two calls, two results", chat(*TOOL_TURN, tools=[READ]),
     chat(*TOOL_TURN, {"role": "assistant", "content": "And these:",
                       "tool_calls": [call("c2", '{"path": "a.c"}'), call("c3", '{"path": "b.c"}')]},
          {"role": "tool", "tool_call_id": "c2", "content": "a"},
          {"role": "tool", "tool_call_id": "c3", "content": [{"type": "text", "text": "b"}]}, tools=[READ])),
]


@pytest.mark.parametrize(("name", "before", "after"), TOOL_CASES, ids=[c[0] for c in TOOL_CASES])
def test_a_tool_turn_encodes_only_its_tail(tool_tok: ChatTokenizer, name: str, before: dict[str, Any],
                                           after: dict[str, Any]) -> None:
    first = tool_tok.tokens(before, None)
    assert first is not None
    got = tool_tok.tokens(after, (first[0], first[1]))
    assert got is not None
    ids, _, kept = got
    text = tool_tok.render(after)
    assert text is not None and list(ids) == list(tool_tok.encode(text)[0]), name
    assert first[1] is not None and kept == first[1].cuts[-1], name  # everything up to the generation prompt


def test_an_anthropic_tool_conversation_renders_as_its_chat_request(tmp_path: Path) -> None:
    tok = ChatTokenizer(write_tokenizer(tmp_path, TOOL_TEMPLATE))
    body = {"system": "Be terse.", "tools": [{"name": "read_file", "description": "Read a file.",
                                              "input_schema": {"properties": {"path": {"type": "string"}}}}],
            "messages": [{"role": "user", "content": "Read pool.c"},
                         {"role": "assistant", "content": [
                             {"type": "text", "text": "Reading."},
                             {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                              "input": {"path": "pool.c"}}]},
                         {"role": "user", "content": [
                             {"type": "tool_result", "tool_use_id": "toolu_1",
                              "content": [{"type": "text", "text": "int x;"}]},
                             {"type": "text", "text": "Safe?"}]}]}
    converted = tok.anthropic_chat(body)
    assert converted is not None
    text = tok.render(converted)
    assert text is not None and text.endswith(
        '<|im_start|>assistant\nReading.\n<tool_call id="toolu_1">\n{"name": "read_file", "arguments": '
        '{"path": "pool.c"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response id="toolu_1">\nint x;\n</tool_response><|im_end|>\n'
        '<|im_start|>user\nSafe?<|im_end|>\n<|im_start|>assistant\n')
    assert '"parameters": {"properties": {"path": {"type": "string"}}, "type": "object"}' in text
