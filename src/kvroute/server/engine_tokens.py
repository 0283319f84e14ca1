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

import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import msgspec
import orjson

from kvroute.fleet.registry import Registry
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.token_chains import TokenChains, with_tokens

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
    """The router's tokenizer for exact mode: the engine's ``/tokenize``, with hashes cached per
    conversation.  ``stats`` counts requests tokenized, skipped (no exact worker), failed."""

    def __init__(self, registry: Registry, scheduler: Scheduler, *, timeout_s: float = 2.0) -> None:
        self._registry = registry
        self._scheduler = scheduler
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._chains = TokenChains()
        self.stats = {"tokenized": 0, "failed": 0}
        self.seconds = 0.0

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
        started = time.perf_counter()
        tokens = await self._tokenize(best.url, body)
        self.seconds += time.perf_counter() - started
        if tokens is None:
            self.stats["failed"] += 1
            return key
        self.stats["tokenized"] += 1
        return with_tokens(key, tokens, block, self._chains)

    async def _tokenize(self, url: str, body: Mapping[str, Any]) -> list[int] | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.post(url + "/tokenize", data=orjson.dumps(body),
                                          headers={"content-type": "application/json"}) as resp:
                if resp.status != 200:
                    log.debug("/tokenize on %s answered %d", url, resp.status)
                    return None
                return _reply.decode(await resp.read()).tokens
        except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as exc:
            log.debug("/tokenize on %s failed: %r", url, exc)
            return None

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None
