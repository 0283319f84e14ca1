"""Model-name resolution: exact aliases, served names, globs in order, the default model."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.api.errors import ApiError
from kvroute.api.model_aliases import AliasError, ModelAliases, body_for, is_glob, parse_alias


def served(*names: str):
    return lambda name: name in names


def test_exact_names_win_over_globs_whatever_their_order() -> None:
    aliases = ModelAliases([("claude-*", "qwen3-4b"), ("claude-haiku-4-5", "qwen3-0.6b")])
    assert aliases.resolve("claude-haiku-4-5", served()) == "qwen3-0.6b"
    assert aliases.resolve("claude-opus-4-1", served()) == "qwen3-4b"


def test_the_first_matching_glob_in_the_order_given() -> None:
    aliases = ModelAliases({"claude-haiku-*": "small", "claude-*": "big", "*": "other"})
    assert aliases.resolve("claude-haiku-4-5-20251001", served()) == "small"
    assert aliases.resolve("claude-sonnet-4-5", served()) == "big"
    assert aliases.resolve("gpt-4o", served()) == "other"
    reordered = ModelAliases({"claude-*": "big", "claude-haiku-*": "small"})
    assert reordered.resolve("claude-haiku-4-5", served()) == "big"


def test_a_served_name_is_never_taken_by_a_glob_but_is_by_an_exact_alias() -> None:
    aliases = ModelAliases({"*": "qwen3-4b", "llama-3": "qwen3-8b"}, default_model="qwen3-4b")
    fleet = served("qwen3-4b", "qwen3-8b", "mistral", "llama-3")
    assert aliases.resolve("mistral", fleet) == "mistral"
    assert aliases.resolve("qwen3-8b", fleet) == "qwen3-8b"
    assert aliases.resolve("llama-3", fleet) == "qwen3-8b"
    assert aliases.resolve("claude-x", fleet) == "qwen3-4b"


def test_the_default_model_takes_what_nothing_else_maps_and_no_rule_leaves_the_name() -> None:
    with_default = ModelAliases({"gpt-*": "qwen3-8b"}, default_model="qwen3-4b")
    assert with_default.resolve("gpt-4o", served("qwen3-4b")) == "qwen3-8b"
    assert with_default.resolve("claude-opus-4-1", served("qwen3-4b")) == "qwen3-4b"
    assert with_default.active
    none = ModelAliases()
    assert not none.active
    assert none.resolve("claude-opus-4-1", served("qwen3-4b")) == "claude-opus-4-1"


def test_globs_are_case_sensitive_fnmatch_patterns() -> None:
    aliases = ModelAliases({"claude-?-[0-9]*": "a", "Claude*": "b"})
    assert aliases.resolve("claude-x-42", served()) == "a"
    assert aliases.resolve("claude-xy-42", served()) == "claude-xy-42"
    assert aliases.resolve("claude", served()) == "claude"
    assert aliases.resolve("Claude 3", served()) == "b"


def test_targets_are_not_resolved_again() -> None:
    aliases = ModelAliases({"a": "b", "b": "c"})
    assert aliases.resolve("a", served()) == "b"


def test_listing_keeps_the_order_and_separates_exact_names_from_globs() -> None:
    aliases = ModelAliases([("claude-*", "m"), ("gpt-4o", "m"), ("o?", "n"), ("fast", "n")])
    assert list(aliases.exact.items()) == [("gpt-4o", "m"), ("fast", "n")]
    assert aliases.globs == (("claude-*", "m"), ("o?", "n"))
    assert [p for p, _ in aliases.patterns] == ["claude-*", "gpt-4o", "o?", "fast"]
    assert is_glob("a[bc]") and is_glob("a?") and not is_glob("org/model:tag")


def test_parse_alias_and_bad_aliases_are_named() -> None:
    assert parse_alias(" claude-* = qwen3-4b ") == ("claude-*", "qwen3-4b")
    assert parse_alias("x=org/m=v2") == ("x", "org/m=v2")
    for bad in ("claude-*", "=qwen3-4b", "claude-*=", ""):
        with pytest.raises(AliasError, match="PATTERN=MODEL"):
            parse_alias(bad)
    with pytest.raises(AliasError, match="must be a model name, not a pattern"):
        ModelAliases({"claude-*": "qwen-*"})
    with pytest.raises(AliasError, match="non-empty"):
        ModelAliases({"": "qwen3-4b"})
    with pytest.raises(AliasError, match="must name a model"):
        ModelAliases({"a": 3})  # type: ignore[dict-item]
    with pytest.raises(AliasError, match="default_model"):
        ModelAliases(default_model=" ")


def test_the_memo_of_glob_results_is_bounded() -> None:
    aliases = ModelAliases({"claude-*": "m"})
    for i in range(10_000):
        assert aliases.resolve(f"claude-{i}", served()) == "m"
        assert aliases.resolve(f"gpt-{i}", served()) == f"gpt-{i}"
    assert len(aliases._memo) <= 4096


@given(st.text(min_size=1, max_size=30), st.lists(st.sampled_from(["a*", "*b", "a?c", "[ab]*", "x"]),
                                                   max_size=5))
def test_resolution_is_what_fnmatch_says_in_order(name: str, patterns: list[str]) -> None:
    import fnmatch

    pairs = [(p, f"m{i}") for i, p in enumerate(patterns)]
    aliases = ModelAliases(pairs)
    rules = dict(pairs)  # a pattern given twice: its first place, its last model
    if name in rules and not is_glob(name):
        expected = rules[name]
    else:
        expected = next((m for p, m in rules.items() if is_glob(p) and fnmatch.fnmatchcase(name, p)), name)
    assert aliases.resolve(name, served()) == expected


# --- the body a worker gets -----------------------------------------------------------------------

def _sent(raw: bytes, target: str = "qwen3-4b") -> bytes:
    return body_for(raw, orjson.loads(raw), target)


def test_the_model_member_is_spliced_where_it_is_provably_the_top_level_one() -> None:
    claude_code = b'{"model":"claude-opus-4-1","messages":[{"role":"user","content":"hi"}],"stream":true}'
    assert _sent(claude_code) == claude_code.replace(b"claude-opus-4-1", b"qwen3-4b")
    python_sdk = b'{"max_tokens":5,"messages":[{"role":"user","content":"x"}],"model":"claude-opus-4-1"}'
    assert _sent(python_sdk) == python_sdk.replace(b"claude-opus-4-1", b"qwen3-4b")
    alone = b'{"model":"a\\"b"}'
    assert _sent(alone, 'q"1') == b'{"model":"q\\"1"}'
    # The same member nested further in (a tool's input in the history) is left as it is.
    nested = (b'{"model":"m","messages":[{"role":"assistant",'
              b'"content":[{"type":"tool_use","input":{"model":"m"}}]}]}')
    assert _sent(nested) == b'{"model":"qwen3-4b"' + nested[len(b'{"model":"m"'):]
    assert orjson.loads(_sent(b'{"model":"m","a":{"model":"m"}}')) == {"model": "qwen3-4b",
                                                                       "a": {"model": "m"}}


@pytest.mark.parametrize("raw", [
    # a duplicate top-level key (orjson keeps the last)
    b'{"model":"x","stream":false,"model":"m"}',
    # in the middle, spaced, escaped, trailing whitespace
    b'{"stream":false,"model":"m","max_tokens":3}',
    b'{"model": "m", "max_tokens": 3}',
    b'{"model":"\\u006d","max_tokens":3}',
    b'{"max_tokens":3,"model":"m"}\n',
    # a string that merely contains the member's bytes, escaped
    b'{"content":"{\\"model\\":\\"m\\"}","model":"m"}',
])
def test_elsewhere_the_body_is_re_encoded_with_only_the_top_level_model_changed(raw: bytes) -> None:
    sent = _sent(raw)
    assert orjson.loads(sent) == {**orjson.loads(raw), "model": "qwen3-4b"}


@given(st.dictionaries(st.text(max_size=8).filter(lambda k: k != "model"),
                       st.recursive(st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=10),
                                    lambda inner: st.lists(inner, max_size=3)
                                    | st.dictionaries(st.sampled_from(["model", "a"]), inner, max_size=3),
                                    max_leaves=8), max_size=4),
       st.integers(0, 4), st.sampled_from(["m", "claude-opus-4-1", 'q"1', "é"]))
def test_the_worker_always_gets_the_same_document_with_the_target_model(
        rest: dict[str, object], position: int, asked: str) -> None:
    items = list(rest.items())
    items.insert(min(position, len(items)), ("model", asked))
    raw = orjson.dumps(dict(items))
    assert orjson.loads(_sent(raw, "target")) == {**dict(items), "model": "target"}


def test_a_body_nested_deeper_than_orjson_writes_is_a_400() -> None:
    raw = b'{"metadata":' + b"[" * 300 + b"]" * 300 + b',"model":"m","stream":false}'
    with pytest.raises(ApiError, match="nested more than 254 levels"):
        _sent(raw)
