"""Tokenizing a request the engine's way, for the token-exact index (routing/exact_index.py).

Only where it can pay: the request is cacheable, unsalted, an OpenAI chat or completions request
(vLLM's ``/tokenize`` takes those shapes), and some ready worker of its model is in exact mode.
The engine's own ``POST /tokenize`` renders the chat template and tokenizes, so the router needs no
model files and cannot disagree with the engine about either; it costs one round trip to one
worker (the least loaded exact one), bounded by ``timeout_s`` — on any failure the request is
routed on the approximate index, as if no worker were exact.  The block hashes are cached per
conversation (routing/token_chains.py): a turn hashes only the blocks its previous turn lacked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import orjson

from kvroute.fleet.registry import Registry
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.token_chains import TokenChains, with_tokens
from kvroute.server.upstream import UpstreamError, UpstreamPool

log = logging.getLogger("kvroute.tokens")

# Fields of a chat request that change how vLLM's /tokenize renders it (the chat template's inputs).
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "tools", "chat_template",
                "chat_template_kwargs", "add_special_tokens", "documents")


def tokenize_body(route: str, doc: Mapping[str, Any], model: str) -> dict[str, Any] | None:
    """The ``/tokenize`` request vLLM renders exactly as it renders ``doc`` on ``route`` for
    ``model`` (the served name, an alias resolved), or None where ``/tokenize`` cannot say
    (Anthropic messages, several prompts, token-id prompts)."""
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


class _Tokenized(msgspec.Struct):
    tokens: list[int]


_reply = msgspec.json.Decoder(_Tokenized)


class EngineTokens:
    """The router's tokenizer for exact mode: the engine's ``/tokenize`` (through the proxy's
    upstream pool), with hashes cached per conversation."""

    def __init__(self, registry: Registry, scheduler: Scheduler, pool: Callable[[], UpstreamPool | None], *,
                 timeout_s: float = 2.0) -> None:
        self._registry = registry
        self._scheduler = scheduler
        self._pool = pool
        self._timeout_s = timeout_s
        self._chains = TokenChains()

    async def keyed(self, route: str, doc: Mapping[str, Any], key: RoutingKey) -> RoutingKey:
        """``key`` with the prompt's own token-block hashes when some worker of its model is exact
        (and its engine tokenized the prompt), else ``key`` unchanged."""
        if not key.cacheable or key.cache_salt is not None:
            return key
        best = self._scheduler.exact_worker(key.model, self._registry.states())
        body = tokenize_body(route, doc, key.model)
        if best is None or body is None:
            return key
        block = self._scheduler.exact.block_size(best.id)
        assert block is not None
        tokens = await self._tokenize(best.url, body)
        if tokens is None:
            return key
        return with_tokens(key, tokens, block, self._chains)

    async def _tokenize(self, url: str, body: Mapping[str, Any]) -> list[int] | None:
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
            log.debug("/tokenize on %s answered %d", url, head.status)
            return None
        try:
            return _reply.decode(b"".join(parts)).tokens
        except msgspec.DecodeError:
            return None
