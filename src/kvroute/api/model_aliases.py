"""Model names a client asks for -> the model a worker serves: aliases and the default model.

Clients ask for models by their own names: Claude Code for ``claude-opus-…``, ``claude-sonnet-…``
and, for its background tasks, ``claude-haiku-…``, whatever the base URL serves.  ``ModelAliases``
maps such a name to a served model, in this order:

1. an exact alias (a pattern without glob characters) for the name, whatever the fleet serves;
2. a name some worker lists as served stays as it is (a catch-all glob such as ``*`` must not take
   another served model's requests);
3. the first glob pattern (``fnmatch``: ``*``, ``?``, ``[seq]``, case-sensitive) matching it, in
   the order given;
4. ``default_model``, when set;
5. otherwise the name stays, and the request gets the API's 404 ``model_not_found``.

A target is not resolved again (no chains).  Resolution is pure: what the fleet serves comes in as
a predicate, asked only when no exact alias applies.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from kvroute.api.errors import ApiError
from kvroute.api.requests import nesting_error

_GLOB_CHARS = frozenset("*?[")
# Names are chosen by clients: the memo of glob results is bounded (cleared when full).
_MEMO_MAX = 4096


class AliasError(ValueError):
    """An alias that cannot work; the message names it."""


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` matches more than one name (contains ``*``, ``?`` or ``[``)."""
    return not _GLOB_CHARS.isdisjoint(pattern)


def parse_alias(text: str) -> tuple[str, str]:
    """``PATTERN=MODEL`` (the ``--model-alias`` flag, ``KVROUTE_ALIASES`` items) as a pair; the
    first ``=`` separates them."""
    pattern, sep, model = text.partition("=")
    pattern, model = pattern.strip(), model.strip()
    if not sep or not pattern or not model:
        raise AliasError(f"a model alias is PATTERN=MODEL (e.g. 'claude-*=qwen3-4b'), got {text!r}")
    return pattern, model


class ModelAliases:
    """The router's model-name rules: ``aliases`` (pattern -> served model, in order) and
    ``default_model`` for names nothing else maps.  ``resolve`` is on the hot path: with neither
    configured (``active`` False) the caller skips it."""

    __slots__ = ("_exact", "_globs", "_memo", "default_model", "patterns")

    def __init__(self, aliases: Mapping[str, str] | Iterable[tuple[str, str]] = (),
                 default_model: str | None = None) -> None:
        # A pattern given twice keeps its first place and its last model.
        pairs: list[tuple[str, str]] = list(
            dict(aliases.items() if isinstance(aliases, Mapping) else aliases).items())
        for pattern, model in pairs:
            if not isinstance(pattern, str) or not pattern.strip():
                raise AliasError(f"an alias pattern must be a non-empty string, got {pattern!r}")
            if not isinstance(model, str) or not model.strip():
                raise AliasError(f"alias {pattern!r} must name a model (a non-empty string), got {model!r}")
            if is_glob(model):
                raise AliasError(f"alias {pattern!r} -> {model!r}: the target must be a model name, "
                                 "not a pattern")
        if default_model is not None and (not isinstance(default_model, str) or not default_model.strip()):
            raise AliasError(f"default_model must be a model name, got {default_model!r}")
        self.patterns: tuple[tuple[str, str], ...] = tuple(pairs)
        self.default_model = default_model
        self._exact: dict[str, str] = {p: m for p, m in pairs if not is_glob(p)}
        self._globs = tuple((re.compile(fnmatch.translate(p)).match, m) for p, m in pairs if is_glob(p))
        self._memo: dict[str, str | None] = {}

    @property
    def active(self) -> bool:
        """Whether any rule is configured (else every name is passed on as it is)."""
        return bool(self.patterns) or self.default_model is not None

    @property
    def exact(self) -> Mapping[str, str]:
        """The exact aliases (no glob characters): alias -> model, in the order given."""
        return self._exact

    @property
    def globs(self) -> tuple[tuple[str, str], ...]:
        """The glob patterns and their models, in the order given."""
        return tuple((p, m) for p, m in self.patterns if is_glob(p))

    def resolve(self, name: str, served: Callable[[str], bool]) -> str:
        """The model a request for ``name`` goes to (``name`` itself when no rule applies).
        ``served(name)``: whether a worker lists ``name`` among the models it serves."""
        target = self._exact.get(name)
        if target is not None:
            return target
        if served(name):
            return name
        found = self._glob(name)
        if found is not None:
            return found
        return self.default_model if self.default_model is not None else name

    def _glob(self, name: str) -> str | None:
        memo = self._memo
        try:
            return memo[name]
        except KeyError:
            pass
        found = next((model for match, model in self._globs if match(name)), None)
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        memo[name] = found
        return found


def body_for(raw: bytes, doc: dict[str, Any], target: str) -> bytes:
    """The request body a worker gets when an alias sent ``doc`` (parsed from ``raw``) to
    ``target``: ``raw`` with the top-level ``model`` value replaced, else ``doc`` re-encoded.

    The bytes are spliced only where the member is provably the top-level one, without reading
    the body: ``raw`` begins with ``{"model":<name>`` followed by ``,`` or ``}`` (Claude Code, the
    OpenAI SDKs) or ends with ``,"model":<name>}`` (the Anthropic Python SDK).  A body that repeats
    the top-level key (which orjson reads as its last value) may then reach the worker with the
    name asked still in its last copy: the worker's 404, never another model.  Anything else is
    re-encoded (~30 µs for 50 KB, benchmarks/bench_model_alias.py); a body nested deeper than
    orjson writes is a 400 naming the field.
    """
    member = b'"model":' + orjson.dumps(doc["model"])
    replacement = b'"model":' + orjson.dumps(target)
    end = len(member) + 1
    if raw.startswith(member, 1) and raw[:1] == b"{" and raw[end:end + 1] in (b",", b"}"):
        return b"{" + replacement + raw[end:]
    if raw.endswith(member + b"}") and raw[-end - 1:-end] == b",":
        return raw[:-end] + replacement + b"}"
    out = dict(doc, model=target)
    try:
        return orjson.dumps(out)
    except orjson.JSONEncodeError:
        error = nesting_error(out) or ApiError(400, "the request body cannot be re-encoded", param="body")
        raise error from None
