"""The engine's KV-cache events (pure, virtual time): what they say is exactly what the block pool and
the Mamba checkpoints hold, the token ids are the request's, resets and restarts clear."""

from __future__ import annotations

import itertools
import random

import pytest
from sim_helpers import VirtualEngine, chat, prose, render

from kvroute.fleet.kv_event_wire import Cleared, KvEvent, Removed, Stored
from kvroute.sim.block_pool import ATTENTION_GROUP
from kvroute.sim.engine import EngineConfig, EngineModel, SimRequest
from kvroute.sim.mamba import MAMBA_GROUP
from kvroute.sim.tokenizer import token_ids


def small(**kw: object) -> EngineConfig:
    values: dict[str, object] = {"num_gpu_blocks": 256, "max_model_len": 4096, "block_size": 16,
                                 "enable_kv_cache_events": True}
    values.update(kw)
    return EngineConfig(**values)  # type: ignore[arg-type]


class Replica:
    """What a consumer rebuilds from the events alone: per group, hash -> its token run and parent."""

    def __init__(self) -> None:
        self.groups: dict[int | None, dict[int | bytes, tuple[int | bytes | None, list[int]]]] = {}

    def apply(self, events: list[KvEvent]) -> None:
        for e in events:
            if isinstance(e, Stored):
                group = self.groups.setdefault(e.group_idx, {})
                parent = e.parent
                per = e.block_size if e.group_idx == ATTENTION_GROUP else len(e.token_ids)
                for i, h in enumerate(e.engine_hashes):
                    assert h not in group, "stored twice without a removal"
                    group[h] = (parent, e.token_ids[i * per:(i + 1) * per])
                    parent = h
            elif isinstance(e, Removed):
                group = self.groups.setdefault(e.group_idx, {})
                for h in e.engine_hashes:
                    assert h in group, "removed what was never stored"
                    del group[h]
            elif isinstance(e, Cleared):
                self.groups.clear()

    def hashes(self, group: int) -> set[int | bytes]:
        return set(self.groups.get(group, {}))


def _workload(engine: EngineModel, seed: int, n: int, replica: Replica) -> None:
    rng = random.Random(seed)
    bases = [prose(300, 40 + i) for i in range(3)]
    now, sent = 0.0, 0
    while sent < n or engine.has_work():
        if sent < n and rng.random() < 0.3:
            prompt = render(chat(rng.choice(bases) + prose(rng.randint(20, 200), sent)))
            req = SimRequest(f"r{sent}", prompt, prose(64, sent).encode(), rng.randint(8, 64))
            engine.add_request(req, now)
            sent += 1
        now += engine.step(now).duration_s or 0.01
        replica.apply(engine.drain_kv_events())
        assert replica.hashes(ATTENTION_GROUP) == set(engine._pool._cached)
        if engine._mamba is not None:
            assert replica.hashes(MAMBA_GROUP) == set(engine._mamba._checkpoints)


@pytest.mark.parametrize("kw", [
    {},
    {"prefix_match_unit": 4},
    {"hybrid": True, "enable_prefix_caching": True, "mamba_cache_mode": "align", "prefix_match_unit": 4,
     "mamba_cache_blocks": 12},
], ids=["dense", "unit4", "hybrid-align"])
def test_events_rebuild_exactly_what_the_engine_caches_under_eviction(kw: dict[str, object]) -> None:
    engine = EngineModel(small(num_gpu_blocks=96, max_model_len=1024, max_num_batched_tokens=256,
                               max_num_seqs=8, **kw), 0.0)
    replica = Replica()
    _workload(engine, 5, 80, replica)
    assert engine._pool.evictions > 20
    # Every stored unit's tokens chain back to a sequence start through parents the consumer saw.
    attention = replica.groups[ATTENTION_GROUP]
    for parent, tokens in attention.values():
        assert len(tokens) == engine._unit
        assert parent is None or isinstance(parent, int)


def test_a_request_reports_its_blocks_with_the_prompt_and_reply_token_ids() -> None:
    v = VirtualEngine(small())
    prompt = render(chat(prose(200, 1)))
    out = prose(40, 2).encode()
    v.run(prompt, 40, out)
    events = v.engine.drain_kv_events()
    stored = [e for e in events if isinstance(e, Stored)]
    assert stored and all(e.group_idx == 0 and e.spec_kind == "full_attention" and e.medium == "GPU"
                          and e.block_size == 16 for e in stored)
    tokens = [t for e in stored for t in e.token_ids]
    hashes = [h for e in stored for h in e.engine_hashes]
    assert len(tokens) == len(hashes) * 16
    pad = b"\x00" * (-len(prompt) % 4)
    assert tokens == token_ids(prompt + pad + out)[:len(tokens)]
    # prompt + reply - 1 tokens have KV (the last generated token is never fed back)
    assert len(tokens) == (len(token_ids(prompt)) + 40 - 1) // 16 * 16
    assert stored[0].parent is None
    for before, after in itertools.pairwise(stored):
        assert after.parent == before.engine_hashes[-1]
    assert len(set(hashes)) == len(hashes)


def test_a_repeat_stores_nothing_new_and_a_salt_starts_another_chain_with_its_extra_key() -> None:
    v = VirtualEngine(small())
    prompt = render(chat(prose(100, 3)))
    v.run(prompt, 1)
    first = v.engine.drain_kv_events()
    v.run(prompt, 1)
    assert v.engine.drain_kv_events() == []
    v.engine.add_request(SimRequest("salted", prompt, b"abcd", 1, cache_salt="tenant-a"), v.now)
    v.drain()
    salted = [e for e in v.engine.drain_kv_events() if isinstance(e, Stored)]
    assert salted[0].extra_keys is not None and salted[0].extra_keys[0] == ["tenant-a"]
    assert all(k is None for k in salted[0].extra_keys[1:])
    assert len(salted[0].extra_keys) == len(salted[0].engine_hashes)
    assert salted[0].token_ids == [t for e in first if isinstance(e, Stored) for t in e.token_ids][
        :len(salted[0].token_ids)]
    unsalted = {h for e in first if isinstance(e, Stored) for h in e.engine_hashes}
    assert not set(salted[0].engine_hashes) & unsalted


def test_hybrid_reports_mamba_checkpoints_as_their_own_group() -> None:
    v = VirtualEngine(small(hybrid=True, enable_prefix_caching=True, mamba_cache_mode="align",
                            mamba_cache_blocks=8, max_num_seqs=4, block_size=64, prefix_match_unit=16,
                            max_num_batched_tokens=128))
    prompt = render(chat(prose(300, 4)))
    v.run(prompt, 1)
    events = v.engine.drain_kv_events()
    mamba = [e for e in events if isinstance(e, Stored) and e.group_idx == MAMBA_GROUP]
    attention = [e for e in events if isinstance(e, Stored) and e.group_idx == ATTENTION_GROUP]
    assert mamba and all(e.spec_kind == "mamba" and len(e.engine_hashes) == 1 for e in mamba)
    assert all(e.spec_kind == "full_attention" for e in attention)
    all_attention = [h for e in attention for h in e.engine_hashes]
    # A checkpoint is named by the hash of the prefix it ends, the same hash as that unit's KV, and
    # carries the tokens since the previous checkpoint.
    assert {e.engine_hashes[0] for e in mamba} <= set(all_attention)
    covered = [t for e in mamba for t in e.token_ids]
    assert covered == [t for e in attention for t in e.token_ids][:len(covered)]


def test_no_events_without_the_flag_or_without_prefix_caching() -> None:
    for cfg in (small(enable_kv_cache_events=False), small(enable_prefix_caching=False)):
        v = VirtualEngine(cfg)
        v.run(render(chat(prose(100, 5))), 4)
        assert v.engine.drain_kv_events() == []
        assert v.engine.reset_prefix_cache()
        assert v.engine.drain_kv_events() == []


def test_reset_prefix_cache_is_refused_while_running_unless_asked_then_clears() -> None:
    v = VirtualEngine(small())
    prompt = render(chat(prose(200, 6)))
    v.run(prompt, 1)
    v.engine.drain_kv_events()
    v.engine.add_request(SimRequest("long", prompt + b" more", b"x" * 400, 100), v.now)
    v.engine.step(v.now)
    assert not v.engine.reset_prefix_cache()
    assert all(not isinstance(e, Cleared) for e in v.engine.drain_kv_events())
    assert v.engine.reset_prefix_cache(reset_running_requests=True)
    assert v.engine.drain_kv_events() == [Cleared()]
    assert not v.engine._pool._cached
    seen = v.drain()
    assert "long" in seen                             # the preempted request recomputes and finishes
    after = v.engine.drain_kv_events()
    assert after and isinstance(after[0], Stored) and after[0].parent is None
    assert v.engine.reset_prefix_cache()
    assert v.engine.drain_kv_events() == [Cleared()]
    assert v.run(prompt, 1).cached == 0


def test_restart_loses_undrained_events_and_reports_cleared() -> None:
    v = VirtualEngine(small())
    v.run(render(chat(prose(100, 7))), 1)
    v.engine.restart(v.now)
    assert v.engine.drain_kv_events() == [Cleared()]
    v.run(render(chat(prose(100, 7))), 1)
    assert isinstance(v.engine.drain_kv_events()[0], Stored)
