"""Workers bucketed by load, so a decision over a large fleet looks only at the workers that can win.

The dispatcher re-files a worker whenever its load changes (sent, finished, scraped, peer load);
a new worker list (a worker registered or removed) files them all again.  Buckets are keyed by the
candidate's ``busy`` figure (routing/view.py) and by vLLM's ``engine_load`` score, both computed by
``Candidate.of`` so they cannot disagree with what the stages read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kvroute.routing.view import Candidate
from kvroute.routing.worker import WorkerState


class _Buckets:
    """Workers by one integer figure, with the keys kept sorted for ascending walks."""

    def __init__(self) -> None:
        self.by_key: dict[int, dict[int, WorkerState]] = {}
        self.keys: list[int] = []
        self._sorted = True

    def add(self, key: int, position: int, state: WorkerState) -> None:
        bucket = self.by_key.get(key)
        if bucket is None:
            bucket = self.by_key[key] = {}
            self.keys.append(key)
            self._sorted = False
        bucket[position] = state

    def remove(self, key: int, position: int) -> None:
        bucket = self.by_key[key]
        del bucket[position]
        if not bucket:
            del self.by_key[key]
            self.keys.remove(key)

    def ascending(self) -> Iterator[tuple[int, dict[int, WorkerState]]]:
        if not self._sorted:
            self.keys.sort()
            self._sorted = True
        for key in list(self.keys):
            bucket = self.by_key.get(key)
            if bucket:
                yield key, bucket


class LoadBook:
    """The workers of one worker list, filed by ``busy`` and by ``engine_load``."""

    def __init__(self) -> None:
        self._workers: Sequence[WorkerState] | None = None
        self._position: dict[int, int] = {}  # id(state) -> position in the worker list
        self._by_id: dict[str, WorkerState] = {}
        self._filed: dict[int, tuple[int, int]] = {}  # position -> (busy, engine_load)
        self.busy = _Buckets()
        self.engine_load = _Buckets()

    def __len__(self) -> int:
        return len(self._filed)

    def follow(self, workers: Sequence[WorkerState]) -> None:
        """File every worker of ``workers`` unless this very list is already filed."""
        if workers is self._workers:
            return
        self._workers = workers
        self._position = {id(w): i for i, w in enumerate(workers)}
        self._by_id = {w.id: w for w in workers}
        self._filed = {}
        self.busy, self.engine_load = _Buckets(), _Buckets()
        for i, w in enumerate(workers):
            self._file(i, w)

    def named(self, worker_id: str) -> WorkerState | None:
        """The filed worker called ``worker_id``."""
        return self._by_id.get(worker_id)

    def position(self, state: WorkerState) -> int:
        """``state``'s position in the filed worker list."""
        return self._position[id(state)]

    def touch(self, state: WorkerState) -> None:
        """``state``'s load changed: file it again (a worker not in the list is ignored)."""
        i = self._position.get(id(state))
        if i is None:
            return
        busy, engine = self._filed.pop(i)
        self.busy.remove(busy, i)
        self.engine_load.remove(engine, i)
        self._file(i, state)

    def _file(self, i: int, state: WorkerState) -> None:
        c = Candidate.of(state)
        self._filed[i] = (c.busy, c.engine_load)
        self.busy.add(c.busy, i, state)
        self.engine_load.add(c.engine_load, i, state)

    def lowest(self, buckets: _Buckets, within: int, accept: Callable[[WorkerState], bool],
               limit: Callable[[int], bool] | None = None) -> dict[int, WorkerState]:
        """``{position: worker}`` of the accepted workers whose figure is at most ``within`` above
        the lowest accepted one's, or, with ``limit``, every accepted worker whose figure it
        admits (walking up from the lowest, stopping at the first it refuses)."""
        out: dict[int, WorkerState] = {}
        least: int | None = None
        for key, bucket in buckets.ascending():
            if limit is not None:
                if not limit(key):
                    break
            elif least is not None and key > least + within:
                break
            for i, w in bucket.items():
                if accept(w):
                    out[i] = w
                    if least is None:
                        least = key
        return out
