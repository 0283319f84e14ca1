"""The flat prefix index: deepest owned hash, epochs, size and age bounds (seed 1's rules)."""

from __future__ import annotations

import tracemalloc
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.routing.hashing import block_hashes
from kvroute.routing.prefix_index import PrefixIndex

T0 = 1_700_000_000.0


def chain(blocks: list[int], scope: bytes = b"m\x00") -> tuple[int, ...]:
    """Hashes of a prompt made of 512-byte blocks, each filled with its block id."""
    return block_hashes(scope, b"".join(b"%08d" % b * 64 for b in blocks), 512, 1 << 30)


def deepest(index: PrefixIndex, hashes: tuple[int, ...], workers: dict[str, float],
            now: float) -> dict[str, int]:
    ids = list(workers)
    slots = index.slots_of([(wid, workers[wid]) for wid in ids])
    return {ids[slots[s]]: d for s, d in index.match(hashes, slots, now).items()}


def test_deepest_owned_hash_is_the_match() -> None:
    index = PrefixIndex()
    a = chain([0, 1, 2, 3, 4])
    index.record(a[:3], "w0", 1.0, T0)
    index.record(a, "w1", 1.0, T0)
    b = chain([0, 1, 2, 9, 9, 9])
    assert deepest(index, a, {"w0": 1.0, "w1": 1.0}, T0) == {"w0": 3, "w1": 5}
    assert deepest(index, b, {"w0": 1.0, "w1": 1.0}, T0) == {"w0": 3, "w1": 3}
    assert deepest(index, chain([7, 1, 2]), {"w0": 1.0, "w1": 1.0}, T0) == {}


def test_sparse_storage_still_matches_by_deepest_stored_hash() -> None:
    index = PrefixIndex()
    a = chain(list(range(10)))
    index.record([a[1], a[6]], "w0", 1.0, T0)
    longer = chain([*range(10), 3, 3])
    assert deepest(index, longer, {"w0": 1.0}, T0) == {"w0": 7}


def test_restarted_worker_stops_matching() -> None:
    index = PrefixIndex()
    a = chain([0, 1, 2])
    index.record(a, "w0", 1.0, T0)
    assert deepest(index, a, {"w0": 1.0}, T0) == {"w0": 3}
    index.register("w0", 2.0)  # re-registered: new epoch, empty cache
    assert deepest(index, a, {"w0": 2.0}, T0) == {}
    assert deepest(index, a, {"w0": 1.0}, T0) == {}
    # A late record stamped with the old epoch is refused; the new epoch matches again once served.
    assert not index.record(a, "w0", 1.0, T0 + 1)
    assert index.record(a[:2], "w0", 2.0, T0 + 1)
    assert deepest(index, a, {"w0": 2.0}, T0 + 1) == {"w0": 2}


def test_shared_blocks_keep_every_owner() -> None:
    index = PrefixIndex()
    a = chain([0, 1])
    for i in range(5):
        index.record(a, f"w{i}", 1.0, T0 + i)
    assert set(index.owners(a[1], T0 + 5)) == {f"w{i}" for i in range(5)}
    index.remove_worker("w2")
    assert "w2" not in index.owners(a[1], T0 + 5)
    assert deepest(index, a, {f"w{i}": 1.0 for i in range(5)}, T0 + 5) == {
        "w0": 2, "w1": 2, "w3": 2, "w4": 2}


def test_index_respects_its_block_ceiling() -> None:
    index = PrefixIndex(max_blocks=100)
    prompts = [chain([i, i + 1, i + 2, i + 3, i + 4]) for i in range(0, 200, 5)]
    for i, p in enumerate(prompts):
        index.record(p, "w0", 1.0, T0 + i)
        assert len(index) <= 100
    assert len(index) == 100
    # The oldest prompts were evicted, the newest still match.
    assert deepest(index, prompts[0], {"w0": 1.0}, T0 + 50) == {}
    assert deepest(index, prompts[-1], {"w0": 1.0}, T0 + 50) == {"w0": 5}


def test_recording_again_protects_from_eviction() -> None:
    index = PrefixIndex(max_blocks=6)
    a, b, c = chain([0, 0]), chain([1, 1]), chain([2, 2])
    index.record(a, "w0", 1.0, T0)
    index.record(b, "w0", 1.0, T0 + 1)
    index.record(a, "w0", 1.0, T0 + 2)  # a is used again: b is now the oldest
    index.record(c, "w0", 1.0, T0 + 3)
    index.record(chain([3, 3]), "w0", 1.0, T0 + 4)
    assert deepest(index, a, {"w0": 1.0}, T0 + 4) == {"w0": 2}
    assert deepest(index, b, {"w0": 1.0}, T0 + 4) == {}


def test_entries_older_than_max_age_are_ignored_and_dropped() -> None:
    index = PrefixIndex(max_age_s=5400)
    a = chain([0, 1, 2])
    index.record(a, "w0", 1.0, T0)
    assert deepest(index, a, {"w0": 1.0}, T0 + 5399) == {"w0": 3}
    assert deepest(index, a, {"w0": 1.0}, T0 + 5402) == {}
    index.record(chain([5]), "w1", 1.0, T0 + 5402)
    assert len(index) == 1  # the stale entries went with the next recording


def test_memory_per_block_is_bounded() -> None:
    index = PrefixIndex(max_blocks=20_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(400):
        index.record(chain([i, 1, 2, 3, 4] * 10), f"w{i % 8}", 1.0, T0 + i)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(index) == 20_000
    assert used / len(index) < 400  # bytes per indexed block, including the hash ints


# --- property test against a plain reference model ---------------------------------------------

class Reference:
    """The index's rules written as plainly as possible."""

    def __init__(self, max_blocks: int, max_age_s: float) -> None:
        self.max_blocks, self.max_age_s = max_blocks, max_age_s
        self.entries: OrderedDict[int, dict[str, tuple[float, int]]] = OrderedDict()
        self.epochs: dict[str, float] = {}

    def record(self, hashes: tuple[int, ...], wid: str, epoch: float, now: float) -> bool:
        if wid in self.epochs and epoch < self.epochs[wid]:
            return False
        self.epochs[wid] = epoch
        for h in hashes:
            owners = self.entries.pop(h, {})
            old = owners.get(wid)
            t = int(now) if old is None or old[0] != epoch else max(old[1], int(now))
            owners[wid] = (epoch, t)
            self.entries[h] = owners
        while len(self.entries) > self.max_blocks:
            self.entries.popitem(last=False)
        cutoff = int(now - self.max_age_s)
        while self.entries:
            first = next(iter(self.entries.values()))
            if max(t for e, t in first.values()) >= cutoff:
                break
            self.entries.popitem(last=False)
        return True

    def deepest(self, hashes: tuple[int, ...], workers: dict[str, float], now: float) -> dict[str, int]:
        out: dict[str, int] = {}
        cutoff = int(now - self.max_age_s)
        for depth, h in enumerate(hashes, 1):
            for wid, (epoch, t) in self.entries.get(h, {}).items():
                if wid in workers and workers[wid] == epoch == self.epochs.get(wid) and t >= cutoff:
                    out[wid] = depth
        return out


prompts = st.lists(st.integers(0, 3), min_size=1, max_size=6)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), prompts, st.integers(0, 2), st.integers(0, 2)),
        st.tuples(st.just("advance"), st.integers(0, 4000)),
        st.tuples(st.just("match"), prompts),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(3, 30))
def test_index_agrees_with_reference_model(operations: list[tuple], max_blocks: int) -> None:
    index, ref = PrefixIndex(max_blocks, 5400), Reference(max_blocks, 5400)
    now = T0
    for op in operations:
        if op[0] == "record":
            _, blocks, w, epoch = op
            h = chain(blocks)
            assert index.record(h, f"w{w}", float(epoch), now) == ref.record(h, f"w{w}", float(epoch), now)
        elif op[0] == "advance":
            now += op[1]
        else:
            h = chain(op[1])
            # Ask about each worker at its current epoch and at a stale one.
            current = {w: e for w, e in ref.epochs.items()}
            assert deepest(index, h, current, now) == ref.deepest(h, current, now)
            stale = {w: e - 1 for w, e in ref.epochs.items()}
            assert deepest(index, h, stale, now) == {}
        assert len(index) == len(ref.entries)
        assert len(index) <= max_blocks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 19), st.lists(st.integers(0, 7), min_size=1, max_size=6),
                          st.integers(0, 3)), min_size=1, max_size=40),
       st.lists(st.integers(0, 7), min_size=1, max_size=8))
def test_one_walk_finds_every_holder_and_its_match(records: list[tuple[int, list[int], int]],
                                                   prompt: list[int]) -> None:
    """``depths`` (the pruning's single walk) says of every slot what ``match`` says of it, also
    for heads shared by many workers and for owners past the age bound."""
    index = PrefixIndex(max_blocks=10_000, max_age_s=100.0)
    for worker, blocks, age in records:
        index.record(chain(blocks), f"w{worker}", 1.0, T0 - 60.0 * age)
    hashes = chain(prompt)
    walk = index.depths(hashes, T0)
    named = index.named(walk)
    for worker in range(20):
        wid = f"w{worker}"
        expected = deepest(index, hashes, {wid: 1.0}, T0).get(wid)
        assert named.get(wid) == expected
