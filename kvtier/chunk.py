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
the event name the store counts (corrupt, torn, namespace_mismatch, wrong_key, version,
unsigned, bad_signature, signed_no_key).

**Signed chunks** (optional, ``store.signing_key``): when a deployment secret is registered
for a namespace (``register_mac_key``), every chunk of that namespace is written with flag
``FLAG_MAC`` and its trailer holds a keyed BLAKE3 MAC (first 16 bytes) over the header region
and the payload instead of the xxh3-128 checksum. Readers that hold the secret refuse chunks
without the flag (``unsigned``) and chunks whose MAC does not match (``bad_signature``);
readers without it refuse signed chunks (``signed_no_key``). A checksum only proves the bytes
are what some writer wrote; the MAC proves that writer held the secret.

Parsing is a fixed binary layout (``struct``) only: nothing here (or in any tier) uses pickle,
``eval`` or any deserializer that can run code; sizes from a header are checked against the
blob/file size before anything is allocated from them.

**Bounded reads.** No reader allocates from a size it did not check: a file or value larger than
the namespace's read limit (``store.max_chunk_bytes``, registered by the store with
``register_read_limit``; ``DEFAULT_MAX_CHUNK_BYTES`` otherwise) is refused before a byte is
allocated for it (``ChunkError("too_large")``, a counted miss), and batched reads never allocate
more than the caller's buffer (plus header and trailer) either.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Protocol

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
FLAG_MAC = 1                      # trailer holds a keyed BLAKE3 MAC, not the xxh3 checksum
_NS_OFFSET = 12                   # the namespace digest's offset in the header struct
MIN_MAC_KEY = 16
DEFAULT_MAX_CHUNK_BYTES = 2**30   # read limit of a namespace no store registered a limit for

_mac_keys: dict[bytes, bytes] = {}
_mac_lock = threading.Lock()
_read_limits: dict[bytes, int] = {}


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def digest(self) -> bytes: ...


class _Blake3Mac:
    """Keyed BLAKE3 truncated to the trailer's 16 digest bytes."""

    __slots__ = ("_h",)

    def __init__(self, key: bytes) -> None:
        import blake3  # optional dependency: only deployments that sign chunks need it

        self._h = blake3.blake3(key=blake3_key(key))

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest(length=16)


def blake3_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key derived from a deployment secret of any length (>= 16 bytes)."""
    import hashlib

    if len(secret) < MIN_MAC_KEY:
        raise ValueError(f"signing key must be at least {MIN_MAC_KEY} bytes")
    return hashlib.blake2b(secret, digest_size=32, person=b"kvtier-mac").digest()


def register_mac_key(namespace_digest: bytes, secret: bytes | None) -> None:
    """Sign and verify every chunk of ``namespace_digest`` in this process with ``secret``
    (None: stop signing). Raises ValueError when another secret is already registered."""
    with _mac_lock:
        if secret is None:
            _mac_keys.pop(namespace_digest, None)
            return
        blake3_key(secret)        # validates the length; imports blake3 early (clear error at open)
        old = _mac_keys.get(namespace_digest)
        if old is not None and old != secret:
            raise ValueError("another signing key is already registered for this namespace")
        _mac_keys[namespace_digest] = secret


def mac_key_for(namespace_digest: bytes) -> bytes | None:
    return _mac_keys.get(namespace_digest)


def register_read_limit(namespace_digest: bytes, limit: int | None) -> None:
    """Readers of ``namespace_digest`` in this process refuse chunks (header + payload + trailer)
    larger than ``limit`` bytes before allocating anything for them (None: back to the default)."""
    if limit is None:
        _read_limits.pop(namespace_digest, None)
        return
    if limit < HEADER_SIZE + TRAILER_SIZE:
        raise ValueError(f"read limit {limit} is smaller than an empty chunk")
    _read_limits[namespace_digest] = int(limit)


def read_limit(namespace_digest: bytes) -> int:
    """Largest encoded chunk a reader of this namespace accepts (side-effect free)."""
    return _read_limits.get(namespace_digest, DEFAULT_MAX_CHUNK_BYTES)


def check_read_size(namespace_digest: bytes, size: int) -> None:
    """Raise ``ChunkError("too_large")`` when an encoded chunk of ``size`` bytes (a file's or a
    value's size, not yet read) exceeds the namespace's read limit."""
    limit = read_limit(namespace_digest)
    if size > limit:
        raise ChunkError("too_large", f"chunk of {size} B exceeds the read limit of {limit} B "
                         "(store.max_chunk_bytes)")


def _header_ns_flags(header: bytes | memoryview) -> tuple[bytes, int]:
    flags = int.from_bytes(bytes(header[8:12]), "little")
    return bytes(header[_NS_OFFSET:_NS_OFFSET + KEY_BYTES]), flags


def new_hasher(header: bytes | memoryview, mac_key: bytes | None = None) -> Hasher:
    """The running digest for a chunk whose header region is ``header`` (fed first by the caller):
    keyed BLAKE3 when the header carries FLAG_MAC, xxh3-128 otherwise. The MAC key is ``mac_key`` or
    the one registered for the header's namespace; a signed header without a key raises ChunkError."""
    ns, flags = _header_ns_flags(header)
    if flags & FLAG_MAC:
        key = mac_key if mac_key is not None else _mac_keys.get(ns)
        if key is None:
            raise ChunkError("signed_no_key", "chunk is signed but no signing key is configured")
        return _Blake3Mac(key)
    return xxhash.xxh3_128()


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


def encode_header(namespace_digest: bytes, meta: ChunkMeta, *, signed: bool | None = None) -> bytearray:
    """The 4 KiB header region for ``meta`` (a fresh, zero-padded bytearray). ``signed`` (default:
    a signing key is registered for the namespace) sets FLAG_MAC."""
    shape = tuple(meta.shape) + (0,) * (MAX_NDIM - len(meta.shape))
    buf = bytearray(HEADER_SIZE)
    if signed is None:
        signed = namespace_digest in _mac_keys
    flags = FLAG_MAC if signed else 0
    _HEADER.pack_into(buf, 0, MAGIC, FORMAT_VERSION, _HEADER.size, flags, namespace_digest, meta.key,
                      meta.parent or _ZERO_KEY, meta.num_tokens, meta.payload_len,
                      meta.dtype.encode(), len(meta.shape), *shape)
    return buf


def checksum(header: bytes | memoryview, payload: bytes | memoryview, mac_key: bytes | None = None) -> bytes:
    """The trailer digest over the header region and the payload: xxh3-128, or the keyed BLAKE3
    MAC when the header is signed (see ``new_hasher``)."""
    h = new_hasher(header, mac_key)
    h.update(header)
    h.update(payload)
    return h.digest()


def encode_trailer(header: bytes | memoryview, payload: bytes | memoryview, mac_key: bytes | None = None) -> bytes:
    return pack_trailer(checksum(header, payload, mac_key))


def pack_trailer(digest: bytes) -> bytes:
    """The trailer for a precomputed ``checksum`` digest."""
    return _TRAILER.pack(TRAILER_MAGIC, digest)


def decode_header(header: bytes | memoryview, namespace_digest: bytes | None = None,
                  expect_key: bytes | None = None) -> ChunkMeta:
    """Parse and check the header region; raises ``ChunkError`` on any mismatch."""
    if len(header) < _HEADER.size:
        raise ChunkError("torn", f"header is {len(header)} bytes")
    (magic, version, hlen, flags, ns, key, parent, ntok, plen, dtype, ndim,
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
    if flags & ~FLAG_MAC:
        raise ChunkError("corrupt", f"unknown header flags {flags:#x}")
    if not flags & FLAG_MAC and ns in _mac_keys:
        raise ChunkError("unsigned", "namespace requires signed chunks; this one is not signed")
    try:
        dtype_s = dtype.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise ChunkError("corrupt", "dtype is not ASCII") from None
    return ChunkMeta(ChunkKey(key), None if parent == _ZERO_KEY else ChunkKey(parent), ntok,
                     tuple(shape[:ndim]), dtype_s, plen)


def verify_trailer(header: bytes | memoryview, payload: bytes | memoryview, trailer: bytes | memoryview,
                   mac_key: bytes | None = None) -> None:
    """Check the trailer magic and checksum / MAC; raises ``ChunkError`` ("torn" / "corrupt" /
    "bad_signature" / "signed_no_key")."""
    verify_digest(trailer, None)
    verify_digest(trailer, checksum(header, payload, mac_key), signed=is_signed(header))


def is_signed(header: bytes | memoryview) -> bool:
    return bool(_header_ns_flags(header)[1] & FLAG_MAC)


def verify_digest(trailer: bytes | memoryview, digest: bytes | None, signed: bool = False) -> None:
    """Check the trailer's magic and (unless None) that it holds ``digest``."""
    if len(trailer) != TRAILER_SIZE:
        raise ChunkError("torn", "trailer missing")
    magic, stored = _TRAILER.unpack(trailer)
    if magic != TRAILER_MAGIC:
        raise ChunkError("torn", "bad trailer magic")
    if digest is not None and stored != digest:
        if signed:
            raise ChunkError("bad_signature", "MAC mismatch: not written with this deployment's signing key")
        raise ChunkError("corrupt", "checksum mismatch")


def encode(namespace_digest: bytes, meta: ChunkMeta, payload: bytes | memoryview, *,
           mac_key: bytes | None = None) -> bytes:
    """A whole chunk as one bytes object (header region + payload + trailer). ``mac_key`` signs it
    with that secret (default: the namespace's registered key, if any)."""
    header = encode_header(namespace_digest, meta, signed=True if mac_key is not None else None)
    return bytes(header) + bytes(payload) + encode_trailer(header, payload, mac_key)


def decode(namespace_digest: bytes | None, data: bytes | memoryview,
           expect_key: bytes | None = None) -> tuple[ChunkMeta, memoryview]:
    """Verify a whole chunk blob; returns its meta and a view of the payload."""
    view = memoryview(data)
    if namespace_digest is not None:
        check_read_size(namespace_digest, len(view))
    meta = decode_header(view[:HEADER_SIZE], namespace_digest, expect_key)
    if len(view) != file_size(meta.payload_len):
        raise ChunkError("torn", f"chunk is {len(view)} bytes, header says {file_size(meta.payload_len)}")
    payload = view[HEADER_SIZE:HEADER_SIZE + meta.payload_len]
    verify_trailer(view[:HEADER_SIZE], payload, view[HEADER_SIZE + meta.payload_len:])
    return meta, payload
