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
  holds that part once, however many sessions use it.  It learns from what the router sees: each
  session counts at least the size the last sessions reached, and a quiet one is forgotten after
  the pauses seen between turns (see :class:`Rule`).
* ``footprint``: its last request's prompt + ``max_tokens``, shared prefixes counted once per
  session, forgotten ``flow_session_idle_s`` after its last request (the first version; kept for
  reference).

The door itself (:class:`SessionDoor`) is flow control's part that asks the book: which queued
requests it holds (a new session's, its prefix not resident anywhere), whether the oldest of them
fits, and the sessions let in whose first request has not been sent yet (they count in the working
set meanwhile).  New sessions pass the door in their own line: highest class first, then oldest
first, none past another.

The book also knows which replica each session's last request went to: a new session passes
where one replica has room for it beside its own sessions (each counted at its size on the mean
over a session's life), with that replica as its *seat*, and its first turn is sent there
(:meth:`SessionBook.seat`; ``Dispatcher.route``).  Sessions sit unevenly on the replicas, so the
fleet's sum alone held new sessions while a replica idled with room, and let others in that
stacked on a replica at its count (docs/saturation.md, "A seat on a replica", "The ceiling with
pauses"); only while both kinds (below) are served does the fleet's sum still let one in.

Two *kinds* of session share the door (``kind``): those the client names, and the identities the
router derives for requests without a session id (a conversation without an id, or a one-shot
question under a shared system prompt: a repeat of the same question derives the same identity,
so only a longer prompt of a derived identity is a later turn, :meth:`SessionBook.is_new`).  While
both kinds are served, each may fill its fair part of the KV cache (an equal part per kind served)
whatever the other holds, and no more: the part one leaves unused is kept for it (a one-shot
question's session counts what it added, not the shared prompt it found resident).  Each kind's
line is its own: the oldest of each kind is asked in turn, and a kind's predicted wait counts only
its own line.  One kind past its part then waits for its own sessions to leave, not for the other
kind's (docs/saturation.md, "Agents and shared prefixes on one fleet": with one line, the agents'
sessions held the cache and the door shed the shared prefixes' questions).

Pure: no clock (``now`` is passed in), no I/O.  ``FlowControl`` (routing/flow.py) owns one
``SessionDoor`` per model.
"""

from __future__ import annotations

import heapq
import statistics
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field

from kvroute.routing.flow_queue import Ticket
from kvroute.routing.key import RoutingKey, client_named
from kvroute.routing.worker import WorkerState


@dataclass(slots=True)
class ServedSession:
    """One session the fleet serves."""

    tokens: int  # what it counts in the working set (by the rule)
    shared: int  # prompt tokens of its first request the fleet already held from other sessions
    inflight: int = 0  # requests sent and not finished
    queued: int = 0  # requests waiting at the router's gate
    ended: float = 0.0  # when its last request ended
    born: int = 0  # the book's count when it was entered: forgotten sessions' sizes keep this order
    mark: int = 0  # its entry among the quiet ones (SessionBook._quiet), while it is quiet
    pause: float | None = None  # its own longest pause between an answer and its next request
    pauses: int = 0  # how many pauses ``pause`` is the longest of
    grew: bool = False  # a later request came with a longer prompt than its first
    worker: str = ""  # the replica its last request went to, whose cache holds it ("": unknown)
    counted: int = 0  # the tokens it counted at each of its requests sent, summed (``lived``)
    sends: int = 0  # its requests sent
    fresh: bool = False  # only its first request was sent: it has not grown yet (``slow start``)

    def quiet(self) -> bool:
        """Nothing of it in flight or waiting at the gate."""
        return self.inflight <= 0 and self.queued <= 0


def unique_tokens(key: RoutingKey, shared: int) -> int:
    """What the session adds to the cache: its footprint less the prefix other sessions hold."""
    return max(0, key.footprint - shared)


def footprint_tokens(key: RoutingKey, shared: int) -> int:
    """Its whole footprint, shared prefix included."""
    return key.footprint


@dataclass(frozen=True, slots=True)
class Rule:
    """How a served session counts in the working set.

    ``tokens`` maps (the session's last request, its shared tokens) to the tokens it counts.  A
    rule that ``learns`` counts each session at least at the size the last sessions of its kind
    (:func:`kind`) to leave had reached (a session grows turn by turn: one admitted at its first
    turn's size would later push the working set past the cache), and forgets a quiet session
    after 1.5 x the longest of the recent pauses between a session's answer and its next request,
    rather than after the fixed ``flow_session_idle_s`` (a session that ended holds its place
    until it is forgotten, keeping a new one out) — or sooner, after ``OWN_PAUSES`` x the
    session's own longest pause, once it has paused ``OWN_SAMPLES`` times between turns.
    """

    tokens: Callable[[RoutingKey, int], int]
    learns: bool


RULES: dict[str, Rule] = {
    "unique": Rule(unique_tokens, learns=True),
    "footprint": Rule(footprint_tokens, learns=False),  # the first version, for reference
}

_SAMPLES = 8  # pauses or ended sessions seen before a rule learns from them
# A session quiet for this multiple of its own longest pause between turns has most likely ended
# (its next turn would have come by then); one that paused often enough is judged by its own
# pauses, not only the fleet's longest (one slow agent would keep every ended session counted).
OWN_PAUSES = 3.0
# Pauses a session must have made before its own are trusted: with pauses drawn at random (an
# agent's tools), the longest of one or two is often far below its next (in virtual time, with
# 3-s mean pauses, trusting one pause at 48 sessions let in sessions that had not ended: 53 % hits
# against 73 %).
OWN_SAMPLES = 3
_LEFT = 64  # sessions' departures the drain rate of the working set is measured over
# A kind whose last session left the book this recently is still served (``alone``): an open
# loop of questions pauses, and a fleet that serves agents and questions would otherwise seat
# its agents as if alone at each pause (in virtual time, 16 agents seated on every replica at the
# start of a step, before 2 req/s of questions came back: the questions' share 0.81 -> 0.70).
_KIND_GONE_S = 60.0
# A kind keeps its part after its last session left only where this many of its sessions left
# within ``_KIND_GONE_S``: fewer were strays, not a workload pausing (a readiness probe's one chat
# request, a user's curl).  Kept for one, it halved an agent fleet's door for a minute (over HTTP,
# 24 agents cold-started behind a benchmark's readiness request: 13,653 tokens/min against 16,469
# before a kind's part outlived its sessions; docs/saturation.md, "A stray request is no kind").
_KIND_MIN = 4
_CLIENTS = 4096  # clients whose last conversation is remembered
_SEEN = 65536  # sessions remembered as admitted, so that their later turns pass the door
KINDS = (True, False)  # the door's kinds of session: named by the client, derived by the router
NAMED = (True,)  # the door on for the sessions the client names only (FlowControl's door from the start)
_RUN = 512  # sizes per run of _Sizes (a run is split past twice this)


class _Sizes:
    """The sizes the sessions count, as a sorted multiset in runs of at most ``2 * _RUN`` (each
    with its sum and its largest), so that a size changes and the sum of those below a bound is
    read in time proportional to the number of runs plus one run's length, not to the book's
    (one sorted list would move half of it at every change)."""

    __slots__ = ("runs", "sums", "tops", "total")

    def __init__(self) -> None:
        self.runs: list[list[int]] = []
        self.sums: list[int] = []
        self.tops: list[int] = []  # each run's largest: where a size goes
        self.total = 0

    def add(self, size: int) -> None:
        """One more session counting ``size``."""
        self.total += size
        if not self.runs:
            self.runs.append([size])
            self.sums.append(size)
            self.tops.append(size)
            return
        k = min(bisect_left(self.tops, size), len(self.runs) - 1)
        run = self.runs[k]
        insort(run, size)
        self.sums[k] += size
        self.tops[k] = run[-1]
        if len(run) > 2 * _RUN:
            low, high = run[:_RUN], run[_RUN:]
            self.runs[k:k + 1] = [low, high]
            self.sums[k:k + 1] = [sum(low), sum(high)]
            self.tops[k:k + 1] = [low[-1], high[-1]]

    def remove(self, size: int) -> None:
        """One session counting ``size`` fewer (one that ``add`` counted)."""
        self.total -= size
        k = bisect_left(self.tops, size)  # the first run that can hold it holds it
        run = self.runs[k]
        del run[bisect_left(run, size)]
        if run:
            self.sums[k] -= size
            self.tops[k] = run[-1]
        else:
            del self.runs[k], self.sums[k], self.tops[k]

    def median(self) -> int:
        """The (upper) median size (0 when empty)."""
        i = sum(map(len, self.runs)) // 2
        for run in self.runs:
            if i < len(run):
                return run[i]
            i -= len(run)
        return 0

    def raised_to(self, floor: int) -> int:
        """The sum of the sizes, each at least ``floor``."""
        k = bisect_left(self.tops, floor)  # the runs before k lie wholly below it
        count = sum(map(len, self.runs[:k]))
        below = sum(self.sums[:k])
        if k < len(self.runs):
            run = self.runs[k]
            j = bisect_left(run, floor)
            count += j
            below += sum(run[:j])
        return self.total - below + floor * count


def _own_keep(pause: float) -> float:
    """How long a session that paused ``pause`` at most between its turns is kept once quiet, by
    its own pauses (at least 1 s: an agent with no pause still takes a moment to send its next
    turn)."""
    return max(1.0, OWN_PAUSES * pause)


@dataclass(slots=True)
class SessionBook:
    """The sessions one model's fleet serves, and the door for new ones.

    The door reads the book every few hundred milliseconds (``working_set``) while sessions stay in
    it for seconds after their last answer, so nothing read there rescans the sessions: the quiet
    ones are kept in a heap by when they ended (forgetting costs what expires, not what is served),
    and the sizes every session counts in sorted runs with their sums (:class:`_Sizes`: the
    working set is their total with the sizes below ``expected`` raised to it).  ``sessions`` is
    read-only outside these methods: they keep the three in step.
    """

    sessions: dict[str, ServedSession] = field(default_factory=dict)
    # Forgotten sessions' sizes, by kind (``kind``): a conversation grows turn by turn, a one-shot
    # question does not, so neither kind's sizes say what the other's reach; of the derived ids,
    # only those that came back longer (conversations) count (in virtual time, with the one-shots'
    # sizes as their kind's floor, shared-prefix questions beside 16 agents got 0.79 of their
    # share, against 0.93: docs/saturation.md, "Agents and shared prefixes on one fleet").
    peaks: dict[bool, deque[int]] = field(default_factory=lambda: {k: deque(maxlen=64) for k in KINDS})
    # The same sessions' mean sizes over their requests: what one holds of a replica's cache on
    # the mean over its life (``lived``, the seat's count).
    lives: dict[bool, deque[int]] = field(default_factory=lambda: {k: deque(maxlen=64) for k in KINDS})
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=256))  # answer -> next request
    sweep_at: int = 1024  # past this many sessions, a finished request sweeps the idle ones
    left: deque[float] = field(default_factory=lambda: deque(maxlen=_LEFT))  # when sessions left
    # Each client's (x-kvroute-client) last session, oldest client first.
    clients: OrderedDict[str, str] = field(default_factory=OrderedDict)
    # Sessions that were served (entered the book), oldest first, each with its first request's
    # prompt tokens: their later turns are not new sessions, even once the book forgot them while
    # they were quiet.
    seen: OrderedDict[str, int] = field(default_factory=OrderedDict)
    # (ended, mark, session id) of each quiet session, plus stale ones (the session was busy again,
    # ended again or was forgotten since: its mark moved on), dropped when they reach the top.
    _quiet: list[tuple[float, int, str]] = field(default_factory=list, repr=False, compare=False)
    # (when its own pauses say it ended, mark, session id) of each quiet session that has paused
    # between turns OWN_SAMPLES times (OWN_PAUSES), stale ones as in ``_quiet``.
    _own: list[tuple[float, int, str]] = field(default_factory=list, repr=False, compare=False)
    # Every session's tokens, by kind (client-named, derived: ``kind``).
    _sizes: dict[bool, _Sizes] = field(default_factory=lambda: {k: _Sizes() for k in KINDS},
                                       repr=False, compare=False)
    # The same, by (replica its last request went to, kind): what each replica's cache keeps.
    _placed: dict[tuple[str, bool], _Sizes] = field(default_factory=dict, repr=False, compare=False)
    # When the last session of each kind left the book (``alone``).
    gone_at: dict[bool, deque[float]] = field(
        default_factory=lambda: {k: deque(maxlen=_KIND_MIN) for k in KINDS})
    # The sessions last sent to each replica, by id (``evicts`` reads those paused there).
    _on: dict[str, set[str]] = field(default_factory=dict, repr=False, compare=False)
    # (when, tokens) of the last sessions that left the book from each replica (``evicts``).
    _left_from: dict[str, deque[tuple[float, int]]] = field(default_factory=dict, repr=False,
                                                             compare=False)
    # Sessions entered and quiet places handed out, for ``born`` and ``mark``.
    _count: int = field(default=0, repr=False, compare=False)
    # Sessions that left the book, by kind: a kind is learnt once ``_SAMPLES`` have (``learning``).
    departed: dict[bool, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    # Fresh sessions (``ServedSession.fresh``) by (replica their request went to, kind).
    _fresh: dict[tuple[str, bool], int] = field(default_factory=dict, repr=False, compare=False)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self.sessions

    def __len__(self) -> int:
        return len(self.sessions)

    def idle_after(self, rule: Rule, idle_s: float) -> float:
        """How long a quiet session is kept: 1.5 x the longest recent pause between turns (at
        least 1 s, at most ``idle_s``) for a rule that learns, else ``idle_s``.  (A session that
        paused ``OWN_SAMPLES`` times between its turns is forgotten sooner where ``OWN_PAUSES`` x
        its own longest pause is shorter: ``forget_idle`` and ``live`` apply that bound.)"""
        if not rule.learns or len(self.gaps) < _SAMPLES:
            return idle_s
        return min(idle_s, max(1.0, 1.5 * max(self.gaps)))

    def expected(self, rule: Rule, of: bool = True) -> int:
        """The size a session of kind ``of`` (:func:`kind`) is expected to reach: the median of
        the last forgotten ones' of its kind (0 for a rule that does not learn, or until a few
        have left)."""
        peaks = self.peaks[of]
        if not rule.learns or len(peaks) < _SAMPLES:
            return 0
        return int(statistics.median(peaks))

    def lived(self, rule: Rule, of: bool = True) -> int:
        """The size a session of kind ``of`` holds on the mean over its life: the median of the
        last forgotten ones' mean sizes over their requests (0 for a rule that does not learn, or
        until a few have left).  The seat counts each session at least this, not ``expected``: a
        replica's sessions are at different turns, and seldom all at their largest at once (in
        virtual time, agents of 7,250 to 10,500 tokens on replicas of 40,690: counted at their
        largest a replica seats three, and four make 12 % more; docs/saturation.md, "The
        ceiling with pauses").  Only where one kind is served (``seat``)."""
        lives = self.lives[of]
        if not rule.learns or len(lives) < _SAMPLES:
            return 0
        return int(statistics.median(lives))

    def learning(self, of: bool) -> bool:
        """Whether the book has yet to learn how large sessions of kind ``of`` grow: fewer than
        ``_SAMPLES`` of them have left it (a cold start)."""
        return self.departed[of] < _SAMPLES

    def typical(self, of: bool) -> int:
        """The median of the tokens the served sessions of kind ``of`` count now (0: none
        served): sessions at every turn of their lives, so it stands in for ``lived`` until
        sessions have left."""
        return self._sizes[of].median()

    def fresh_on(self, worker: str, of: bool) -> int:
        """How many sessions of kind ``of`` last sent to ``worker`` have sent only their first
        request (:attr:`ServedSession.fresh`)."""
        return self._fresh.get((worker, of), 0)

    def count_on(self, worker: str, of: bool) -> int:
        """How many served sessions of kind ``of`` were last sent to ``worker``."""
        sizes = self._placed.get((worker, of))
        return sum(map(len, sizes.runs)) if sizes is not None else 0

    def _freshen(self, session_id: str, entry: ServedSession, sign: int) -> None:
        """Count (+1) or stop counting (-1) fresh ``entry`` on the replica it was sent to."""
        at = (entry.worker, kind(session_id))
        left = self._fresh.get(at, 0) + sign
        if left:
            self._fresh[at] = left
        else:
            del self._fresh[at]

    def arrived(self, session_id: str, now: float, client: str | None = None) -> None:
        """A request of the session reached the router: if the session was quiet, the pause since
        its last answer is one more sample (the fleet's and its own).  A ``client``
        (``x-kvroute-client``) that starts another session has ended its previous one: that one
        is forgotten now if it is quiet, rather than after the pauses."""
        entry = self.sessions.get(session_id)
        if entry is not None and entry.quiet():
            gap = max(0.0, now - entry.ended)
            self.gaps.append(gap)
            entry.pause = gap if entry.pause is None else max(entry.pause, gap)
            entry.pauses += 1
        if client is None:
            return
        old = self.clients.get(client)
        self.clients[client] = session_id
        self.clients.move_to_end(client)
        if len(self.clients) > _CLIENTS:
            self.clients.popitem(last=False)
        if old is not None and old != session_id:
            former = self.sessions.get(old)
            if former is not None and former.quiet():
                self._forget([(old, former)], now)

    def is_new(self, session_id: str, prompt_tokens: int) -> bool:
        """Whether a request of ``session_id`` with ``prompt_tokens`` opens a session the fleet
        does not serve (as far as the book remembers): a later turn of one it served does not, even
        after the book forgot it.  For an identity the router derived, a later turn is a longer
        prompt than its first: the same prompt again is the same question asked again (a one-shot
        client's repeat derives the same identity), which is a new session at the door (in virtual
        time, at 10 req/s of shared-prefix questions, repeats let past the door as later turns
        thrashed one seed of eight: 4.53 req/s, 65 % hits)."""
        if session_id in self.sessions:
            return False
        first = self.seen.get(session_id)
        if first is None:
            return True
        return not client_named(session_id) and prompt_tokens <= first

    def leave_rate(self, now: float) -> float:
        """Sessions leaving the working set per second (forgotten as ended, or freed by their
        client's next conversation), over the last departures: how fast the door drains."""
        left = self.left
        if len(left) < 2:
            return 0.0
        span = max(now, left[-1]) - left[0]
        return (len(left) - 1) / span if span > 0 else 0.0

    def queued(self, session_id: str, delta: int) -> None:
        """A request of the session started (+1) or stopped (-1) waiting at the gate: a session
        waiting there is not idle, however long it waits."""
        entry = self.sessions.get(session_id)
        if entry is not None:
            was_quiet = entry.quiet()
            entry.queued = max(0, entry.queued + delta)
            self._settled(session_id, entry, was_quiet, entry.ended)

    def _place(self, session_id: str, entry: ServedSession, sign: int) -> None:
        """Count (+1) or stop counting (-1) ``entry`` on the replica it was last sent to."""
        at = (entry.worker, kind(session_id))
        sizes = self._placed.get(at)
        if sizes is None:
            sizes = self._placed[at] = _Sizes()
        on = self._on.setdefault(entry.worker, set())
        if sign > 0:
            sizes.add(entry.tokens)
            on.add(session_id)
        else:
            sizes.remove(entry.tokens)
            on.discard(session_id)
            if not sizes.runs:  # a replica that left keeps no entry
                del self._placed[at]
            if not on:
                del self._on[entry.worker]

    def sent(self, key: RoutingKey, prefill_tokens: int, rule: str, worker: str = "") -> None:
        """A request of ``key``'s session left for ``worker`` (its id; "" where unknown), which had
        to compute ``prefill_tokens`` of its prompt (the routing decision's prediction)."""
        assert key.session_id is not None
        entry = self.sessions.get(key.session_id)
        if entry is None:
            shared = max(0, key.est_prompt_tokens - prefill_tokens)
            self._count += 1
            entry = self.sessions[key.session_id] = ServedSession(0, shared, born=self._count,
                                                                  worker=worker)
            entry.tokens = RULES[rule].tokens(key, shared)
            self._sizes[kind(key.session_id)].add(entry.tokens)
            self._place(key.session_id, entry, +1)
            # Back after the book forgot it while quiet, it has grown already.
            entry.fresh = key.session_id not in self.seen
            if entry.fresh:
                self._freshen(key.session_id, entry, +1)
            # A session back after a pause is recent again; its first prompt stays its first.
            self.seen[key.session_id] = self.seen.get(key.session_id, key.est_prompt_tokens)
            self.seen.move_to_end(key.session_id)
            if len(self.seen) > _SEEN:
                self.seen.popitem(last=False)
        else:
            if entry.fresh:
                entry.fresh = False
                self._freshen(key.session_id, entry, -1)
            first = self.seen.get(key.session_id, key.est_prompt_tokens)
            entry.grew = entry.grew or key.est_prompt_tokens > first
            tokens = RULES[rule].tokens(key, entry.shared)
            if tokens != entry.tokens or worker != entry.worker:
                sizes = self._sizes[kind(key.session_id)]
                sizes.remove(entry.tokens)
                sizes.add(tokens)
                self._place(key.session_id, entry, -1)
                entry.tokens, entry.worker = tokens, worker
                self._place(key.session_id, entry, +1)
        entry.counted += entry.tokens
        entry.sends += 1
        was_quiet = entry.quiet()
        entry.inflight += 1
        self._settled(key.session_id, entry, was_quiet, entry.ended)

    def finished(self, session_id: str, now: float) -> None:
        """A request of the session ended."""
        entry = self.sessions.get(session_id)
        if entry is not None:
            was_quiet, ended = entry.quiet(), entry.ended
            entry.inflight -= 1
            entry.ended = now
            self._settled(session_id, entry, was_quiet, ended)

    def _settled(self, session_id: str, entry: ServedSession, was_quiet: bool, ended: float) -> None:
        """``entry`` changed: one that turned quiet, or ended again while quiet, takes its place
        among the quiet ones (its former place, if any, goes stale)."""
        if entry.quiet() and (not was_quiet or entry.ended != ended):
            self._count += 1
            entry.mark = self._count
            heapq.heappush(self._quiet, (entry.ended, entry.mark, session_id))
            if entry.pause is not None and entry.pauses >= OWN_SAMPLES:
                heapq.heappush(self._own, (entry.ended + _own_keep(entry.pause), entry.mark, session_id))
            if len(self._quiet) + len(self._own) > 4 * len(self.sessions) + 128:
                # Mostly stale places (sessions busy again): rebuilt, so the heaps stay within a
                # multiple of the book, at a cost spread over the pushes that filled them.
                quiet = [(sid, e) for sid, e in self.sessions.items() if e.quiet()]
                self._quiet = [(e.ended, e.mark, sid) for sid, e in quiet]
                self._own = [(e.ended + _own_keep(e.pause), e.mark, sid) for sid, e in quiet
                             if e.pause is not None and e.pauses >= OWN_SAMPLES]
                heapq.heapify(self._quiet)
                heapq.heapify(self._own)

    def _current(self, place: tuple[float, int, str]) -> ServedSession | None:
        """The session a place among the quiet ones stands for, if that place is not stale."""
        entry = self.sessions.get(place[2])
        return entry if entry is not None and entry.mark == place[1] and entry.quiet() else None

    def forget_idle(self, now: float, idle_s: float, rule: str) -> None:
        """Forget the sessions quiet for longer than the rule keeps one (see :class:`Rule`): only
        the places of those that ended longest ago are looked at."""
        r = RULES[rule]
        keep = self.idle_after(r, idle_s)
        heap = self._quiet
        gone: dict[str, ServedSession] = {}
        while heap and heap[0][0] < now - keep:
            place = heapq.heappop(heap)
            entry = self._current(place)
            if entry is not None:
                gone[place[2]] = entry
        own = self._own
        while r.learns and own and own[0][0] < now:
            place = heapq.heappop(own)
            entry = self._current(place)
            if entry is not None:
                gone[place[2]] = entry
        if gone:
            self._forget(list(gone.items()), now)

    def _forget(self, gone: list[tuple[str, ServedSession]], now: float) -> None:
        """The sessions ``gone`` ended: out of the book, their sizes kept for ``expected`` (in the
        order they entered it: ``peaks`` keeps only the last ones appended; a derived id's only
        if it grew), their departures for ``leave_rate``.  Their places among the quiet ones go
        stale."""
        gone.sort(key=lambda item: item[1].born)
        for sid, entry in gone:
            del self.sessions[sid]
            self._sizes[kind(sid)].remove(entry.tokens)
            self._place(sid, entry, -1)
            if entry.fresh:
                self._freshen(sid, entry, -1)
            self.departed[kind(sid)] += 1
            if kind(sid) or entry.grew:  # a derived id that never grew was no conversation
                self.peaks[kind(sid)].append(entry.tokens)
                self.lives[kind(sid)].append(entry.counted // max(1, entry.sends))
            self.left.append(now)
            self.gone_at[kind(sid)].append(now)
            left_from = self._left_from.get(entry.worker)
            if left_from is None:
                left_from = self._left_from[entry.worker] = deque(maxlen=_LEFT)
            left_from.append((now, entry.tokens))

    def sweep(self, now: float, idle_s: float, rule: str) -> None:
        """Bound the book where the door is not asked (KV sizes unknown, every turn resident): once
        it holds more than ``sweep_at`` sessions, the idle ones are forgotten (what
        ``working_set`` would do first anyway) and the next sweep waits for twice what is left."""
        self.forget_idle(now, idle_s, rule)
        self.sweep_at = max(1024, 2 * len(self.sessions))

    def live(self, now: float, idle_s: float, rule: str) -> int:
        """How many sessions the working set counts now (read-only: the idle ones are not)."""
        r = RULES[rule]
        keep = self.idle_after(r, idle_s)
        idle: set[str] = set()
        # The heaps' places that expired form a subtree at each root: walk only those.
        # (A quiet place's first field is when it ended, an own one's when its own pauses run out.)
        for heap, before in ((self._quiet, now - keep), (self._own if r.learns else [], now)):
            below = [0]
            while below:
                i = below.pop()
                if i < len(heap) and heap[i][0] < before:
                    if self._current(heap[i]) is not None:
                        idle.add(heap[i][2])
                    below += (2 * i + 1, 2 * i + 2)
        return len(self.sessions) - len(idle)

    def working_set(self, now: float, idle_s: float, rule: str, of: bool | None = None,
                    lived: bool = False) -> int:
        """KV tokens the served sessions count (each at least ``expected`` of its kind, or
        ``lived`` with ``lived``), the idle ones forgotten first; only those of kind ``of``
        (:func:`kind`), if given."""
        self.forget_idle(now, idle_s, rule)
        r = RULES[rule]
        return sum(self._sizes[k].raised_to(self.lived(r, k) if lived else self.expected(r, k))
                   for k in KINDS if of is None or k == of)

    def alone(self, joining: bool, now: float) -> bool:
        """Whether the fleet serves no kind of session but ``joining``'s (:meth:`kinds`)."""
        return self.kinds(joining, now) == 1

    def kinds(self, joining: bool, now: float) -> int:
        """How many kinds of session (:func:`kind`) the fleet serves, a session of kind
        ``joining`` counted: those with a session in the book, or one that left it within
        ``_KIND_GONE_S``.  A kind whose sessions all left a moment ago keeps its part: counted
        only while in the book, a step's 16 new agents arriving before 2 req/s of questions came
        back each passed against the whole fleet's KV, twice their part, and the questions
        waited behind them at the door for 100 s (virtual time, seed 0: their share 0.72;
        docs/saturation.md, "A kind's part outlives a pause of its sessions")."""
        return sum(1 for k in KINDS if k == joining or self._serves(k, now))

    def _serves(self, k: bool, now: float) -> bool:
        """Whether kind ``k`` is served: a session of it in the book, or ``_KIND_MIN`` of them gone
        from it within ``_KIND_GONE_S`` (fewer were strays, not a workload pausing)."""
        if self._sizes[k].runs:
            return True
        gone = self.gone_at[k]
        return len(gone) == _KIND_MIN and now - gone[0] <= _KIND_GONE_S

    def fits(self, key: RoutingKey, prefill_tokens: int, fleet_kv: int, share: float, rule: str,
             now: float, idle_s: float, opened: int = 0, opened_own: int = 0) -> bool:
        """Whether a new session whose first request has ``prefill_tokens`` not cached anywhere
        may start: the working set (plus ``opened``, the sessions let in and not sent yet) plus
        what it would add stays within ``share`` of the fleet's KV cache (always, when nothing is
        served: a fleet too small for one session is the engine's to refuse); while both kinds of
        session are served (:meth:`kinds`), its own kind's (plus ``opened_own``, those of
        ``opened`` of its kind; each session at least ``lived``) stays within that kind's fair
        part of it, ``share`` over the kinds served, and no more: the part another kind leaves
        unused is kept for it, not lent."""
        assert key.session_id is not None
        working = self.working_set(now, idle_s, rule) + opened
        if working == 0:
            return True
        if self.alone(kind(key.session_id), now):
            return working + self.need(key, prefill_tokens, rule) <= share * fleet_kv
        return self._in_part(key, prefill_tokens, fleet_kv, share, rule, now, idle_s, opened_own)

    def _in_part(self, key: RoutingKey, prefill_tokens: int, fleet_kv: int, share: float, rule: str,
                 now: float, idle_s: float, opened_own: int) -> bool:
        """Whether a new session of ``key``'s kind fits that kind's fair part of ``share`` of the
        fleet's KV cache, ``fleet_kv`` (``fits`` and ``seat``, while both kinds are served): its
        kind's working set (plus ``opened_own``) and what it adds, each session at least
        ``lived``."""
        assert key.session_id is not None
        mine = kind(key.session_id)
        # Not lent: one-shot questions' sessions count what each added, not the shared prompt
        # they find resident (held once, counted by none of them once warm), so their kind looks
        # to leave room it uses.  Lent, agents beside them took that room and evicted the
        # prompts (virtual time, 16 agents beside 1 req/s of questions, seed 0: 85 of 175
        # questions found theirs on no replica; the questions' TTFT p50 over seeds 0-3 3.38 s,
        # kept 0.38 s: docs/saturation.md, "Each kind keeps its part of the cache").
        # Each session counts its size over its life, as the door of its kind alone on its part
        # of the fleet does (the seat): counted at their largest, 16 agents beside 2 req/s of
        # questions kept 7 sessions where alone on half of the fleet they keep 8, and got
        # 0.75-0.85 of their share (virtual time, seeds 0-7; 0.82-0.91 counted so:
        # docs/saturation.md, "A kind's part outlives a pause of its sessions").
        own = self.working_set(now, idle_s, rule, of=mine, lived=True) + opened_own
        need = self.need(key, prefill_tokens, rule, seated=True)
        return own + need <= share * fleet_kv / self.kinds(mine, now)

    def placed(self, worker: str, now: float, idle_s: float, rule: str, lived: bool = False,
               floor: int = 0) -> int:
        """KV tokens the served sessions last sent to ``worker`` count (each at least ``expected``
        of its kind, or ``lived`` with ``lived``, and at least ``floor``), the idle ones forgotten
        first."""
        self.forget_idle(now, idle_s, rule)
        r = RULES[rule]
        return sum(self._placed[(worker, k)].raised_to(
                       max(floor, self.lived(r, k) if lived else self.expected(r, k)))
                   for k in KINDS
                   if (worker, k) in self._placed)

    def evicts(self, worker: str, kv: int, need: int) -> bool:
        """Whether a new session adding ``need`` tokens on ``worker`` (``kv`` tokens of KV cache)
        would evict the history of a session paused there, by the engine's LRU order.

        An engine keeps what finished requests leave in its cache on a free list and takes new
        blocks from the head, the content freed longest ago first (vLLM's prefix cache; the
        simulator's block pool).  A paused session's history went there when its last answer
        ended; a session that ended since (its client started another: the usual way a seat
        frees up) left its history behind it, so a new session's prefill evicts the paused one's
        first and spares the dead one.  Ahead of the oldest paused session's history lies about
        ``kv`` less what the replica's sessions hold less what those that left the book from it
        since it paused held (the cache is full once warm); a prefill of more than that
        evicts it, and its next turn prefills its history again (in virtual time, agents with
        pauses at 24-48 sessions: ~47 such turns a step, ~4,100 tokens each; docs/saturation.md,
        "The seat waits for a paused history").  False where no session paused there."""
        paused = [self.sessions[sid] for sid in self._on.get(worker, ())]
        oldest = min((e.ended for e in paused if e.quiet()), default=None)
        if oldest is None:
            return False
        held = sum(e.tokens for e in paused)
        since = sum(tokens for at, tokens in self._left_from.get(worker, ()) if at > oldest)
        return kv - held - since < need

    def seat(self, key: RoutingKey, prefill_tokens: int, replicas: Sequence[tuple[str, int]],
             share: float, rule: str, now: float, idle_s: float,
             opened: Callable[[str], int] = lambda worker: 0, opened_own: int = 0,
             slow_start: int = 0) -> str | None:
        """The replica a new session whose first request has ``prefill_tokens`` not cached anywhere
        may start on although the fleet's working set is past ``share`` of its KV (``fits``):
        among ``replicas`` (id, KV tokens), one whose own served sessions (each at least
        ``lived`` where one kind is served, else ``expected``; plus ``opened(replica)``, those
        let in and not sent yet that may land there) plus what the new one adds stay within
        ``share`` of its KV cache — always one that
        keeps none (a replica too small for one session is the engine's to refuse).  Of those,
        the one with the most room left; None where none has room, or while both kinds of
        session are served and its kind (plus ``opened_own``) would pass its fair part of the
        fleet's KV (each of its sessions at least ``lived``, as in ``fits``: a seat is room on a
        replica, never the other kind's part), or, where one kind is served, while its first
        prefill on that replica would evict a paused session's history (``evicts``).

        A replica's cache keeps the sessions sent to it: where the sessions sit unevenly, the
        fleet's sum holds a new session while a replica has room for it, and that replica idles
        while its own sessions pause (docs/saturation.md, "A seat on a replica").  The seat is
        where its first turn goes (``Dispatcher.route``): placed elsewhere, it would evict the
        sessions counted there.

        ``slow_start`` (a window; 0: off): where one kind is served and the book is still
        ``learning`` how large its sessions grow (a cold start), each session counts at least the
        ``typical`` one served, and a replica takes a new session only while its ``fresh`` ones
        (not seen past their first request; one let in for it and not sent yet counts as one)
        number fewer than the window, or than its sessions seen past their first request.  A cold
        fleet's first turns all look small: seated by their size, five agents a replica outgrew
        its cache a few turns later (docs/saturation.md, "The cold start")."""
        assert key.session_id is not None
        mine = kind(key.session_id)
        alone = self.alone(mine, now)
        if not alone and not self._in_part(key, prefill_tokens, sum(kv for _, kv in replicas), share,
                                           rule, now, idle_s, opened_own):
            return None
        # Where one kind is served a replica's sessions count at ``lived``, else at their largest
        # (while both kinds are, the door asks for a seat only once its kind's part has no room,
        # ``SessionDoor.fits``; a seat given there too cost the questions: docs/saturation.md,
        # "Tried and not kept", "A kind's part on the mixed fleet").
        need = self.need(key, prefill_tokens, rule, seated=alone)
        cold = slow_start > 0 and alone and self.learning(mine)
        floor = self.typical(mine) if cold else 0
        need = max(need, floor)
        best: str | None = None
        most = 0.0
        size = 0
        for worker, kv in replicas:
            pending = opened(worker)
            fresh = self.fresh_on(worker, mine)
            if cold and fresh + bool(pending) >= max(slow_start, self.count_on(worker, mine) - fresh):
                continue
            total = self.placed(worker, now, idle_s, rule, lived=alone, floor=floor) + pending
            room = share * kv - total - need
            if (room >= 0 or not total) and (best is None or room > most):
                best, most, size = worker, room, kv
        # Where one kind is served, a seat whose first prefill would evict a paused session's
        # history waits for that session's next turn (``evicts``); the session is not sent to a
        # replica with less room meanwhile (as often better as worse in virtual time:
        # docs/saturation.md, "The seat waits for a paused history").
        if best is not None and alone and self.evicts(best, size, need):
            return None
        return best

    def need(self, key: RoutingKey, prefill_tokens: int, rule: str, seated: bool = False) -> int:
        """What a new session whose first request has ``prefill_tokens`` not cached anywhere adds
        to the working set (``seated``: to its seat's count, at least ``lived``)."""
        assert key.session_id is not None
        r = RULES[rule]
        shared = max(0, key.est_prompt_tokens - prefill_tokens)
        mine = kind(key.session_id)
        return max(r.tokens(key, shared), self.lived(r, mine) if seated else self.expected(r, mine))


def kind(session_id: str) -> bool:
    """The door's kind of a session (``KINDS``): named by the client (True), or an identity the
    router derived (False)."""
    return client_named(session_id)


# Shed first turns whose place in the door's line is kept for their return, at most.
_PLACES = 1024


def door_order(t: Ticket) -> tuple[int, float, int]:
    """The door's line: highest class first, then the earliest place (a first turn that was shed
    and came back keeps the place it had), then arrival."""
    return (-t.priority, t.place, t.seq)


@dataclass(slots=True)
class SessionDoor:
    """Session admission at one model's gate.  ``on`` (every method's switch) is the kinds of
    session (:func:`kind`) it applies to now (``KINDS``, ``NAMED`` or none: FlowControl's
    ``_door_kinds``)."""

    book: SessionBook = field(default_factory=SessionBook)
    # Working-set tokens of new sessions let in at the door and not yet sent, by (their seat, kind).
    opened: dict[tuple[str, bool], int] = field(default_factory=dict)
    # The seats of new sessions granted and not yet routed, by session (at most ``_PLACES``).
    seats: OrderedDict[str, str] = field(default_factory=OrderedDict)
    # First turns shed while held at the door, by session: (their place in the line, until when it
    # is kept for them), the oldest kept first.
    places: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)

    def is_new(self, key: RoutingKey, on: Container[bool]) -> bool:
        """Whether session admission applies to ``key``: on for its kind, and a session the fleet
        has not served (a later turn of an admitted session never waits at the door)."""
        sid = key.session_id
        return sid is not None and kind(sid) in on and self.book.is_new(sid, key.est_prompt_tokens)

    def holds(self, t: Ticket, on: Container[bool]) -> bool:
        """Whether the door holds ``t``: a new session's request whose prefix is not resident (nor
        its session bound by another router instance: ``Ticket.bound``)."""
        return not t.resident and not t.bound and self.is_new(t.key, on)

    def line(self, tickets: Iterable[Ticket], on: Container[bool]) -> deque[Ticket]:
        """The requests the door holds, in the order they pass it (:func:`door_order`)."""
        return deque(sorted((t for t in tickets if self.holds(t, on)), key=door_order))

    @staticmethod
    def heads(line: Iterable[Ticket]) -> list[Ticket]:
        """The first of each kind of session (:func:`kind`) in the door's ``line``, in its order:
        the ones that may pass next (each kind's line is its own)."""
        firsts: dict[bool, Ticket] = {}
        for t in line:
            assert t.key.session_id is not None
            firsts.setdefault(kind(t.key.session_id), t)
            if len(firsts) == len(KINDS):
                break
        return list(firsts.values())

    def waiting(self, tickets: Iterable[Ticket], on: Container[bool]) -> int:
        """How many new sessions have a request held at the door."""
        return len({t.key.session_id for t in tickets if self.holds(t, on)})

    def returned(self, t: Ticket, now: float) -> None:
        """``t`` arrived: a first turn shed at the door that comes back within the time its place
        was kept for takes that place again."""
        sid = t.key.session_id
        if sid is None:
            return
        kept = self.places.pop(sid, None)
        if kept is not None and now <= kept[1]:
            t.place = min(t.place, kept[0])

    def remember(self, t: Ticket, now: float, keep_s: float) -> None:
        """Held ``t`` was shed at the door: its place is kept for its return for ``keep_s``
        (its Retry-After and the queue TTL); the oldest kept go first past ``_PLACES``."""
        sid = t.key.session_id
        if sid is None:
            return
        self.places[sid] = (t.place, now + keep_s)
        self.places.move_to_end(sid)
        while len(self.places) > _PLACES:
            self.places.popitem(last=False)

    def kept(self, now: float) -> int:
        """How many shed first turns' places are kept for their return at ``now`` (those past
        their time are dropped)."""
        places = self.places
        while places:
            sid, (_, until) = next(iter(places.items()))
            if until >= now:
                break
            del places[sid]
        return len(places)

    def ahead(self, t: Ticket, tickets: Iterable[Ticket], now: float, on: Container[bool]) -> int:
        """How many new sessions of its kind (:func:`kind`) stand before held ``t`` in the door's
        line: those held with an earlier place, and those shed from an earlier place whose place
        is still kept (they are coming back)."""
        line = [u for u in tickets if u is not t]
        line.append(t)
        return next(n for u, n in self.aheads(line, now, on) if u is t)

    def aheads(self, tickets: Iterable[Ticket], now: float, on: Container[bool]) -> list[tuple[Ticket, int]]:
        """:meth:`ahead` of every request the door holds among ``tickets``, in the door's order, in
        one pass (the queue's pump asks it of all of them)."""
        for gone in [other for other, (_, until) in self.places.items() if until < now]:
            del self.places[gone]
        kept: dict[bool, list[float]] = {}
        for other, (at, _) in self.places.items():
            kept.setdefault(kind(other), []).append(at)
        for places in kept.values():
            places.sort()
        seen: dict[bool, set[str]] = {}
        # Kept places of sessions held too (a shed first turn sent again while its place is
        # kept: rare), which count once, as held.
        both: dict[bool, list[float]] = {}
        out: list[tuple[Ticket, int]] = []
        for t in self.line(tickets, on):
            sid = t.key.session_id
            assert sid is not None
            own = kind(sid)
            held = seen.setdefault(own, set())
            twice = both.setdefault(own, [])
            before = bisect_left(kept.get(own, []), t.place) - sum(1 for p in twice if p < t.place)
            place = self.places.get(sid)
            first = sid not in held
            # Its own kept place is no session ahead of it.
            own_place = first and place is not None and place[0] < t.place
            out.append((t, len(held) + before - own_place))
            if first:
                held.add(sid)
                if place is not None:
                    twice.append(place[0])
        return out

    def wait_s(self, t: Ticket, tickets: Iterable[Ticket], now: float, on: Container[bool]) -> float | None:
        """The predicted wait of held ``t`` at the door: the sessions of its kind before it and
        itself over the rate at which served sessions leave the working set (each that leaves
        makes room for about one more); None until that rate is measured."""
        rate = self.book.leave_rate(now)
        if rate <= 0:
            return None
        return (self.ahead(t, tickets, now, on) + 1) / rate

    def waits(self, tickets: Iterable[Ticket], now: float, on: Container[bool]) -> list[tuple[Ticket, float]]:
        """:meth:`wait_s` of every request the door holds among ``tickets`` (the wait left from
        ``now``: the sessions still ahead of each); empty until the rate is measured."""
        rate = self.book.leave_rate(now)
        if rate <= 0:
            return []
        return [(t, (n + 1) / rate) for t, n in self.aheads(tickets, now, on)]

    def fits(self, t: Ticket, workers: Sequence[WorkerState], now: float, on: Container[bool], *,
             fill: float, rule: str, idle_s: float, door_s: float,
             seat_fill: float | None = None, slow_start: int = 0) -> bool:
        """Whether ``t`` may pass as far as session admission goes.  A request of a session the
        fleet serves, or whose prefix is still resident (a session forgotten while quiet), always
        fits; a new session's first request fits while one replica has room for it within
        ``seat_fill`` (default ``fill``) of its KV beside the sessions it serves
        (:meth:`SessionBook.seat`), which becomes ``t.seat``, or, while both kinds are served,
        while its kind's working set has room for it within its fair part of ``fill``
        (``flow_session_fill``) of the fleet's KV cache (:meth:`SessionBook.fits`); or
        once it has waited ``door_s`` (``flow_session_door_s``; 0: never) — always, when the door
        is off, the request has no session or the KV sizes are unknown.  Sessions let in and not
        sent yet count in the working set, and on their seat (those let in without one, on every
        replica).  ``slow_start`` (``flow_session_slow_start``): the seat's cold start
        (:meth:`SessionBook.seat`)."""
        t.seat = None
        if not self.holds(t, on):
            return True
        if door_s and now - t.arrived >= door_s:
            return True
        replicas: list[tuple[str, int]] = []
        for w in workers:
            if w.ready and w.serves(t.key.model):
                if w.kv_tokens is None:
                    return True
                replicas.append((w.id, w.kv_tokens))
        sid = t.key.session_id
        assert sid is not None
        mine = kind(sid)
        opened = sum(self.opened.values())
        own = sum(n for (_, of), n in self.opened.items() if of == mine)
        # Where one kind is served, a new session passes only on a seat: the fleet's sum let
        # sessions in that placement then stacked on a replica already at its count, while
        # another idled (in virtual time, agents with pauses at 24 / 32 / 48 sessions: 20,523 /
        # 20,053 / 20,171 tokens/min seated only, against 18,347 / 18,709 / 19,125;
        # docs/saturation.md, "The ceiling with pauses").
        # There the seat's count takes the sessions' pauses in, and keeps ``seat_fill``.  While
        # both kinds are served everything is as before the seat was the only test.
        alone = self.book.alone(mine, now)
        if not alone and self.book.fits(
                t.key, t.prefill_tokens, sum(kv for _, kv in replicas), fill, rule, now, idle_s,
                opened, own):
            return True
        # One let in by the fleet's test has no seat: it may land on any replica.
        unseated = sum(n for (seat, _), n in self.opened.items() if not seat)
        t.seat = self.book.seat(
            t.key, t.prefill_tokens, replicas, seat_fill if alone and seat_fill is not None else fill,
            rule, now, idle_s,
            lambda worker: unseated + sum(self.opened.get((worker, k), 0) for k in KINDS), own,
            slow_start)
        return t.seat is not None

    def let_in(self, t: Ticket, rule: str, now: float) -> None:
        """``t`` passes the door at ``now``: what its session adds counts on its seat until it is
        sent."""
        assert t.key.session_id is not None
        t.door_tokens = self.book.need(t.key, t.prefill_tokens, rule, seated=t.seat is not None and
                                       self.book.alone(kind(t.key.session_id), now))
        at = (t.seat or "", kind(t.key.session_id))
        self.opened[at] = self.opened.get(at, 0) + t.door_tokens

    def claimed(self, t: Ticket) -> None:
        """``t``, let in, is being sent (or was withdrawn): from its send on its session counts in
        the book, no longer through ``opened``."""
        if t.door_tokens and t.key.session_id is not None:
            at = (t.seat or "", kind(t.key.session_id))
            left = self.opened[at] - t.door_tokens
            if left:
                self.opened[at] = left
            else:
                del self.opened[at]
        t.door_tokens = 0

    def granted(self, t: Ticket) -> None:
        """``t`` passed the gate: its seat, if the door gave it one, waits for its routing
        (``take_seat``); the oldest go first past ``_PLACES`` (an edge that never routed)."""
        sid = t.key.session_id
        if t.seat is None or sid is None:
            return
        self.seats[sid] = t.seat
        self.seats.move_to_end(sid)
        while len(self.seats) > _PLACES:
            self.seats.popitem(last=False)

    def take_seat(self, session_id: str | None) -> str | None:
        """The seat the door gave the session's request now being routed (once)."""
        return None if session_id is None else self.seats.pop(session_id, None)
