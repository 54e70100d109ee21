"""FaultyTier (kvtier.tiers.faulty): injected latency, errors, corruption and stalls around real
tiers; every injected fault is a miss / refused write / UNAVAILABLE plus a counted event, never
wrong bytes, never a call past its deadline."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.chunk import ChunkMeta
from kvtier.config import FaultyConfig, StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.store import TieredStore
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.faulty import FaultyTier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.protocol import Deadline, Status, WriteItem

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 8_000
KEYS = chunk_keys(NS, list(range(4 * 40)))


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, P, dtype=np.uint8).tobytes()


def meta(i: int) -> ChunkMeta:
    return ChunkMeta(KEYS[i], KEYS[i - 1] if i else None, 4, (P,), "uint8", P)


def _inner(kind: str, tmp: Path, tm: Telemetry):
    if kind == "memory":
        return MemoryTier.open(10**7, telemetry=tm)
    return DiskTier.open(tmp, NS, 10**8, telemetry=tm)


def filled(kind: str, tmp: Path, n: int = 40, **faults) -> tuple[FaultyTier, Telemetry]:
    tm = Telemetry()
    inner = _inner(kind, tmp, tm)
    for i in range(n):
        assert inner.put(meta(i), payload(i))
    return FaultyTier.wrap(inner, FaultyConfig(wraps=kind, **faults), NS, tm), tm


def events(tm: Telemetry) -> dict[str, int]:
    return {k.removeprefix("events."): v for k, v in tm.snapshot().items() if k.startswith("events.")}


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_corruption_is_caught_by_verification_never_wrong_bytes(kind, tmp_path):
    t, tm = filled(kind, tmp_path, corrupt_rate=0.5, seed=3)
    out = bytearray(P)
    hits = misses = 0
    for i in range(40):
        m = t.get_into(KEYS[i], memoryview(out))
        if m is None:
            misses += 1
        else:
            hits += 1
            assert bytes(out[:m.payload_len]) == payload(i)      # a hit is always the exact payload
    assert t.injected["corrupt"] == misses > 5 and hits > 5
    ev = events(tm)
    assert sum(ev.get(k, 0) for k in ("corrupt", "torn", "wrong_key", "namespace_mismatch", "version")) >= misses
    t.close()


def test_disk_corruption_goes_through_the_disk_tiers_own_check(tmp_path):
    """The file itself is damaged: the disk tier verifies, counts and removes it (not the wrapper)."""
    t, tm = filled("disk", tmp_path, n=5, corrupt_rate=1.0)
    assert t.get_into(KEYS[0], memoryview(bytearray(P))) is None
    assert not Path(t.path_of(KEYS[0])).exists()                   # removed by DiskTier._read
    assert sum(events(tm).values()) >= 1
    assert not t.contains(KEYS[0])
    t.close()


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_errors_are_misses_and_refused_writes(kind, tmp_path):
    t, tm = filled(kind, tmp_path, error_rate=0.5, seed=1)
    out = memoryview(bytearray(P))
    got = [t.get_into(KEYS[i], out) for i in range(40)]
    assert 5 < sum(g is None for g in got) < 35
    res = t.read_into(KEYS[:40], [memoryview(bytearray(P)) for _ in range(40)], Deadline.never())
    assert {r.status for r in res} == {Status.HIT, Status.UNAVAILABLE}
    assert all(r.error == "io_error" for r in res if not r.ok)
    released, done = [], []
    items = [WriteItem(ChunkMeta(k, None, 4, (P,), "uint8", P), memoryview(payload(0)),
                       release=lambda k=k: released.append(k)) for k in chunk_keys(NS, list(range(1000, 1080)))]
    accepted = t.write(items, lambda k, ok: done.append((k, ok)))
    assert 0 < sum(accepted) < len(items)
    assert t.flush(10)                                            # the disk tier's write() is asynchronous
    assert len(released) == len(items)                            # every payload released exactly once
    assert sorted(k for k, ok in done if not ok) == sorted(it.meta.key for it, a in zip(items, accepted) if not a)
    assert t.injected["io_error"] > 0 and t.injected["write_error"] > 0
    assert events(tm).get("io_error", 0) >= 1
    t.close()


def test_same_seed_same_faults(tmp_path):
    a, _ = filled("memory", tmp_path / "a", error_rate=0.3, corrupt_rate=0.3, seed=7)
    b, _ = filled("memory", tmp_path / "b", error_rate=0.3, corrupt_rate=0.3, seed=7)
    c, _ = filled("memory", tmp_path / "c", error_rate=0.3, corrupt_rate=0.3, seed=8)
    runs = [[t.get_into(KEYS[i], memoryview(bytearray(P))) is None for i in range(40)] for t in (a, b, c)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_latency_past_the_deadline_is_unavailable_and_bounded(tmp_path):
    t, _ = filled("disk", tmp_path, n=4, latency_ms=5000)
    t0 = time.monotonic()
    res = t.read_into(KEYS[:4], [memoryview(bytearray(P)) for _ in range(4)], Deadline.after(0.05))
    assert [r.status for r in res] == [Status.UNAVAILABLE] * 4 and res[0].error == "timeout"
    assert time.monotonic() - t0 < 4.0                           # cut at the deadline, not 4 x 5 s
    assert t.contains(KEYS[0])                                   # index lookups are never slowed
    t.close()


def test_stall_after_n_calls(tmp_path):
    t, _ = filled("memory", tmp_path, n=4, stall_after=2, stall_s=60)
    outs = [memoryview(bytearray(P)) for _ in range(2)]
    assert all(r.ok for r in t.read_into(KEYS[:2], outs, Deadline.after(5)))   # calls 1, 2: fine
    res = t.read_into(KEYS[2:4], outs, Deadline.after(0.05))                    # then stalled
    assert [r.status for r in res] == [Status.UNAVAILABLE] * 2
    assert t.injected["stall"] == 1                               # the 2nd key never started (deadline)
    t.close()


def test_store_wraps_the_configured_tier_and_serves_only_exact_bytes(tmp_path):
    base = {"chunk_size": 4, "memory": {"enabled": False},
            "disk": {"enabled": True, "path": str(tmp_path), "capacity": 10**8}}
    with TieredStore.open(StoreConfig.model_validate(base), NS) as s:      # written without faults
        for i in range(40):
            assert s.put(KEYS[i], KEYS[i - 1] if i else None, payload(i), num_tokens=4, shape=(P,), dtype="uint8")
        assert s.flush(10)
    cfg = StoreConfig.model_validate({**base, "faults": {"wraps": "disk", "corrupt_rate": 0.3, "seed": 5}})
    with TieredStore.open(cfg, NS) as s:                                    # read back through the drill
        assert isinstance(s.tier("disk"), FaultyTier)
        out = bytearray(P)
        served = 0
        for i in range(40):
            n = s.get_into(KEYS[i], out)
            if n is not None:
                served += 1
                assert bytes(out[:n]) == payload(i)
        assert 0 < served < 40
        assert s.stats()["counters"].get("events.corrupt", 0) == 40 - served == s.tier("disk").injected["corrupt"]


def test_attributes_the_store_sets_reach_the_inner_tier(tmp_path):
    t, _ = filled("disk", tmp_path, n=1)
    hook = lambda keys: None  # noqa: E731
    t.on_evict = hook
    assert t.inner.on_evict is hook and t.on_evict is hook
    assert t.path_of(KEYS[0]) == t.inner.path_of(KEYS[0])
    t.close()
