"""The disk tier's write path: atomic publish (a crash between the write and the rename leaves no
visible chunk, partial or whole), one rename per publish (the fan-out directories exist from open), a
removed fan-out directory made again, a failed rename leaving nothing behind, exact files."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.chunk import ChunkMeta, file_size
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disklayout import NamespaceDir

NS = Namespace("m", "f", "float32", "L", 4, 4)
KEYS = chunk_keys(NS, list(range(4 * 16)))
ROOT = Path(__file__).resolve().parents[2]


def _meta(i: int, size: int) -> ChunkMeta:
    return ChunkMeta(KEYS[i], KEYS[i - 1] if i else None, 4, (size,), "uint8", size)


def _payload(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def _open(path: Path, o_direct: bool = False) -> DiskTier:
    return DiskTier.open(path, NS, 10**9, o_direct=o_direct, rescan_interval_s=0, telemetry=Telemetry())


CRASH_CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np
    from kvtier.chunk import ChunkMeta
    from kvtier.keys import Namespace, chunk_keys
    from kvtier.tiers.disk import DiskTier
    NS = Namespace("m", "f", "float32", "L", 4, 4)
    keys = chunk_keys(NS, list(range(64)))
    crash_at, size, o_direct = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    real, seen = os.replace, [0]
    def replace(src, dst):
        if str(dst).endswith(".kvc"):
            if seen[0] == crash_at:        # the temp file is complete, the rename not done: die now
                os._exit(9)
            seen[0] += 1
        return real(src, dst)
    os.replace = replace
    t = DiskTier.open(sys.argv[1], NS, 10**9, o_direct=o_direct, rescan_interval_s=0)
    for i, k in enumerate(keys):
        p = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
        t.put(ChunkMeta(k, keys[i - 1] if i else None, 4, (size,), "uint8", size), p)
""")


@pytest.mark.parametrize("crash_at,size,o_direct", [(0, 5000, False), (2, 5000, True), (1, 5 * 2**20 + 7, True)])
def test_a_crash_between_write_and_rename_leaves_no_visible_chunk(tmp_path: Path, crash_at: int, size: int,
                                                                  o_direct: bool) -> None:
    proc = subprocess.run([sys.executable, "-c", CRASH_CHILD, str(tmp_path), str(crash_at), str(size),
                           "1" if o_direct else "0"], env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode == 9
    nsdir = NamespaceDir.all_under(tmp_path)[0]
    published = sorted(p for p in nsdir.chunks.rglob("*.kvc"))
    assert len(published) == crash_at                        # the crashed chunk has no final name
    assert all(p.stat().st_size == file_size(size) for p in published)   # and no final name holds a partial file
    assert len(list(nsdir.tmp.iterdir())) == 1               # its complete temp file, invisible to readers
    t = _open(tmp_path, o_direct)                             # reopening removes the dead writer's temp file
    try:
        assert list(nsdir.tmp.iterdir()) == []
        assert not t.contains(KEYS[crash_at]) and t.get(KEYS[crash_at]) is None
        for i in range(crash_at):
            got = t.get(KEYS[i])
            assert got is not None and bytes(got[1]) == _payload(i, size)
        assert t.usage().used_bytes == crash_at * file_size(size) and t.usage().num_chunks == crash_at
    finally:
        t.close()


def test_every_publish_is_one_rename_the_fan_out_directories_exist_from_open(tmp_path: Path, monkeypatch) -> None:
    t = _open(tmp_path)
    calls: list[str] = []
    real_makedirs, real_replace = os.makedirs, os.replace
    monkeypatch.setattr(os, "makedirs", lambda *a, **k: (calls.append("makedirs"), real_makedirs(*a, **k))[1])
    monkeypatch.setattr(os, "replace", lambda *a, **k: (calls.append("replace"), real_replace(*a, **k))[1])
    try:
        assert sorted(p.name for p in t.layout.chunks.iterdir()) == [f"{i:02x}" for i in range(256)]
        assert t.put(_meta(0, 100), _payload(0, 100))
        assert calls == ["replace"]                           # the first chunk under its prefix too
        assert t.delete(KEYS[0])
        calls.clear()
        assert t.put(_meta(0, 100), _payload(0, 100))
        assert calls == ["replace"]
        assert list(t.layout.tmp.iterdir()) == []
    finally:
        t.close()


def test_reopening_makes_the_missing_fan_out_directories_and_keeps_the_chunks(tmp_path: Path) -> None:
    t = _open(tmp_path)
    assert t.put(_meta(0, 100), _payload(0, 100))
    kept = Path(t.path_of(KEYS[0])).parent.name
    gone = next(f"{i:02x}" for i in range(256) if f"{i:02x}" != kept)
    t.close()
    (t.layout.chunks / gone).rmdir()
    t = _open(tmp_path)
    try:
        assert (t.layout.chunks / gone).is_dir()
        got = t.get(KEYS[0])
        assert got is not None and bytes(got[1]) == _payload(0, 100)
    finally:
        t.close()


def test_a_removed_fan_out_directory_is_made_again(tmp_path: Path) -> None:
    t = _open(tmp_path)
    try:
        assert t.put(_meta(0, 100), _payload(0, 100))
        final = Path(t.path_of(KEYS[0]))
        assert t.delete(KEYS[0])
        final.parent.rmdir()                                   # removed by hand (or another tool) since
        assert t.put(_meta(0, 100), _payload(0, 100))
        assert final.stat().st_size == file_size(100)
        got = t.get(KEYS[0])
        assert got is not None and bytes(got[1]) == _payload(0, 100)
        assert list(t.layout.tmp.iterdir()) == []
    finally:
        t.close()


def test_a_failed_rename_leaves_nothing_and_keeps_the_ledger(tmp_path: Path, monkeypatch) -> None:
    t = _open(tmp_path)
    try:
        assert t.put(_meta(0, 100), _payload(0, 100))
        used = t.usage().used_bytes

        def refuse(src, dst):
            raise OSError(errno.EIO, "injected")
        monkeypatch.setattr(os, "replace", refuse)
        assert not t.put(_meta(1, 100), _payload(1, 100))
        monkeypatch.undo()
        assert not os.path.exists(t.path_of(KEYS[1])) and not t.contains(KEYS[1])
        assert list(t.layout.tmp.iterdir()) == []              # the temp file is removed, not left behind
        assert t.usage().used_bytes == used
    finally:
        t.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.one_of(st.integers(1, 3 * 4096 + 50), st.sampled_from([4096, 2**20, 4 * 2**20 + 4095])),
       o_direct=st.booleans(), seed=st.integers(0, 2**16))
def test_published_files_are_exact_and_read_back(tmp_path: Path, size: int, o_direct: bool, seed: int) -> None:
    d = tmp_path / f"{size}-{int(o_direct)}-{seed}"
    t = _open(d, o_direct)
    try:
        src = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
        assert t.put(_meta(0, size), src)
        assert os.stat(t.path_of(KEYS[0])).st_size == file_size(size)
        assert list(t.layout.tmp.iterdir()) == []
        assert t.usage().used_bytes == file_size(size)
        got = t.get(KEYS[0])
        assert got is not None and bytes(got[1]) == src
    finally:
        t.close()


@pytest.mark.parametrize("fail", [False, True])
def test_large_writes_return_only_after_the_checksum_finished(tmp_path: Path, monkeypatch, fail: bool) -> None:
    """A large chunk's write is issued by the calling thread while a pool thread hashes the same buffer:
    write_chunk_file never returns (nor raises) while the pool thread may still read the caller's buffer,
    and the digest written is the payload's."""
    import threading
    import time

    from kvtier.chunk import HEADER_SIZE, checksum
    from kvtier.tiers import diskio

    state: dict[str, float] = {}
    real_checksum, real_writev = diskio.checksum, diskio._writev_all

    def slow_checksum(*parts):
        state["hash_thread"] = threading.get_ident()
        time.sleep(0.2)                    # longer than the write: the caller must wait for it
        digest = real_checksum(*parts)
        state["hashed_at"] = time.perf_counter()
        return digest

    def writev(fd, parts):
        state["write_thread"] = threading.get_ident()
        if fail:
            raise OSError(errno.ENOSPC, "injected")
        real_writev(fd, parts)
    monkeypatch.setattr(diskio, "checksum", slow_checksum)
    monkeypatch.setattr(diskio, "_writev_all", writev)
    size = diskio.PIPELINE_MIN + 12_345
    payload = memoryview(_payload(3, size))
    header = bytes(HEADER_SIZE)
    path = str(tmp_path / "c.tmp")
    if fail:
        with pytest.raises(OSError):
            diskio.write_chunk_file(path, header, payload, o_direct=False, fsync=False)
    else:
        diskio.write_chunk_file(path, header, payload, o_direct=False, fsync=False)
    returned = time.perf_counter()
    assert state["hashed_at"] <= returned
    assert state["write_thread"] == threading.get_ident() != state["hash_thread"]
    if not fail:
        data = Path(path).read_bytes()
        assert data[HEADER_SIZE:HEADER_SIZE + size] == bytes(payload)
        assert data[-16:] == real_checksum(memoryview(header), payload)
