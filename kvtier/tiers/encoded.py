"""EncodedTier: a shared backend that stores chunk payloads in a compact encoding (``kvtier.encoding``).

``store.shared.encoding`` other than ``plain`` puts this wrapper between the ``GuardedTier`` and the
backend (``kvtier.tiers.registry``), so encoding and decoding run on the guard's pool threads,
under its deadlines, never on the engine's thread. Contracts:

* **Separate namespace.** The backend is opened with ``namespace.with_encoding(encoding)``: its
  directory / key prefix and the namespace digest in every chunk header name the encoding, so a
  reader configured for another encoding (or ``plain``) finds nothing of it (a miss) and can never
  decode one encoding's bytes as another's. Chunk keys stay the store's (one chain for every tier).
* **Verified, then decoded.** The backend stores the frame as the payload of an ordinary chunk
  (checksum or MAC over the frame, verified by the backend as for plain chunks); the wrapper then
  decodes into the caller's buffer. A frame that does not decode is a miss counted as ``corrupt``
  and removed from the backend. The meta handed up is the plain chunk's (``payload_len`` = the
  decoded length), so callers never see the encoding.
* **Writes** encode on the calling (pool) thread, release the caller's payload at once and hand the
  frame to the backend as memory it may keep until written.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from kvtier import encoding as enc
from kvtier.chunk import ChunkMeta, mac_key_for, read_limit, register_mac_key, register_read_limit
from kvtier.keys import ChunkKey, Namespace
from kvtier.metrics import Telemetry
from kvtier.tiers.base import Tier, WrappingTier, as_byte_view
from kvtier.tiers.protocol import Deadline, PrefixResult, ReadResult, WriteDone, WriteItem


def _noop() -> None:
    return None


def encoded_namespace(namespace: Namespace, encoding: str) -> Namespace:
    """The namespace a shared backend storing ``encoding`` is opened with. It shares the store's
    signing secret and read limit (registered here for its own digest: the backend verifies
    chunks under it)."""
    ns = namespace.with_encoding(enc.check_encoding(encoding))
    if ns != namespace:
        register_mac_key(ns.digest(), mac_key_for(namespace.digest()))
        register_read_limit(ns.digest(), read_limit(namespace.digest()) + enc.MAX_OVERHEAD)
    return ns


class EncodedTier(WrappingTier):
    def __init__(self, inner: Tier, encoding: str, telemetry: Telemetry) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.encoding = enc.check_encoding(encoding)
        self._tm = telemetry

    @property
    def capabilities(self):  # type: ignore[override]
        return self.inner.capabilities

    @classmethod
    def wrap(cls, inner: Tier, encoding: str, telemetry: Telemetry) -> "EncodedTier":
        """``inner`` (opened with ``encoded_namespace``) behind the codec; its eviction reports are
        forwarded. ImportError when the codec's library is missing."""
        enc.require_codec(encoding)
        self = cls(inner, encoding, telemetry)
        inner.on_evict = lambda keys: self._report_evicted(keys)
        inner.on_forget = lambda keys: self._report_forgotten(keys)
        return self

    # -- encoding ----------------------------------------------------------------------------------
    def _encoded(self, meta: ChunkMeta, payload: bytes | memoryview) -> tuple[ChunkMeta, memoryview]:
        frame = memoryview(enc.encode(self.encoding, as_byte_view(payload), meta.shape, meta.dtype))
        return replace(meta, payload_len=len(frame)), frame

    def _decoded(self, key: ChunkKey, meta: ChunkMeta, frame: memoryview, out: memoryview,
                 bad: list[ChunkKey]) -> ReadResult:
        try:
            n = enc.decode_into(self.encoding, frame[:meta.payload_len], out, meta.shape, meta.dtype)
        except enc.EncodingError as e:
            self._tm.event(e.kind, self.name, f"{key.hex()[:16]}: {self.encoding} frame: {e}")
            bad.append(key)
            return ReadResult.miss(e.kind)
        return ReadResult.hit(replace(meta, payload_len=n))

    def _drop(self, bad: list[ChunkKey]) -> None:
        if bad:
            try:
                self.inner.delete_many(bad)
            except Exception:            # removal is best effort; the miss is already counted
                pass

    # -- reads -------------------------------------------------------------------------------------
    def longest_prefix(self, keys: Sequence[ChunkKey], deadline: Deadline) -> PrefixResult:
        return self.inner.longest_prefix(keys, deadline)

    def contains(self, key: ChunkKey) -> bool:
        return self.inner.contains(key)

    def read_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview], deadline: Deadline, *,
                  lent: bool = False) -> list[ReadResult]:
        """Frames are read into private buffers (lent to the backend: nothing else ever sees them),
        then decoded into ``outs`` before this returns."""
        views = [as_byte_view(o, writable=True) for o in outs]
        frames = [memoryview(bytearray(len(v) + enc.MAX_OVERHEAD)) for v in views]
        got = self.inner.read_into(keys, frames, deadline, lent=True)
        bad: list[ChunkKey] = []
        res = [self._decoded(k, r.meta, f, v, bad) if r.ok and r.meta is not None else r
               for k, r, f, v in zip(keys, got, frames, views)]
        self._drop(bad)
        return res

    def get_into(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        return self.read_into([key], [out], Deadline.never())[0].meta

    def get(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        got = self.inner.get(key)
        if got is None:
            return None
        meta, frame = got
        try:
            n = enc.plain_length(self.encoding, frame)
        except enc.EncodingError as e:
            self._tm.event(e.kind, self.name, f"{key.hex()[:16]}: {self.encoding} frame: {e}")
            self._drop([key])
            return None
        out = memoryview(bytearray(n))
        bad: list[ChunkKey] = []
        r = self._decoded(key, meta, memoryview(frame), out, bad)
        self._drop(bad)
        return (r.meta, out) if r.ok and r.meta is not None else None

    def payload_size(self, key: ChunkKey) -> int | None:
        return None                      # the backend knows the frame's size, not the plain one

    # -- writes ------------------------------------------------------------------------------------
    def put(self, meta: ChunkMeta, payload: bytes | memoryview) -> bool:
        return self.write([WriteItem(meta, as_byte_view(payload))])[0]

    def write(self, items: Sequence[WriteItem], on_done: WriteDone | None = None) -> list[bool]:
        encoded: list[WriteItem] = []
        for item in items:
            try:
                meta, frame = self._encoded(item.meta, item.payload)
            finally:
                if item.release is not None:
                    item.release()
            encoded.append(WriteItem(meta, frame, _noop))
        return self.inner.write(encoded, on_done)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start_threads(self) -> None:
        self.inner.start_threads()

    def prepare(self, payload_len: int) -> bool:
        return self.inner.prepare(payload_len)
