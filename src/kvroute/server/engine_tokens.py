"""Tokenizing a request the engine's way, for the token-exact index (routing/exact_index.py).

Only where it can pay: the request is cacheable, unsalted, an OpenAI chat or completions request
(vLLM's ``/tokenize`` takes those shapes) or an Anthropic messages request (tokenized as the chat
request vLLM converts it into: :func:`anthropic_chat`), and some ready worker of its model is in
exact mode.
The engine's own ``POST /tokenize`` renders the chat template and tokenizes, so the router needs no
model files and cannot disagree with the engine about either; it costs one round trip to one
worker (the least loaded exact one), bounded by ``timeout_s`` — on any failure the request is
routed on the approximate index, as if no worker were exact.  The block hashes are cached per
conversation (routing/token_chains.py): a turn hashes only the blocks its previous turn lacked.

Where the model's settings name a ``tokenizer`` folder, the router tokenizes the request itself
(api/local_tokens.py: no round trip, and a conversation's next turn encodes only its tail); what
that cannot vouch for still goes to ``/tokenize``.  ``kvroute_tokenize_total{path,outcome}`` counts
which path tokenized each request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import orjson
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvroute.api.anthropic_chat import AnthropicConversionError, anthropic_to_chat, has_inline_system
from kvroute.api.local_tokens import ChatTokenizer, TemplateError
from kvroute.api.tokenizer_settings import TokenizerSettings
from kvroute.fleet.registry import Registry
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler, session_hash
from kvroute.routing.token_chains import TokenChains, with_tokens
from kvroute.server.upstream import UpstreamError, UpstreamPool

log = logging.getLogger("kvroute.tokens")

# Fields of a chat request that change how vLLM's /tokenize renders it (the chat template's inputs).
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "tools", "chat_template",
                "chat_template_kwargs", "add_special_tokens", "documents")


def tokenize_body(route: str, doc: Mapping[str, Any], model: str) -> dict[str, Any] | None:
    """The ``/tokenize`` request vLLM renders exactly as it renders ``doc`` on ``route`` for
    ``model`` (the served name, an alias resolved), or None where ``/tokenize`` cannot say
    (several prompts, token-id prompts; an Anthropic messages request is converted to its chat
    request first: :func:`anthropic_chat`)."""
    if route == "chat":
        body = {name: doc[name] for name in _CHAT_FIELDS if name in doc}
        if not isinstance(body.get("messages"), list):
            return None
        body.setdefault("add_generation_prompt", True)
    elif route == "completions":
        prompt = doc.get("prompt")
        if not isinstance(prompt, str):
            return None
        body = {"prompt": prompt}
    else:
        return None
    body["model"] = model
    return body


# vLLM's probe of a chat template (``_detect_merge_inline_system``): one that refuses a system
# message after the first turn has the inline ones merged into the leading one.
_INLINE_SYSTEM_PROBE = [{"role": role, "content": "t"} for role in ("system", "user", "system", "user")]


def anthropic_chat(doc: Mapping[str, Any], local: ChatTokenizer | None,
                   merge_inline_system: bool | None = None) -> dict[str, Any] | None:
    """The chat request vLLM serves an Anthropic messages request ``doc`` as, or None where the
    router cannot know it.  With the model's ``local`` tokenizer the conversion follows its chat
    template; without, ``merge_inline_system`` is what the engine's ``/tokenize`` told of its
    template (None: not known, so a request with inline system messages is left to the
    approximate index), and disabled thinking (whose effort vLLM probes) is left there too."""
    if local is not None:
        return local.anthropic_chat(doc)
    thinking = doc.get("thinking")
    if (isinstance(thinking, Mapping) and thinking.get("type") == "disabled") \
            or (merge_inline_system is None and has_inline_system(doc)):
        return None
    try:
        return anthropic_to_chat(doc, merge_inline_system=bool(merge_inline_system))
    except AnthropicConversionError:
        return None


class _Tokenized(msgspec.Struct):
    tokens: list[int]


_reply = msgspec.json.Decoder(_Tokenized)


_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5)


class TokenizeMetrics:
    """``kvroute_tokenize_total{path,outcome}``, ``kvroute_tokenize_seconds{path}`` and
    ``kvroute_tokenize_tokens_total{part}``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvroute_tokenize", "Requests tokenized for exact mode, by path (local: the router's own "
            "tokenizer; engine: an engine's /tokenize) and outcome (ok; declined: left by the local "
            "tokenizer to the engine; failed: no tokens, routed on the approximate index)",
            ["path", "outcome"], registry=registry)
        self.seconds = Histogram(
            "kvroute_tokenize_seconds", "Seconds spent tokenizing a request for exact mode, by path",
            ["path"], buckets=_SECONDS_BUCKETS, registry=registry)
        self.tokens = Counter(
            "kvroute_tokenize_tokens", "Tokens the local tokenizer produced, by part (reused: kept from "
            "the conversation's previous turn, or from another conversation's first turn with the "
            "same head; encoded: encoded for this request)",
            ["part"], registry=registry)
        # The hot path's children, bound once.
        self.local_seconds = self.seconds.labels("local")
        self.engine_seconds = self.seconds.labels("engine")
        self.reused = self.tokens.labels("reused")
        self.encoded = self.tokens.labels("encoded")
        self.local_ok = self.requests.labels("local", "ok")


class EngineTokens:
    """The router's tokenizer for exact mode: the model's own tokenizer where its settings name
    one, else (and for what that declines) the engine's ``/tokenize`` through the proxy's upstream
    pool; hashes cached per conversation."""

    def __init__(self, registry: Registry, scheduler: Scheduler, pool: Callable[[], UpstreamPool | None], *,
                 timeout_s: float = 2.0, metrics: TokenizeMetrics | None = None) -> None:
        self._registry = registry
        self._scheduler = scheduler
        self._pool = pool
        self._timeout_s = timeout_s
        self._chains = TokenChains()
        self._metrics = metrics
        # Local tokenizers by folder, loaded once; None: the folder could not be used (logged).
        self._local: dict[str, ChatTokenizer | None] = {}
        # Whether each engine's chat template merges inline system messages, by URL, once known.
        self._merges: dict[str, bool] = {}
        config = scheduler.config
        for settings in (config.default, *config.models.values()):
            folder = settings.block(TokenizerSettings).tokenizer
            if folder and folder not in self._local:
                self._local[folder] = ChatTokenizer(folder)  # TemplateError: the router does not start

    async def keyed(self, route: str, doc: Mapping[str, Any], key: RoutingKey) -> RoutingKey:
        """``key`` with the prompt's own token-block hashes when some worker of its model is exact
        (and the prompt could be tokenized), else ``key`` unchanged."""
        if not key.cacheable or key.cache_salt is not None:
            return key
        best = self._scheduler.exact_worker(key.model, self._registry.states())
        if best is None:
            return key
        block = self._scheduler.block_size(best)
        assert block is not None
        folder = self._scheduler.settings_for(key.model).block(TokenizerSettings).tokenizer
        if route == "messages":
            tokenizer = self._tokenizer(folder) if folder else None
            merge = None
            if tokenizer is None and has_inline_system(doc):
                merge = await self._merges_inline_system(best.url, key.model)
            chat = anthropic_chat(doc, tokenizer, merge)
            if chat is None:
                return key
            route, doc = "chat", chat
        if folder:
            local = self._local_keyed(folder, route, doc, key, block)
            if local is not None:
                return local
        body = tokenize_body(route, doc, key.model)
        if body is None:
            return key
        started = time.perf_counter()
        tokens = await self._tokenize(best.url, body)
        metrics = self._metrics
        if metrics is not None:
            metrics.engine_seconds.observe(time.perf_counter() - started)
            metrics.requests.labels("engine", "ok" if tokens is not None else "failed").inc()
        if tokens is None:
            return key
        return with_tokens(key, tokens, block, self._chains)

    def _tokenizer(self, folder: str) -> ChatTokenizer | None:
        if folder in self._local:
            return self._local[folder]
        try:  # a folder named since start-up (settings changed at run time)
            found: ChatTokenizer | None = ChatTokenizer(folder)
        except TemplateError as exc:
            log.error("tokenizer %s cannot be used, tokenizing through the engines: %s", folder, exc)
            found = None
        self._local[folder] = found
        return found

    def _local_keyed(self, folder: str, route: str, doc: Mapping[str, Any], key: RoutingKey,
                     block: int) -> RoutingKey | None:
        """``key`` keyed by the local tokenizer, or None where it declined (or cannot be used)."""
        local = self._tokenizer(folder)
        metrics = self._metrics
        if local is None:
            if metrics is not None:
                metrics.requests.labels("local", "failed").inc()
            return None
        started = time.perf_counter()
        if route == "chat":
            conversation = session_hash(key)
            got = local.tokens(doc, self._chains.previous(conversation))
        elif route == "completions" and isinstance(prompt := doc.get("prompt"), str):
            got = local.prompt_tokens(prompt)
        else:
            got = None
        if got is None:
            if metrics is not None:
                metrics.requests.labels("local", "declined").inc()
            return None
        tokens, rendering, kept = got
        out = with_tokens(key, tokens, block, self._chains, rendering)
        if metrics is not None:
            metrics.local_seconds.observe(time.perf_counter() - started)
            metrics.local_ok.inc()
            metrics.reused.inc(kept)
            metrics.encoded.inc(len(tokens) - kept)
        return out

    async def _merges_inline_system(self, url: str, model: str) -> bool | None:
        """Whether the engine at ``url`` merges an Anthropic request's inline system messages into
        its leading one: its ``/tokenize`` refuses (400) the probe vLLM renders its template with
        (in the full template environment, where vLLM probes a bare one: a template that calls
        ``raise_exception`` or ``strftime_now`` on every turn is judged differently).  Asked once
        per engine; None while it cannot be asked."""
        if url not in self._merges:
            body = {"model": model, "messages": _INLINE_SYSTEM_PROBE, "add_generation_prompt": False}
            answer = await self._post_tokenize(url, body)
            if answer is None or answer[0] not in (200, 400):
                return None
            self._merges[url] = answer[0] == 400
        return self._merges[url]

    async def _tokenize(self, url: str, body: Mapping[str, Any]) -> list[int] | None:
        answer = await self._post_tokenize(url, body)
        if answer is None:
            return None
        status, tokens = answer
        if status != 200:
            log.debug("/tokenize on %s answered %d", url, status)
            return None
        return tokens

    async def _post_tokenize(self, url: str, body: Mapping[str, Any]) -> tuple[int, list[int] | None] | None:
        """The status and tokens of ``/tokenize``'s answer, or None where none came."""
        # Through the proxy's own keep-alive pool: an aiohttp round trip cost twice the router's
        # CPU for a whole small request.
        pool = self._pool()
        if pool is None:
            return None
        origin = pool.origin(url)
        data = orjson.dumps(body)
        request = (b"POST " + origin.base_path + b"/tokenize HTTP/1.1\r\nhost: " + origin.host_header
                   + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
        call = None
        try:
            async with asyncio.timeout(self._timeout_s):
                call = await pool.send(origin, request)
                head = await call.head
                parts: list[bytes] = []
                call.attach(parts.append)
                await call.done
        except (TimeoutError, UpstreamError) as exc:
            log.debug("/tokenize on %s failed: %r", url, exc)
            if call is not None:
                call.abort()
            return None
        if head.status != 200:
            return head.status, None
        try:
            return 200, _reply.decode(b"".join(parts)).tokens
        except msgspec.DecodeError:
            return None
