"""The raw disk baselines of ``kvtier bench store``: sequential O_DIRECT writes and reads of one
file (fio when installed), raw reads at the tier's own concurrency and read mode, and raw writes
at the writer pool's concurrency. No checksums: what the device gives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from kvtier.bench.store_bench_files import drop_page_cache, random_buffer, remove_settled
from kvtier.bench.store_bench_rounds import GB, WRITER_THREADS
from kvtier.tiers.diskio import ALIGN, open_direct


def raw_disk(path: Path, chunk: int, n: int, buf: memoryview | None = None) -> dict:
    """One raw pass: sequential O_DIRECT write then read (after a page-cache drop) of n
    chunk-sized blocks to one file, no checksum (fio when available)."""
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


def raw_write_parallel(path: Path, chunk: int, n: int, buf: memoryview, threads: int = WRITER_THREADS) -> float:
    """Raw O_DIRECT writes at the writer pool's concurrency: ``threads`` threads, each writing
    its share of the n chunk-sized blocks sequentially to its own file (then fsync)."""
    import threading
    block = (chunk + ALIGN - 1) // ALIGN * ALIGN
    files = [path / f"raw{i}.bin" for i in range(threads)]
    fds = [open_direct(str(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, True)[0] for f in files]

    def write(i: int) -> None:
        for j in range(i, n, threads):
            os.pwrite(fds[i], buf, (j // threads) * block)
        os.fsync(fds[i])
    ts = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    w = n * block / (time.perf_counter() - t0) / GB
    for fd in fds:
        os.close(fd)
    for f in files:
        f.unlink()
    os.sync()
    return w
