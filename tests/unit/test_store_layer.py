"""The tier layer: an ordered tier list from the registry, declared capabilities, index-only
lookups, the background rescan, store events, shared-tier edges, async puts with reused buffers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import ConfigError, StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.store import StoreEvent, TieredStore
from kvtier.tiers import registry
from kvtier.tiers.protocol import Deadline, Status
from kvtier.tiers.registry import open_tiers
from tests.unit.fake_tiers import DictSharedTier

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 8192
FILE = P + 4116


def cfg(tmp: Path | None, mem_chunks: int = 8, disk_chunks: int = 64, **kw) -> StoreConfig:
    data: dict = {"chunk_size": 4, "memory": {"enabled": mem_chunks > 0, "capacity": mem_chunks * P}}
    if tmp is not None:
        data["disk"] = {"enabled": True, "path": str(tmp), "capacity": disk_chunks * FILE,
                        **kw.pop("disk", {})}
    data.update(kw)
    return StoreConfig.model_validate(data)


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, P, dtype=np.uint8).tobytes()


def put_chain(store: TieredStore, keys, start: int = 0) -> list[bool]:
    return [store.put(k, keys[i - 1] if i else None, payload(start + i), num_tokens=4, shape=(P,), dtype="uint8")
            for i, k in enumerate(keys)]


def with_shared(config: StoreConfig, shared: DictSharedTier) -> TieredStore:
    tm = Telemetry()
    return TieredStore.from_tiers(config, NS, open_tiers(config, NS, tm) + [shared], tm)


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# -- registry ---------------------------------------------------------------------------------
def test_tiers_are_an_ordered_list_with_declared_capabilities(tmp_path: Path) -> None:
    with TieredStore.open(cfg(tmp_path), NS) as s:
        assert [t.name for t in s.tiers] == ["memory", "disk"]
        for t in s.tiers:
            c = t.capabilities
            assert c.complete_index and c.local_budget and not c.shared and not c.evicts_itself
        assert s.tier("disk") is s.tiers[1] and s.tier("nope") is None and not s.has_remote()


def test_optional_backends_are_not_imported_unless_configured() -> None:
    code = ("import sys, kvtier.store, kvtier.tiers.registry, kvtier.config\n"
            "bad = [m for m in sys.modules if m.split('.')[-1] in ('sharedfs','valkey','mooncake','faulty','redis')]\n"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_missing_client_library_is_a_one_line_config_error(monkeypatch) -> None:
    def no_client(name: str):
        raise ModuleNotFoundError("No module named 'valkey'", name="valkey")
    monkeypatch.setattr(registry.importlib, "import_module", no_client)
    with pytest.raises(ConfigError) as e:
        registry.backend_class("valkey")
    msg = str(e.value)
    assert "\n" not in msg and "valkey" in msg and "pip install valkey" in msg
    with pytest.raises(ConfigError, match="unknown backend"):
        registry.backend_class("tape")


# -- lookups are index-only; the index learns in the background ---------------------------------
def test_lookup_makes_no_system_call(tmp_path: Path, monkeypatch) -> None:
    keys = chunk_keys(NS, list(range(40)))
    with TieredStore.open(cfg(tmp_path, mem_chunks=0), NS) as s:
        assert all(put_chain(s, keys)) and s.flush(10)
        import kvtier.tiers.disk as disk_mod

        def no_io(*a, **k):
            raise AssertionError("system call on the lookup path")
        for name in ("stat", "lstat", "open", "scandir"):
            monkeypatch.setattr(disk_mod.os, name, no_io)
        monkeypatch.setattr(disk_mod.os.path, "exists", no_io)
        r = s.lookup(keys)
        monkeypatch.undo()        # close() below may do I/O (manifest): only the lookup is under test
        assert r.num_chunks == len(keys) and r.status is Status.HIT and r.tiers == ("disk",) * len(keys)


def test_background_rescan_learns_other_processes_chunks(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(24)))
    fast = cfg(tmp_path, mem_chunks=0, disk={"rescan_interval_s": 0.05})
    with TieredStore.open(fast, NS) as a, TieredStore.open(fast, NS) as b:
        events: list[StoreEvent] = []
        b.subscribe(events.append)
        assert b.lookup(keys).num_chunks == 0
        assert all(put_chain(a, keys)) and a.flush(10)
        assert wait_for(lambda: b.lookup(keys).num_chunks == len(keys))      # learnt by the rescan thread
        a.delete(keys[3])                                                     # another process removes one
        assert wait_for(lambda: b.lookup(keys).num_chunks == 3)
        assert any(e.kind == "evicted" and keys[3] in e.keys for e in events)
        assert b.tier("disk").usage().num_chunks == 3                         # (a dropped 3 and its descendants)


def test_publish_path_never_rescans_the_directory(tmp_path: Path, monkeypatch) -> None:
    keys = chunk_keys(NS, list(range(40)))
    with TieredStore.open(cfg(tmp_path, mem_chunks=0, disk_chunks=4, disk={"rescan_interval_s": 0}), NS) as s:
        disk = s.tier("disk")
        monkeypatch.setattr(disk._index, "scan", lambda: (_ for _ in ()).throw(AssertionError("rescan on publish")))
        for i, k in enumerate(keys):                          # independent one-chunk prompts
            assert s.put(k, None, payload(i), num_tokens=4, shape=(P,), dtype="uint8")
        assert s.flush(10)                                    # evicted from its index to fit the budget
        u = disk.usage()
        assert u.used_bytes <= u.capacity_bytes and u.num_chunks == 4


# -- events ------------------------------------------------------------------------------------
def test_ram_evictions_and_demotions_are_reported(tmp_path: Path) -> None:
    chains = [chunk_keys(NS, list(range(100 * c, 100 * c + 8))) for c in range(6)]   # 6 prompts x 2 chunks
    with TieredStore.open(cfg(tmp_path, mem_chunks=4, write_policy="write_back"), NS) as s:
        events: list[StoreEvent] = []
        s.subscribe(events.append)
        for c, keys in enumerate(chains):
            assert all(put_chain(s, keys, start=10 * c))
        assert s.flush(10)
        evicted = {k for e in events if e.kind == "evicted" and e.tier == "memory" for k in e.keys}
        on_disk = {k for e in events if e.kind == "stored" and e.tier == "disk" for k in e.keys}
        assert len(evicted) >= 2 and evicted <= on_disk
        assert all(s.where(k) == "disk" for k in evicted)


def test_memory_only_eviction_is_reported() -> None:
    chains = [chunk_keys(NS, list(range(100 * c, 100 * c + 8))) for c in range(6)]
    with TieredStore.open(cfg(None, mem_chunks=4), NS) as s:
        gone: list[bytes] = []
        s.subscribe(lambda e: gone.extend(e.keys) if e.kind == "evicted" else None)
        for keys in chains:
            assert all(put_chain(s, keys))
        assert gone and all(s.where(k) is None for k in gone)


# -- shared tier edges ---------------------------------------------------------------------------
def test_shared_tier_is_written_in_background_and_read_last(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(24)))
    shared = DictSharedTier()
    with with_shared(cfg(tmp_path), shared) as s:
        assert all(put_chain(s, keys)) and s.flush(10)
        assert set(shared.data) == set(keys)
        assert s.lookup(keys).num_chunks == len(keys)
    shared.calls = 0
    fresh = tmp_path / "fresh"                          # "another machine": empty local tiers
    with with_shared(cfg(fresh), shared) as s:
        assert s.lookup(keys).num_chunks == 0 and shared.calls == 0          # lookup never asks the network
        assert s.get_into(keys[0], bytearray(P), local_only=True) is None and shared.calls == 0   # sync loads neither
        res = s.shared_prefix(keys, Deadline.after(5))
        assert res.num_chunks == len(keys) and res.status is Status.HIT
        outs = [bytearray(P) for _ in keys]
        got = s.read_into(keys, outs, Deadline.after(5))
        assert all(r.ok for r in got) and all(bytes(o) == payload(i) for i, o in enumerate(outs))
        assert s.flush(10) and s.lookup(keys).num_chunks == len(keys)       # promoted into the local tiers
        # a put whose parent is only in the shared tier is not an orphan
        more = chunk_keys(NS, list(range(28)))
        assert s.put(more[-1], more[-2], payload(99), num_tokens=4, shape=(P,), dtype="uint8")


def test_a_chain_goes_to_the_shared_tier_without_local_tiers(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(24)))
    shared = DictSharedTier()
    with with_shared(StoreConfig.model_validate({"chunk_size": 4, "memory": {"enabled": False}}), shared) as s:
        assert s.tiers == [shared]
        assert all(put_chain(s, keys)) and s.flush(10)          # a child's parent is only in the shared tier
        assert set(shared.data) == set(keys)


def test_stalled_shared_tier_does_not_delay_puts_or_lookups(tmp_path: Path) -> None:
    from kvtier.config import SharedFsConfig
    from kvtier.tiers.guard import GuardedTier

    keys = chunk_keys(NS, list(range(24)))
    shared = DictSharedTier()
    shared.stall()
    tm = Telemetry()
    conf = cfg(tmp_path)
    guarded = GuardedTier.wrap(shared, SharedFsConfig(path=tmp_path / "x", max_inflight=2), tm)
    with TieredStore.from_tiers(conf, NS, open_tiers(conf, NS, tm) + [guarded], tm) as s:
        assert all(put_chain(s, keys))                  # returns although the backend hangs
        assert s.lookup(keys).num_chunks == len(keys)
        res = s.shared_prefix(keys, Deadline.after(0.1))
        assert res.status is Status.UNAVAILABLE
        assert shared.max_blocked <= 2
        shared.resume()


# -- #12: async puts from a buffer the caller reuses at once --------------------------------------
@pytest.mark.parametrize("mem_chunks", [0, 64])
def test_async_put_with_reused_caller_buffer_writes_that_chunks_bytes(tmp_path: Path, monkeypatch,
                                                                       mem_chunks: int) -> None:
    keys = chunk_keys(NS, list(range(64)))            # 16 chunks
    with TieredStore.open(cfg(tmp_path, mem_chunks=mem_chunks, disk={"writer_threads": 1}), NS) as s:
        disk = s.tier("disk")
        gate = threading.Event()
        real = disk.write_file
        monkeypatch.setattr(disk, "write_file", lambda m, p: gate.wait(10) and real(m, p))
        buf = bytearray(P)                              # the connector's one staging buffer
        for i, k in enumerate(keys):
            buf[:] = payload(i)
            assert s.put(k, keys[i - 1] if i else None, buf, num_tokens=4, shape=(P,), dtype="uint8")
            buf[:] = b"\xee" * P                        # reused right after put returns
        gate.set()
        assert s.flush(10)
        for i, k in enumerate(keys):
            got = disk.get(k)                           # from the disk tier itself, verified
            assert got is not None and bytes(got[1]) == payload(i), f"chunk {i}"
