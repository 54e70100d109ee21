"""RAM tier: a slab of fixed-size slots allocated once and reused.

Fresh allocations page-fault on first touch, which halves copy speed on this class
of machine, so the tier maps one anonymous slab (``capacity // slot_size`` slots,
page aligned) when the first chunk arrives (or at ``prepare``) and copies payloads
into free slots forever after. The slot size is ``memory.slot_size`` or the first
payload's size rounded up to 4 KiB; a larger payload is refused (counted
``dropped_store``).

``prefault``: when the slab is mapped, a background thread at idle CPU priority faults
every page in (``madvise(MADV_POPULATE_WRITE)``, which never changes page contents, so
it runs safely beside puts), so later copies into the slab do not pay first-touch page
faults on the critical path. Cost: the whole ``capacity`` becomes resident at once
instead of as chunks arrive (the slab is never returned to the OS either way), and the
populate costs CPU time while the engine is otherwise idle (about 1 s per GiB here).
Where the kernel lacks MADV_POPULATE_WRITE (before Linux 5.14) the slab is mapped with
MAP_POPULATE instead, synchronously.

Readers pin a slot while they copy out of it, so eviction never recycles a slot
under a reader; a slot handed to the disk writer (write-through source or write-back
demotion) stays pinned until the write finished. RAM is trusted: payloads are not
checksummed here (they were verified when they came from disk or remote).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from typing import Callable

from kvtier.chunk import ChunkMeta
from kvtier.eviction import EvictionPolicy, PolicyName
from kvtier.keys import ChunkKey
from kvtier.metrics import Telemetry
from kvtier.tiers.base import Tier, TierUsage, as_byte_view, copy_bytes
from kvtier.tiers.protocol import Capabilities

PAGE = 4096
MADV_POPULATE_WRITE = 23          # Linux >= 5.14
PREFAULT_STEP = 32 << 20
log = logging.getLogger("kvtier.store")


def round_up(n: int, align: int = PAGE) -> int:
    return (n + align - 1) // align * align


class MemoryTier(Tier):
    name = "memory"
    capabilities = Capabilities(shared=False, evicts_itself=False, complete_index=True, local_budget=True)

    def __init__(self, capacity: int, slot_size: int | None, policy: PolicyName,
                 prefault: bool, telemetry: Telemetry) -> None:
        super().__init__()
        self.capacity = capacity
        self._slot_size = round_up(slot_size) if slot_size else None
        self._prefault = prefault
        self._tm = telemetry
        self._lock = threading.Lock()
        self._policy = EvictionPolicy(policy)
        self._entries: dict[ChunkKey, tuple[int, ChunkMeta]] = {}
        self._slab: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._free: list[int] = []
        self._pins: list[int] = []
        self._owner: list[ChunkKey | None] = []
        self._used = 0
        self._closed = False
        self._prefaulter: threading.Thread | None = None
        self.prefaulted_bytes = 0

    @classmethod
    def open(cls, capacity: int, *, slot_size: int | None = None, policy: PolicyName = "lru",
             prefault: bool = False, telemetry: Telemetry | None = None) -> "MemoryTier":
        return cls(capacity, slot_size, policy, prefault, telemetry or Telemetry())

    # -- slab ----------------------------------------------------------------------------
    def _ensure_slab(self, payload_len: int) -> bool:
        if self._slab is not None:
            return True
        if self._slot_size is None:
            self._slot_size = round_up(max(payload_len, 1))
        n = self.capacity // self._slot_size
        if n == 0:
            return False
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        madvise = _libc_madvise() if self._prefault else None
        if self._prefault and madvise is None and hasattr(mmap, "MAP_POPULATE"):
            flags |= mmap.MAP_POPULATE
        self._slab = mmap.mmap(-1, n * self._slot_size, flags=flags)
        self._view = memoryview(self._slab)
        if madvise is not None:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(self._slab))
            self._prefaulter = threading.Thread(target=self._prefault_slab, args=(madvise, addr, len(self._slab)),
                                                name="kvtier-prefault", daemon=True)
            self._prefaulter.start()
        self._free = list(range(n - 1, -1, -1))
        self._pins = [0] * n
        self._owner = [None] * n
        return True

    def prepare(self, payload_len: int) -> bool:
        """Map the slab now (slot size from ``payload_len`` unless configured) and start the
        prefault if configured; False if not even one slot fits."""
        with self._lock:
            if self._closed:
                return False
            return self._ensure_slab(payload_len)

    def _prefault_slab(self, madvise, addr: int, length: int) -> None:
        """(background thread) Fault the slab in, PREFAULT_STEP bytes at a time, at idle priority."""
        from kvtier.promoter import lower_thread_priority

        lower_thread_priority()
        t0 = time.perf_counter()
        off = 0
        while off < length and not self._closed:
            n = min(PREFAULT_STEP, length - off)
            if madvise(ctypes.c_void_p(addr + off), ctypes.c_size_t(n), MADV_POPULATE_WRITE) != 0:
                log.info("kvtier: RAM slab prefault stopped at %d of %d bytes (errno %d)", off, length,
                         ctypes.get_errno())
                return
            off += n
            self.prefaulted_bytes = off
        log.debug("kvtier: RAM slab of %d bytes prefaulted in %.1f s", off, time.perf_counter() - t0)

    def _slot_view(self, slot: int, length: int) -> memoryview:
        assert self._view is not None and self._slot_size is not None
        start = slot * self._slot_size
        return self._view[start:start + length]

    @property
    def slot_size(self) -> int | None:
        return self._slot_size

    def _unpin(self, slot: int) -> None:
        with self._lock:
            self._pins[slot] -= 1
            if self._pins[slot] == 0 and self._owner[slot] is None and not self._closed:
                self._free.append(slot)

    def _drop_locked(self, key: ChunkKey) -> tuple[int, ChunkMeta] | None:
        ent = self._entries.pop(key, None)
        if ent is None:
            return None
        slot, meta = ent
        self._policy.remove(key)
        self._owner[slot] = None
        self._used -= meta.payload_len
        return ent

    def _free_slot_locked(self, slot: int) -> None:
        if self._pins[slot] == 0:
            self._free.append(slot)

    # -- Tier API -------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return key in self._entries

    def contains_many(self, keys) -> list[bool]:
        e = self._entries
        return [k in e for k in keys]

    def meta(self, key: ChunkKey) -> ChunkMeta | None:
        ent = self._entries.get(key)
        return ent[1] if ent else None

    def payload_size(self, key: ChunkKey) -> int | None:
        ent = self._entries.get(key)
        return ent[1].payload_len if ent else None

    def pin(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview, Callable[[], None]] | None:
        """Pin ``key``'s slot: (meta, read view, release). The view stays valid until release()."""
        with self._lock:
            ent = self._entries.get(key)
            if ent is None:
                return None
            slot, meta = ent
            self._pins[slot] += 1
            view = self._slot_view(slot, meta.payload_len)
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self._unpin(slot)
        return meta, view, release

    def get_into(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        t0 = time.perf_counter()
        with self._lock:
            ent = self._entries.get(key)
            if ent is None:
                self._tm.miss(self.name)
                return None
            slot, meta = ent
            out = as_byte_view(out, writable=True)
            if len(out) < meta.payload_len:
                raise ValueError(f"output buffer has {len(out)} bytes, chunk needs {meta.payload_len}")
            self._pins[slot] += 1
            self._policy.touch(key)
            src = self._slot_view(slot, meta.payload_len)
        try:
            copy_bytes(out[:meta.payload_len], src)
        finally:
            self._unpin(slot)
        self._tm.hit(self.name, meta.payload_len, time.perf_counter() - t0)
        return meta

    def get(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        meta = self.meta(key)
        if meta is None:
            self._tm.miss(self.name)
            return None
        buf = memoryview(bytearray(meta.payload_len))
        got = self.get_into(key, buf)
        return None if got is None else (got, buf[:got.payload_len])

    def put(self, meta: ChunkMeta, payload: bytes | memoryview) -> bool:
        t0 = time.perf_counter()
        src = as_byte_view(payload)
        if len(src) != meta.payload_len:
            raise ValueError(f"payload is {len(src)} bytes, meta says {meta.payload_len}")
        evicted: list[ChunkMeta] = []
        demote: list[tuple[ChunkMeta, memoryview, Callable[[], None]]] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("memory tier is closed")
            if meta.key in self._entries:
                self._policy.touch(meta.key)
                return True
            if not self._ensure_slab(meta.payload_len) or meta.payload_len > (self._slot_size or 0):
                self._tm.event("dropped_store", self.name, f"payload {meta.payload_len} B exceeds slot")
                return False
            parent = meta.parent

            guard = self.evict_guard

            def keep(k: ChunkKey) -> bool:  # pinned slots cannot be reused yet; never cut the new chunk's prefix
                return k == parent or self._pins[self._entries[k][0]] > 0 or (guard is not None and guard(k))
            while not self._free:
                victim = self._policy.pick(exclude=keep)
                if victim is None:
                    break
                vslot, vmeta = self._drop_locked(victim)  # type: ignore[misc]
                evicted.append(vmeta)
                if self.on_demote is not None:
                    self._pins[vslot] += 1
                    demote.append((vmeta, self._slot_view(vslot, vmeta.payload_len),
                                   self._releaser(vslot)))
                else:
                    self._free_slot_locked(vslot)
            slot = self._free.pop() if self._free else None
            if slot is not None:
                self._pins[slot] += 1          # reserved while we copy outside the lock
        if evicted:
            self._tm.evicted(self.name, len(evicted))
        for item in reversed(demote):   # victims are picked tail-first: demote parents first, so a
            self.on_demote(*item)  # type: ignore[misc]   # child's write never finds its parent in no tier
        self._report_evicted([m.key for m in evicted])
        if slot is None:
            self._tm.event("dropped_store", self.name, "no free memory slot (all pinned)")
            return False
        copy_bytes(self._slot_view(slot, meta.payload_len), src)
        with self._lock:
            self._pins[slot] -= 1
            if meta.key in self._entries or self._closed:  # another thread won the race
                self._free_slot_locked(slot)
                return True
            self._entries[meta.key] = (slot, meta)
            self._owner[slot] = meta.key
            self._used += meta.payload_len
            self._policy.add(meta.key, meta.parent, meta.payload_len, meta.num_tokens)
            used = self._used
        self._tm.wrote(self.name, meta.payload_len, time.perf_counter() - t0)
        self._tm.usage(self.name, used, self.capacity)
        return True

    def _releaser(self, slot: int) -> Callable[[], None]:
        done = []

        def release() -> None:
            if not done:
                done.append(True)
                self._unpin(slot)
        return release

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            ent = self._drop_locked(key)
            if ent is None:
                return False
            self._free_slot_locked(ent[0])
            used = self._used
        self._tm.usage(self.name, used, self.capacity)
        return True

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._used, self.capacity, len(self._entries))

    def allocated_bytes(self) -> int:
        return len(self._slab) if self._slab is not None else 0

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._entries)

    def holds(self, key: ChunkKey) -> bool:
        return key in self._entries

    def has_children(self, key: ChunkKey) -> bool:
        return self._policy.has_children(key)

    def children(self, key: ChunkKey) -> list[ChunkKey]:
        with self._lock:
            return sorted(self._policy.children(key))

    def orphans(self, present: Callable[[ChunkKey], bool]) -> list[ChunkKey]:
        with self._lock:
            return self._policy.orphans(present)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
            pinned = any(self._pins)
        if self._prefaulter is not None:
            self._prefaulter.join(10)    # it stops after the current step (idle priority: it may be starved)
            pinned = pinned or self._prefaulter.is_alive()   # never unmap under it; exit frees the slab
        if self._slab is not None and not pinned:
            try:
                self._view.release()  # type: ignore[union-attr]
                self._slab.close()
            except BufferError:
                pass  # a caller still holds a view; the slab is freed when it is collected


def _libc_madvise():
    """libc ``madvise`` (ctypes releases the GIL during the call) if MADV_POPULATE_WRITE works here."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        probe = mmap.mmap(-1, PAGE)
        try:
            cbuf = ctypes.c_char.from_buffer(probe)
            ok = fn(ctypes.c_void_p(ctypes.addressof(cbuf)), ctypes.c_size_t(PAGE), MADV_POPULATE_WRITE) == 0
            del cbuf
        finally:
            probe.close()
        return fn if ok else None
    except (OSError, AttributeError, ValueError, TypeError):
        return None
