"""Helpers for the routing tests: a settable clock, worker fleets, prompts, keys."""

from __future__ import annotations

from kvroute.routing.key import RoutingKey
from kvroute.routing.scheduler import Scheduler
from kvroute.routing.worker import WorkerState


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fleet(n: int, *, model: str = "m", max_num_seqs: int | None = 32) -> list[WorkerState]:
    """``n`` healthy workers serving ``model``."""
    return [WorkerState(id=f"w{i}", url=f"http://127.0.0.1:{9000 + i}", models=frozenset({model}),
                        epoch=1.0, max_num_seqs=max_num_seqs) for i in range(n)]


def text(seed: int, n_bytes: int) -> str:
    """Deterministic, distinct text of ``n_bytes`` ASCII bytes for a seed."""
    unit = f"<{seed:06d} lorem ipsum dolor sit amet>"
    return (unit * (n_bytes // len(unit) + 1))[:n_bytes]


def key(prefix: str | bytes, *, session: str | None = None, model: str = "m", salt: str | None = None,
        max_tokens: int = 0) -> RoutingKey:
    """A routing key with the usual bytes/4 token estimate."""
    raw = prefix.encode() if isinstance(prefix, str) else prefix
    return RoutingKey(model=model, prefix=raw, session_id=session, est_prompt_tokens=len(raw) // 4,
                      max_tokens=max_tokens, cache_salt=salt)


def send(s: Scheduler, k: RoutingKey, workers: list[WorkerState], *, keep_inflight: bool = False) -> str:
    """Decide and commit one request; returns the chosen worker id.  With ``keep_inflight`` the
    request stays in flight on that worker (the caller finishes it)."""
    d = s.decide(k, workers)
    assert d.worker_id is not None, d.reason
    s.commit(k, d)
    if keep_inflight:
        next(w for w in workers if w.id == d.worker_id).inflight += 1
    return d.worker_id
