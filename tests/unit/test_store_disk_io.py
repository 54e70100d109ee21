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
    key = chunk_keys(NS, [9, 1, 2, 3])[0]
    size = 6 * 2**20
    src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    tier.put(ChunkMeta(key, None, 4, (size,), "uint8", size), src)
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
