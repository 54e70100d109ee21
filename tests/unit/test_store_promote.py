"""Promotion off the critical path (get_into(promote=False) + promote_later) and the RAM slab prefault."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.promoter import Promoter
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 8192


def cfg(tmp: Path, **kw) -> StoreConfig:
    data: dict = {"chunk_size": 4, "memory": {"capacity": 16 * P},
                  "disk": {"enabled": True, "path": str(tmp), "capacity": 64 * (P + 4116)}}
    data.update(kw)
    return StoreConfig.model_validate(data)


def payload(i: int) -> bytes:
    return np.full(P, i % 251, dtype=np.uint8).tobytes()


def _disk_only_chain(tmp: Path, n: int) -> list:
    keys = chunk_keys(NS, list(range(4 * n)))
    with TieredStore.open(cfg(tmp), NS) as s:
        for i, k in enumerate(keys):
            assert s.put(k, keys[i - 1] if i else None, payload(i), num_tokens=4, shape=(P,), dtype="uint8")
        assert s.flush(10)
    return keys


def test_get_into_without_promotion_then_background_promotion(tmp_path: Path) -> None:
    keys = _disk_only_chain(tmp_path, 4)
    with TieredStore.open(cfg(tmp_path), NS) as s:
        assert s.lookup(keys).tiers == ("disk",) * 4
        out = bytearray(P)
        for i, k in enumerate(keys):
            assert s.get_into(k, out, promote=False) == P and bytes(out) == payload(i)
        assert s.lookup(keys).tiers == ("disk",) * 4          # nothing promoted on the read path
        assert s.promote_later(keys) == 4
        assert s.promoter.wait_idle(10)
        assert s.lookup(keys).tiers == ("memory",) * 4
        assert s.tier("memory") is not None
        for i, k in enumerate(keys):                            # promoted bytes are the verified payload
            assert s.tier("memory").get_into(k, memoryview(out)) is not None and bytes(out) == payload(i)
        assert s.promote_later(keys) == 0                       # already in RAM: nothing queued


def test_default_get_into_still_promotes_synchronously(tmp_path: Path) -> None:
    keys = _disk_only_chain(tmp_path, 2)
    with TieredStore.open(cfg(tmp_path), NS) as s:
        s.get_into(keys[0], bytearray(P))
        assert s.lookup(keys).tiers == ("memory", "disk")


def test_promote_later_respects_promote_on_hit_and_orphans(tmp_path: Path) -> None:
    keys = _disk_only_chain(tmp_path, 3)
    with TieredStore.open(cfg(tmp_path, promote_on_hit=False), NS) as s:
        assert s.promote_later(keys) == 0
    with TieredStore.open(cfg(tmp_path), NS) as s:
        s.delete(keys[2])
        s.tier("disk").delete(keys[0])        # keys[1]'s parent is now in no tier: it must not be promoted
        s.promote_later(keys[1:2])
        assert s.promoter.wait_idle(10)
        assert s.tier("memory") is not None and not s.tier("memory").contains(keys[1])


def test_promoter_waits_while_busy(tmp_path: Path) -> None:
    keys = _disk_only_chain(tmp_path, 2)
    with TieredStore.open(cfg(tmp_path), NS) as s:
        with s.busy():
            s.promote_later(keys)
            assert not s.promoter.wait_idle(0.3)               # paused: nothing promoted yet
            assert s.tier("memory") is not None and not any(s.tier("memory").contains(k) for k in keys)
        assert s.promoter.wait_idle(10)
        assert all(s.tier("memory").contains(k) for k in keys)


def test_promoter_bounded_and_survives_errors() -> None:
    seen: list[bytes] = []
    gate = threading.Event()

    def promote(key, scratch):
        gate.wait(5)
        if key == b"bad":
            raise RuntimeError("boom")
        seen.append(key)
        return scratch

    p = Promoter(promote, max_pending=3)
    assert p.submit([b"bad", b"a", b"a", b"b"]) == 3       # deduplicated
    assert p.dropped == 0
    assert p.submit([b"c", b"d", b"e", b"f", b"g"]) <= 1   # the thread holds at most one: the queue is full
    assert p.dropped >= 4                                   # the bound: extra keys are dropped and counted
    gate.set()
    assert p.wait_idle(5)
    dropped = p.dropped
    assert p.submit([b"h", b"i", b"j"]) == 3 and p.dropped == dropped   # room again once drained
    assert p.wait_idle(5)
    assert seen[:2] == [b"a", b"b"] and b"h" in seen        # an exception did not stop the thread
    p.close()
    assert p.submit([b"x"]) == 0


def test_min_hits_admits_a_key_at_its_nth_submission() -> None:
    seen: list[bytes] = []
    p = Promoter(lambda key, scratch: (seen.append(key), scratch)[1], max_tracked=2)
    assert p.submit([b"a", b"b"], min_hits=2) == 0           # first sighting: only counted
    assert p.submit([b"a"], min_hits=2) == 1                 # second: queued
    assert p.submit([b"c", b"d"], min_hits=2) == 0           # tracking is bounded: "b" falls out
    assert p.submit([b"b"], min_hits=2) == 0
    assert p.wait_idle(5) and seen == [b"a"]
    p.close()


def test_prefault_populates_the_slab_beside_puts() -> None:
    m = MemoryTier.open(64 * P, prefault=True)
    assert m.prepare(P)
    assert m.allocated_bytes() == 64 * P
    from kvtier.chunk import ChunkMeta
    keys = chunk_keys(NS, list(range(4 * 8)))
    for i, k in enumerate(keys):                               # puts while the prefault may still run
        assert m.put(ChunkMeta(k, None, 4, (P,), "uint8", P), payload(i))
    if m._prefaulter is not None:                              # MADV_POPULATE_WRITE available (Linux >= 5.14)
        m._prefaulter.join(10)
        assert m.prefaulted_bytes == 64 * P
    out = bytearray(P)
    for i, k in enumerate(keys):                               # populate never changed page contents
        assert m.get_into(k, memoryview(out)) is not None and bytes(out) == payload(i)
    m.close()


def test_prepare_sizes_slots_before_the_first_put() -> None:
    m = MemoryTier.open(10 * P)
    assert m.allocated_bytes() == 0
    assert m.prepare(P - 100)
    assert m.slot_size == P and m.allocated_bytes() == 10 * P
    m.close()
    assert not MemoryTier.open(P // 2).prepare(P)              # not one slot fits


def test_threads_spawned_on_any_cpu_leave_the_caller_bound() -> None:
    import os

    from kvtier.promoter import run_in_thread_on_any_cpu

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        import pytest
        pytest.skip("needs Linux and two CPUs")
    allowed = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def bound_caller() -> None:                    # like vLLM's worker thread, bound to one core
        os.sched_setaffinity(0, {min(allowed)})

        def spawn() -> None:
            t = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
            t.start()
            t.join()
        run_in_thread_on_any_cpu(spawn)
        seen["caller"] = os.sched_getaffinity(0)

    t = threading.Thread(target=bound_caller)
    t.start()
    t.join()
    assert seen["caller"] == {min(allowed)}
    assert seen["child"] == allowed
