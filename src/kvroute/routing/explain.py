"""Pieces of the one log line every decision gets (each policy's explainer composes them).

Never any prompt text: workers, block counts, loads, estimated tokens, and a session's 64-bit
hash (8 hex digits), not its id.
"""

from __future__ import annotations

from kvroute.routing.decision import DecisionKind
from kvroute.routing.view import Candidate, View


def session_tag(view: View) -> str:
    """The session as 8 hex digits (the high half of its 64-bit hash)."""
    return f"{(view.session or 0) >> 32:08x}"


def blocks(view: View, c: Candidate) -> str:
    """``matched/total blocks`` on ``c`` (engine blocks, said so, where its state is exact)."""
    if c.exact:
        return f"{c.matched_blocks}/{len(view.key.token_hashes)} blocks (exact)"
    return f"{c.matched_blocks}/{view.total_blocks} blocks"


def bound_kind(view: View, chosen: Candidate) -> DecisionKind | None:
    """STICKY or OVERFLOW for a request whose session is bound somewhere, else None."""
    if view.bound is None:
        return None
    return DecisionKind.STICKY if chosen.worker.id == view.bound else DecisionKind.OVERFLOW

