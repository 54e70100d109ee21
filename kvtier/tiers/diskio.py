"""Chunk file I/O: buffered or O_DIRECT, zero-copy where the buffers allow it.

``write_chunk_file`` writes header region + payload + trailer to a *new* file (O_EXCL;
callers publish it with os.replace). ``read_chunk_file`` reads and verifies one into
a caller buffer. With O_DIRECT every segment must be 4 KiB aligned in address,
length and offset: aligned caller buffers are used in place, anything else goes
through a per-thread page-aligned bounce buffer (an mmap). When the filesystem
refuses O_DIRECT (EINVAL at open, e.g. tmpfs) both fall back to buffered I/O.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import threading

from concurrent.futures import ThreadPoolExecutor

from typing import TYPE_CHECKING

from kvtier.chunk import (HEADER_SIZE, TRAILER_SIZE, ChunkError, ChunkMeta, check_read_size, checksum, decode_header,
                          is_signed, new_hasher, pack_trailer, verify_digest)

if TYPE_CHECKING:
    from kvtier.chunk import Hasher

ALIGN = 4096
PIECE = 2 << 20             # read granularity when hashing overlaps the reads
PIPELINE_MIN = 4 << 20      # payloads at least this large overlap I/O and checksumming (the default for reads)
PREALLOCATE_MIN = 1 << 20   # O_DIRECT chunk files at least this large get their exact blocks reserved first
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_tls = threading.local()


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _bounce(size: int) -> memoryview:
    """This thread's page-aligned scratch buffer of at least ``size`` bytes."""
    buf: mmap.mmap | None = getattr(_tls, "buf", None)
    if buf is None or len(buf) < size:
        if buf is not None:
            _tls.view.release()
            buf.close()
        buf = mmap.mmap(-1, _round_up(max(size, ALIGN)))
        _tls.buf, _tls.view = buf, memoryview(buf)
    return _tls.view


def address(view: memoryview) -> int:
    """Memory address of a buffer (read-only buffers through numpy)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    import numpy as np
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def aligned(view: memoryview) -> bool:
    return len(view) == 0 or address(view) % ALIGN == 0


def open_direct(path: str, flags: int, use_direct: bool, mode: int = 0o600) -> tuple[int, bool]:
    """Open with O_DIRECT when asked and supported; returns (fd, direct_in_use)."""
    if use_direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, mode), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def _writev_all(fd: int, parts: list[memoryview]) -> None:
    parts = [p for p in parts if len(p)]
    while parts:
        n = os.writev(fd, parts)
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]


def _preadv_all(fd: int, parts: list[memoryview], offset: int, end: int | None = None) -> int:
    """Fill ``parts`` from ``offset``; returns bytes read (short only at end of file). ``end``: the
    file's size when known: a read that reached it stops there instead of probing the end of file
    with one more system call (an O_DIRECT tail part is padded to 4 KiB past the file's end)."""
    parts = [p for p in parts if len(p)]
    total = 0
    while parts and (end is None or offset < end):
        n = os.preadv(fd, parts, offset)
        if n == 0:
            break
        total += n
        offset += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]
    return total


def _io_pool() -> ThreadPoolExecutor:
    """Helper threads that run a chunk's syscalls while the caller hashes (preadv/writev and
    xxhash's update all release the GIL), so checksumming overlaps the device time. Sized for a few
    concurrent readers with all pieces of a 14 MiB chunk in flight each."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvtier-io")
    return _POOL


def _load_fallocate():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _load_fallocate()


def _preallocate(fd: int, size: int) -> None:
    """Reserve exactly ``size`` bytes of blocks (fallocate(2), mode 0; no glibc zero-fill emulation).

    Without it ext4 rounds an O_DIRECT allocation up (a 5.6 MiB chunk gets an 8 MiB-aligned
    slot) and leaves the rest free: chunk files then sit on disk with 30% gaps and read back
    slower than one contiguous file. ENOSPC raises; a filesystem that cannot (EOPNOTSUPP,
    EINVAL) is written without."""
    if _FALLOCATE is None:
        return
    if _FALLOCATE(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
            raise OSError(err, os.strerror(err))


def _end_buffered(fd: int) -> None:
    """Switch ``fd``, opened by ``open_direct`` with O_DIRECT as its only status flag, to buffered
    I/O: one F_SETFL (Linux changes only O_APPEND, O_NONBLOCK, O_DIRECT, O_NOATIME and O_ASYNC
    through it, and none of the others was set), no F_GETFL first."""
    fcntl.fcntl(fd, fcntl.F_SETFL, 0)


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def unlink_quiet(path: str) -> None:
    """Remove ``path``; nothing when it is already gone or cannot be removed."""
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (after a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_chunk_file(path: str, header: bytes | bytearray, payload: memoryview,
                     *, o_direct: bool, fsync: bool) -> bool:
    """Create ``path`` (must not exist) holding one chunk. Returns whether O_DIRECT was used.

    With O_DIRECT the file's blocks are reserved first (``_preallocate``: contiguous chunk
    files). One large write carries the header region and the payload (with O_DIRECT: the
    payload's 4 KiB-aligned body, from the caller's buffer in place when it is aligned,
    else through one bounce copy), issued by this thread; for payloads of ``PIPELINE_MIN``
    or more a helper thread computes the checksum meanwhile. The last bytes (the
    payload's unaligned rest, if any, and the 20-byte trailer) follow as one small
    *buffered* write, so the file never needs padding and truncating. Raises OSError
    (ENOSPC, EIO, ...); the caller removes the partial temp file."""
    plen = len(payload)
    fd, direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, o_direct)
    try:
        if direct and plen >= PREALLOCATE_MIN:
            _preallocate(fd, HEADER_SIZE + plen + TRAILER_SIZE)
        hdr = memoryview(header)
        if direct:
            if not aligned(payload):                        # unaligned source: one bounce copy
                big = _bounce(HEADER_SIZE + _round_up(plen))
                big[HEADER_SIZE:HEADER_SIZE + plen] = payload
                payload = big[HEADER_SIZE:HEADER_SIZE + plen]
                hdr = big[:HEADER_SIZE]
            else:
                hdr = _bounce(HEADER_SIZE)[:HEADER_SIZE]
            hdr[:] = header
        body = plen // ALIGN * ALIGN if direct else plen
        parts = [hdr, payload[:body]]
        if plen >= PIPELINE_MIN:
            # this thread issues the write at once; a pool thread hashes meanwhile (much shorter than the
            # write, so its result is waiting when the write returns: no thread wake-up on the
            # critical path). Never return while the pool thread may still read the caller's buffer.
            fut = _io_pool().submit(checksum, hdr, payload)
            try:
                _writev_all(fd, parts)
            finally:
                digest = fut.result()
        else:
            digest = checksum(hdr, payload)
            _writev_all(fd, parts)
        if direct:
            _end_buffered(fd)
        _pwrite_all(fd, bytes(payload[body:]) + pack_trailer(digest), HEADER_SIZE + body)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return direct


def _groups(n: int) -> list[range]:
    """Indices of ``n`` parts grouped per syscall: the small header part rides with the first
    piece and the small tail part with the last, so neither costs a device round trip."""
    if n <= 3:
        return [range(n)]
    return [range(0, 2), *(range(i, i + 1) for i in range(2, n - 2)), range(n - 2, n)]


def read_plan(payload_len: int, direct: bool, pipeline_min: int = PIPELINE_MIN) -> list[int]:
    """Bytes of each read system call ``read_chunk_file`` issues for one chunk of ``payload_len``
    payload bytes into a 4 KiB-aligned buffer (several: all in flight together), with the same
    ``pipeline_min``. The tier's own reads in flight, for a raw baseline that is to match them."""
    body = payload_len // ALIGN * ALIGN
    if direct and not body:
        return [_round_up(HEADER_SIZE + payload_len + TRAILER_SIZE)]     # one bounce read
    hashed = body if direct else payload_len
    tail = _round_up(payload_len - body + TRAILER_SIZE) if direct else TRAILER_SIZE
    lens = [HEADER_SIZE, *(min(PIECE, hashed - i) for i in range(0, hashed, PIECE)), tail]
    if hashed < pipeline_min:
        return [sum(lens)]
    return [sum(lens[i] for i in g) for g in _groups(len(lens))]


def _read_and_hash(fd: int, parts: list[memoryview], nhash: int, end: int | None = None,
                   pipeline_min: int = PIPELINE_MIN) -> tuple[int, "Hasher | None"]:
    """Read ``parts`` (consecutive, from offset 0; ``parts[0]`` is the header region); hash the
    first ``nhash``. Returns (bytes read, the running digest state — xxh3-128, or the keyed MAC
    for a signed header — or None if a hashed part came up short). ``end``: the file's size.
    Fewer than ``pipeline_min`` hashed bytes past the header: one ``preadv``, hashed after it.

    Large reads are one ``preadv`` per piece, all issued at once: every piece but the first goes
    to the helper pool, the first (with the header) is read by this thread itself (one thread
    hand-off fewer per chunk; it is also the first to reach the device). The device sees them
    in flight together (like one big read) and this thread hashes each piece as soon as it has
    landed, in order, so only the last piece's hash is not overlapped with device time."""
    want_hashed = sum(len(p) for p in parts[:nhash])
    if want_hashed - len(parts[0]) < pipeline_min:
        got = _preadv_all(fd, parts, 0, end)
        if got < want_hashed:
            return got, None
        h = new_hasher(parts[0])      # parts[0] is the header region: it says checksum or MAC
        for part in parts[:nhash]:
            h.update(part)
        return got, h
    h = None
    pool = _io_pool()
    groups = _groups(len(parts))
    futs, off = [], sum(len(parts[i]) for i in groups[0])
    for group in groups[1:]:
        views = [parts[i] for i in group]
        futs.append((group, pool.submit(_preadv_all, fd, views, off, end)))
        off += sum(len(v) for v in views)
    got, complete, short = 0, True, False
    try:
        first = _preadv_all(fd, [parts[i] for i in groups[0]], 0, end)
        landed = itertools.chain([(groups[0], first)], ((g, f.result()) for g, f in futs))
        for group, n in landed:
            if short:
                continue
            got += n
            for i in group:
                c = min(n, len(parts[i]))
                n -= c
                if c < len(parts[i]):      # end of file: nothing after this counts
                    complete = complete and i >= nhash
                    short = True
                    break
                if i < nhash:
                    if h is None:
                        h = new_hasher(parts[0])
                    h.update(parts[i])
    finally:
        for _, fut in futs:          # never return while a helper may still write into the buffers
            fut.exception()
    return got, h if complete and h is not None else None


def _pieces(view: memoryview) -> list[memoryview]:
    return [view[i:i + PIECE] for i in range(0, len(view), PIECE)]


def refuse_oversize(fd: int, size: int, plen: int, limit: int, namespace_digest: bytes, key: bytes) -> None:
    """A chunk file whose payload (``plen`` bytes) exceeds the caller's ``limit``: ValueError when
    its header agrees (a well-formed chunk that does not fit is the caller's error), ChunkError
    ("torn") when it does not. Nothing when it fits."""
    if plen <= limit:
        return
    hb = _bounce(HEADER_SIZE)[:HEADER_SIZE]
    if _preadv_all(fd, [hb], 0) < HEADER_SIZE:
        raise ChunkError("torn", "short header")
    if decode_header(hb, namespace_digest, key).payload_len != plen:
        raise ChunkError("torn", f"file is {size} bytes, header disagrees")
    raise ValueError(f"output buffer has {limit} bytes, chunk needs {plen}")


def read_chunk_file(path: str, out: memoryview, namespace_digest: bytes, key: bytes,
                    *, o_direct: bool, pipeline_min: int = PIPELINE_MIN) -> ChunkMeta:
    """Read and verify the chunk at ``path`` into ``out[:payload_len]``. Payloads of
    ``pipeline_min`` bytes or more are read in pieces all in flight, each hashed as it lands;
    smaller ones in one ``preadv``, checksummed after it.

    Raises FileNotFoundError / OSError, ChunkError (verification), or ValueError when
    ``out`` is too small for a well-formed chunk."""
    fd, direct = open_direct(path, os.O_RDONLY, o_direct)
    try:
        size = os.fstat(fd).st_size
        plen = size - HEADER_SIZE - TRAILER_SIZE
        if plen < 0:
            raise ChunkError("torn", f"file is {size} bytes")
        check_read_size(namespace_digest, size)     # nothing below allocates more than min(out, limit)
        refuse_oversize(fd, size, plen, len(out), namespace_digest, key)
        dst = out[:plen]
        body = plen // ALIGN * ALIGN
        if not direct:
            hdr = memoryview(bytearray(HEADER_SIZE))
            trl = memoryview(bytearray(TRAILER_SIZE))
            parts = [hdr, *_pieces(dst), trl]
            got, h = _read_and_hash(fd, parts, len(parts) - 1, pipeline_min=pipeline_min)
            digest = h.digest() if h is not None else None
        elif aligned(dst) and body:
            rest = plen - body
            scratch = _bounce(HEADER_SIZE + _round_up(rest + TRAILER_SIZE))
            hdr = scratch[:HEADER_SIZE]
            tail = scratch[HEADER_SIZE:HEADER_SIZE + _round_up(rest + TRAILER_SIZE)]
            parts = [hdr, *_pieces(dst[:body]), tail]
            got, h = _read_and_hash(fd, parts, len(parts) - 1, end=size, pipeline_min=pipeline_min)
            got = min(got, size)
            dst[body:] = tail[:rest]
            trl = tail[rest:rest + TRAILER_SIZE]
            if h is not None:
                h.update(dst[body:])
            digest = h.digest() if h is not None else None
        else:
            big = _bounce(_round_up(size))
            got = min(_preadv_all(fd, [big[:_round_up(size)]], 0, size), size)
            hdr = big[:HEADER_SIZE]
            dst[:] = big[HEADER_SIZE:HEADER_SIZE + plen]
            trl = big[HEADER_SIZE + plen:size]
            digest = checksum(hdr, dst)
        if got != size:
            raise ChunkError("torn", f"read {got} of {size} bytes")
        meta = decode_header(hdr, namespace_digest, key)
        if meta.payload_len != plen:
            raise ChunkError("torn", f"file holds {plen} payload bytes, header says {meta.payload_len}")
        verify_digest(trl, digest, signed=is_signed(hdr))
        return meta
    finally:
        os.close(fd)


def read_header(path: str) -> ChunkMeta | None:
    """The header of a chunk file (payload unverified), or None if unreadable/malformed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return decode_header(os.pread(fd, HEADER_SIZE, 0))
    except (OSError, ChunkError):
        return None
    finally:
        os.close(fd)
