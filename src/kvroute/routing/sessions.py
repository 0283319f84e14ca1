"""Session stickiness's table: session -> worker, with idle expiry and a bound on entries.

Sessions are keyed by a 64-bit hash of (cache scope, session id), so the table and the messages
shared between router instances never carry the raw id, and a session that talks to two models
keeps one binding per model.  Entries are kept in least-recently-seen order, so expiry and
eviction both pop from the front.  Per-worker counts of bound and of recently active sessions
are kept up to date as bindings change, so reading them costs nothing per session.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class Binding:
    """Where one session lives, when it last sent a request, and whether it counts as active there
    (not a one-shot's: ``SessionTable.bind``)."""

    worker_id: str
    last_seen: float
    active: bool = True


@dataclass(slots=True)
class _ActiveWindow:
    """Sessions seen within one window, oldest first, and how many live on each worker."""

    within_s: float
    seen: OrderedDict[int, Binding] = field(default_factory=OrderedDict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, session: int, worker_id: str, now: float) -> None:
        self.remove(session)
        self.seen[session] = Binding(worker_id, now)
        self.counts[worker_id] = self.counts.get(worker_id, 0) + 1

    def remove(self, session: int) -> None:
        old = self.seen.pop(session, None)
        if old is not None:
            self._uncount(old.worker_id)

    def expire(self, now: float) -> None:
        cutoff = now - self.within_s
        seen = self.seen
        while seen:
            session, oldest = next(iter(seen.items()))
            if oldest.last_seen >= cutoff:
                break
            del seen[session]
            self._uncount(oldest.worker_id)

    def _uncount(self, worker_id: str) -> None:
        n = self.counts[worker_id] - 1
        if n:
            self.counts[worker_id] = n
        else:
            del self.counts[worker_id]


class SessionTable:
    """Bounded, expiring session bindings with per-worker counts of bound and active sessions."""

    def __init__(self, ttl_s: float = 3600.0, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._bindings: OrderedDict[int, Binding] = OrderedDict()
        self._per_worker: dict[str, int] = {}
        self._windows: dict[float, _ActiveWindow] = {}

    def __len__(self) -> int:
        return len(self._bindings)

    def get(self, session: int, now: float) -> str | None:
        """The worker ``session`` is bound to, unless the binding has expired."""
        b = self._bindings.get(session)
        if b is None or now - b.last_seen > self.ttl_s:
            return None
        return b.worker_id

    def bind(self, session: int, worker_id: str, now: float, active: bool = True) -> bool:
        """Bind (or re-bind, or refresh) ``session`` to ``worker_id``; returns whether it moved.

        A refresh stamped older than the binding's last request (a late message from another router
        instance) is ignored.  ``active=False`` binds a session that sends no later turn (a
        one-shot): it is not counted among the sessions active on the worker.
        """
        b = self._bindings.get(session)
        if b is None:
            self._bindings[session] = Binding(worker_id, now, active)
            self._count(worker_id, 1)
            moved = True
        else:
            if now < b.last_seen:
                return False
            moved = b.worker_id != worker_id
            if moved:
                self._count(b.worker_id, -1)
                self._count(worker_id, 1)
                b.worker_id = worker_id
            b.last_seen = now
            b.active = active
            self._bindings.move_to_end(session)
        for window in self._windows.values():
            if active:
                window.add(session, worker_id, now)
            else:
                window.remove(session)
        self.expire(now)
        return moved

    def expire(self, now: float) -> None:
        """Drop idle bindings and, beyond the bound, the least recently seen ones."""
        bindings = self._bindings
        cutoff = now - self.ttl_s
        while bindings:
            session, oldest = next(iter(bindings.items()))
            if oldest.last_seen >= cutoff and len(bindings) <= self.max_entries:
                break
            del bindings[session]
            self._count(oldest.worker_id, -1)
            for window in self._windows.values():
                window.remove(session)

    def drop_worker(self, worker_id: str) -> int:
        """Unbind every session of a removed worker; returns how many there were."""
        gone = [s for s, b in self._bindings.items() if b.worker_id == worker_id]
        for s in gone:
            del self._bindings[s]
            for window in self._windows.values():
                window.remove(s)
        self._per_worker.pop(worker_id, None)
        return len(gone)

    def bound(self, worker_id: str) -> int:
        """Sessions currently bound to ``worker_id`` (including idle ones not yet expired)."""
        return self._per_worker.get(worker_id, 0)

    def active(self, now: float, within_s: float) -> Mapping[str, int]:
        """Sessions per worker whose last request is at most ``within_s`` old (read-only).

        Kept up to date as sessions are bound, so a read costs only the sessions that went idle
        since the last one (the first read for a new window walks the recent bindings once).
        """
        window = self._windows.get(within_s)
        if window is None:
            window = self._windows[within_s] = _ActiveWindow(within_s)
            cutoff = now - within_s
            recent: list[tuple[int, Binding]] = []
            for session, b in reversed(self._bindings.items()):
                if b.last_seen < cutoff:
                    break
                if b.active:
                    recent.append((session, b))
            for session, b in reversed(recent):
                window.add(session, b.worker_id, b.last_seen)
        window.expire(now)
        return window.counts

    def _count(self, worker_id: str, delta: int) -> None:
        n = self._per_worker.get(worker_id, 0) + delta
        if n:
            self._per_worker[worker_id] = n
        else:
            self._per_worker.pop(worker_id, None)
