"""Disk chunk I/O paths: buffered / O_DIRECT, aligned / unaligned buffers, pipelined large chunks."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from kvtier.chunk import HEADER_SIZE, ChunkMeta
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers import diskio
from kvtier.tiers.disk import DiskTier

NS = Namespace("m", "f", "float32", "L", 4, 4)


def _put_random(tier: DiskTier, first_token: int, size: int, seed: int):
    """Put one chunk of ``size`` random bytes; its key and payload."""
    key = chunk_keys(NS, [first_token, 1, 2, 3])[0]
    src = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    tier.put(ChunkMeta(key, None, 4, (size,), "uint8", size), src)
    return key, src


def _buf(n: int, aligned: bool) -> memoryview:
    if aligned:
        return memoryview(mmap.mmap(-1, n))
    return memoryview(bytearray(n + 8))[8:]          # deliberately not 4 KiB aligned


@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("size", [1, 4096, 100_000, 4 * 2**20 + 123, 6 * 2**20])
@pytest.mark.parametrize("aligned", [True, False])
def test_roundtrip_every_path(tmp_path: Path, o_direct: bool, size: int, aligned: bool) -> None:
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=o_direct, telemetry=Telemetry())
    key = chunk_keys(NS, [size % 7, 1, 2, 3])[0]
    src = _buf(size, aligned)
    src[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    meta = ChunkMeta(key, None, 4, (size,), "uint8", size)
    assert tier.put(meta, src)
    out = _buf(size, aligned)
    assert tier.get_into(key, out) == meta and bytes(out) == bytes(src)
    tier.close()


@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("offset", [HEADER_SIZE + 5, HEADER_SIZE + 3 * 2**20 + 7, HEADER_SIZE + 6 * 2**20 - 1])
def test_corruption_deep_in_a_large_chunk(tmp_path: Path, o_direct: bool, offset: int) -> None:
    tm = Telemetry()
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=o_direct, telemetry=tm)
    size = 6 * 2**20
    key, src = _put_random(tier, 9, size, seed=1)
    with open(tier.path_of(key), "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))
    assert tier.get_into(key, _buf(size, True)) is None
    assert tm.snapshot()["events.corrupt"] == 1
    tier.close()


def test_o_direct_falls_back_when_refused(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os
    real_open = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)
    monkeypatch.setattr(diskio.os, "open", no_direct)
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=True, telemetry=Telemetry())
    key = chunk_keys(NS, [5, 1, 2, 3])[0]
    assert tier.put(ChunkMeta(key, None, 4, (10,), "uint8", 10), b"0123456789")
    got = tier.get(key)
    assert got is not None and bytes(got[1]) == b"0123456789"
    tier.close()


@pytest.mark.parametrize("o_direct,o_direct_read", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("size", [14 * 2**20, 5_898_240, 5_898_240 + 100])   # 7B and default chunks (+ unaligned)
def test_large_chunks_exact_file_and_every_read_mode(tmp_path: Path, o_direct: bool, o_direct_read: bool,
                                                      size: int) -> None:
    """One big write + buffered tail: the file is exactly header + payload + trailer (no
    padding left behind), and reads in pieces in flight together return the same bytes."""
    from kvtier.chunk import file_size
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=o_direct, o_direct_read=o_direct_read,
                         fsync="file", telemetry=Telemetry())
    assert tier.o_direct_read is o_direct_read
    key = chunk_keys(NS, [size % 11, 1, 2, 3])[0]
    src = _buf(size, True)
    src[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    meta = ChunkMeta(key, None, 4, (size,), "uint8", size)
    assert tier.put(meta, src)
    import os
    assert os.stat(tier.path_of(key)).st_size == file_size(size)
    assert os.listdir(tier.root / "tmp") == []
    out = _buf(size, True)
    for _ in range(2):
        assert tier.get_into(key, out) == meta and bytes(out) == bytes(src)
    tier.close()


@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("cut", [HEADER_SIZE + 2**20, HEADER_SIZE + 7 * 2**20 + 5, HEADER_SIZE + 14 * 2**20 + 10])
def test_truncated_large_chunk_is_torn(tmp_path: Path, o_direct: bool, cut: int) -> None:
    """A short file is caught by whichever in-flight piece comes up short (never served)."""
    import os
    tm = Telemetry()
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=o_direct, telemetry=tm)
    key = chunk_keys(NS, [cut % 13, 1, 2, 3])[0]
    size = 14 * 2**20
    tier.put(ChunkMeta(key, None, 4, (size,), "uint8", size), np.ones(size, dtype=np.uint8).tobytes())
    os.truncate(tier.path_of(key), cut)
    assert tier.get_into(key, _buf(size, True)) is None
    assert tm.snapshot()["events.torn"] == 1 and not os.path.exists(tier.path_of(key))
    tier.close()


def test_read_error_in_a_helper_piece_is_a_miss(tmp_path: Path, monkeypatch) -> None:
    """An EIO in one of the concurrent piece reads is a counted miss; the file is kept."""
    import errno
    import os
    tm = Telemetry()
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=True, telemetry=tm)
    size = 14 * 2**20
    key, src = _put_random(tier, 3, size, seed=3)
    real = os.preadv

    def flaky(fd, bufs, off, *a):
        if off > 4 * 2**20:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, off, *a)
    monkeypatch.setattr(diskio.os, "preadv", flaky)
    out = _buf(size, True)
    assert tier.get_into(key, out) is None and tm.snapshot()["events.io_error"] == 1
    monkeypatch.undo()
    assert tier.get_into(key, out) is not None and bytes(out) == src
    tier.close()


def test_o_direct_chunk_files_are_allocated_exactly(tmp_path: Path, monkeypatch) -> None:
    """With O_DIRECT the exact file size is reserved before the write (ext4 would otherwise round
    the allocation up and leave gaps between chunk files); small chunks skip it."""
    import os
    from kvtier.chunk import file_size
    fd, direct = diskio.open_direct(str(tmp_path / "probe"), os.O_WRONLY | os.O_CREAT, True)
    os.close(fd)
    if not direct:
        pytest.skip("this filesystem refuses O_DIRECT (e.g. tmpfs)")
    real, calls = diskio._FALLOCATE, []

    def spy(fd, mode, off, size):
        calls.append((mode, off, size))
        return real(fd, mode, off, size) if real is not None else 0
    monkeypatch.setattr(diskio, "_FALLOCATE", spy)
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=True, telemetry=Telemetry())
    keys = chunk_keys(NS, [7, 1, 2, 3, 4, 5, 6, 7])
    for key, size in zip(keys, (5_898_240, 100_000)):
        src = _buf(size, True)
        src[:] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        assert tier.put(ChunkMeta(key, None, 4, (size,), "uint8", size), src)
        out = _buf(size, True)
        assert tier.get_into(key, out) is not None and bytes(out) == bytes(src)
    assert calls == [(0, 0, file_size(5_898_240))]
    tier.close()


def test_fallocate_refused_or_full(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os
    calls = []

    def refuse(err):
        def fake(fd, mode, off, size):
            calls.append(size)
            import ctypes
            ctypes.set_errno(err)
            return -1
        return fake
    size = 2 * 2**20
    src = np.random.default_rng(8).integers(0, 256, size, dtype=np.uint8).tobytes()
    tm = Telemetry()
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=True, telemetry=tm)
    keys = chunk_keys(NS, [8, 1, 2, 3, 4, 5, 6, 7])
    monkeypatch.setattr(diskio, "_FALLOCATE", refuse(errno.EOPNOTSUPP))
    assert tier.put(ChunkMeta(keys[0], None, 4, (size,), "uint8", size), src)      # written without
    got = tier.get(keys[0])
    assert got is not None and bytes(got[1]) == src
    monkeypatch.setattr(diskio, "_FALLOCATE", refuse(errno.ENOSPC))
    assert not tier.put(ChunkMeta(keys[1], keys[0], 4, (size,), "uint8", size), src)  # a counted enospc
    assert tm.snapshot()["events.enospc"] == 1 and len(calls) == 2
    assert os.listdir(tier.root / "tmp") == [] and not os.path.exists(tier.path_of(keys[1]))
    tier.close()
