"""Tokenizing a chat request in the router, the way vLLM does, from the model's own files.

Exact mode (routing/exact_index.py) needs a request's token ids as the engine computes them, chat
template included.  ``server/engine_tokens.py`` asks an engine's ``/tokenize`` (a round trip per
request); with the per-model setting ``tokenizer`` (a path to the model's folder) it asks this
module instead: HF ``tokenizers`` for the ids and ``jinja2`` for the chat template, rendered with
what transformers' ``apply_chat_template`` gives a template (``raise_exception``, ``strftime_now``,
its ``tojson``, the special tokens by name, ``{% generation %}``), over the messages as vLLM's
renderer hands them over.  Both are the optional extra ``kvroute[tokenizer]``.

What this module cannot vouch for it declines (``render`` answers None) and the request goes to
the engine's ``/tokenize`` as before: media or other non-text content parts, tool calls vLLM
refuses (not of type ``function``, without an id, ``arguments`` not a string), a request's own
``chat_template``, ``continue_final_message``.  Tool calls and tool results are rendered as vLLM
0.32 hands them to the template (``vllm/renderers/chat_utils.py``: ``_parse_chat_message_content``
and ``_postprocess_messages``): each call's ``arguments`` string decoded into a dict (``{}`` where it
is empty, not JSON or not an object), a null ``content`` as no text, ``tool_call_id`` on tool
messages, and the request's ``tools`` as ``ChatCompletionToolsParam.model_dump()``.

A conversation's next turn encodes only its tail: the template is rendered whole (a template is a
program; only it knows what a turn adds), then the text is compared with the previous turn's
rendering, and the tokens before the last special token both renderings share are kept.  That cut
is safe because ``tokenizers`` splits the text at its special tokens before anything else, so the
tokens before one never depend on the text after it.

A new conversation takes the same cut from another's first turn where both start alike (a shared
system prompt, each with its own question: :class:`SharedHeads`), so that a long system prompt is
encoded once, not once per conversation.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from itertools import compress
from pathlib import Path
from typing import Any

from kvroute.api.anthropic_chat import AnthropicConversionError, anthropic_to_chat
from kvroute.routing.token_chains import Rendering

# vLLM drops Claude Code's attribution line from system text (vllm/renderers/chat_utils.py); a
# system message that starts with it is left to the engine.
_BILLING_HEADER = "x-anthropic-billing-header"

# A template that loops over a message's content takes it as a list of parts (vLLM's "openai"
# content format); others get the text parts joined by newlines (its "string" format).  vLLM reads
# this off the template's syntax tree; these are the loops it finds.
_CONTENT_LOOP = re.compile(
    r"\{%-?\s*for\s+\w+\s+in\s+(?:content\b|\w+(?:\.content\b|\[\s*['\"]content['\"]\s*\]))")

# What transformers' special_tokens_map names (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# A head shorter than this is not kept for other conversations: encoding it costs less than
# looking it up.
_MIN_HEAD_CHARS = 512
# The first special tokens of a rendering whose heads are kept: a system prompt ends within them
# in every chat template (a bos token, the system turn's opening and closing tokens, the next
# turn's opening one).
_HEADS_PER_RENDERING = 4


class SharedHeads:
    """The heads of recent first turns' renderings, up to one of their first special tokens, by
    the text before it: a new conversation that starts with the same text keeps its tokens.
    Bounded by ``max_chars`` of kept text (each head's ids weigh about twice as much again); the
    least recently used go first.  A head is found by the hash of the text it ends at, so a
    found one is only a candidate: ``shared_cut`` decides what of it the new text shares."""

    def __init__(self, special: Sequence[str], max_chars: int = 4_000_000) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self._heads: OrderedDict[int, tuple[array[int], Rendering]] = OrderedDict()
        # Longest first, so that a special token that starts with another is found whole.
        alternatives = sorted({t for t in special if t}, key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def __len__(self) -> int:
        return len(self._heads)

    def find(self, text: str) -> tuple[array[int], Rendering] | None:
        """The longest kept head that ``text``'s own first special tokens may end, or None."""
        if self._special is None or not self._heads:
            return None
        # The same first special tokens ``add`` keeps heads at, so no lookup can miss by design.
        ends = []
        for n, match in enumerate(self._special.finditer(text), 1):
            if match.end() >= _MIN_HEAD_CHARS:
                ends.append(match.end())
            if n == _HEADS_PER_RENDERING:
                break
        for end in reversed(ends):
            key = hash(text[:end])
            found = self._heads.get(key)
            if found is not None:
                self._heads.move_to_end(key)
                return found
        return None

    def add(self, ids: array[int], rendering: Rendering) -> None:
        """Keep ``rendering``'s heads (and their ids) up to its first special tokens."""
        text, cuts = rendering.text, rendering.cuts
        heads = self._heads
        for c in range(min(_HEADS_PER_RENDERING, len(cuts) // 3)):
            end = cuts[3 * c + 1]
            if end < _MIN_HEAD_CHARS:
                continue
            key = hash(text[:end])
            if key in heads:  # the same head, kept from an earlier first turn
                heads.move_to_end(key)
                continue
            heads[key] = (ids[:cuts[3 * c + 2]], Rendering(text[:end], cuts[:3 * c + 3]))
            self.chars += end
        while heads and self.chars > self.max_chars:
            self.chars -= len(heads.popitem(last=False)[1][1].text)


def merges_inline_system(template: str | None) -> bool:
    """Whether vLLM 0.32 merges an Anthropic request's inline system messages into its leading
    system prompt for this chat template: where the template fails on [system, user, system,
    user] in a bare sandbox (``AnthropicServingMessages._detect_merge_inline_system``; no
    ``raise_exception`` or other helpers there, so a template that calls one fails too)."""
    if not template:
        return True
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    turns = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]
    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.from_string(template).render(messages=turns, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


class TemplateError(ValueError):
    """The model folder's tokenizer or chat template cannot be used; the message says why."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as its text or as an AddedToken's fields.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str:
    """The folder's default chat template: chat_template.jinja where present (transformers reads
    it over the config's), else tokenizer_config.json's (a list of named ones: "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if not isinstance(template, str):
        raise TemplateError(f"{folder}: no chat template (tokenizer_config.json's chat_template or "
                            "chat_template.jinja)")
    return template


def _compile(template: str) -> Any:
    """The template compiled once, in the environment transformers renders chat templates in."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        # ``{% generation %}...{% endgeneration %}`` marks the assistant's tokens for training
        # masks; rendering keeps its body as it is.
        tags = {"generation"}  # noqa: RUF012  (jinja's Extension declares it so)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # transformers' own: no HTML escaping, unlike jinja's.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template: {exc}") from None


def _tool(tool: Any) -> dict[str, Any] | None:
    """A request's tool as vLLM hands it to the template (``ChatCompletionToolsParam.model_dump``:
    every field, unset ones as None, ``strict`` and ``defer_loading`` only when set)."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        return None
    fn = tool.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or set(tool) - {"type", "function"}:
        return None
    known = ("name", "description", "parameters", "strict", "defer_loading")
    if set(fn) - set(known):
        return None
    out: dict[str, Any] = {k: fn.get(k) for k in known[:3]}
    out.update({k: fn[k] for k in known[3:] if fn.get(k) is not None})
    return {"type": "function", "function": out}


def _arguments(text: str) -> dict[str, Any]:
    """A tool call's ``arguments`` as vLLM's ``_postprocess_messages`` hands them to the template:
    the JSON object they spell, else (empty, not JSON, not an object) an empty dict, which vLLM
    substitutes so that a bad call in the history does not fail every later turn."""
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except ValueError:  # json.JSONDecodeError, as vLLM catches
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    """An assistant message's ``tool_calls`` as vLLM hands them to the template, or None where its
    request model refuses them (or where they are not function calls, which its
    ``_postprocess_messages`` refuses).  Pydantic's validation rebuilds each call with the fields
    its TypedDicts declare first, in their order (``id``, ``function``: ``arguments``, ``name``;
    ``type``), and any others after them, as the client sent them."""
    if not isinstance(calls, list):
        return None
    out = []
    for call in calls:
        if not isinstance(call, Mapping) or call.get("type") != "function" \
                or not isinstance(call.get("id"), str):
            return None
        fn = call.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            return None
        function = {"arguments": _arguments(fn["arguments"]), "name": fn["name"],
                    **{k: v for k, v in fn.items() if k not in ("arguments", "name")}}
        out.append({"id": call["id"], "function": function, "type": "function",
                    **{k: v for k, v in call.items() if k not in ("id", "function", "type")}})
    return out


class ChatTokenizer:
    """A model's tokenizer and chat template, loaded from its folder."""

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(folder)
        try:
            self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            config_file = path / "tokenizer_config.json"
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        except Exception as exc:  # OSError, bad JSON, and tokenizers' own plain Exception
            raise TemplateError(f"{path}: {exc}") from None
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        source = _chat_template(path, config)
        self._template = _compile(source)
        self.merge_inline_system = merges_inline_system(source)
        self._disabled_effort: str | None = None
        self._wrap_parts = _CONTENT_LOOP.search(source) is not None
        self._uses_tools = "tools" in source
        named = config.get("chat_template")
        self._tool_use_template = not (path / "chat_template.jinja").is_file() and isinstance(named, list) \
            and any(isinstance(t, Mapping) and t.get("name") == "tool_use" for t in named)
        self._names = {name: text for name in _NAMED_TOKENS
                       if (text := _token_text(config.get(name))) is not None}
        added = self._tokenizer.get_added_tokens_decoder()
        self._special = frozenset(i for i, t in added.items() if t.special)
        self.heads = SharedHeads([t.content for t in added.values() if t.special])

    def messages(self, doc: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        """The request's messages as vLLM's renderer hands them to the template, or None where
        they hold what this module leaves to the engine."""
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        out: list[dict[str, Any]] = []
        for message in messages:
            if not isinstance(message, Mapping):
                return None
            role = message.get("role")
            if not isinstance(role, str) or role == "developer" or message.get("reasoning") is not None:
                return None
            calls = message.get("tool_calls")
            if calls is not None and role != "assistant":
                return None
            content = message.get("content")
            # An assistant's tool-call turn may come without text: vLLM takes it as no parts.
            if content is None and role != "assistant":
                return None
            content = self._content(content, self._wrap_parts, role)
            if content is None or (role == "system" and isinstance(content, str)
                                   and content.startswith(_BILLING_HEADER)):
                return None
            item: dict[str, Any] = {"role": role, "content": content}
            if calls:  # an empty list is dropped, so the template takes the plain assistant path
                item["tool_calls"] = _tool_calls(calls)
                if item["tool_calls"] is None:
                    return None
            if role == "tool" and "tool_call_id" in message:
                call_id = message["tool_call_id"]
                if call_id is not None and not isinstance(call_id, str):
                    return None
                item["tool_call_id"] = call_id
            if isinstance(message.get("name"), str):
                item["name"] = message["name"]
            out.append(item)
        return out

    def disabled_thinking_effort(self) -> str:
        """The effort vLLM 0.32 maps an Anthropic ``thinking: {"type": "disabled"}`` to for this
        template: "low" where "none" fails to render or renders as some effort does, else "none"
        (``AnthropicServingMessages._probe_disabled_thinking_effort``); probed once."""
        if self._disabled_effort is None:
            def probe(effort: str) -> str | None:
                return self.render({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {
                    "reasoning_effort": effort, "enable_thinking": effort != "none"}})
            none = probe("none")
            self._disabled_effort = "low" if none is None or any(
                probe(e) == none for e in ("low", "medium", "high", "xhigh", "max")) else "none"
        return self._disabled_effort

    def anthropic_chat(self, doc: Mapping[str, Any]) -> dict[str, Any] | None:
        """An Anthropic messages request as the chat request vLLM renders it as with this
        template (api/anthropic_chat.py), or None where vLLM would refuse it or name a tool call
        by its own clock."""
        thinking = doc.get("thinking")
        disabled = isinstance(thinking, Mapping) and thinking.get("type") == "disabled"
        effort = self.disabled_thinking_effort() if disabled else "none"
        try:
            return anthropic_to_chat(doc, merge_inline_system=self.merge_inline_system,
                                     disabled_thinking_effort=effort)
        except AnthropicConversionError:
            return None

    @staticmethod
    def _content(content: Any, wrap: bool, role: str) -> str | list[dict[str, str]] | None:
        """A message's text content as vLLM's ``_parse_chat_message_content`` passes it on: parts
        for a template that loops over them ("openai" format), else the non-empty texts joined by
        newlines ("string" format); a tool's answer as text either way (its parts' texts joined,
        empty ones too where they were kept as parts).  None: not text only, or parts with other
        fields for a template that gets parts."""
        if content is None:
            texts: list[str] = []
        elif isinstance(content, str):
            texts = [content]
        elif isinstance(content, list) and content and all(
                isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            texts = [p["text"] for p in content]
        else:
            return None
        if not wrap:
            return "\n".join(t for t in texts if t)
        if role == "tool":
            return "\n".join(texts)
        # vLLM hands such a template a part's other fields too (cache_control, ...), as its
        # validation rebuilds them: not reproduced here.
        if isinstance(content, list) and any(len(p) > 2 for p in content):
            return None
        return [{"type": "text", "text": t} for t in texts]

    def render(self, doc: Mapping[str, Any]) -> str | None:
        """The prompt text vLLM renders a chat request into, or None where this module leaves
        the request to the engine (the module docstring says what)."""
        if "chat_template" in doc or doc.get("continue_final_message") or "documents" in doc:
            return None
        add_generation = doc.get("add_generation_prompt", True)
        kwargs = doc.get("chat_template_kwargs") or {}
        if not isinstance(add_generation, bool) or not isinstance(kwargs, Mapping) \
                or {"chat_template", "tokenize", "messages", "tools"} & set(kwargs):
            return None
        messages = self.messages(doc)
        if messages is None:
            return None
        tools = None
        raw = doc.get("tools")
        # vLLM refuses an empty list; a folder's "tool_use" template (transformers' pick where
        # tools are given) is not the one compiled here.
        if raw is not None and (raw == [] or self._tool_use_template):
            return None
        # A template that never names them renders the same with or without them.
        if self._uses_tools and raw is not None:
            tools = [_tool(t) for t in raw] if isinstance(raw, list) else [None]
            if any(t is None for t in tools):
                return None
        try:
            text: str = self._template.render(
                {**self._names, **kwargs, "messages": messages, "tools": tools, "documents": None,
                 "add_generation_prompt": add_generation})
        except Exception:  # the template refused the request: the engine answers it, with its reason
            return None
        return text

    def encode(self, text: str, add_special_tokens: bool = False) -> tuple[array[int], array[int]]:
        """``text``'s token ids and its cuts (``Rendering.cuts``: start, end, token index of each
        special token)."""
        enc = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        listed = enc.ids
        cuts = array("q")
        special = self._special
        # Offsets only of the special tokens (the whole list would cost a tuple per token), found
        # by a scan in C.
        for i in compress(range(len(listed)), map(special.__contains__, listed)):
            span = enc.token_to_chars(i)
            if span is not None:  # every token of a single text has its characters
                cuts.extend((span[0], span[1], i))
        return array("Q", listed), cuts

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def prompt_tokens(self, prompt: str) -> tuple[array[int], None, int]:
        """A completions prompt's token ids (with the special tokens the tokenizer adds, as vLLM's
        completions do by default); nothing is kept from another request."""
        return self.encode(prompt, add_special_tokens=True)[0], None, 0

    def tokens(self, doc: Mapping[str, Any], previous: tuple[Sequence[int], Rendering] | None
               ) -> tuple[array[int], Rendering | None, int] | None:
        """A chat request's token ids, its rendering and how many of the ids were kept from
        ``previous`` (the conversation's last turn: its ids and rendering; None: a new
        conversation, which looks for its head among other first turns'), or None where the
        request is left to the engine."""
        text = self.render(doc)
        if text is None:
            return None
        add_special = doc.get("add_special_tokens", False)
        if not isinstance(add_special, bool):
            return None
        first = previous is None
        if first and not add_special:
            previous = self.heads.find(text)
        cut = -1 if previous is None or add_special else shared_cut(previous[1], text)
        if previous is None or cut < 0:
            ids, cuts = self.encode(text, add_special)
            rendering = Rendering(text, cuts)
            if first and not add_special:
                self.heads.add(ids, rendering)
            return ids, rendering, 0
        old_ids, old = previous
        start, kept = old.cuts[3 * cut], old.cuts[3 * cut + 2]
        tail, tail_cuts = self.encode(text[start:])
        ids = array("Q", old_ids[:kept]) if not isinstance(old_ids, array) else old_ids[:kept]
        ids.extend(tail)
        cuts = old.cuts[:3 * cut]
        for i in range(0, len(tail_cuts), 3):
            cuts.extend((tail_cuts[i] + start, tail_cuts[i + 1] + start, tail_cuts[i + 2] + kept))
        rendering = Rendering(text, cuts)
        if first:
            self.heads.add(ids, rendering)
        return ids, rendering, kept


def shared_cut(previous: Rendering, text: str) -> int:
    """The last of ``previous``'s cuts (its index) whose special token ``text`` holds at the same
    place with the same text before it, or -1: the tokens before that cut are ``text``'s too.
    Binary search: a cut is shared only if every cut before it is."""
    cuts, old = previous.cuts, previous.text
    lo, hi = -1, len(cuts) // 3  # cut lo is shared (or none), cut hi is not (or past the last)
    if hi and text.startswith(old[:cuts[3 * hi - 2]]):
        return hi - 1  # the usual next turn: the whole previous rendering up to its last cut
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(old[:cuts[3 * mid + 1]]):
            lo = mid
        else:
            hi = mid
    return lo
