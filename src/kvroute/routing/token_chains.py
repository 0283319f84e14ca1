"""A request's own token-block hashes, cached per conversation so that a turn hashes only its tail.

A chat agent resends its whole history every turn: turn N+1's tokens start with turn N's (up to the
last full block turn N ended in).  Hashing is cumulative (``token_block_hashes`` chains from the
previous block), so the blocks a turn shares with the conversation's previous turn keep their
hashes and only the new ones are computed.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.routing.hashing import token_block_hashes
from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import session_hash


@dataclass(slots=True)
class _Chain:
    tokens: Sequence[int]
    block: int
    hashes: tuple[int, ...]


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
    """Own block hashes of prompts, remembered for the last ``max_entries`` conversations."""

    def __init__(self, max_entries: int = 20_000) -> None:
        self.max_entries = max_entries
        self._chains: OrderedDict[int, _Chain] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chains)

    def hashes(self, conversation: int | None, tokens: Sequence[int], block: int) -> tuple[int, ...]:
        """The own hashes of ``tokens``' full ``block``-token blocks; ``conversation`` (a session's
        key, None: none) names what the previous turn computed."""
        if conversation is None:
            return tuple(token_block_hashes(tokens, block))
        chains = self._chains
        prev = chains.get(conversation)
        n = len(tokens) // block
        if prev is None or prev.block != block:
            out = tuple(token_block_hashes(tokens, block))
        else:
            shared = _shared_blocks(prev.tokens, tokens, block, min(n, len(prev.hashes)))
            head = prev.hashes[:shared]
            parent = head[-1] if head else None
            out = head + tuple(token_block_hashes(tokens[shared * block:], block, parent))
            chains.move_to_end(conversation)
        chains[conversation] = _Chain(tokens, block, out)
        if len(chains) > self.max_entries:
            chains.popitem(last=False)
        return out


def with_tokens(key: RoutingKey, tokens: Sequence[int], block: int, chains: TokenChains) -> RoutingKey:
    """``key`` with the own hashes of its engine tokens (``block`` tokens a block) and their count
    as its prompt size: what both edges (HTTP and the virtual cluster) hand the dispatcher."""
    hashes = chains.hashes(session_hash(key), tokens, block)
    return dataclasses.replace(key, token_hashes=hashes, token_block=block, est_prompt_tokens=len(tokens))
