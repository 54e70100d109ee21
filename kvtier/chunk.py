"""The self-describing, verified chunk format (what a chunk file / remote object holds).

Layout (all integers little-endian)::

    [0, 4096)            header region: struct below, zero padded (4 KiB keeps the
                         payload aligned for O_DIRECT)
        magic "KVTC" | u16 format version | u16 header struct length | u32 flags
        32 B namespace digest | 32 B chunk key | 32 B parent key (zeros = first chunk)
        u32 token count | u64 payload length | 16 B dtype (ASCII, NUL padded)
        u8 ndim | 8 x u64 shape
    [4096, 4096+P)       payload (P bytes)
    [4096+P, 4096+P+20)  trailer: magic "KVTE" | xxh3-128 over header region + payload

A reader verifies magic, version, namespace, key, the total length and the checksum
before handing out a single byte; any mismatch raises ``ChunkError`` whose ``kind`` is
the event name the store counts (corrupt, torn, namespace_mismatch, wrong_key, version).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvtier import FORMAT_VERSION
from kvtier.keys import KEY_BYTES, ChunkKey

MAGIC = b"KVTC"
TRAILER_MAGIC = b"KVTE"
HEADER_SIZE = 4096
MAX_NDIM = 8
_HEADER = struct.Struct(f"<4sHHI{KEY_BYTES}s{KEY_BYTES}s{KEY_BYTES}sIQ16sB{MAX_NDIM}Q")
_TRAILER = struct.Struct("<4s16s")
TRAILER_SIZE = _TRAILER.size
_ZERO_KEY = bytes(KEY_BYTES)


class ChunkError(Exception):
    """A chunk failed verification; ``kind`` names the counted event."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What the store knows about a chunk besides its payload bytes."""

    key: ChunkKey
    parent: ChunkKey | None     # None: first chunk of a prompt (its parent is the namespace root)
    num_tokens: int
    shape: tuple[int, ...]
    dtype: str
    payload_len: int

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES or (self.parent is not None and len(self.parent) != KEY_BYTES):
            raise ValueError("chunk keys are 32 bytes")
        if len(self.shape) > MAX_NDIM:
            raise ValueError(f"payload shape has more than {MAX_NDIM} dims")
        if len(self.dtype.encode()) > 16:
            raise ValueError("dtype name longer than 16 bytes")
        if self.payload_len < 0 or self.num_tokens < 0:
            raise ValueError("negative payload length or token count")


def file_size(payload_len: int) -> int:
    """Exact size in bytes of a chunk file holding ``payload_len`` payload bytes."""
    return HEADER_SIZE + payload_len + TRAILER_SIZE


def encode_header(namespace_digest: bytes, meta: ChunkMeta) -> bytearray:
    """The 4 KiB header region for ``meta`` (a fresh, zero-padded bytearray)."""
    shape = tuple(meta.shape) + (0,) * (MAX_NDIM - len(meta.shape))
    buf = bytearray(HEADER_SIZE)
    _HEADER.pack_into(buf, 0, MAGIC, FORMAT_VERSION, _HEADER.size, 0, namespace_digest, meta.key,
                      meta.parent or _ZERO_KEY, meta.num_tokens, meta.payload_len,
                      meta.dtype.encode(), len(meta.shape), *shape)
    return buf


def checksum(header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    """xxh3-128 digest over the header region and the payload."""
    h = xxhash.xxh3_128(header)
    h.update(payload)
    return h.digest()


def encode_trailer(header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    return pack_trailer(checksum(header, payload))


def pack_trailer(digest: bytes) -> bytes:
    """The trailer for a precomputed ``checksum`` digest."""
    return _TRAILER.pack(TRAILER_MAGIC, digest)


def decode_header(header: bytes | memoryview, namespace_digest: bytes | None = None,
                  expect_key: bytes | None = None) -> ChunkMeta:
    """Parse and check the header region; raises ``ChunkError`` on any mismatch."""
    if len(header) < _HEADER.size:
        raise ChunkError("torn", f"header is {len(header)} bytes")
    (magic, version, hlen, _flags, ns, key, parent, ntok, plen, dtype, ndim,
     *shape) = _HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise ChunkError("corrupt", "bad magic")
    if version != FORMAT_VERSION or hlen != _HEADER.size:
        raise ChunkError("version", f"format version {version} (expected {FORMAT_VERSION})")
    if ndim > MAX_NDIM:
        raise ChunkError("corrupt", f"ndim {ndim}")
    if namespace_digest is not None and ns != namespace_digest:
        raise ChunkError("namespace_mismatch", "chunk belongs to another namespace")
    if expect_key is not None and key != expect_key:
        raise ChunkError("wrong_key", "chunk key does not match the requested key")
    try:
        dtype_s = dtype.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise ChunkError("corrupt", "dtype is not ASCII") from None
    return ChunkMeta(ChunkKey(key), None if parent == _ZERO_KEY else ChunkKey(parent), ntok,
                     tuple(shape[:ndim]), dtype_s, plen)


def verify_trailer(header: bytes | memoryview, payload: bytes | memoryview, trailer: bytes | memoryview) -> None:
    """Check the trailer magic and checksum; raises ``ChunkError`` ("torn" / "corrupt")."""
    verify_digest(trailer, None)
    verify_digest(trailer, checksum(header, payload))


def verify_digest(trailer: bytes | memoryview, digest: bytes | None) -> None:
    """Check the trailer's magic and (unless None) that it holds ``digest``."""
    if len(trailer) != TRAILER_SIZE:
        raise ChunkError("torn", "trailer missing")
    magic, stored = _TRAILER.unpack(trailer)
    if magic != TRAILER_MAGIC:
        raise ChunkError("torn", "bad trailer magic")
    if digest is not None and stored != digest:
        raise ChunkError("corrupt", "checksum mismatch")


def encode(namespace_digest: bytes, meta: ChunkMeta, payload: bytes | memoryview) -> bytes:
    """A whole chunk as one bytes object (header region + payload + trailer)."""
    header = encode_header(namespace_digest, meta)
    return bytes(header) + bytes(payload) + encode_trailer(header, payload)


def decode(namespace_digest: bytes | None, data: bytes | memoryview,
           expect_key: bytes | None = None) -> tuple[ChunkMeta, memoryview]:
    """Verify a whole chunk blob; returns its meta and a view of the payload."""
    view = memoryview(data)
    meta = decode_header(view[:HEADER_SIZE], namespace_digest, expect_key)
    if len(view) != file_size(meta.payload_len):
        raise ChunkError("torn", f"chunk is {len(view)} bytes, header says {file_size(meta.payload_len)}")
    payload = view[HEADER_SIZE:HEADER_SIZE + meta.payload_len]
    verify_trailer(view[:HEADER_SIZE], payload, view[HEADER_SIZE + meta.payload_len:])
    return meta, payload
