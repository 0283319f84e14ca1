"""Mamba (linear-attention) state slots of a hybrid model, and the checkpoints kept in them.

A hybrid model keeps, besides the attention KV blocks, one recurrent state per running sequence.
In vLLM's ``align`` mode the state is also saved so that a later request with the same prefix can
resume from it.  Our model of that (documented in docs/simulator.md): a fixed number of state
slots; each running sequence holds one; the rest hold *checkpoints*, keyed by the chained unit hash
of the prefix they summarize, evicted least-recently-used first when a slot is needed.

With an ``events`` list, an evicted checkpoint appends a ``Removed`` of the Mamba group there
(``store`` says whether it kept a new checkpoint, for the caller to report it as stored).
"""

from __future__ import annotations

from collections import OrderedDict

from kvroute.fleet.kv_event_wire import MEDIUM_GPU, KvEvent, Removed

# The KV-cache group of the Mamba states in the events (after the attention group).
MAMBA_GROUP = 1


class MambaStatePool:
    """``num_slots`` state slots shared by running sequences and prefix checkpoints."""

    __slots__ = ("_checkpoints", "_events", "held", "num_slots")

    def __init__(self, num_slots: int, events: list[KvEvent] | None = None) -> None:
        if num_slots <= 0:
            raise ValueError("the Mamba state pool needs at least one slot")
        self.num_slots = num_slots
        self.held = 0
        self._checkpoints: OrderedDict[int, None] = OrderedDict()
        self._events = events

    @property
    def num_checkpoints(self) -> int:
        """Checkpoints currently kept."""
        return len(self._checkpoints)

    def _make_room(self) -> bool:
        if self.held + len(self._checkpoints) < self.num_slots:
            return True
        if self._checkpoints:
            evicted, _none = self._checkpoints.popitem(last=False)
            if self._events is not None:
                self._events.append(Removed([evicted], MAMBA_GROUP, MEDIUM_GPU))
            return True
        return False

    def acquire(self) -> bool:
        """Give a running sequence its slot (evicting the oldest checkpoint if needed)."""
        if not self._make_room():
            return False
        self.held += 1
        return True

    def release(self) -> None:
        """A running sequence finished, was preempted or aborted."""
        self.held -= 1

    def has(self, prefix_hash: int) -> bool:
        """Whether a checkpoint of this prefix exists (and mark it recently used)."""
        if prefix_hash in self._checkpoints:
            self._checkpoints.move_to_end(prefix_hash)
            return True
        return False

    def store(self, prefix_hash: int) -> bool:
        """Save the state at the end of this prefix, if a slot can be found for it (True: a new
        checkpoint was kept)."""
        if prefix_hash in self._checkpoints:
            self._checkpoints.move_to_end(prefix_hash)
            return False
        if self._make_room():
            self._checkpoints[prefix_hash] = None
            return True
        return False

    def clear_checkpoints(self) -> None:
        """Drop every checkpoint (a prefix-cache reset); the running sequences keep their slots."""
        self._checkpoints.clear()
