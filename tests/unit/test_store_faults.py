"""Fault injection: every fault on a cache path is a miss (or dropped put) plus a counted
event, never an exception to the caller and never wrong bytes."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvtier.chunk import HEADER_SIZE
from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.store import TieredStore
from kvtier.tiers import diskio

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 10_000


def disk_only(tmp: Path, **disk) -> StoreConfig:
    return StoreConfig.model_validate({"chunk_size": 4, "memory": {"enabled": False},
                                       "disk": {"enabled": True, "path": str(tmp), "capacity": 10**8, **disk}})


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, P, dtype=np.uint8).tobytes()


@pytest.fixture
def stored(tmp_path: Path):
    keys = chunk_keys(NS, list(range(32)))
    s = TieredStore.open(disk_only(tmp_path), NS)
    for i, k in enumerate(keys):
        assert s.put(k, keys[i - 1] if i else None, payload(i), num_tokens=4, shape=(P,), dtype="uint8")
    assert s.flush(10)
    yield s, keys
    s.close()


def events(s: TieredStore) -> dict[str, int]:
    return {k.removeprefix("events."): v for k, v in s.stats()["counters"].items() if k.startswith("events.")}


def _assert_miss_and_removed(s: TieredStore, key: bytes, kind: str) -> None:
    assert s.get(key) is None
    out = bytearray(P)
    assert s.get_into(key, out) is None
    assert events(s).get(kind, 0) >= 1
    assert not os.path.exists(s.tier("disk").path_of(key))          # bad chunk removed ...
    assert s.lookup([key]).num_chunks == 0                   # ... and no longer promised


@pytest.mark.parametrize("where", ["payload", "header", "trailer"])
def test_corrupt_byte_is_a_counted_miss(stored, where: str) -> None:
    s, keys = stored
    path = s.tier("disk").path_of(keys[1])
    off = {"payload": HEADER_SIZE + 1234, "header": 200, "trailer": HEADER_SIZE + P + 10}[where]
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    _assert_miss_and_removed(s, keys[1], "corrupt")
    assert bytes(s.get(keys[0])) == payload(0)               # neighbours unaffected


# every field of the header struct (<4sHHI32s32s32sIQ16sB8Q: offsets below), the zero padding of the
# header region, the payload and both trailer fields: flipping one byte is a miss + the named event
_FIELDS = {"magic": (0, "corrupt"), "version": (4, "version"), "header_len": (6, "version"),
           "flags": (8, "corrupt"), "namespace": (12 + 5, "namespace_mismatch"), "key": (44 + 7, "wrong_key"),
           "parent": (76 + 3, "corrupt"), "num_tokens": (108, "corrupt"), "payload_len": (112, "torn"),
           "dtype": (120, "corrupt"), "ndim": (136, "corrupt"), "shape": (137, "corrupt"),
           "padding": (3000, "corrupt"), "payload_first": (HEADER_SIZE, "corrupt"),
           "payload_last": (HEADER_SIZE + P - 1, "corrupt"), "trailer_magic": (HEADER_SIZE + P, "torn"),
           "trailer_checksum": (HEADER_SIZE + P + 4 + 15, "corrupt")}


@pytest.mark.parametrize("field", sorted(_FIELDS))
def test_corruption_at_every_header_field(stored, field: str) -> None:
    s, keys = stored
    off, kind = _FIELDS[field]
    path = s.tier("disk").path_of(keys[2])
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))
    before = events(s)
    _assert_miss_and_removed(s, keys[2], kind)
    after = events(s)
    assert after.get(kind, 0) - before.get(kind, 0) >= 1      # this test's event, not an earlier one
    assert bytes(s.get(keys[1])) == payload(1)               # neighbours unaffected


def test_events_reach_prometheus(stored) -> None:
    from prometheus_client import REGISTRY
    s, keys = stored
    def sample(name: str, labels: dict) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    ev0 = sample("kvtier_events_total", {"kind": "corrupt"})      # per-test deltas: other tests in this
    miss0 = sample("kvtier_store_misses_total", {"tier": "disk"})  # process counted into the same registry
    hit0 = sample("kvtier_store_hits_total", {"tier": "disk"})
    with open(s.tier("disk").path_of(keys[0]), "r+b") as f:
        f.seek(HEADER_SIZE)
        f.write(b"\0\1\2")
    assert s.get(keys[0]) is None
    assert bytes(s.get(keys[5])) == payload(5)
    assert sample("kvtier_events_total", {"kind": "corrupt"}) - ev0 == 1
    assert sample("kvtier_store_misses_total", {"tier": "disk"}) - miss0 == 1
    assert sample("kvtier_store_hits_total", {"tier": "disk"}) - hit0 == 1
    assert events(s).get("corrupt") == 1                       # the store's own counters agree


def test_bad_magic_is_corrupt(stored) -> None:
    s, keys = stored
    with open(s.tier("disk").path_of(keys[0]), "r+b") as f:
        f.write(b"XXXX")
    _assert_miss_and_removed(s, keys[0], "corrupt")


@pytest.mark.parametrize("size", [0, 100, HEADER_SIZE + 50, HEADER_SIZE + P + 5])
def test_truncated_file_is_torn(stored, size: int) -> None:
    s, keys = stored
    os.truncate(s.tier("disk").path_of(keys[2]), size)
    _assert_miss_and_removed(s, keys[2], "torn")


def test_appended_garbage_is_torn(stored) -> None:
    s, keys = stored
    with open(s.tier("disk").path_of(keys[2]), "ab") as f:
        f.write(b"junk")
    _assert_miss_and_removed(s, keys[2], "torn")


def test_missing_file_is_a_counted_miss(stored) -> None:
    s, keys = stored
    assert keys[4] in s.tier("disk").keys()                          # indexed ...
    os.unlink(s.tier("disk").path_of(keys[4]))                       # ... then removed underneath (other process, rm)
    out = bytearray(P)
    assert s.get_into(keys[4], out) is None and events(s)["missing"] == 1
    assert keys[4] not in s.tier("disk").keys()
    os.unlink(s.tier("disk").path_of(keys[3]))
    assert s.lookup(keys).num_chunks == 4           # lookups are index-only: the index learns of it ...
    assert s.get(keys[3]) is None and s.lookup(keys).num_chunks == 3   # ... from the read that misses
    assert events(s)["missing"] == 2


def test_chunk_under_another_key_name_is_wrong_key(stored) -> None:
    s, keys = stored
    shutil.copy(s.tier("disk").path_of(keys[0]), s.tier("disk").path_of(keys[5]))
    _assert_miss_and_removed(s, keys[5], "wrong_key")


def test_foreign_namespace_chunk_is_refused(stored, tmp_path: Path) -> None:
    s, keys = stored
    other = Namespace("m", "other-weights", "float32", "L", 4, 4)
    with TieredStore.open(disk_only(tmp_path), other) as t:
        okeys = chunk_keys(other, list(range(12)))
        # plant NS's chunk file under the other namespace's file name for the same tokens
        dst = t.tier("disk").path_of(okeys[0])
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(s.tier("disk").path_of(keys[0]), dst)
        t.tier("disk").rescan()                                   # (what the background rescan does)
        assert t.lookup(okeys).num_chunks == 1                   # the file exists ...
        assert t.get(okeys[0]) is None                            # ... but is never served
        assert events(t)["namespace_mismatch"] == 1
        assert not os.path.exists(dst)


def test_enospc_drops_the_put(tmp_path: Path, monkeypatch) -> None:
    keys = chunk_keys(NS, list(range(8)))
    with TieredStore.open(disk_only(tmp_path), NS) as s:
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(diskio.os, "writev", full)
        assert s.put(keys[0], None, payload(0), num_tokens=4, shape=(P,), dtype="uint8")  # queued
        assert s.flush(10)
        assert events(s)["enospc"] == 1
        assert s.lookup(keys).num_chunks == 0 and s.get(keys[0]) is None
        assert os.listdir(s.tier("disk").root / "tmp") == []            # no partial temp file left
        assert not s.tier("disk").put(s_meta(keys[0]), payload(0))      # sync path: False, no exception
        monkeypatch.undo()
        assert s.tier("disk").put(s_meta(keys[0]), payload(0))
        assert bytes(s.get(keys[0])) == payload(0)


def test_read_io_error_is_a_miss(stored, monkeypatch) -> None:
    s, keys = stored

    def eio(*a, **k):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(diskio.os, "preadv", eio)
    assert s.get(keys[0]) is None and events(s)["io_error"] >= 1
    monkeypatch.undo()
    assert bytes(s.get(keys[0])) == payload(0)                 # a transient error does not delete


def test_full_queue_drops_and_counts(tmp_path: Path, monkeypatch) -> None:
    keys = chunk_keys(NS, list(range(40)))
    with TieredStore.open(disk_only(tmp_path, queue_depth=2, writer_threads=1), NS) as s:
        import threading
        gate = threading.Event()
        real = s.tier("disk").write_file
        monkeypatch.setattr(s.tier("disk"), "write_file", lambda m, p: gate.wait(10) and real(m, p))
        results = [s.put(k, None, payload(i), num_tokens=4, shape=(P,), dtype="uint8")
                   for i, k in enumerate(keys)]
        gate.set()
        assert s.flush(10)
        assert results.count(False) >= len(keys) - 3          # 1 in the writer + 2 queued
        assert events(s)["dropped_store"] == results.count(False)


def s_meta(key: bytes):
    from kvtier.chunk import ChunkMeta
    return ChunkMeta(key, None, 4, (P,), "uint8", P)


def test_disk_tier_that_cannot_open_is_skipped_with_one_event(tmp_path: Path) -> None:
    """An unusable store.disk.path (here: below a regular file; likewise read-only or permission
    denied) -> the store serves without the SSD tier, one counted `tier_unavailable` event."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    cfg = StoreConfig.model_validate({"chunk_size": 4, "memory": {"capacity": 10**6},
                                      "disk": {"enabled": True, "path": str(blocker / "ssd")}})
    keys = chunk_keys(NS, list(range(8)))
    with TieredStore.open(cfg, NS) as s:
        assert s.tier("disk") is None and s.tier("memory") is not None
        assert events(s) == {"tier_unavailable": 1}
        assert s.put(keys[0], None, payload(0), num_tokens=4, shape=(P,), dtype="uint8")
        assert bytes(s.get(keys[0])) == payload(0)
