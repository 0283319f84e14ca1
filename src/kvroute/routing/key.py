"""What the scheduler needs to know about one request, extracted once on the hot path."""

from __future__ import annotations

from dataclasses import dataclass

# Prompt tokens are estimated as canonical bytes / 4 (English text and JSON average about 4 bytes
# per token in common BPE vocabularies); the parser and the scheduler use the same figure.
EST_BYTES_PER_TOKEN = 4

# A session id the router derived from a conversation's head (api/requests.py), not one the client sent.
DERIVED_SESSION_PREFIX = "conv:"


def client_named(session_id: str) -> bool:
    """Whether ``session_id`` is one the client sent (a header or field), not one the router
    derived from a conversation's head."""
    return not session_id.startswith(DERIVED_SESSION_PREFIX)


# Not frozen, like Decision: made once per request, and a frozen dataclass's 19 fields are 19
# object.__setattr__ calls, ~28k instructions against ~4k (docs/benchmarks.md, "2026-12-07:
# instructions per request").  Treat it as a value: nothing assigns to a key's fields.
@dataclass(slots=True)
class RoutingKey:
    """A request reduced to what routing needs.

    ``prefix`` is the canonical, prefix-stable rendering of the prompt: appending a turn to a
    conversation appends bytes to it and leaves every earlier byte unchanged.  The prefix index
    hashes it; nothing else reads it.  ``cache_scope`` (model name and vLLM ``cache_salt``) seeds
    the hash chain, so requests that an engine would never let share a cache never match.
    ``cacheable`` is False for requests that leave nothing in the engine's prefix cache
    (embeddings, token counting): they are routed but their blocks are not recorded.
    ``stream`` says the client asked for a streamed answer (its first byte is the first token).
    ``priority`` (1 high, 0 normal, -1 low) and ``tenant`` (None: the default tenant) are what flow
    control orders by: strictly by class, then fairly between tenants (routing/flow.py).
    ``token_hashes`` are the own hashes of the prompt's full blocks of ``token_block`` engine
    tokens, when the edge tokenized it the engine's way (routing/exact_index.py): workers whose
    events are exact are matched on them; empty otherwise.  ``client`` (``x-kvroute-client``)
    names the client that sends the session: its next session ends this one (session admission).
    ``answer_tokens`` is the answer's length where the request fixes it (vLLM's ``ignore_eos``, or
    ``min_tokens`` equal to ``max_tokens``: the answer is ``max_tokens`` long), else None (it ends
    at its end-of-sequence token): when it ends, and so when a request queued behind it on its
    engine finds room (routing/exact_index.py).
    """

    model: str
    prefix: bytes
    session_id: str | None = None
    est_prompt_tokens: int = 0
    max_tokens: int = 0
    cache_salt: str | None = None
    cacheable: bool = True
    stream: bool = False
    priority: int = 0
    tenant: str | None = None
    token_hashes: tuple[int, ...] = ()
    token_block: int = 0
    client: str | None = None
    answer_tokens: int | None = None

    @property
    def footprint(self) -> int:
        """KV tokens the request holds while it runs: its prompt and at most ``max_tokens`` of
        output (what flow control reserves and charges a tenant for)."""
        return self.est_prompt_tokens + self.max_tokens

    @property
    def client_session(self) -> bool:
        """Whether the client named the session (a header or field), rather than the router
        deriving one from the conversation's head."""
        return self.session_id is not None and client_named(self.session_id)

    @property
    def cache_scope(self) -> bytes:
        """Bytes that seed the block-hash chain: model and salt, never shared across either."""
        return f"{self.model}\x00{self.cache_salt or ''}".encode()
