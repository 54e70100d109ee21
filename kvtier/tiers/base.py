"""The tier interface every storage level implements (memory, disk, later remote).

Guarantees every tier gives (tests/unit/test_store_tiers_contract.py checks each
one against every tier):

* **Thread safety.** Every method may be called from any thread concurrently.
* **Never wrong data.** ``get``/``get_into`` return the exact payload that was put
  under that key, or a miss. A payload read from anything but process memory is
  verified (header, namespace, key, length, checksum) first.
* **Failure is a miss.** Read failures (corruption, a vanished file, I/O errors)
  return ``None`` and are counted as events; a failed write returns ``False`` and
  is counted. No method raises for a cache fault; only programming errors (a
  buffer too small, a closed tier) raise.
* **Budget.** ``usage().used_bytes <= usage().capacity_bytes`` after every call
  (disk: within the margin documented in docs/store-design.md).
* **Copy semantics.** ``put`` copies the payload (the caller may reuse its buffer at
  once); ``get`` returns a buffer the caller owns.
* **Prefix-aware eviction.** Eviction removes chain tails first; evicted keys are
  reported to ``on_evict`` so the store can drop chunks orphaned everywhere (tiers whose
  ``capabilities.evicts_itself`` is set evict on their own and report nothing).

The **batched, deadline-carrying calls** (``longest_prefix``, ``read_into``, ``write``,
``delete_many``, ``flush``) are what the store uses; their values are defined in
``kvtier.tiers.protocol``. Local tiers get them from the per-key calls below (their
lookups are memory-only); network tiers (shared filesystem, Valkey, Mooncake) implement
them natively with one round trip per batch and never block past the deadline.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from kvtier.chunk import ChunkMeta
from kvtier.keys import ChunkKey
from kvtier.tiers.protocol import Capabilities, Deadline, PrefixResult, ReadResult, Status, WriteDone, WriteItem

if TYPE_CHECKING:
    from kvtier.config import SharedTierBase

EvictHook = Callable[[list[ChunkKey]], None]
#: (meta, read view of the payload, release) — a tier hands a chunk it evicts to the next tier down;
#: the view stays valid until ``release()`` (called once, by whoever writes it).
DemoteHook = Callable[[ChunkMeta, memoryview, Callable[[], None]], None]
Pinned = tuple[ChunkMeta, memoryview, Callable[[], None]]


@dataclass(frozen=True, slots=True)
class TierUsage:
    used_bytes: int
    capacity_bytes: int
    num_chunks: int


def as_byte_view(buf: bytes | bytearray | memoryview, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (numpy arrays, tensors' storage...)."""
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise ValueError("output buffer is read-only")
    return view


COPY_NOGIL_MIN = 1 << 16     # smaller copies: a slice assignment (the call overhead would dominate)


def copy_bytes(dst: memoryview, src: bytes | bytearray | memoryview) -> None:
    """``dst[:] = src`` for flat byte views of equal length (ValueError otherwise), with the GIL
    released for large copies (``ctypes.memmove``): a chunk copy (~12 MB, ~1 ms) then never stalls
    the engine's thread or another reader's; a memoryview slice assignment holds the GIL
    throughout and is ~3x slower here."""
    n = len(dst)
    if len(src) != n:
        raise ValueError(f"copy of {len(src)} bytes into a {n}-byte view")
    if n < COPY_NOGIL_MIN:
        dst[:] = src
        return
    import ctypes

    import numpy as np

    d = np.frombuffer(dst, np.uint8)
    if not d.flags.writeable:
        raise ValueError("output buffer is read-only")
    s = np.frombuffer(src, np.uint8)
    ctypes.memmove(d.ctypes.data, s.ctypes.data, n)


class Tier(ABC):
    """One storage level. See the module docstring for the guarantees."""

    name: str = "tier"
    capabilities: Capabilities = Capabilities()

    def __init__(self) -> None:
        self.on_evict: EvictHook | None = None
        # set by the store: True = do not evict this candidate (it is the last copy of a
        # chunk whose children live in another tier; evicting it would orphan them)
        self.evict_guard: Callable[[ChunkKey], bool] | None = None
        # set by the store: is ``key`` (a parent) still reachable in some tier? Tiers that write in
        # the background re-check a chunk's parent before and after publishing (no orphans).
        self.parent_ok: Callable[[ChunkKey], bool] | None = None
        # set by the store (write_back): where chunks this tier evicts go (tiers that can lend
        # their bytes, i.e. RAM, call it; others never do)
        self.on_demote: DemoteHook | None = None
        # set by the store: keys that left this tier without this process evicting them (another
        # process removed the file; found by a read or a rescan). Listeners are told; no cascade.
        self.on_forget: EvictHook | None = None

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """True if a get of ``key`` is expected to hit (it may still miss on a fault)."""

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    @abstractmethod
    def get_into(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        """Copy the verified payload into ``out[:payload_len]``; its meta, or None on a miss.

        On a miss the contents of ``out`` are unspecified. Raises ValueError if
        ``out`` is smaller than the payload."""

    @abstractmethod
    def get(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        """The verified payload in a fresh caller-owned buffer, or None on a miss."""

    def get_many(self, keys: Iterable[ChunkKey]) -> list[tuple[ChunkMeta, memoryview] | None]:
        return [self.get(k) for k in keys]

    @abstractmethod
    def put(self, meta: ChunkMeta, payload: bytes | memoryview) -> bool:
        """Store a copy of ``payload`` under ``meta.key``; False if not stored (counted)."""

    def put_many(self, items: Iterable[tuple[ChunkMeta, bytes | memoryview]]) -> list[bool]:
        return [self.put(m, p) for m, p in items]

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool:
        """Remove ``key``; True if it was present."""

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        return sum(self.delete(k) for k in keys)

    @abstractmethod
    def usage(self) -> TierUsage:
        """Bytes used / budget / number of chunks (this process's view for shared tiers)."""

    @abstractmethod
    def keys(self) -> list[ChunkKey]:
        """Keys this tier knows (for shared tiers: this process's index)."""

    @abstractmethod
    def children(self, key: ChunkKey) -> list[ChunkKey]:
        """Chunks in this tier whose parent is ``key`` (the store follows chains across tiers)."""

    @abstractmethod
    def holds(self, key: ChunkKey) -> bool:
        """Lock-free, I/O-free membership in this process's view (for eviction guards)."""

    @abstractmethod
    def has_children(self, key: ChunkKey) -> bool:
        """Lock-free: does a chunk in this tier name ``key`` as its parent?"""

    def close(self) -> None:
        """Release resources; later calls may raise. Idempotent."""

    # -- optional hooks with safe defaults (the store calls them on every tier) ---------------
    def pin(self, key: ChunkKey) -> Pinned | None:
        """Lend the tier's own copy of ``key``: (meta, read view, release), valid until release().
        None: this tier cannot lend its bytes (the caller copies instead). Default: None."""
        return None

    def payload_size(self, key: ChunkKey) -> int | None:
        """Payload bytes of ``key`` from this process's index, without I/O; None if unknown."""
        return None

    def prepare(self, payload_len: int) -> bool:
        """Allocate buffers for payloads of ``payload_len`` bytes now; False if nothing to do."""
        return False

    def start_threads(self) -> None:
        """Start the tier's background threads now (they inherit the caller's CPU affinity)."""

    # -- the batched, deadline-bounded calls the store uses (kvtier.tiers.protocol) ----------
    def longest_prefix(self, keys: Sequence[ChunkKey], deadline: Deadline) -> PrefixResult:
        """How many leading ``keys`` this tier holds. Local default: ``contains`` per key."""
        n = 0
        for key in keys:
            if not self.contains(key):
                return PrefixResult(n, Status.MISS)
            n += 1
        return PrefixResult(n, Status.HIT)

    def read_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview],
                  deadline: Deadline, *, lent: bool = False) -> list[ReadResult]:
        """Read each key into its buffer (verified). Keys not reached before ``deadline`` are
        UNAVAILABLE("timeout"). Local default: ``get_into`` per key.

        ``lent=False``: no buffer is written after the call returned (a tier whose reads may
        outlive the deadline reads into private memory and copies out while the caller waits).
        ``lent=True``: the caller gives up every buffer whose result is not HIT (it never reads or
        reuses it again), so a tier may read straight into the buffers and skip that copy; a late
        read may then still write into a buffer after the call returned. Tiers whose reads always
        end before they return ignore it."""
        results: list[ReadResult] = []
        for key, out in zip(keys, outs):
            if deadline.expired():
                results.append(ReadResult.unavailable("timeout"))
                continue
            meta = self.get_into(key, as_byte_view(out, writable=True))
            results.append(ReadResult.hit(meta) if meta is not None else ReadResult.miss())
        return results

    def write(self, items: Sequence[WriteItem], on_done: WriteDone | None = None) -> list[bool]:
        """Accept chunks for writing; True per item accepted (False: refused or dropped, counted).
        ``on_done(key, ok)`` follows for each accepted item once it is durable or has failed, and
        each item's ``release`` is called once the tier no longer reads its payload. Local default:
        a synchronous ``put`` (copies), so ``release`` and ``on_done`` run before returning."""
        accepted: list[bool] = []
        for item in items:
            try:
                ok = self.put(item.meta, item.payload)
            finally:
                if item.release is not None:
                    item.release()
            accepted.append(ok)
            if on_done is not None:
                on_done(item.meta.key, ok)
        return accepted

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until accepted writes are durable; False if ``timeout`` expired first."""
        return True

    def _report_evicted(self, keys: list[ChunkKey]) -> None:
        if keys and self.on_evict is not None:
            self.on_evict(keys)

    def _report_forgotten(self, keys: list[ChunkKey]) -> None:
        if keys and self.on_forget is not None:
            self.on_forget(keys)


class WrappingTier(Tier):
    """A tier in front of another one, ``inner`` (faults: ``FaultyTier``; deadlines and a breaker:
    ``GuardedTier``). Deleting, flushing, closing and the index-only calls are the inner tier's;
    subclasses override what they change and implement the reads and writes."""

    inner: Tier

    def delete(self, key: ChunkKey) -> bool:
        return self.inner.delete(key)

    def delete_many(self, keys: Iterable[ChunkKey]) -> int:
        return self.inner.delete_many(keys)

    def flush(self, timeout: float | None = None) -> bool:
        return self.inner.flush(timeout)

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def keys(self) -> list[ChunkKey]:
        return self.inner.keys()

    def children(self, key: ChunkKey) -> list[ChunkKey]:
        return self.inner.children(key)

    def holds(self, key: ChunkKey) -> bool:
        return self.inner.holds(key)

    def has_children(self, key: ChunkKey) -> bool:
        return self.inner.has_children(key)

    def close(self) -> None:
        self.inner.close()


class RemoteTier(Tier):
    """A shared backend (shared filesystem, Valkey, Mooncake) with no local index: the mount or the
    server is the index, so the index-only calls know nothing, and the per-key calls ride on the
    batched ones with the config's deadlines (``lookup_timeout_s`` for existence, ``io_timeout_s``
    for reads and writes)."""

    cfg: "SharedTierBase"

    def contains(self, key: ChunkKey) -> bool:
        return self.longest_prefix([key], Deadline.after(self.cfg.lookup_timeout_s)).num_chunks == 1

    def get_into(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        r = self.read_into([key], [out], Deadline.after(self.cfg.io_timeout_s))[0]
        return r.meta if r.ok else None

    def put(self, meta: ChunkMeta, payload: bytes | memoryview) -> bool:
        return self.write([WriteItem(meta, memoryview(payload))])[0]

    def keys(self) -> list[ChunkKey]:
        return []

    def children(self, key: ChunkKey) -> list[ChunkKey]:
        return []

    def holds(self, key: ChunkKey) -> bool:
        return False

    def has_children(self, key: ChunkKey) -> bool:
        return False
