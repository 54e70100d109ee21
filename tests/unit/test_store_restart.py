"""Restart: the index is recovered from the directory; a writer killed mid-write never
leaves a servable partial chunk; fsck finds and repairs what a crash or bit rot leaves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from kvtier.chunk import HEADER_SIZE, ChunkMeta
from kvtier.config import StoreConfig
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.store import TieredStore
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.fsck import check

NS = Namespace("m", "f", "float32", "L", 4, 4)
P = 50_000


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, P, dtype=np.uint8).tobytes()


def test_restart_recovers_index_ledger_and_parents(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(4 * 300)))
    tier = DiskTier.open(tmp_path, NS, 10**9, telemetry=Telemetry())
    for i, k in enumerate(keys):
        assert tier.put(ChunkMeta(k, keys[i - 1] if i else None, 4, (P,), "uint8", P), payload(i % 7))
    used = tier.usage().used_bytes
    tier.close()
    for manifest in (True, False):             # with the manifest hint, then by reading every header
        if not manifest:
            os.unlink(tmp_path / NS.short_id() / "manifest")
        t = DiskTier.open(tmp_path, NS, 10**9, telemetry=Telemetry())
        assert t.usage().num_chunks == 300 and t.usage().used_bytes == used
        assert t.parent(keys[10]) == keys[9] and t.parent(keys[0]) is None
        assert t.children(keys[297]) == [keys[298]] and t.children(keys[299]) == []
        got = t.get(keys[123])
        assert got is not None and bytes(got[1]) == payload(123 % 7)
        t.close()


def test_damaged_manifest_is_ignored(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(40)))
    t = DiskTier.open(tmp_path, NS, 10**9, telemetry=Telemetry())
    for i, k in enumerate(keys):
        t.put(ChunkMeta(k, keys[i - 1] if i else None, 4, (10,), "uint8", 10), b"x" * 10)
    t.close()
    (tmp_path / NS.short_id() / "manifest").write_bytes(b"garbage" * 100)
    t = DiskTier.open(tmp_path, NS, 10**9, telemetry=Telemetry())
    assert t.usage().num_chunks == 10 and t.parent(keys[5]) == keys[4]
    t.close()


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from kvtier.chunk import ChunkMeta
    from kvtier.keys import Namespace, chunk_keys
    from kvtier.tiers import diskio
    from kvtier.tiers.disk import DiskTier
    ns = Namespace("m", "f", "float32", "L", 4, 4)
    keys = chunk_keys(ns, list(range(4 * 6)))
    P = int(sys.argv[2])
    t = DiskTier.open(sys.argv[1], ns, 10**9)
    for i in range(5):
        t.put(ChunkMeta(keys[i], keys[i - 1] if i else None, 4, (P,), "uint8", P),
              np.random.default_rng(i).integers(0, 256, P, dtype=np.uint8).tobytes())
    real = diskio._writev_all
    def half_then_hang(fd, parts):
        real(fd, [parts[0], parts[1][: len(parts[1]) // 2]])   # header + half the payload ...
        print("HALF", flush=True)
        time.sleep(60)                                          # ... then get SIGKILLed
    diskio._writev_all = half_then_hang
    t.put(ChunkMeta(keys[5], keys[4], 4, (P,), "uint8", P), b"z" * P)
""")


def test_writer_killed_mid_write_is_never_served(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), str(P)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "HALF"
        tmp_dir = tmp_path / NS.short_id() / "tmp"
        partial = [p for p in tmp_dir.iterdir() if p.name.endswith(".tmp")]
        assert len(partial) == 1 and 0 < partial[0].stat().st_size < HEADER_SIZE + P
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    keys = chunk_keys(NS, list(range(4 * 6)))
    # plant what a non-atomic writer could leave: chunk 4 truncated under its final name
    probe = DiskTier.open(tmp_path, NS, 10**9)               # (open cleans the dead writer's temp file)
    os.truncate(probe.path_of(keys[4]), HEADER_SIZE + 100)
    probe.close()
    cfg = StoreConfig.model_validate({"chunk_size": 4, "memory": {"enabled": False},
                                      "disk": {"enabled": True, "path": str(tmp_path)}})
    with TieredStore.open(cfg, NS) as s:
        assert list(tmp_dir.iterdir()) == []                 # the dead writer's temp file is gone
        assert s.lookup(keys).num_chunks == 5                # the killed put of chunk 5 never published
        for i in range(4):
            assert bytes(s.get(keys[i])) == np.random.default_rng(i).integers(0, 256, P, dtype=np.uint8).tobytes()
        assert s.get(keys[4]) is None                        # partial file: detected, never served
        assert s.stats()["counters"]["events.torn"] == 1
        assert s.lookup(keys).num_chunks == 4


def test_planted_temp_files_are_cleaned(tmp_path: Path) -> None:
    t = DiskTier.open(tmp_path, NS, 10**9, telemetry=Telemetry())
    t.close()
    tmp_dir = tmp_path / NS.short_id() / "tmp"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_dir / f"{'ab' * 32}.{dead}.1.0.tmp").write_bytes(b"partial")
    (tmp_dir / "junk-without-pid").write_bytes(b"x")
    live = tmp_dir / f"{'cd' * 32}.{os.getppid()}.1.0.tmp"       # a live writer's file is left alone
    live.write_bytes(b"in progress")
    tm = Telemetry()
    DiskTier.open(tmp_path, NS, 10**9, telemetry=tm).close()
    assert sorted(p.name for p in tmp_dir.iterdir()) == [live.name]
    assert tm.snapshot()["events.temp_cleaned"] == 1


def test_fsck_reports_and_repairs(tmp_path: Path) -> None:
    keys = chunk_keys(NS, list(range(4 * 8)))
    t = DiskTier.open(tmp_path, NS, 10**9, telemetry=Telemetry())
    for i, k in enumerate(keys):
        t.put(ChunkMeta(k, keys[i - 1] if i else None, 4, (P,), "uint8", P), payload(i))
    t.close()
    root = tmp_path / NS.short_id()
    with open(t.path_of(keys[3]), "r+b") as f:              # bit rot in chunk 3 -> 4..7 become orphans
        f.seek(HEADER_SIZE + 99)
        f.write(b"\xff\xfe")
    (root / "tmp" / f"{'ee' * 32}.999999999.1.0.tmp").write_bytes(b"x")
    os.pwrite(os.open(root / "ledger", os.O_RDWR), (12345).to_bytes(8, "little"), 0)
    dry = check(tmp_path, repair=False)
    assert not dry.clean and list(dry.bad.values()) == ["corrupt"] and len(dry.orphans) == 4
    assert len(dry.temp_files) == 1 and dry.ok == 3 and dry.removed == 0
    fixed = check(tmp_path)
    assert fixed.removed == 6 and fixed.ledger_fixed == 1
    again = check(tmp_path)
    assert again.clean and again.ok == 3 and again.chunks == 3
    t = DiskTier.open(tmp_path, NS, 10**9, telemetry=Telemetry())
    assert t.usage().num_chunks == 3 and t.usage().used_bytes == again.bytes_ok
    t.close()


def test_fsck_cli(tmp_path: Path) -> None:
    DiskTier.open(tmp_path, NS, 10**9).close()
    ok = subprocess.run([sys.executable, "-m", "kvtier.cli", "fsck", str(tmp_path), "--json", "-"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and '"clean": true' in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "kvtier.cli", "fsck", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not a directory" in bad.stderr
