"""The plain-I/O passes of ``kvtier bench store``. No checksums, no ledger, no index: what the
device gives.

* The ceiling variants (``write_files``, ``read_file``): plain I/O of the tier's own chunk-file
  bytes, file by file, at the tier's concurrency, with the tier's O_DIRECT choice and one reused
  source/destination buffer. Writes (``WRITE_SHAPES``): ``publish`` = the tier's own sequence
  (create in a ``tmp/`` directory, reserve the blocks, O_DIRECT body + buffered tail, close,
  rename into a fan-out directory, made beforehand by ``prepare_layout`` as the tier makes them
  when it opens); ``create`` = the same without the rename; ``padded`` (O_DIRECT only) = one O_DIRECT write of the file rounded up to 4 KiB, no tail write, no rename (up to
  4 KiB more per file, one request fewer: a plain-I/O bound the exact-size format cannot reach).
  Reads (``READ_SHAPES``) of the tier's own files: ``plan`` = ``get_into``'s read system calls
  (``diskio.read_plan``), all in flight together; ``whole`` = one ``preadv`` of the file.
* References (not ceilings: other files): sequential writes/reads of one preallocated file in
  chunk-sized blocks (``raw_disk``: fio when installed, which preallocates too) and reads of fresh
  files at the tier's reads in flight (``raw_read_same_io``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from kvtier.bench.store_bench_files import drop_page_cache, random_buffer, remove_settled
from kvtier.bench.store_bench_rounds import GB
from kvtier.tiers.diskio import ALIGN, _end_buffered, _preallocate, open_direct, read_plan
from kvtier.tiers.disklayout import NamespaceDir


def raw_disk(path: Path, chunk: int, n: int, buf: memoryview | None = None) -> dict:
    """The one-file reference: sequential O_DIRECT write (blocks reserved first, fsync) then read
    (after a page-cache drop) of n chunk-sized blocks in one file, no checksum (fio when available)."""
    f = path / "raw.bin"
    block = (chunk + ALIGN - 1) // ALIGN * ALIGN
    if shutil.which("fio"):
        res = {}
        for rw in ("write", "read"):
            cmd = ["fio", "--name=raw", f"--filename={f}", f"--rw={rw}", f"--bs={block}", f"--size={n * block}",
                   "--direct=1", "--ioengine=psync", "--output-format=json", "--end_fsync=1"]
            out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            res[f"raw_{rw}_gbps"] = out["jobs"][0][rw]["bw_bytes"] / GB
        remove_settled(f)
        return {**res, "raw_tool": "fio"}
    if buf is None:
        buf = random_buffer(block, 1)
    fd, direct = open_direct(str(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, True)
    t0 = time.perf_counter()
    if direct:
        _preallocate(fd, n * block)          # as fio does (fallocate=native): no allocating writes
    for i in range(n):
        os.pwrite(fd, buf, i * block)
    os.fsync(fd)
    w = n * block / (time.perf_counter() - t0) / GB
    os.close(fd)
    drop_page_cache([str(f)])
    fd, _ = open_direct(str(f), os.O_RDONLY, True)
    t0 = time.perf_counter()
    for i in range(n):
        os.preadv(fd, [buf], i * block)
    r = n * block / (time.perf_counter() - t0) / GB
    os.close(fd)
    remove_settled(f)
    return {"raw_write_gbps": w, "raw_read_gbps": r, "raw_tool": "python" + ("" if direct else "-buffered")}


def raw_read_same_io(path: Path, chunk: int, n: int, o_direct: bool) -> float:
    """GB/s of raw reads of n fresh chunk-sized files with ``get_into``'s pieces in flight (one chunk
    at a time, as this bench calls it) and read mode; no checksum."""
    from kvtier.bench.rawread import best_raw_read, tier_reads_in_flight
    from kvtier.chunk import file_size

    fbytes = file_size(chunk)
    inflight, piece = tier_reads_in_flight(fbytes, 1, o_direct)
    r = best_raw_read(path / "raw-same-io", fbytes, n, inflight, piece, tries=1, o_direct=o_direct)
    os.sync()
    return r.bytes_per_s / GB


WRITE_SHAPES = {True: ("publish", "create", "padded"), False: ("publish", "create")}   # by O_DIRECT
READ_SHAPES = ("plan", "whole")


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write_exact(fd: int, src: memoryview, file_bytes: int) -> int:
    """The tier's writes into the new file ``fd`` opened with O_DIRECT: its exact blocks reserved, the
    4 KiB-aligned body as one O_DIRECT write, the rest as one buffered write. Returns the body's length."""
    _preallocate(fd, file_bytes)
    body = file_bytes // ALIGN * ALIGN
    os.pwrite(fd, src[:body], 0)
    _end_buffered(fd)
    os.pwrite(fd, src[body:file_bytes], body)
    return body


def write_one(tmp: str, final: str | None, src: memoryview, file_bytes: int, o_direct: bool, shape: str,
              layout: NamespaceDir | None = None) -> None:
    """Write one file of ``file_bytes`` bytes from ``src`` (aligned, at least the file rounded up to
    4 KiB) the way ``shape`` says (see the module doc); ``final``: rename there (``publish``)."""
    fd, direct = open_direct(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, o_direct)
    try:
        if direct and shape == "padded":
            _preallocate(fd, _round_up(file_bytes))
            os.pwrite(fd, src[:_round_up(file_bytes)], 0)
        elif direct:
            write_exact(fd, src, file_bytes)
        else:
            os.pwrite(fd, src[:file_bytes], 0)
    finally:
        os.close(fd)
    if final is not None and layout is not None:
        layout.publish(tmp, final)


def prepare_layout(layout: NamespaceDir, fanout: bool) -> None:
    """Make ``layout``'s ``tmp/`` and ``chunks/`` (and, with ``fanout``, its 256 fan-out directories, as
    the tier makes them when it opens a namespace), before any timed write."""
    layout.tmp.mkdir(parents=True, exist_ok=True)
    layout.chunks.mkdir(exist_ok=True)
    if fanout:
        layout.make_fanout()


def write_files(layout: NamespaceDir, names: Sequence[str], src: memoryview, file_bytes: int, *, o_direct: bool,
                shape: str, threads: int = 1) -> float:
    """Seconds to write one file per name in ``layout`` (the tier's: ``tmp/<name>.tmp``; ``publish``
    renames each to ``chunks/<name[:2]>/<name>.kvc`` with the tier's ``publish``) with ``threads``
    threads (each takes the next name when it is free, as the writer pool takes the next job), then
    ``os.sync`` (written back, as the tier's put is timed). Files stay (the caller removes the directory).
    ``prepare_layout`` makes the fan-out directories beforehand; one missing is made by the
    rename that needs it (``NamespaceDir.publish``), inside the timing."""
    prepare_layout(layout, fanout=False)      # tmp/ and chunks/ when the caller did not
    tmp = layout.tmp

    todo = iter(names)
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:                # the next file to whichever thread is free, as the writer pool's queue
                name = next(todo, None)
            if name is None:
                return
            final = f"{layout.chunks}/{name[:2]}/{name}.kvc" if shape == "publish" else None
            write_one(f"{tmp}/{name}.tmp", final, src, file_bytes, o_direct, shape, layout)
    t0 = time.perf_counter()
    if threads == 1:
        work()
    else:
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    os.sync()
    return time.perf_counter() - t0


def _read_at(fd: int, view: memoryview, offset: int, end: int) -> int:
    got = 0
    while got < len(view) and offset + got < end:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def read_file(path: str, buf: memoryview, file_bytes: int, *, o_direct: bool, shape: str,
              pool: ThreadPoolExecutor | None = None) -> int:
    """Plain read of one whole chunk file into ``buf`` (aligned, the file rounded up to 4 KiB):
    ``whole`` = one ``preadv``; ``plan`` = ``get_into``'s read system calls for this file, the
    first on this thread, the others on ``pool``, all in flight together. Returns bytes read."""
    from kvtier.chunk import HEADER_SIZE, TRAILER_SIZE

    fd, direct = open_direct(path, os.O_RDONLY, o_direct)
    try:
        n = _round_up(file_bytes) if direct else file_bytes
        if shape == "whole" or pool is None:
            return min(_read_at(fd, buf[:n], 0, file_bytes), file_bytes)
        lens = read_plan(file_bytes - HEADER_SIZE - TRAILER_SIZE, direct)
        offs = [sum(lens[:i]) for i in range(len(lens))]
        futs = [pool.submit(_read_at, fd, buf[o:o + ln], o, file_bytes) for o, ln in zip(offs[1:], lens[1:])]
        try:
            got = _read_at(fd, buf[:lens[0]], 0, file_bytes)
        finally:
            got += sum(f.result() for f in futs)
        return min(got, file_bytes)
    finally:
        os.close(fd)
