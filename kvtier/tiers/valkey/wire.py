"""The Valkey tier's wire helpers: hand-packed RESP ``SET`` commands whose payload goes out of the
caller's buffer without a copy, sent on one pooled connection, and the byte windows that bound one
pipeline. Side-effect free except ``send_sets`` (it writes to a socket)."""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

from kvtier.chunk import ChunkMeta, checksum, encode_header, file_size, pack_trailer
from kvtier.tiers.protocol import WriteItem

log = logging.getLogger("kvtier.valkey")

WINDOW_BYTES = 64 * 2**20        # most bytes in one read/write pipeline


def set_pieces(ns_digest: bytes, rk: bytes, meta: ChunkMeta, payload: memoryview, px: int | None) -> list:
    """A RESP ``SET rk <chunk> [PX ms]`` as socket pieces: the payload goes out of the caller's buffer
    as is (no copy); header and trailer ride in small byte strings around it."""
    header = encode_header(ns_digest, meta)
    trailer = pack_trailer(checksum(header, payload))
    n = 5 if px else 3
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (n, len(rk), rk, file_size(meta.payload_len))
    tail = trailer + b"\r\n"
    if px:
        ms = str(px).encode()
        tail += b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
    return [head + bytes(header), payload, tail] if len(payload) else [head + bytes(header) + tail]


def send_sets(client: Any, commands: list[list]) -> list[Any]:
    """Send packed commands on one pooled connection and read one reply each (error replies are
    returned, not raised). A transport error drops the connection (the next call reconnects)."""
    pool = client.connection_pool
    conn = pool.get_connection("SET")
    try:
        conn.send_packed_command([piece for cmd in commands for piece in cmd], check_health=False)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except Exception as exc:
                if not _is_reply_error(exc):
                    raise
                replies.append(exc)
        return replies
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _is_reply_error(exc: BaseException) -> bool:
    import valkey

    return isinstance(exc, valkey.ResponseError)


def windows(index: list[int], sizes: list[int]) -> Iterable[list[int]]:
    """Split ``index`` into runs whose ``sizes`` sum to at most WINDOW_BYTES (at least one each)."""
    run: list[int] = []
    total = 0
    for i, size in zip(index, sizes):
        if run and total + size > WINDOW_BYTES:
            yield run
            run, total = [], 0
        run.append(i)
        total += size
    if run:
        yield run


def release(items: Sequence[WriteItem], released: list[bool], i: int) -> None:
    if not released[i]:
        released[i] = True
        rel = items[i].release
        if rel is not None:
            try:
                rel()
            except Exception:
                log.exception("kvtier valkey: a write item's release() raised")
