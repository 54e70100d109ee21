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
from pathlib import Path

from blocks import arguments, print_figures, time_blocks, timed

from kvtier.bench.store_bench_files import remove_settled
from kvtier.bench.store_bench_raw import prepare_layout, write_exact, write_one
from kvtier.tiers.diskio import open_direct
from kvtier.tiers.disklayout import NamespaceDir

VARIANTS = ("publish", "unnamed_link", "writeback_hint", "padded")
_LIBC = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _AT_SYMLINK_FOLLOW, _SYNC_FILE_RANGE_WRITE = -100, 0x400, 2


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write_exact(fd: int, src: memoryview, fbytes: int, hint: bool) -> None:
    """The tier's writes (``write_exact``), the buffered tail's write-back started at once: ``hint``."""
    body = write_exact(fd, src, fbytes)
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


def _layout(d: Path, variant: str) -> NamespaceDir:
    remove_settled(d)
    lay = NamespaceDir(d)
    prepare_layout(lay, fanout=True)
    return lay


def _write(lay: NamespaceDir, names: list[str], src: memoryview, fbytes: int, variant: str) -> float:
    return timed(lambda: [write_variant(lay, name, src, fbytes, variant) for name in names])


def main(root: Path, chunk: int, blocks: int) -> None:
    print_figures(time_blocks(root, chunk, blocks, VARIANTS, _layout, _write), chunk, base="publish")


if __name__ == "__main__":
    main(*arguments("usage: publish_alternatives.py DIR [CHUNK_MIB] [BLOCKS]", 24))
