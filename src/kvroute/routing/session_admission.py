"""Session admission: start a new session only while the fleet's KV cache can hold the working set
of the sessions it already serves, so that the sessions it admitted keep their caches.

Past the fleet's capacity, every session admitted beyond what the KV cache holds evicts the blocks
of another one, and from then on every turn of every session is a cold prefill (docs/flow-control.md
measures the cliff: on 4 x a4000-qwen3-4b, 78 % prefix hits at 16 agent sessions, 35 % at 24).
Holding a new session's first turn at the door until the working set has room keeps the admitted
ones warm.

A *rule* (``RULES``, setting ``flow_session_rule``) says how many KV tokens a served session
counts in the working set, from its last request and what the fleet already held of its first one:

* ``unique`` (default): its last request's prompt + ``max_tokens``, less the part of its first
  prompt that other sessions had already put in the cache (a shared system prompt): the engine
  holds that part once, however many sessions use it.
* ``footprint``: its last request's prompt + ``max_tokens``, shared prefixes counted once per
  session (the first version; kept for reference).

Pure: no clock (``now`` is passed in), no I/O.  ``FlowControl`` (routing/flow.py) owns one
``SessionBook`` per model and asks it at the door.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvroute.routing.key import RoutingKey


def footprint(key: RoutingKey) -> int:
    """KV tokens a request holds while it runs: its prompt and at most ``max_tokens`` of output."""
    return key.est_prompt_tokens + key.max_tokens


@dataclass(slots=True)
class ServedSession:
    """One session the fleet serves."""

    tokens: int  # what it counts in the working set (by the rule)
    shared: int  # prompt tokens of its first request the fleet already held from other sessions
    inflight: int = 0
    ended: float = 0.0  # when its last request ended


# A rule maps (the session's last request, its shared tokens) to the tokens it counts.
Rule = Callable[[RoutingKey, int], int]


def unique_tokens(key: RoutingKey, shared: int) -> int:
    """What the session adds to the cache: its footprint less the prefix other sessions hold."""
    return max(0, footprint(key) - shared)


def footprint_tokens(key: RoutingKey, shared: int) -> int:
    """Its whole footprint, shared prefix included."""
    return footprint(key)


RULES: dict[str, Rule] = {"unique": unique_tokens, "footprint": footprint_tokens}


@dataclass(slots=True)
class SessionBook:
    """The sessions one model's fleet serves, and the door for new ones."""

    sessions: dict[str, ServedSession] = field(default_factory=dict)
    # What the last sessions to leave counted at the end: a session grows turn by turn, so one
    # admitted at its first turn's size is counted at the size sessions end up with.
    peaks: deque[int] = field(default_factory=lambda: deque(maxlen=64))
    # The last pauses between a session's answer and its next request: a session silent for much
    # longer than they has most likely ended, and holding its place would keep a new one out.
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=256))

    def idle_after(self, idle_s: float) -> float:
        """How long a session may be silent before it is forgotten: twice the longest of the
        recent pauses between turns (at least 1 s), at most ``idle_s`` (``idle_s`` until a few
        pauses were seen)."""
        if len(self.gaps) < 8:
            return idle_s
        return min(idle_s, max(1.0, 2.0 * max(self.gaps)))

    def expected(self) -> int:
        """The size a session is expected to reach: the median of the last ones' (0 until a few
        have left)."""
        return int(statistics.median(self.peaks)) if len(self.peaks) >= 4 else 0

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.sessions

    def __len__(self) -> int:
        return len(self.sessions)

    def __iter__(self) -> Iterator[str]:
        return iter(self.sessions)

    def sent(self, key: RoutingKey, prefill_tokens: int, rule: str, now: float) -> None:
        """A request of ``key``'s session left for a replica that had to compute ``prefill_tokens``
        of its prompt (the routing decision's prediction)."""
        assert key.session_id is not None
        entry = self.sessions.get(key.session_id)
        if entry is not None and entry.inflight <= 0:
            self.gaps.append(now - entry.ended)
        if entry is None:
            shared = max(0, key.est_prompt_tokens - prefill_tokens)
            entry = self.sessions[key.session_id] = ServedSession(0, shared)
        entry.tokens = RULES[rule](key, entry.shared)
        entry.inflight += 1

    def finished(self, session_id: str, now: float) -> None:
        """A request of the session ended."""
        entry = self.sessions.get(session_id)
        if entry is not None:
            entry.inflight -= 1
            entry.ended = now

    def working_set(self, now: float, idle_s: float) -> int:
        """KV tokens the served sessions count; a session idle for more than ``idle_s`` (nothing
        in flight since its last request ended) is forgotten first."""
        idle_s = self.idle_after(idle_s)
        for sid, entry in list(self.sessions.items()):
            if entry.inflight <= 0 and now - entry.ended > idle_s:
                del self.sessions[sid]
                self.peaks.append(entry.tokens)
        expected = self.expected()
        return sum(max(entry.tokens, expected) for entry in self.sessions.values())

    def fits(self, key: RoutingKey, prefill_tokens: int, fleet_kv: int, share: float, rule: str,
             now: float, idle_s: float) -> bool:
        """Whether a new session whose first request has ``prefill_tokens`` not cached anywhere
        may start: the working set plus what it would add stays within ``share`` of the fleet's KV
        cache (always, when nothing is served: a fleet too small for one session is the engine's
        to refuse)."""
        working = self.working_set(now, idle_s)
        shared = max(0, key.est_prompt_tokens - prefill_tokens)
        need = max(RULES[rule](key, shared), self.expected())
        return working == 0 or working + need <= share * fleet_kv
