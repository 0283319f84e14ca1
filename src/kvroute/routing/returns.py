"""Whether the conversations that sent no session id come back: the learned return share.

A request without a client session id carries an identity the router derived from its head and
first own message (``RoutingKey.client_session`` is False).  For an agent or a chat app, that
identity is a conversation: its next turn repeats the same head and first message and appends
the answer and a new message, so it comes back *longer*.  For a one-shot client (a question under
a shared system prompt, llm-d's shared-prefix benchmark) the same identity comes back only as the
very same prompt asked again: the same question derives the same identity, and a repeat is not a
follow-up.  Counting any request of a known identity as a return mistakes every repeated
question for a conversation.

``ReturnShare`` learns, per model, the share of derived identities whose conversation comes back
with a follow-up turn (a longer prompt) within ``window_s`` of its first request: an identity
resolves as *returned* at its first follow-up, as *one-shot* once ``window_s`` passed without one.
The share is the running mean of those resolutions over the first ``memory`` of them, then an
exponentially weighted one (weight ``1 / memory``); it is told only once ``min_resolved`` have
resolved, so a fresh router assumes nothing.  Returns resolve at once and one-shots only after the
window, so while a workload changes the share leans towards "returns": the guards a returning
conversation needs are kept rather than dropped.

Pure: no I/O, the time is passed in (the scheduler's clock, one path for both clocks).  Each
router instance learns from the requests it routes itself.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

RETURN_WINDOW_S = 60.0
MIN_RESOLVED = 16
MEMORY = 64
# Identities tracked at once, beyond which the oldest are forgotten unresolved (a flood of new
# identities must not grow the table without bound).
MAX_TRACKED = 100_000


@dataclass(slots=True)
class _Seen:
    """A derived identity's first request within the window: when, how long, and whether a
    longer turn has followed."""

    at: float
    tokens: int
    returned: bool = False


class ReturnShare:
    """The share of one model's derived identities whose conversation comes back (see the
    module's docstring)."""

    def __init__(self, window_s: float = RETURN_WINDOW_S, min_resolved: int = MIN_RESOLVED,
                 memory: int = MEMORY, max_tracked: int = MAX_TRACKED) -> None:
        if window_s <= 0 or min_resolved < 1 or memory < 1 or max_tracked < 1:
            raise ValueError("window_s, min_resolved, memory and max_tracked must be positive")
        self.window_s = window_s
        self.min_resolved = min_resolved
        self.memory = memory
        self.max_tracked = max_tracked
        self._seen: OrderedDict[int, _Seen] = OrderedDict()  # by first request, oldest first
        self._resolved = 0
        self._share = 0.0

    def seen(self, session: int, prompt_tokens: int, now: float) -> None:
        """A request of the derived identity ``session`` with ``prompt_tokens`` was sent at ``now``."""
        self._expire(now)
        entry = self._seen.get(session)
        if entry is None:
            self._seen[session] = _Seen(now, prompt_tokens)
            while len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
        elif not entry.returned and prompt_tokens > entry.tokens:
            entry.returned = True
            self._resolve(1.0)

    def returned(self, session: int, prompt_tokens: int = 0) -> bool:
        """Whether ``session`` came back with a follow-up turn within the window of its first
        request (False for an identity not seen within the window), or a request of it with
        ``prompt_tokens`` is one (longer than its first): a conversation's first follow-up is
        routed before it is seen."""
        entry = self._seen.get(session)
        return entry is not None and (entry.returned or prompt_tokens > entry.tokens)

    def share(self, now: float) -> float | None:
        """The learned share of identities that come back, 0-1 (None before ``min_resolved``
        resolved)."""
        self._expire(now)
        return self._share if self._resolved >= self.min_resolved else None

    def _expire(self, now: float) -> None:
        cutoff = now - self.window_s
        seen = self._seen
        while seen:
            session, oldest = next(iter(seen.items()))
            if oldest.at > cutoff:
                break
            del seen[session]
            if not oldest.returned:
                self._resolve(0.0)

    def _resolve(self, returned: float) -> None:
        self._resolved += 1
        self._share += (returned - self._share) / min(self._resolved, self.memory)
