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
import mmap
import os
import threading

from kvtier.chunk import HEADER_SIZE, TRAILER_SIZE, ChunkError, ChunkMeta, decode_header, verify_trailer

ALIGN = 4096
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


def open_direct(path: str, flags: int, use_direct: bool, mode: int = 0o644) -> tuple[int, bool]:
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


def _preadv_all(fd: int, parts: list[memoryview], offset: int) -> int:
    """Fill ``parts`` from ``offset``; returns bytes read (short only at end of file)."""
    parts = [p for p in parts if len(p)]
    total = 0
    while parts:
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


def write_chunk_file(path: str, header: bytes | bytearray, payload: memoryview, trailer: bytes,
                     *, o_direct: bool, fsync: bool) -> bool:
    """Create ``path`` (must not exist) holding one chunk. Returns whether O_DIRECT was used.

    Raises OSError (ENOSPC, EIO, ...); the caller removes the partial temp file."""
    total = HEADER_SIZE + len(payload) + TRAILER_SIZE
    fd, direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, o_direct)
    try:
        if not direct:
            _writev_all(fd, [memoryview(header), payload, memoryview(trailer)])
        else:
            body = len(payload) // ALIGN * ALIGN
            hdr = _bounce(HEADER_SIZE + ALIGN * 2)
            if aligned(payload) and body:
                rest = len(payload) - body
                tail_len = _round_up(rest + TRAILER_SIZE)
                tail = hdr[HEADER_SIZE:HEADER_SIZE + tail_len]
                tail[:rest] = payload[body:]
                tail[rest:rest + TRAILER_SIZE] = trailer
                hdr[:HEADER_SIZE] = header
                _writev_all(fd, [hdr[:HEADER_SIZE], payload[:body], tail])
            else:
                big = _bounce(_round_up(total))
                big[:HEADER_SIZE] = header
                big[HEADER_SIZE:HEADER_SIZE + len(payload)] = payload
                big[HEADER_SIZE + len(payload):total] = trailer
                _writev_all(fd, [big[:_round_up(total)]])
            os.ftruncate(fd, total)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return direct


def read_chunk_file(path: str, out: memoryview, namespace_digest: bytes, key: bytes,
                    *, o_direct: bool) -> ChunkMeta:
    """Read and verify the chunk at ``path`` into ``out[:payload_len]``.

    Raises FileNotFoundError / OSError, ChunkError (verification), or ValueError when
    ``out`` is too small for a well-formed chunk."""
    fd, direct = open_direct(path, os.O_RDONLY, o_direct)
    try:
        size = os.fstat(fd).st_size
        plen = size - HEADER_SIZE - TRAILER_SIZE
        if plen < 0:
            raise ChunkError("torn", f"file is {size} bytes")
        if plen > len(out):  # a well-formed chunk that does not fit is the caller's error
            hb = _bounce(HEADER_SIZE)[:HEADER_SIZE]
            if _preadv_all(fd, [hb], 0) < HEADER_SIZE:
                raise ChunkError("torn", "short header")
            if decode_header(hb, namespace_digest, key).payload_len != plen:
                raise ChunkError("torn", f"file is {size} bytes, header disagrees")
            raise ValueError(f"output buffer has {len(out)} bytes, chunk needs {plen}")
        dst = out[:plen]
        if not direct:
            hdr = memoryview(bytearray(HEADER_SIZE))
            trl = memoryview(bytearray(TRAILER_SIZE))
            got = _preadv_all(fd, [hdr, dst, trl], 0)
        else:
            body = plen // ALIGN * ALIGN
            scratch = _bounce(HEADER_SIZE + _round_up(plen - body + TRAILER_SIZE) + ALIGN)
            if aligned(dst) and body:
                hdr = scratch[:HEADER_SIZE]
                tail = scratch[HEADER_SIZE:HEADER_SIZE + _round_up(plen - body + TRAILER_SIZE)]
                got = _preadv_all(fd, [hdr, dst[:body], tail], 0)
                rest = plen - body
                dst[body:] = tail[:rest]
                trl = tail[rest:rest + TRAILER_SIZE]
            else:
                big = _bounce(_round_up(size))
                got = _preadv_all(fd, [big[:_round_up(size)]], 0)
                hdr = big[:HEADER_SIZE]
                dst[:] = big[HEADER_SIZE:HEADER_SIZE + plen]
                trl = big[HEADER_SIZE + plen:size]
            got = min(got, size)
        if got != size:
            raise ChunkError("torn", f"read {got} of {size} bytes")
        meta = decode_header(hdr, namespace_digest, key)
        if meta.payload_len != plen:
            raise ChunkError("torn", f"file holds {plen} payload bytes, header says {meta.payload_len}")
        verify_trailer(hdr, dst, trl)
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
