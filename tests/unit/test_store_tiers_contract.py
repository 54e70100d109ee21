"""One contract, every tier: the guarantees in kvtier/tiers/base.py, checked per tier."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from kvtier.chunk import ChunkMeta
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.base import Tier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 12_288 + 100        # payload bytes: deliberately not a multiple of 4 KiB (O_DIRECT tail path)
CAP_CHUNKS = 6
DISK_CAP = CAP_CHUNKS * (P + 4096 + 20)


def _memory(tmp: Path) -> Tier:
    return MemoryTier.open(CAP_CHUNKS * 16_384, telemetry=Telemetry())


def _disk(tmp: Path) -> Tier:
    return DiskTier.open(tmp, NS, DISK_CAP, telemetry=Telemetry())


def _disk_direct(tmp: Path) -> Tier:
    return DiskTier.open(tmp, NS, DISK_CAP, o_direct=True, fsync="always", telemetry=Telemetry())


TIERS: dict[str, Callable[[Path], Tier]] = {"memory": _memory, "disk": _disk, "disk_o_direct": _disk_direct}


@pytest.fixture(params=list(TIERS))
def tier(request, tmp_path):
    t = TIERS[request.param](tmp_path)
    yield t
    t.close()


def chain(n: int, seed: int = 0) -> list[tuple[ChunkMeta, bytes]]:
    keys = chunk_keys(NS, list(range(seed * 1000, seed * 1000 + 4 * n)))
    rng = np.random.default_rng(seed)
    out = []
    for i, k in enumerate(keys):
        payload = rng.integers(0, 256, size=P, dtype=np.uint8).tobytes()
        out.append((ChunkMeta(k, keys[i - 1] if i else None, 4, (P,), "uint8", P), payload))
    return out


def test_roundtrip_get_and_get_into(tier: Tier) -> None:
    items = chain(3)
    for meta, payload in items:
        assert tier.put(meta, payload)
    for meta, payload in items:
        assert tier.contains(meta.key)
        got = tier.get(meta.key)
        assert got is not None and got[0] == meta and bytes(got[1]) == payload
        out = bytearray(P + 50)
        m = tier.get_into(meta.key, memoryview(out))
        assert m == meta and bytes(out[:P]) == payload


def test_miss_is_none_not_exception(tier: Tier) -> None:
    key = chunk_keys(NS, [9, 9, 9, 9])[0]
    assert not tier.contains(key)
    assert tier.get(key) is None
    assert tier.get_into(key, memoryview(bytearray(P))) is None
    assert not tier.delete(key)


def test_put_copies_payload(tier: Tier) -> None:
    (meta, payload), = chain(1)
    buf = bytearray(payload)
    assert tier.put(meta, memoryview(buf))
    buf[:] = bytes(len(buf))            # caller reuses its buffer at once
    got = tier.get(meta.key)
    assert got is not None and bytes(got[1]) == payload


def test_get_into_too_small_raises(tier: Tier) -> None:
    (meta, payload), = chain(1)
    tier.put(meta, payload)
    with pytest.raises(ValueError):
        tier.get_into(meta.key, memoryview(bytearray(P - 1)))


def test_delete(tier: Tier) -> None:
    (meta, payload), = chain(1)
    tier.put(meta, payload)
    assert tier.delete(meta.key)
    assert not tier.contains(meta.key) and tier.get(meta.key) is None
    assert tier.usage().num_chunks == 0


def test_batch_forms(tier: Tier) -> None:
    items = chain(3, seed=1)
    assert tier.put_many(items) == [True] * 3
    assert tier.contains_many([m.key for m, _ in items]) == [True] * 3
    got = tier.get_many([m.key for m, _ in items])
    assert [bytes(g[1]) for g in got if g] == [p for _, p in items]
    assert tier.delete_many([m.key for m, _ in items]) == 3


def test_budget_and_tail_first_eviction(tier: Tier) -> None:
    """Many short chains through a small tier: budget holds, only leaves are evicted,
    and a put never evicts its own parent."""
    parent: dict[bytes, bytes | None] = {}
    violations: list[str] = []

    def on_evict(keys: list[bytes]) -> None:
        present = set(tier.keys())
        for k in keys:
            if any(parent.get(c) == k for c in present):
                violations.append("evicted a chunk whose child is still in the tier")
    tier.on_evict = on_evict
    evicted_total = 0
    for seed in range(5):
        for meta, payload in chain(3, seed=10 + seed):
            parent[meta.key] = meta.parent
            ok = tier.put(meta, payload)
            u = tier.usage()
            assert u.used_bytes <= u.capacity_bytes
            if ok and meta.parent is not None:
                assert tier.contains(meta.parent), "a put evicted its own parent"
        evicted_total = 15 - tier.usage().num_chunks
    assert tier.usage().num_chunks <= CAP_CHUNKS
    assert evicted_total >= 9
    assert not violations


def test_concurrent_put_get(tier: Tier) -> None:
    """Threads put DISTINCT chains (own payloads) totalling far more than the budget, so eviction
    runs concurrently with puts and gets: a get returns that key's own payload or misses."""
    chains = {wid: chain(4, seed=10 + wid) for wid in range(4)}            # 16 chunks, budget 6
    expect = {meta.key: payload for items in chains.values() for meta, payload in items}
    assert len(set(expect.values())) == 16
    errors: list[str] = []
    hits = [0]

    def worker(wid: int) -> None:
        out = memoryview(bytearray(P))
        for _ in range(10):
            for meta, payload in chains[wid]:
                tier.put(meta, payload)
                for other in chains.values():                               # read everyone's chunks
                    m = other[0][0]
                    got = tier.get(m.key)
                    if got is not None:
                        hits[0] += 1
                        if bytes(got[1]) != expect[m.key]:
                            errors.append(f"wrong bytes for another worker's key in worker {wid}")
                got_meta = tier.get_into(meta.key, out)
                if got_meta is not None and bytes(out[:got_meta.payload_len]) != payload:
                    errors.append(f"wrong bytes in worker {wid}")
                u = tier.usage()
                if u.used_bytes > u.capacity_bytes:
                    errors.append(f"over budget: {u.used_bytes} > {u.capacity_bytes}")
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert hits[0] > 0                                                      # reads did hit meanwhile
    u = tier.usage()
    assert u.used_bytes <= u.capacity_bytes                                 # evicted down to the budget
    for key in tier.keys():
        got = tier.get(key)
        assert got is None or bytes(got[1]) == expect[key]


