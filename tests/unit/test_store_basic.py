"""TieredStore composition: lookup, get/put across tiers, policies, persistence, registry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.store import TieredStore, shared_store

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 8192


def cfg(tmp: Path | None, mem_chunks: int = 8, disk_chunks: int = 64, **kw) -> StoreConfig:
    data: dict = {"chunk_size": 4, "memory": {"enabled": mem_chunks > 0, "capacity": mem_chunks * P}}
    if tmp is not None:
        data["disk"] = {"enabled": True, "path": str(tmp), "capacity": disk_chunks * (P + 4116)}
    data.update(kw)
    return StoreConfig.model_validate(data)


def payload(i: int) -> bytes:
    return np.full(P, i % 251, dtype=np.uint8).tobytes()


def put_chain(store: TieredStore, keys, start: int = 0) -> list[bool]:
    return [store.put(k, keys[i - 1] if i else None, payload(start + i), num_tokens=4, shape=(P,), dtype="uint8")
            for i, k in enumerate(keys)]


def test_lookup_longest_prefix_and_tiers(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(40)))          # 10 chunks
    with TieredStore.open(cfg(tmp_path), NS) as s:
        assert s.lookup(keys).num_chunks == 0
        assert all(put_chain(s, keys[:6]))
        assert s.flush(10)
        r = s.lookup(keys)
        assert r.num_chunks == 6 and len(r.tiers) == 6 and set(r.tiers) <= {"memory", "disk"}
        s.delete(keys[3])                              # a gap: lookup stops before it
        assert s.lookup(keys).num_chunks == 3


def test_get_returns_exact_bytes_from_each_tier(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(24)))
    with TieredStore.open(cfg(tmp_path), NS) as s:
        put_chain(s, keys)
        s.flush(10)
        for i, k in enumerate(keys):
            assert bytes(s.get(k)) == payload(i)
            out = bytearray(P)
            assert s.get_into(k, out) == P and bytes(out) == payload(i)
    # reopened without RAM: everything comes from disk, verified
    with TieredStore.open(cfg(tmp_path, mem_chunks=0), NS) as s:
        assert s.lookup(keys).tiers == ("disk",) * len(keys)
        for i, k in enumerate(keys):
            assert bytes(s.get(k)) == payload(i)


def test_promote_on_hit(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(8)))
    with TieredStore.open(cfg(tmp_path), NS) as s:
        put_chain(s, keys)
        s.flush(10)
    with TieredStore.open(cfg(tmp_path), NS) as s:
        assert s.lookup(keys).tiers == ("disk", "disk")
        s.get(keys[0]), s.get(keys[1])
        assert s.lookup(keys).tiers == ("memory", "memory")
    with TieredStore.open(cfg(tmp_path, promote_on_hit=False), NS) as s:
        s.get(keys[0])
        assert s.lookup(keys).tiers == ("disk", "disk")


def test_write_back_demotes_on_ram_eviction(tmp_path: Path) -> None:
    chains = [chunk_keys(NS, list(range(100 * c, 100 * c + 8))) for c in range(6)]   # 6 chains x 2 chunks
    seen: dict[str, list[int]] = {}
    for policy in ("write_through", "write_back"):
        with TieredStore.open(cfg(tmp_path / policy, mem_chunks=4, write_policy=policy), NS) as s:
            on_disk = []
            for c, keys in enumerate(chains):
                assert all(put_chain(s, keys, start=10 * c))
                s.flush(10)
                on_disk.append(s.tier("disk").usage().num_chunks)
            seen[policy] = on_disk
            for c, keys in enumerate(chains):              # every chunk still served, exact
                assert s.lookup(keys).num_chunks == 2
                assert bytes(s.get(keys[1])) == payload(10 * c + 1)
    assert seen["write_through"] == [2, 4, 6, 8, 10, 12]    # every put reaches the disk at once
    assert seen["write_back"][:2] == [0, 0]                 # RAM holds 4 chunks: nothing written yet
    assert seen["write_back"][-1] >= 8                      # RAM evictions were demoted to disk


def test_write_through_memory_only_and_disk_only(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(16)))
    with TieredStore.open(cfg(None), NS) as s:
        assert all(put_chain(s, keys)) and s.lookup(keys).tiers == ("memory",) * 4
    with TieredStore.open(cfg(tmp_path, mem_chunks=0), NS) as s:
        assert all(put_chain(s, keys)) and s.flush(10)
        assert s.lookup(keys).tiers == ("disk",) * 4


def test_orphan_put_refused(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(16)))
    with TieredStore.open(cfg(tmp_path), NS) as s:
        assert not s.put(keys[2], keys[1], payload(2), num_tokens=4, shape=(P,), dtype="uint8")
        assert s.stats()["counters"]["events.orphan_put"] == 1
        assert s.lookup(keys).num_chunks == 0


def test_namespaces_never_mix(tmp_path: Path) -> None:
    import os
    import shutil

    other = Namespace("m", "f2", "float32", "L", 4, 4)
    toks = list(range(8))
    mine = chunk_keys(NS, toks)
    with TieredStore.open(cfg(tmp_path, mem_chunks=0), NS) as s:
        put_chain(s, mine)
        s.flush(10)
        src = s.tier("disk").path_of(mine[0])
    with TieredStore.open(cfg(tmp_path, mem_chunks=0), other) as s:
        ks = chunk_keys(other, toks)
        assert s.lookup(ks).num_chunks == 0 and s.get(ks[0]) is None
        assert s.get(mine[0]) is None                    # even the other namespace's key misses
        ev = s.stats()["counters"]
        assert ev.get("events.foreign_namespace") == 1   # the other namespace in the directory: counted
        # a chunk of NS planted under other's key (a mixed-up copy, a bug): refused by the header check
        dst = s.tier("disk").path_of(ks[0])
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(src, dst)
        s.tier("disk").rescan()
        assert s.get(ks[0]) is None and s.get_into(ks[0], bytearray(P)) is None
        assert s.stats()["counters"].get("events.namespace_mismatch") == 1
        assert not os.path.exists(dst)                   # removed, never served


def test_shared_store_registry(tmp_path: Path) -> None:
    c = cfg(tmp_path)
    a = shared_store(c, NS)
    try:
        assert shared_store(c, NS) is a
        assert shared_store(cfg(tmp_path, mem_chunks=4), NS) is not a
    finally:
        a.close()
    b = shared_store(c, NS)
    assert b is not a
    b.close()


def test_stats_snapshot(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(8)))
    with TieredStore.open(cfg(tmp_path), NS) as s:
        put_chain(s, keys)
        s.flush(10)
        s.lookup(keys)
        s.get(keys[0])
        st = s.stats()
    assert st["tiers"]["memory"]["chunks"] == 2 and st["tiers"]["disk"]["chunks"] == 2
    assert st["counters"]["lookups"] == 1 and st["counters"]["hits.memory"] == 1


def test_chunk_size_must_match_namespace(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        TieredStore.open(StoreConfig(), NS)


def test_lent_reads_go_to_the_last_tier_only() -> None:
    """``read_into(lent=True)``: only the lowest tier may read straight into the caller's buffers. A
    tier above it that times out could still write late into a buffer that a tier below has just
    filled with a hit; so tiers above are always asked with ``lent=False``."""
    from kvtier.chunk import ChunkMeta
    from kvtier.metrics import Telemetry
    from kvtier.tiers.protocol import Deadline
    from kvtier.tiers.registry import open_tiers
    from tests.unit.fake_tiers import DictSharedTier

    class Recording(DictSharedTier):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name, self.lent = name, []

        def read_into(self, keys, outs, deadline, *, lent=False):
            self.lent.append(lent)
            return super().read_into(keys, outs, deadline, lent=lent)

    keys = chunk_keys(NS, list(range(8)))
    upper, lower = Recording("shared_a"), Recording("shared_b")
    lower.data[keys[0]] = (ChunkMeta(keys[0], None, 4, (P,), "uint8", P), payload(3))
    c, tm = cfg(None), Telemetry()
    with TieredStore.from_tiers(c, NS, open_tiers(c, NS, tm) + [upper, lower], tm) as s:
        out = bytearray(P)
        assert s.read_into([keys[0]], [out], Deadline.after(5), promote=False, lent=True)[0].ok
        assert bytes(out) == payload(3)
        assert (upper.lent, lower.lent) == ([False], [True])
        s.read_into([keys[0]], [bytearray(P)], Deadline.after(5))
        assert lower.lent == [True, False]
