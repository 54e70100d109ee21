"""TieredStore: the KV chunk store the connector talks to (RAM -> local SSD).

Python API (thread-safe; every cache fault is a miss or a dropped put plus a counted
event, never an exception or wrong bytes)::

    store = TieredStore.open(config.store, namespace)      # or shared_store(...) per process
    keys = chunk_keys(namespace, token_ids)
    hit = store.lookup(keys)                                 # LookupResult(num_chunks, tiers)
    n = store.get_into(keys[0], out)                         # payload length, or None = miss
    store.put(keys[1], keys[0], payload, num_tokens=256, shape=(...), dtype="bfloat16")
    store.get_into(keys[0], out, promote=False); store.promote_later([keys[0]])
    store.flush(); store.stats(); store.close()

Composition: ``lookup`` walks the keys and stops at the first chunk no tier holds
(memory first, then disk), so it never reports a chunk after a gap. ``get`` tries
tiers top-down; a disk hit is copied into RAM when ``promote_on_hit``. A caller on a
latency-critical path (the connector's load) reads with ``promote=False`` and hands the
keys to ``promote_later``: a background thread at idle CPU priority copies them into RAM
later, and pauses while any ``busy()`` section (a load) runs, so promotion never delays a
load or the forward pass that follows it.
``write_through``: a put lands in RAM now and is queued for disk (the RAM slot is
the write's source, pinned until written). ``write_back``: a put lands in RAM only;
chunks evicted from RAM are queued for disk (demotion). A put whose parent chunk is
nowhere in the store is refused (``orphan_put``): it could never be hit. When a
chunk leaves every tier, its descendants are removed too (``orphan_evicted``).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from kvtier.chunk import HEADER_SIZE, TRAILER_SIZE, ChunkMeta
from kvtier.config import StoreConfig
from kvtier.keys import ChunkKey, Namespace
from kvtier.metrics import Telemetry
from kvtier.tiers.base import Tier, as_byte_view
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from kvtier.promoter import Promoter
from kvtier.tiers.registry import open_tiers


@dataclass(frozen=True)
class LookupResult:
    num_chunks: int                # longest prefix of consecutive chunks available (0..len(keys))
    tiers: tuple[str, ...]         # tier name holding each of those chunks


class TieredStore:
    def __init__(self, config: StoreConfig, namespace: Namespace, memory: MemoryTier | None,
                 disk: DiskTier | None, telemetry: Telemetry) -> None:
        self.config = config
        self.namespace = namespace
        self.memory = memory
        self.disk = disk
        self.tiers: list[Tier] = [t for t in (memory, disk) if t is not None]
        self.telemetry = telemetry
        self._root = namespace.digest()
        self._closed = False
        self.promoter = Promoter(self._promote_from_disk)

    @classmethod
    def open(cls, config: StoreConfig, namespace: Namespace) -> "TieredStore":
        if config.chunk_size != namespace.chunk_size:
            raise ValueError(f"store.chunk_size {config.chunk_size} != namespace.chunk_size {namespace.chunk_size}")
        from kvtier.chunk import register_mac_key
        from kvtier.security import signing_secret

        register_mac_key(namespace.digest(), signing_secret(config))   # None: this namespace is not signed
        tm = Telemetry()
        tiers = open_tiers(config, namespace, tm)
        memory, disk = tiers.get("memory"), tiers.get("disk")
        self = cls(config, namespace, memory, disk, tm)
        for tier in self.tiers:
            tier.on_evict = self._on_evict
            others = [t for t in self.tiers if t is not tier]
            if others:
                tier.evict_guard = self._make_guard(others)
        if disk is not None:
            disk.parent_ok = self._present
            if memory is not None and config.write_policy == "write_back":
                memory.on_demote = self._demote
        return self

    # -- reads ------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """Longest prefix of ``keys`` held by some tier, and which tier holds each chunk."""
        found: list[str] = []
        mem = self.memory.contains if self.memory is not None else None
        disk = self.disk.contains if self.disk is not None else None
        for key in keys:
            if mem is not None and mem(key):
                found.append("memory")
            elif disk is not None and disk(key):
                found.append("disk")
            else:
                break
        self.telemetry.lookup(len(keys), len(found))
        return LookupResult(len(found), tuple(found))

    def get_into(self, key: ChunkKey, out: memoryview | bytearray, *, promote: bool | None = None) -> int | None:
        """Copy the verified payload into ``out``; its length, or None on a miss (out is then garbage).

        ``promote``: copy a disk hit into RAM now (default: ``promote_on_hit``)."""
        meta = self.get_meta_into(key, out, promote=promote)
        return None if meta is None else meta.payload_len

    def get_meta_into(self, key: ChunkKey, out: memoryview | bytearray, *,
                      promote: bool | None = None) -> ChunkMeta | None:
        """Like ``get_into`` but returns the chunk's meta (shape, dtype, tokens)."""
        view = as_byte_view(out, writable=True)
        for tier in self.tiers:
            meta = tier.get_into(key, view)
            if meta is not None:
                if tier is self.disk and (self.config.promote_on_hit if promote is None else promote):
                    self._promote(meta, view[:meta.payload_len])
                return meta
        return None

    def prepare_memory(self, payload_len: int) -> bool:
        """Map the RAM tier's slab for payloads of ``payload_len`` bytes now (and start its
        prefault when ``memory.prefault``), instead of at the first put. False without RAM tier."""
        return self.memory.prepare(payload_len) if self.memory is not None else False

    def start_background_threads(self) -> None:
        """Start the promoter and the disk writers now: they inherit the CPU affinity of the
        calling thread (the connector calls this from a thread allowed on every CPU)."""
        self.promoter.start()
        start_writers = getattr(self.disk, "start_writers", None)   # tiers without writers: nothing to start
        if start_writers is not None:
            start_writers()

    def promote_later(self, keys: Sequence[ChunkKey], min_hits: int = 1) -> int:
        """Queue disk chunks for a background copy into RAM (idle priority, after any ``busy()``
        section), each once it was passed here ``min_hits`` times (read that often from disk).
        No-op without both tiers or with ``promote_on_hit`` off. Returns keys queued now."""
        if self.memory is None or self.disk is None or not self.config.promote_on_hit or self._closed:
            return 0
        return self.promoter.submit([k for k in keys if not self.memory.contains(k)], min_hits)

    def busy(self):
        """Context manager: background promotion waits while any such section is open."""
        return self.promoter.paused()

    def _promote_from_disk(self, key: ChunkKey, scratch: bytearray) -> bytearray:
        """(promoter thread) Read ``key`` from disk (verified) into RAM unless RAM has it."""
        assert self.disk is not None and self.memory is not None
        if self._closed or self.memory.contains(key):
            return scratch
        try:
            need = os.stat(self.disk.path_of(key)).st_size - HEADER_SIZE - TRAILER_SIZE
        except OSError:
            return scratch      # gone meanwhile (evicted by another process): nothing to promote
        if len(scratch) < need:
            scratch = bytearray(need)
        try:
            meta = self.disk.get_into(key, memoryview(scratch))
        except ValueError:      # replaced by a larger file meanwhile: skip it
            return scratch
        if meta is not None:
            self._promote(meta, memoryview(scratch)[:meta.payload_len])
        return scratch

    def get(self, key: ChunkKey) -> memoryview | None:
        """The verified payload in a fresh caller-owned buffer, or None on a miss."""
        got = self.get_with_meta(key)
        return None if got is None else got[1]

    def get_with_meta(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        for tier in self.tiers:
            got = tier.get(key)
            if got is not None:
                if tier is self.disk:
                    self._promote(*got)
                return got
        return None

    def _promote(self, meta: ChunkMeta, payload: memoryview) -> None:
        if self.memory is not None and self.config.promote_on_hit:
            if meta.parent is None or self._present(meta.parent):
                if self.memory.put(meta, payload) and meta.parent is not None and not self._present(meta.parent):
                    self.memory.delete(meta.key)

    # -- writes -----------------------------------------------------------------------------
    def put(self, key: ChunkKey, parent: ChunkKey | None, payload: bytes | memoryview, *, num_tokens: int,
            shape: tuple[int, ...], dtype: str) -> bool:
        """Store a chunk; never blocks long. False = not stored anywhere (counted event)."""
        if parent == self._root:
            parent = None
        src = as_byte_view(payload)
        meta = ChunkMeta(key, parent, num_tokens, tuple(shape), dtype, len(src))
        if parent is not None and not self._present(parent):
            self.telemetry.event("orphan_put", "store", f"parent of {key.hex()[:16]} is in no tier")
            return False
        stored = False
        if self.memory is not None:
            stored = self.memory.put(meta, src)
            if stored and parent is not None and not self._present(parent):
                self.memory.delete(key)   # its parent left every tier meanwhile: never keep an orphan
                self.telemetry.event("orphan_put", "store", f"parent of {key.hex()[:16]} evicted during put")
                return False
        if self.disk is not None and (self.memory is None or self.config.write_policy == "write_through"
                                      or not stored):
            pinned = self.memory.pin(key) if stored and self.memory is not None else None
            if pinned is not None:
                ok = self.disk.submit(meta, pinned[1], pinned[2])
            else:
                ok = self.disk.submit_copy(meta, src)
            stored = stored or ok
        return stored

    def _demote(self, meta: ChunkMeta, view: memoryview, release) -> None:  # write_back: RAM eviction
        assert self.disk is not None
        self.disk.submit(meta, view, release)

    def _present(self, key: ChunkKey) -> bool:
        return any(t.contains(key) for t in self.tiers)

    @staticmethod
    def _make_guard(others: list[Tier]):
        def keep(key: ChunkKey) -> bool:   # the last copy of a chunk whose children live elsewhere
            return not any(t.holds(key) for t in others) and any(t.has_children(key) for t in others)
        return keep

    def _on_evict(self, keys: list[ChunkKey]) -> None:
        """A tier evicted ``keys``: drop the descendants of any chunk that left every tier."""
        self._cascade(keys)

    def _cascade(self, keys: list[ChunkKey]) -> None:
        """Remove, from every tier, the descendants of each of ``keys`` that no tier holds.

        Walks parent->child edges tier by tier, so a chain that crosses tiers (a RAM chunk
        whose parent lives only on disk) is followed too."""
        work = [k for k in keys if not self._present(k)]
        seen = set(work)
        while work:
            key = work.pop()
            children: set[ChunkKey] = set()
            for tier in self.tiers:
                for child in tier.children(key):
                    children.add(child)
                    if tier.delete(child):
                        self.telemetry.event("orphan_evicted", tier.name, child.hex()[:16])
            for child in children - seen:
                seen.add(child)
                work.append(child)

    def delete(self, key: ChunkKey) -> bool:
        """Remove ``key`` and (since they become unreachable) its descendants from every tier."""
        removed = False
        for tier in self.tiers:
            removed = tier.delete(key) or removed
        self._cascade([key])
        return removed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued background writes; False if ``timeout`` expired first."""
        return self.disk.flush(timeout) if self.disk is not None else True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _forget(self)
        self.promoter.close()
        for tier in reversed(self.tiers):
            tier.close()

    def stats(self) -> dict:
        """Plain-dict snapshot: per-tier usage and this store's counters."""
        tiers = {}
        for t in self.tiers:
            u = t.usage()
            tiers[t.name] = {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                             "chunks": u.num_chunks}
            self.telemetry.usage(t.name, u.used_bytes, u.capacity_bytes)
        return {"namespace": self.namespace.short_id(), "write_policy": self.config.write_policy,
                "eviction": self.config.eviction, "tiers": tiers, "counters": self.telemetry.snapshot(),
                "time": time.time()}

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_registry: dict[tuple[str, Namespace], TieredStore] = {}
_registry_lock = threading.Lock()


def shared_store(config: StoreConfig, namespace: Namespace) -> TieredStore:
    """The process-wide store for (config, namespace): the scheduler and worker halves of a
    connector in one process get the same open instance."""
    key = (config.model_dump_json(), namespace)
    with _registry_lock:
        store = _registry.get(key)
        if store is None or store._closed:
            store = TieredStore.open(config, namespace)
            _registry[key] = store
        return store


def _forget(store: TieredStore) -> None:
    with _registry_lock:
        for k, v in list(_registry.items()):
            if v is store:
                del _registry[k]
