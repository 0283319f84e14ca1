"""A request's own token-block hashes, cached per conversation so that a turn hashes only its tail.

A chat agent resends its whole history every turn: turn N+1's tokens start with turn N's (up to the
last full block turn N ended in).  Hashing is cumulative (``token_block_hashes`` chains from the
previous block), so the blocks a turn shares with the conversation's previous turn keep their
hashes and only the new ones are computed.

What is remembered is bounded twice: by conversations and by tokens (kept as 8-byte ids, the form
they are hashed in: a token id decoded from JSON costs ~36 bytes as a Python int in a list, and an
agent's conversation can hold 100k of them).

A router that tokenizes locally (api/local_tokens.py) also keeps, in the same entry, the text it
rendered the prompt into and where that text's tokens may be cut (``Rendering``), so that the next
turn encodes only the text after the last cut the two renderings share.  That text is not counted
against ``max_tokens``: at about four characters a token and a byte a character it weighs about
half the tokens' eight bytes.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.routing.hashing import token_block_hashes
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import session_hash


@dataclass(frozen=True, slots=True)
class Rendering:
    """A prompt as a local tokenizer rendered it: ``text``, and ``cuts``, the (start character,
    end character, token index) of each special token in it, flattened into one array in text
    order: the tokens before a special token do not depend on the text from it on."""

    text: str
    cuts: array[int]


@dataclass(slots=True)
class _Chain:
    tokens: Sequence[int]
    block: int
    hashes: tuple[int, ...]
    rendering: Rendering | None


def _shared_blocks(a: Sequence[int], b: Sequence[int], block: int, limit: int) -> int:
    """Leading full blocks ``a`` and ``b`` have in common, at most ``limit``."""
    if limit <= 0:
        return 0
    if a[:limit * block] == b[:limit * block]:
        return limit
    lo, hi = 0, limit  # a[:lo*block] agree, a[:hi*block] do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid * block] == b[:mid * block]:
            lo = mid
        else:
            hi = mid
    return lo


class TokenChains:
    """Own block hashes of prompts, remembered for the last ``max_entries`` conversations and at
    most ``max_tokens`` tokens of them in all (the least recently used go first)."""

    def __init__(self, max_entries: int = 20_000, max_tokens: int = 8_000_000) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._chains: OrderedDict[int, _Chain] = OrderedDict()
        self.tokens = 0  # tokens remembered, over every conversation

    def __len__(self) -> int:
        return len(self._chains)

    def previous(self, conversation: int | None) -> tuple[Sequence[int], Rendering] | None:
        """The tokens and rendering the conversation's previous turn was remembered with, where a
        local tokenizer rendered it (its place in the least-recently-used order unchanged)."""
        chain = None if conversation is None else self._chains.get(conversation)
        if chain is None or chain.rendering is None:
            return None
        return chain.tokens, chain.rendering

    def hashes(self, conversation: int | None, tokens: Sequence[int], block: int,
               rendering: Rendering | None = None) -> tuple[int, ...]:
        """The own hashes of ``tokens``' full ``block``-token blocks; ``conversation`` (a session's
        key, None: none) names what the previous turn computed; ``rendering``: the text the tokens
        were encoded from, kept for the next turn (``previous``)."""
        if conversation is None:
            return tuple(token_block_hashes(tokens, block))
        chains = self._chains
        prev = chains.pop(conversation, None)
        if prev is not None:
            self.tokens -= len(prev.tokens)
        # What hashing packs them into anyway; compared as memory.  A local tokenizer's are packed.
        packed = tokens if isinstance(tokens, array) and tokens.typecode == "Q" else array("Q", tokens)
        n = len(packed) // block
        if prev is None or prev.block != block:
            out = tuple(token_block_hashes(packed, block))
        else:
            shared = _shared_blocks(prev.tokens, packed, block, min(n, len(prev.hashes)))
            head = prev.hashes[:shared]
            parent = head[-1] if head else None
            out = head + tuple(token_block_hashes(packed[shared * block:], block, parent))
        if len(packed) <= self.max_tokens:
            chains[conversation] = _Chain(packed, block, out, rendering)
            self.tokens += len(packed)
        while chains and (len(chains) > self.max_entries or self.tokens > self.max_tokens):
            self.tokens -= len(chains.popitem(last=False)[1].tokens)
        return out


def with_tokens(key: RoutingKey, tokens: Sequence[int], block: int, chains: TokenChains,
                rendering: Rendering | None = None) -> RoutingKey:
    """``key`` with the own hashes of its engine tokens (``block`` tokens a block) and their count
    as its prompt size: what both edges (HTTP and the virtual cluster) hand the dispatcher;
    ``rendering``: what a local tokenizer encoded them from."""
    hashes = chains.hashes(session_hash(key), tokens, block, rendering)
    return dataclasses.replace(key, token_hashes=hashes, token_block=block, est_prompt_tokens=len(tokens))
