"""The best raw read this machine achieves for a given set of chunk-sized reads: the "ideal" that
kvtier's SSD tier is compared against.

``best_raw_read`` writes FRESH files (never read before, so no read-ahead state), makes them
durable (fsync) and evicts them from the page cache, then reads them back with ``O_DIRECT``
into 4 KiB-aligned buffers, split into the same pieces and with the same number of reads in
flight as the tier's loads (``PREFETCH_DEPTH`` chunks ahead, each chunk's pieces all submitted at
once — see ``kvtier/tiers/diskio.py``). The best of ``tries`` rounds (new files each round) is
kept: a bound, not an average. Where the filesystem refuses ``O_DIRECT`` (tmpfs) the reads are
buffered from evicted files and the result says so.

Side effects: files under ``directory`` (removed before returning).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ALIGN = 4096


@dataclass(frozen=True)
class RawRead:
    seconds: float            # best wall time over the tries
    nbytes: int               # bytes read per try
    files: int
    reads_in_flight: int
    piece_bytes: int
    o_direct: bool
    tries: int

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


def tier_reads_in_flight(file_bytes: int, chunks_ahead: int, o_direct: bool = True) -> tuple[int, int]:
    """(reads in flight, piece size) of the SSD tier loading chunk files of ``file_bytes`` with
    ``chunks_ahead`` chunk reads in flight (the connector's ``PREFETCH_DEPTH``): the read system
    calls ``read_chunk_file`` issues per chunk (``diskio.read_plan``: header, 2 MiB pieces and tail,
    grouped), all in flight together, times ``chunks_ahead``; the piece splits the file evenly."""
    from kvtier.chunk import HEADER_SIZE, TRAILER_SIZE
    from kvtier.tiers.diskio import read_plan

    per_chunk = len(read_plan(file_bytes - HEADER_SIZE - TRAILER_SIZE, o_direct))
    return chunks_ahead * per_chunk, -(-file_bytes // per_chunk)


def _aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, max(ALIGN, -(-n // ALIGN) * ALIGN))     # page-aligned anonymous memory


def _write_fresh(paths: list[Path], file_bytes: int) -> None:
    block = os.urandom(min(file_bytes, 1 << 20))
    for p in paths:
        with open(p, "wb") as f:
            left = file_bytes
            while left > 0:
                left -= f.write(block[:left])
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _open(path: Path, o_direct: bool = True) -> tuple[int, bool]:
    direct = getattr(os, "O_DIRECT", 0)
    if direct and o_direct:
        try:
            return os.open(path, os.O_RDONLY | direct), True
        except OSError:
            pass
    return os.open(path, os.O_RDONLY), False


_local = threading.local()


def _read_piece(fd: int, piece_bytes: int, offset: int, length: int) -> int:
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < piece_bytes:
        buf = _local.buf = _aligned(piece_bytes)      # one aligned buffer per reading thread
    view = memoryview(buf)[:-(-length // ALIGN) * ALIGN]
    got = 0
    while got < length:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return min(got, length)


def best_raw_read(directory: Path, file_bytes: int, files: int, reads_in_flight: int, piece_bytes: int,
                  tries: int = 3, o_direct: bool = True) -> RawRead:
    """Best wall time reading ``files`` fresh files of ``file_bytes`` each (see the module doc);
    ``o_direct=False``: buffered reads of the evicted files (the tier's buffered mode)."""
    if file_bytes <= 0 or files <= 0 or reads_in_flight <= 0 or piece_bytes <= 0:
        raise ValueError("file_bytes, files, reads_in_flight and piece_bytes must be > 0")
    directory.mkdir(parents=True, exist_ok=True)
    piece_bytes = -(-piece_bytes // ALIGN) * ALIGN
    best, direct_all = float("inf"), True
    with ThreadPoolExecutor(reads_in_flight, thread_name_prefix="kvtier-rawread") as pool:
        for t in range(tries):
            paths = [directory / f"raw-{os.getpid()}-{t}-{i}.bin" for i in range(files)]
            try:
                _write_fresh(paths, file_bytes)
                fds = [_open(p, o_direct) for p in paths]
                direct_all = direct_all and all(d for _, d in fds)
                jobs = [(fd, off, min(piece_bytes, file_bytes - off)) for fd, _ in fds
                        for off in range(0, file_bytes, piece_bytes)]
                t0 = time.perf_counter()
                futs = [pool.submit(_read_piece, fd, piece_bytes, off, n) for fd, off, n in jobs]
                got = sum(f.result() for f in futs)
                dt = time.perf_counter() - t0
                for fd, _ in fds:
                    os.close(fd)
                if got != file_bytes * files:
                    raise OSError(f"raw read got {got} of {file_bytes * files} bytes")
                best = min(best, dt)
            finally:
                for p in paths:
                    p.unlink(missing_ok=True)
    return RawRead(best, file_bytes * files, files, reads_in_flight, piece_bytes, direct_all, tries)
