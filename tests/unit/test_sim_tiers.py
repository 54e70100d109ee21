"""The simulator's tiers evict in the store's order; vLLM's prefix-cache model."""

from __future__ import annotations

import random

import numpy as np

from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.sim.prefix_cache import PrefixCacheModel
from kvtier.sim.profile import TierProfile
from kvtier.sim.tiers import StoreModel
from kvtier.store import TieredStore

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 8192


def _seeded_chains(seed: int, n_req: int = 120):
    """Requests over a few shared prefixes with random extensions (token lists)."""
    rng = random.Random(seed)
    roots = [[rng.randrange(1000) for _ in range(8)] for _ in range(4)]
    out = []
    for _ in range(n_req):
        toks = list(rng.choice(roots)) + [rng.randrange(1000) for _ in range(4 * rng.randrange(0, 5))]
        out.append(toks)
    return out


def _replay_real(reqs, cap: int, policy: str) -> list[list[bytes]]:
    """Contents of a real RAM-only TieredStore after each request (lookup, get hits, put rest)."""
    cfg = StoreConfig.model_validate({"chunk_size": 4, "eviction": policy,
                                      "memory": {"enabled": True, "capacity": cap * P}})
    states = []
    with TieredStore.open(cfg, NS) as s:
        for toks in reqs:
            keys = chunk_keys(NS, toks)
            n = s.lookup(keys).num_chunks
            for k in keys[:n]:
                assert s.get(k) is not None
            for i in range(n, len(keys)):
                s.put(keys[i], keys[i - 1] if i else None, np.zeros(P, np.uint8).tobytes(), num_tokens=4,
                      shape=(P,), dtype="uint8")
            states.append(sorted(k for k in s.memory.keys()))
    return states


def _replay_model(reqs, cap: int, policy: str) -> list[list[bytes]]:
    m = StoreModel.open({"ram": TierProfile(capacity=cap * P), "ssd": TierProfile(), "shared": TierProfile()},
                        P, 4, policy, 2)
    states = []
    for toks in reqs:
        keys = chunk_keys(NS, toks)
        where = m.lookup(keys)
        m.read(keys[:len(where)], where)
        m.save(keys, len(where))
        states.append(sorted(m.tiers[0].policy.keys()))
    return states


def test_model_evicts_in_the_real_store_order_on_a_seeded_trace() -> None:
    for policy in ("lru", "cost"):
        for seed in (1, 2, 3):
            reqs = _seeded_chains(seed)
            real, model = _replay_real(reqs, 10, policy), _replay_model(reqs, 10, policy)
            assert real == model, (policy, seed)
            assert any(len(s) == 10 for s in model)         # capacity was reached: eviction happened


def test_prefix_cache_hits_holds_and_evicts_tail_first() -> None:
    c = PrefixCacheModel(capacity_units=6)
    assert c.match([1, 2, 3]) == 0 and c.can_allocate([], 4)
    c.acquire([], 4)
    assert c.commit([1, 2, 3]) == [1, 2, 3]            # 3 cached units + 1 private (decode)
    assert c.match([1, 2, 3, 9]) == 3
    assert not c.can_allocate([], 3)                    # 4 in use, 2 empty
    c.release([1, 2, 3], 1)
    assert c.empty == 3 and c.cached_units == 3
    c.acquire([], 4)                                    # needs 1 eviction: the chain tail goes first
    assert c.match([1, 2, 3]) == 2 and c.evictions == 1


def test_prefix_cache_shared_blocks_are_held_once() -> None:
    c = PrefixCacheModel(capacity_units=4)
    c.acquire([], 2)
    c.commit([5, 6])
    assert c.can_allocate([5, 6], 4)                    # the hit blocks are shared, 2 new fit
    c.acquire([5, 6], 4)
    assert c.empty == 0
    c.release([5, 6], 0)
    c.release([5, 6], 2)
    assert c.cached_units == 2 and c.empty == 2 and c.used_by_nobody()
