"""Ways a disk-tier put could publish a chunk file, against the one it uses: O_DIRECT chunk files
written block by block (64 MiB), the variants interleaved in rotating order within each block, same
bytes, each block timed until written back (``os.sync``). No checksum, ledger or index: plain I/O.

* ``publish``: what the tier does (a named temp file in ``tmp/``, blocks reserved, O_DIRECT body,
  buffered tail, rename into its fan-out directory, made beforehand as the tier makes them at open);
* ``unnamed_link``: the same writes into an unnamed file (O_TMPFILE in ``tmp/``), linked into place
  with linkat(2) through ``/proc/self/fd`` (no temp name, no rename; a crash leaves nothing);
* ``writeback_hint``: ``publish`` with the tail's write-back started at once (sync_file_range);
* ``padded``: one O_DIRECT write of the file rounded up to 4 KiB, no tail, no publish: a bound the
  exact-size chunk format cannot reach.

Prints GB/s and the per-block ratio against ``publish`` (above 1: faster).

    python benchmarks/disk_publish/publish_alternatives.py DIR [CHUNK_MIB] [BLOCKS]
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np

from kvtier.bench.store_bench_files import random_buffer, remove_settled
from kvtier.bench.store_bench_raw import prepare_layout, write_one
from kvtier.chunk import file_size
from kvtier.tiers.diskio import ALIGN, _end_buffered, _preallocate, open_direct
from kvtier.tiers.disklayout import NamespaceDir

VARIANTS = ("publish", "unnamed_link", "writeback_hint", "padded")
_LIBC = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _AT_SYMLINK_FOLLOW, _SYNC_FILE_RANGE_WRITE = -100, 0x400, 2


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write_exact(fd: int, src: memoryview, fbytes: int, hint: bool) -> None:
    """The tier's writes: blocks reserved, O_DIRECT body, buffered tail (write-back started: ``hint``)."""
    _preallocate(fd, fbytes)
    body = fbytes // ALIGN * ALIGN
    os.pwrite(fd, src[:body], 0)
    _end_buffered(fd)
    os.pwrite(fd, src[body:fbytes], body)
    if hint:
        _check(_LIBC.sync_file_range(fd, ctypes.c_int64(body), ctypes.c_int64(fbytes - body),
                                     ctypes.c_uint(_SYNC_FILE_RANGE_WRITE)), "sync_file_range")


def write_variant(lay: NamespaceDir, name: str, src: memoryview, fbytes: int, variant: str) -> None:
    final = f"{lay.chunks}/{name[:2]}/{name}.kvc"
    tmp = f"{lay.tmp}/{name}.tmp"
    if variant == "publish":
        write_one(tmp, final, src, fbytes, True, "publish", lay)
    elif variant == "padded":
        write_one(tmp, None, src, fbytes, True, "padded", lay)
    elif variant == "writeback_hint":
        fd, _ = open_direct(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, True)
        try:
            _write_exact(fd, src, fbytes, hint=True)
        finally:
            os.close(fd)
        lay.publish(tmp, final)
    else:
        fd, _ = open_direct(str(lay.tmp), os.O_WRONLY | os.O_TMPFILE, True)
        try:
            _write_exact(fd, src, fbytes, hint=False)
            _check(_LIBC.linkat(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), _AT_FDCWD, final.encode(),
                                _AT_SYMLINK_FOLLOW), "linkat")
        finally:
            os.close(fd)


def main(root: Path, chunk: int, blocks: int, rounds: int = 2) -> None:
    fbytes = file_size(chunk)
    src = random_buffer(-(-fbytes // ALIGN) * ALIGN, 3)
    per = max(1, (64 << 20) // chunk)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        lays = {v: NamespaceDir(root / f"{v}-{r}") for v in VARIANTS}
        for v, lay in lays.items():
            remove_settled(lay.root)
            prepare_layout(lay, fanout=True)
        os.sync()
        for b in range(blocks):
            names = [os.urandom(32).hex() for _ in range(per)]
            k = (b + r) % len(VARIANTS)
            for v in VARIANTS[k:] + VARIANTS[:k]:
                t = time.perf_counter()
                for name in names:
                    write_variant(lays[v], name, src, fbytes, v)
                os.sync()
                times[v].append(time.perf_counter() - t)
        for v in VARIANTS:
            remove_settled(root / f"{v}-{r}")
    vol = rounds * blocks * per * chunk / 1e9
    print(f"{rounds} rounds x {blocks} blocks of {per} chunk files of {chunk / 2**20:.2f} MiB payload")
    for v, ts in times.items():
        print(f"{v:16s} {vol / sum(ts):.3f} GB/s")
    base = np.array(times["publish"])
    for v in VARIANTS[1:]:
        ratio = base / np.array(times[v])
        print(f"{v} / publish, per block: median {np.median(ratio):.3f}, mean {ratio.mean():.3f}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: publish_alternatives.py DIR [CHUNK_MIB] [BLOCKS]")
    main(Path(sys.argv[1]), int(float(sys.argv[2] if len(sys.argv) > 2 else 5.62) * 2**20),
         int(sys.argv[3]) if len(sys.argv) > 3 else 24)
