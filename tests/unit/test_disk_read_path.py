"""The disk tier's verified read path (diskio.read_chunk_file): the read system calls it issues
(``read_plan``, no end-of-file probe, the first piece on the calling thread), and that every byte
stays verified whichever piece is damaged, short or fails."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.chunk import HEADER_SIZE, ChunkMeta, file_size
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers import diskio
from kvtier.tiers.disk import DiskTier

NS = Namespace("m", "readpath", "float32", "L", 4, 4)
DEFAULT, SEVEN_B = 23_040 * 256, 57_344 * 256          # the bench's chunk sizes (multiples of 4 KiB)


def _direct_ok(tmp_path: Path) -> bool:
    fd, direct = diskio.open_direct(str(tmp_path / "probe"), os.O_WRONLY | os.O_CREAT, True)
    os.close(fd)
    os.unlink(tmp_path / "probe")
    return direct


def _aligned(n: int) -> memoryview:
    return memoryview(mmap.mmap(-1, max(n, 1)))[:n]


def _put(tier: DiskTier, size: int, seed: int):
    key = chunk_keys(NS, [seed, 1, 2, 3])[0]
    src = _aligned(size)
    src[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    meta = ChunkMeta(key, None, 4, (size,), "uint8", size)
    assert tier.put(meta, src)
    return key, meta, bytes(src)


class _Spy:
    """Records every preadv of diskio: (thread id, offset, bytes asked, bytes got)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[int, int, int, int]] = []
        self._lock = threading.Lock()
        real = os.preadv

        def spy(fd, bufs, off, *a):
            n = real(fd, bufs, off, *a)
            with self._lock:
                self.calls.append((threading.get_ident(), off, sum(len(b) for b in bufs), n))
            return n
        monkeypatch.setattr(diskio.os, "preadv", spy)


def test_read_plan_of_the_bench_chunks() -> None:
    # 5.6 MiB: header + 2 MiB | 2 MiB | 1.6 MiB + tail page -> 3 reads in flight (O_DIRECT)
    assert diskio.read_plan(DEFAULT, True) == [HEADER_SIZE + 2**21, 2**21, DEFAULT - 2**22 + 4096]
    assert len(diskio.read_plan(SEVEN_B, True)) == 7
    assert sum(diskio.read_plan(SEVEN_B, False)) == file_size(SEVEN_B)     # buffered: exact parts
    assert diskio.read_plan(100_000, True) == [HEADER_SIZE + 98_304 + 4096]  # small: one read
    assert diskio.read_plan(100, True) == [8192]                            # no aligned body: bounce


@pytest.mark.parametrize("o_direct", [True, False])
@pytest.mark.parametrize("size", [DEFAULT, SEVEN_B, DEFAULT + 100, 100_000])
def test_reads_follow_the_plan_without_an_end_of_file_probe(tmp_path: Path, monkeypatch, o_direct: bool,
                                                            size: int) -> None:
    if o_direct and not _direct_ok(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT (e.g. tmpfs)")
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=o_direct, telemetry=Telemetry(), rescan_interval_s=0)
    key, meta, src = _put(tier, size, seed=size % 97)
    spy = _Spy(monkeypatch)
    out = _aligned(size)
    assert tier.get_into(key, out) == meta and bytes(out) == src
    calls = sorted(spy.calls, key=lambda c: c[1])
    fsize = file_size(size)
    assert all(off < fsize for _, off, _, _ in calls)              # never a read at/after the end
    assert sum(got for *_, got in calls) == fsize
    if o_direct and size % 4096 == 0:
        assert [asked for _, _, asked, _ in calls] == diskio.read_plan(size, True)
    if len(calls) > 1:                                              # pipelined: the header piece is
        assert calls[0][0] == threading.get_ident()                 # read by the calling thread
    tier.close()


@pytest.mark.parametrize("offset", [100, HEADER_SIZE + 7, HEADER_SIZE + 2**21 + 3, HEADER_SIZE + DEFAULT - 1,
                                    HEADER_SIZE + DEFAULT + 5])       # header, 1st/2nd/last piece, trailer
def test_a_flipped_bit_anywhere_is_never_served(tmp_path: Path, offset: int) -> None:
    tm = Telemetry()
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=True, telemetry=tm, rescan_interval_s=0)
    key, _, _ = _put(tier, DEFAULT, seed=5)
    with open(tier.path_of(key), "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 1]))
    assert tier.get_into(key, _aligned(DEFAULT)) is None
    snap = tm.snapshot()
    assert sum(v for k, v in snap.items() if k.startswith("events.")) == 1
    assert not os.path.exists(tier.path_of(key))
    tier.close()


@pytest.mark.parametrize("cut", [HEADER_SIZE + 100, HEADER_SIZE + 2**21 + 10, file_size(DEFAULT) - 1])
def test_a_short_file_is_torn_in_any_piece(tmp_path: Path, cut: int) -> None:
    tm = Telemetry()
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=True, telemetry=tm, rescan_interval_s=0)
    key, _, _ = _put(tier, DEFAULT, seed=6)
    os.truncate(tier.path_of(key), cut)
    assert tier.get_into(key, _aligned(DEFAULT)) is None
    assert tm.snapshot()["events.torn"] == 1
    tier.close()


def test_an_error_on_the_calling_threads_piece_waits_for_the_helpers(tmp_path: Path, monkeypatch) -> None:
    """EIO in the first piece (read inline) is a counted miss, and get_into returns only once the
    helpers' reads into the caller's buffer are over."""
    tm = Telemetry()
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=True, telemetry=tm, rescan_interval_s=0)
    key, meta, src = _put(tier, SEVEN_B, seed=7)
    real = os.preadv
    busy = {"now": 0, "max": 0}
    lock = threading.Lock()

    def flaky(fd, bufs, off, *a):
        if off == 0:
            raise OSError(errno.EIO, "Input/output error")
        with lock:
            busy["now"] += 1
            busy["max"] = max(busy["max"], busy["now"])
        try:
            time.sleep(0.05)
            return real(fd, bufs, off, *a)
        finally:
            with lock:
                busy["now"] -= 1
    monkeypatch.setattr(diskio.os, "preadv", flaky)
    out = _aligned(SEVEN_B)
    assert tier.get_into(key, out) is None
    assert busy["now"] == 0 and busy["max"] >= 1 and tm.snapshot()["events.io_error"] == 1
    monkeypatch.undo()
    assert tier.get_into(key, out) == meta and bytes(out) == src      # the file was kept
    tier.close()


def test_one_read_per_chunk_mode_reads_and_verifies_the_same(tmp_path: Path, monkeypatch) -> None:
    """``read_pipeline_min`` above the chunk (the bench's one-read pass): one preadv per chunk, checksum after."""
    tier = DiskTier.open(tmp_path, NS, 2**30, o_direct=True, telemetry=Telemetry(), rescan_interval_s=0)
    key, meta, src = _put(tier, DEFAULT, seed=8)
    tier.read_pipeline_min = 1 << 62
    spy = _Spy(monkeypatch)
    out = _aligned(DEFAULT)
    assert tier.get_into(key, out) == meta and bytes(out) == src
    assert len(spy.calls) == 1 and spy.calls[0][2] == sum(diskio.read_plan(DEFAULT, True))
    with open(tier.path_of(key), "r+b") as f:
        f.seek(HEADER_SIZE + 3 * 2**20)
        f.write(b"\xff\x00\xff")
    assert tier.get_into(key, out) is None
    tier.close()
