"""File I/O of the shared-filesystem tier, on its own daemon threads.

A call into a FUSE or NFS mount can block uninterruptibly while the mount is stalled, so
the shared tier never uses the process-wide pools (``diskio``'s helper pool serves the
local SSD tier, ``concurrent.futures`` joins its threads at interpreter exit): it runs
every syscall on a ``DaemonPool`` of fixed size, so a stall holds at most that many
threads and never blocks exit or the local tiers. Reads land in a pool-owned bounce
buffer and are copied to the caller only while the caller still waits (a stalled read
that completes late never writes into a buffer the caller has reused) — unless the caller
lends its buffers (``read_into(..., lent=True)``: it never reuses one that did not come back
a HIT), then the payload is read straight into them (``read_chunk_into``). The syscall loops and
the per-thread bounce buffer are the local SSD tier's (``diskio``); only the threads differ.

Side-effect free except the functions' documented file operations.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from typing import Callable

from kvtier.chunk import (HEADER_SIZE, TRAILER_SIZE, ChunkError, ChunkMeta, check_read_size, checksum, decode_header,
                          pack_trailer, verify_digest)
from kvtier.tiers.diskio import _bounce, _preadv_all, _writev_all, refuse_oversize

MIN_FILE = HEADER_SIZE + TRAILER_SIZE


class DaemonPool:
    """``threads`` daemon threads behind an unbounded FIFO; ``submit`` never blocks.

    Callers bound the backlog themselves (``backlog()``): a job stuck in a stalled mount
    keeps its thread, and jobs queued behind it wait."""

    def __init__(self, threads: int, name: str) -> None:
        self._q: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.size = threads
        self._name = name
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("pool is closed")
            if not self._threads:
                for i in range(self.size):
                    t = threading.Thread(target=self._run, name=f"{self._name}-{i}", daemon=True)
                    t.start()
                    self._threads.append(t)
            self._pending += 1
        self._q.put(fn)

    def backlog(self) -> int:
        """Jobs submitted and not finished (running or queued)."""
        return self._pending

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:   # jobs report their own failures; a thread never dies
                pass
            finally:
                with self._lock:
                    self._pending -= 1

    def close(self) -> None:
        """Ask the threads to stop after their current job; never waits (a thread may be stuck)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._threads:
            self._q.put(None)


class Batch:
    """One batched call: pool workers *pull* indices in order (head first) and fill results;
    ``abandoned`` once the caller returned. ``prefix`` mode: complete as soon as the first
    non-True value is known with everything before it True (a chain's gap); else when all are in."""

    def __init__(self, n: int, prefix: bool) -> None:
        self.n = n
        self.values: list[object] = [None] * n
        self.filled = [False] * n
        self.next = 0              # next index to hand out
        self.scan = 0              # prefix mode: first index not known to be True
        self.left = n
        self.gap = n               # prefix mode: lowest index known not True
        self.prefix = prefix
        self.copying = 0
        self.abandoned = False
        self.complete = n == 0
        self.cond = threading.Condition()

    def take(self) -> int | None:
        with self.cond:
            if self.abandoned or self.complete or self.next >= self.n or self.next > self.gap:
                return None
            i, self.next = self.next, self.next + 1
            return i

    def put_locked(self, i: int, value: object) -> None:
        self.values[i], self.filled[i] = value, True
        self.left -= 1
        if self.prefix:
            if value is not True:
                self.gap = min(self.gap, i)
            while self.scan < self.n and self.filled[self.scan] and self.values[self.scan] is True:
                self.scan += 1
            done = self.scan == self.n or (self.filled[self.scan] and self.values[self.scan] is not True)
        else:
            done = self.left == 0
        if done:
            self.complete = True
            self.cond.notify_all()

    def put(self, i: int, value: object) -> None:
        with self.cond:
            self.put_locked(i, value)


def fan_out(pool: DaemonPool, b: Batch, fn: Callable[[int], None]) -> None:
    """Start up to ``pool.size`` workers that run ``fn(i)`` for indices pulled from ``b``."""
    def worker() -> None:
        while (i := b.take()) is not None:
            fn(i)
    for _ in range(min(pool.size, b.n)):
        pool.submit(worker)


def bounce(size: int) -> memoryview:
    """This thread's scratch buffer of at least ``size`` bytes (grown on demand, reused): diskio's.
    The shared tier's threads never run the SSD tier's I/O, so the two never share one."""
    return _bounce(size)


def probe_write(path: str) -> None:
    """Create and remove an empty file (is the mount writable?). Raises OSError (EROFS, ...)."""
    with open(path, "w"):
        pass
    os.unlink(path)


def stat_chunk(path: str) -> int | None:
    """The file's mtime (ns) if a plausible chunk file is there, None if absent or too short.
    Raises OSError for anything but "not there" (the caller tells a down mount from a fault)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_mtime_ns if st.st_size >= MIN_FILE else None


def _open_chunk(fd: int, limit: int, namespace_digest: bytes, key: bytes) -> tuple[os.stat_result, int]:
    """(stat, payload length) of an open chunk file that fits ``limit`` payload bytes; raises as ``read_chunk``."""
    st = os.fstat(fd)
    if st.st_size < MIN_FILE:
        raise ChunkError("torn", f"file is {st.st_size} bytes")
    plen = st.st_size - MIN_FILE
    check_read_size(namespace_digest, st.st_size)   # no buffer grows past min(limit, read limit)
    refuse_oversize(fd, st.st_size, plen, limit, namespace_digest, key)
    return st, plen


def _verified(head: memoryview, payload: memoryview, trailer: memoryview, namespace_digest: bytes,
              key: bytes) -> ChunkMeta:
    meta = decode_header(head, namespace_digest, key)
    if meta.payload_len != len(payload):
        raise ChunkError("torn", f"file holds {len(payload)} payload bytes, header says {meta.payload_len}")
    verify_digest(trailer, None)
    verify_digest(trailer, checksum(head, payload))
    return meta


def read_chunk(path: str, limit: int, namespace_digest: bytes, key: bytes) -> tuple[ChunkMeta, memoryview, int]:
    """Read and verify one chunk file into this thread's bounce buffer.

    Returns (meta, payload view into the bounce buffer, mtime ns). Raises FileNotFoundError
    / OSError, ChunkError (torn, corrupt, wrong_key, ...), or ValueError when a well-formed
    chunk's payload exceeds ``limit`` bytes (the caller's buffer)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st, plen = _open_chunk(fd, limit, namespace_digest, key)
        size = st.st_size
        view = bounce(size)[:size]
        got = _preadv_all(fd, [view], 0)
        if got != size:
            raise ChunkError("torn", f"read {got} of {size} bytes")
        payload = view[HEADER_SIZE:HEADER_SIZE + plen]
        meta = _verified(view[:HEADER_SIZE], payload, view[HEADER_SIZE + plen:], namespace_digest, key)
        return meta, payload, st.st_mtime_ns
    finally:
        os.close(fd)


def read_chunk_into(path: str, out: memoryview, namespace_digest: bytes, key: bytes) -> tuple[ChunkMeta, int]:
    """Read and verify one chunk file with its payload straight into ``out`` (one scatter read:
    header and trailer into this thread's bounce buffer, payload into ``out[:payload_len]``).

    Returns (meta, mtime ns); raises as ``read_chunk`` (``out`` then holds unspecified bytes). For
    callers that lend ``out`` (``read_into(..., lent=True)``): no copy out of a bounce buffer."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st, plen = _open_chunk(fd, len(out), namespace_digest, key)
        scratch = bounce(MIN_FILE)
        head, payload, trailer = scratch[:HEADER_SIZE], out[:plen], scratch[HEADER_SIZE:MIN_FILE]
        got = _preadv_all(fd, [head, payload, trailer], 0, end=st.st_size)
        if got != st.st_size:
            raise ChunkError("torn", f"read {got} of {st.st_size} bytes")
        return _verified(head, payload, trailer, namespace_digest, key), st.st_mtime_ns
    finally:
        os.close(fd)


def _load_renameat2():
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_NO_RENAME2 = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}
_renameat2_ok = _RENAMEAT2 is not None       # cleared for the process once a filesystem refuses it


def _rename_noreplace(tmp: str, final: str) -> bool | None:
    """renameat2(RENAME_NOREPLACE): True = published, False = ``final`` exists (tmp left), None =
    not supported here. Raises OSError for anything else."""
    global _renameat2_ok
    if not _renameat2_ok:
        return None
    import ctypes

    if _RENAMEAT2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    if err in _NO_RENAME2:
        _renameat2_ok = False
        return None
    raise OSError(err, os.strerror(err), final)


def publish(tmp: str, final: str) -> None:
    """Give the complete file ``tmp`` its final name without ever replacing an existing one (another
    machine's identical bytes stay, and other clients' cached entries for it stay valid), then drop
    ``tmp`` if it is left: ``renameat2(RENAME_NOREPLACE)`` — one metadata operation — where the
    filesystem has it (ext4, XFS, FUSE mounts that implement it, e.g. JuiceFS); else ``link(2)``
    (EEXIST when the key is published) + ``unlink``; where hard links are unsupported too,
    ``rename`` (a duplicate then replaces identical bytes: readers on other mounts may miss it for
    their entry-cache time). Raises OSError (ENOENT: no leaf directory yet)."""
    done = _rename_noreplace(tmp, final)
    if done is True:
        return
    if done is None:
        try:
            os.link(tmp, final)
        except FileExistsError:
            pass
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            os.rename(tmp, final)
            return
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def write_chunk(tmp: str, header: bytes | bytearray, payload: memoryview, *, fsync: bool, stamp_ns: int) -> None:
    """Create ``tmp`` (O_EXCL) holding header region + payload + trailer, with mtime ``stamp_ns``.
    Raises OSError; the caller removes the partial file and renames a complete one into place."""
    trailer = pack_trailer(checksum(header, payload))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _writev_all(fd, [memoryview(header), payload, memoryview(trailer)])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.utime(tmp, ns=(stamp_ns, stamp_ns))


__all__ = ["Batch", "DaemonPool", "fan_out", "MIN_FILE", "bounce", "probe_write", "publish", "read_chunk",
           "read_chunk_into", "stat_chunk", "write_chunk"]
