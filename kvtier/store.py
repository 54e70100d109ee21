"""TieredStore: the KV chunk store the connector talks to, over an ordered list of tiers.

Python API (thread-safe; every cache fault is a miss or a dropped put plus a counted
event, never an exception or wrong bytes)::

    store = TieredStore.open(config.store, namespace)      # or shared_store(...) per process
    keys = chunk_keys(namespace, token_ids)
    hit = store.lookup(keys)                     # LookupResult(num_chunks, tiers, status): local index only
    far = store.shared_prefix(keys[hit.num_chunks:], Deadline.after(0.5))   # PrefixResult (network)
    res = store.read_into(keys, outs, Deadline.after(5))                   # list[ReadResult], top-down
    n = store.get_into(keys[0], out)             # payload length, or None = miss (one-key read_into)
    store.put(keys[1], keys[0], payload, num_tokens=256, shape=(...), dtype="bfloat16")
    store.subscribe(listener)                    # StoreEvent(kind=stored|promoted|evicted, tier, keys)
    store.flush(); store.stats(); store.close()

Tiers (``kvtier.tiers.registry``): ``memory -> disk -> shared``, each behind the ``Tier``
protocol and described by its ``Capabilities``; the store never special-cases a tier
class. *Local* tiers (``capabilities.complete_index``) answer ``lookup`` from memory, cheap
enough for the scheduler's loop; *shared* tiers are asked only through ``shared_prefix``,
``read_into`` and background writes, with deadlines (``GuardedTier``).

Edges between neighbouring tiers:

* **reads** try tiers top-down per key; a hit in tier i is *promoted* into the local tiers
  above it when ``promote_on_hit`` (``promote=False`` + ``promote_later`` keeps that off a
  latency-critical path: a background thread at idle priority does it, pausing while any
  ``busy()`` section runs).
* **write_through**: a put is written to every local tier (the first one synchronously; the
  others from its pinned copy, in the background). **write_back**: a put lands in the first
  local tier that takes it; what that tier evicts is *demoted* to the next local tier.
* a **shared** tier is written asynchronously after the local ones, under both policies,
  never on the caller's critical path (its own budget; no cluster-wide lock).

A put whose parent chunk is nowhere is refused (``orphan_put``). When a chunk leaves every
local tier, its descendants are removed from the local tiers too (``orphan_evicted``).
Those rules live in ``kvtier.lineage``, the copies up in ``kvtier.promotion``, the events in
``kvtier.store_events``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from kvtier.chunk import ChunkMeta
from kvtier.config import StoreConfig
from kvtier.keys import ChunkKey, Namespace
from kvtier.lineage import Lineage
from kvtier.metrics import Telemetry
from kvtier.promoter import Promoter
from kvtier.promotion import Promotion
from kvtier.store_events import Listeners, StoreEvent, StoreListener
from kvtier.tiers.base import Tier, as_byte_view
from kvtier.tiers.protocol import Deadline, PrefixResult, ReadResult, Status, WriteItem
from kvtier.tiers.registry import open_tiers

__all__ = ["LookupResult", "StoreEvent", "StoreListener", "TieredStore", "shared_store"]


@dataclass(frozen=True)
class LookupResult:
    num_chunks: int                # longest prefix of consecutive chunks the local tiers hold (0..len(keys))
    tiers: tuple[str, ...]         # tier name holding each of those chunks
    status: Status = Status.MISS   # HIT: every key; MISS: the chain stops at num_chunks


class TieredStore:
    def __init__(self, config: StoreConfig, namespace: Namespace, tiers: Sequence[Tier],
                 telemetry: Telemetry) -> None:
        self.config = config
        self.namespace = namespace
        self.tiers: list[Tier] = list(tiers)
        self.local: list[Tier] = [t for t in self.tiers if t.capabilities.complete_index]
        self.remote: list[Tier] = [t for t in self.tiers if not t.capabilities.complete_index]
        self.telemetry = telemetry
        self._root = namespace.digest()
        self._closed = False
        self._listeners = Listeners()
        self._notify = self._listeners.notify
        self.lineage = Lineage(self.local, telemetry, self._notify)
        self._promotion = Promotion(config, self.tiers, self.lineage, self._notify, lambda: self._closed)
        self.promoter = Promoter(self._promotion.from_below)

    @classmethod
    def open(cls, config: StoreConfig, namespace: Namespace) -> "TieredStore":
        if config.chunk_size != namespace.chunk_size:
            raise ValueError(f"store.chunk_size {config.chunk_size} != namespace.chunk_size {namespace.chunk_size}")
        from kvtier.chunk import register_mac_key, register_read_limit
        from kvtier.security import signing_secret

        register_mac_key(namespace.digest(), signing_secret(config))   # None: this namespace is not signed
        register_read_limit(namespace.digest(), config.read_limit())   # no reader allocates past it
        tm = Telemetry()
        return cls.from_tiers(config, namespace, open_tiers(config, namespace, tm), tm)

    @classmethod
    def from_tiers(cls, config: StoreConfig, namespace: Namespace, tiers: Sequence[Tier],
                   telemetry: Telemetry) -> "TieredStore":
        """A store over ``tiers`` (top first) already opened, wired together (tests, harnesses)."""
        self = cls(config, namespace, tiers, telemetry)
        for tier in self.tiers:
            tier.on_evict = self._evict_hook(tier)
            tier.on_forget = self._forget_hook(tier)
            tier.parent_ok = self.lineage.present
            others = [t for t in self.local if t is not tier]
            if others and tier.capabilities.complete_index:
                tier.evict_guard = Lineage.evict_guard(others)
        if len(self.local) > 1 and config.write_policy == "write_back":
            self.local[0].on_demote = self._demote
        return self

    def tier(self, name: str) -> Tier | None:
        """The tier called ``name`` (tests, tools); the data path never asks for one by name."""
        return next((t for t in self.tiers if t.name == name), None)

    @property
    def memory(self) -> Tier | None:
        """``tier("memory")`` (tests, tools; not used by the data path)."""
        return self.tier("memory")

    @property
    def disk(self) -> Tier | None:
        """``tier("disk")`` (tests, tools; not used by the data path)."""
        return self.tier("disk")

    # -- events ------------------------------------------------------------------------------
    def subscribe(self, listener: StoreListener) -> Callable[[], None]:
        """Call ``listener(StoreEvent)`` (from any thread; it must not block) on every change of the
        local tiers; returns a function that unsubscribes."""
        return self._listeners.subscribe(listener)

    def where(self, key: ChunkKey) -> str | None:
        """Name of the top-most local tier holding ``key`` (index only), or None."""
        return next((t.name for t in self.local if t.contains(key)), None)

    # -- lookups -------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey], deadline: Deadline | None = None) -> LookupResult:
        """Longest prefix of ``keys`` the local tiers hold, and which tier holds each chunk.
        Memory-only (indexes), safe on the scheduler's loop; ``deadline`` is accepted for symmetry."""
        found: list[str] = []
        for key in keys:
            name = self.where(key)
            if name is None:
                break
            found.append(name)
        self.telemetry.lookup(len(keys), len(found))
        return LookupResult(len(found), tuple(found), Status.HIT if len(found) == len(keys) else Status.MISS)

    def has_remote(self) -> bool:
        """Whether a tier without a complete local index (a shared tier) is configured."""
        return bool(self.remote)

    def shared_prefix(self, keys: Sequence[ChunkKey], deadline: Deadline | None = None) -> PrefixResult:
        """How many leading ``keys`` the shared tier(s) hold: one batched, deadline-bounded query per
        tier (never raises). UNAVAILABLE when the tier asked last could not answer in time."""
        deadline = deadline or Deadline.never()
        n, status = 0, Status.MISS
        for tier in self.remote:
            if n == len(keys):
                break
            try:
                res = tier.longest_prefix(keys[n:], deadline)
            except Exception as e:   # a backend bug is "unavailable", never an exception upwards
                self.telemetry.event("io_error", tier.name, f"longest_prefix: {e}")
                res = PrefixResult(0, Status.UNAVAILABLE)
            n += res.num_chunks
            status = res.status
        self.lineage.mark_shared(keys[:n])
        return PrefixResult(n, Status.HIT if keys and n == len(keys) else status)

    # -- reads ---------------------------------------------------------------------------------
    def read_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview | bytearray],
                  deadline: Deadline | None = None, *, promote: bool | None = None,
                  local_only: bool = False, lent: bool = False) -> list[ReadResult]:
        """Read each key into its buffer, trying tiers top-down (one batched call per tier for the
        keys still unanswered). Per key: HIT (verified bytes in the buffer), MISS (no tier has it),
        UNAVAILABLE (a tier that might have it did not answer in time). ``promote``: copy hits from
        lower tiers into the local tiers above now (default ``promote_on_hit``). ``local_only``:
        never ask a shared tier (a synchronous load must not wait on the network). ``lent``: the
        caller never reuses a buffer whose result is not HIT (``Tier.read_into``); only the last
        tier is read with ``lent`` (a late write from a tier above could otherwise land on a hit
        that a tier below put into the same buffer)."""
        deadline = deadline or Deadline.never()
        views = [as_byte_view(o, writable=True) for o in outs]
        results: list[ReadResult] = [ReadResult.miss() for _ in keys]
        hit_at = [-1] * len(keys)
        todo = list(range(len(keys)))
        for ti, tier in enumerate(self.tiers):
            if not todo:
                break
            if local_only and not tier.capabilities.complete_index:
                continue
            try:
                got = tier.read_into([keys[i] for i in todo], [views[i] for i in todo], deadline,
                                     lent=lent and ti == len(self.tiers) - 1)
            except ValueError:
                raise                    # a buffer too small: a programming error
            except Exception as e:       # a backend bug is "unavailable", never an exception upwards
                self.telemetry.event("io_error", tier.name, f"read_into: {e}")
                got = [ReadResult.unavailable("error")] * len(todo)
            for i, r in zip(todo, got):
                if r.ok:
                    results[i], hit_at[i] = r, ti
                elif r.status is Status.UNAVAILABLE or results[i].status is not Status.UNAVAILABLE:
                    results[i] = r
            todo = [i for i in todo if hit_at[i] < 0]
        if self.config.promote_on_hit if promote is None else promote:
            for i, ti in enumerate(hit_at):
                if ti > 0:
                    meta = results[i].meta
                    assert meta is not None
                    self._promotion.copy_up(meta, views[i][:meta.payload_len], ti)
        for i, ti in enumerate(hit_at):
            if ti >= 0 and not self.tiers[ti].capabilities.complete_index:
                self.lineage.mark_shared([keys[i]])
        return results

    def get_into(self, key: ChunkKey, out: memoryview | bytearray, *, promote: bool | None = None,
                 deadline: Deadline | None = None, local_only: bool = False) -> int | None:
        """Copy the verified payload into ``out``; its length, or None on a miss (out is then garbage)."""
        meta = self.get_meta_into(key, out, promote=promote, deadline=deadline, local_only=local_only)
        return None if meta is None else meta.payload_len

    def get_meta_into(self, key: ChunkKey, out: memoryview | bytearray, *, promote: bool | None = None,
                      deadline: Deadline | None = None, local_only: bool = False,
                      lent: bool = False) -> ChunkMeta | None:
        """Like ``get_into`` but returns the chunk's meta (shape, dtype, tokens)."""
        return self.read_into([key], [out], deadline, promote=promote, local_only=local_only, lent=lent)[0].meta

    def get(self, key: ChunkKey) -> memoryview | None:
        """The verified payload in a fresh caller-owned buffer, or None on a miss."""
        got = self.get_with_meta(key)
        return None if got is None else got[1]

    def get_with_meta(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        for ti, tier in enumerate(self.tiers):
            got = tier.get(key)
            if got is not None:
                if ti > 0 and self.config.promote_on_hit:
                    self._promotion.copy_up(got[0], got[1], ti)
                return got
        return None

    # -- promotion (a hit in tier i copied into the local tiers above it) -------------------------
    def promote_later(self, keys: Sequence[ChunkKey], min_hits: int = 1) -> int:
        """Queue chunks held below the top tier for a background copy into the tiers above (idle
        priority, after any ``busy()`` section), each once it was passed here ``min_hits`` times.
        No-op with a single tier or ``promote_on_hit`` off. Returns keys queued now."""
        if len(self.tiers) < 2 or not self.local or not self.config.promote_on_hit or self._closed:
            return 0
        top = self.tiers[0]
        return self.promoter.submit([k for k in keys if not top.contains(k)], min_hits)

    def busy(self):
        """Context manager: background promotion waits while any such section is open."""
        return self.promoter.paused()

    def promote(self, meta: ChunkMeta, payload: memoryview | bytearray) -> None:
        """Copy a verified chunk the caller read from a shared tier (``read_into(promote=False)``)
        into the local tiers that lack it: the promotion ``read_into`` would have made, done later
        in the caller's order (a chunk whose parent is neither local nor known in the shared tier
        is not promoted: never an orphan). The caller may reuse ``payload`` once this returns."""
        self._promotion.copy_up(meta, as_byte_view(payload)[:meta.payload_len], len(self.tiers))

    # -- writes --------------------------------------------------------------------------------
    def put(self, key: ChunkKey, parent: ChunkKey | None, payload: bytes | memoryview, *, num_tokens: int,
            shape: tuple[int, ...], dtype: str) -> bool:
        """Store a chunk; never blocks long. The caller may reuse ``payload`` once this returns.
        False = not stored anywhere (counted event)."""
        if parent == self._root:
            parent = None
        src = as_byte_view(payload)
        meta = ChunkMeta(key, parent, num_tokens, tuple(shape), dtype, len(src))
        self._promotion.max_payload = max(self._promotion.max_payload, len(src))
        if parent is not None and not self.lineage.present(parent):
            self.telemetry.event("orphan_put", "store", f"parent of {key.hex()[:16]} is in no tier")
            return False
        first: Tier | None = None
        for tier in self.local:          # the first local tier that takes it gets a copy now
            if tier.write([WriteItem(meta, src)])[0]:
                first = tier
                break
        if first is not None and parent is not None and not self.lineage.present(parent):
            first.delete(key)   # its parent left every tier meanwhile: never keep an orphan
            self.telemetry.event("orphan_put", "store", f"parent of {key.hex()[:16]} evicted during put")
            return False
        stored = first is not None
        if first is not None:
            self._notify("stored", first, [key])
        below = self.local[self.local.index(first) + 1:] if first is not None else []
        rest = (below if self.config.write_policy == "write_through" else []) + self.remote
        for tier in rest:                # background writes from the first tier's pinned copy
            pinned = first.pin(key) if first is not None else None
            item = WriteItem(meta, pinned[1], pinned[2]) if pinned is not None else WriteItem(meta, src)
            try:
                ok = tier.write([item])[0]
            except Exception as e:       # a backend bug drops this write only
                self.telemetry.event("io_error", tier.name, f"write: {e}")
                if pinned is not None:
                    pinned[2]()
                ok = False
            if ok:
                self._notify("stored", tier, [key])
                if not tier.capabilities.complete_index:
                    self.lineage.mark_shared([key])   # its children may be put before the write lands
            stored = stored or ok
        return stored

    def _demote(self, meta: ChunkMeta, view: memoryview, release: Callable[[], None]) -> None:
        """write_back: the top local tier evicted ``meta``; write it to the next local tier."""
        if len(self.local) < 2:
            release()
            return
        nxt = self.local[1]
        if nxt.write([WriteItem(meta, view, release)])[0]:
            self._notify("stored", nxt, [meta.key])

    def _evict_hook(self, tier: Tier):
        def on_evict(keys: list[ChunkKey]) -> None:
            """``tier`` evicted ``keys``: tell listeners, drop descendants orphaned everywhere."""
            self._notify("evicted", tier, keys)
            self.lineage.cascade(keys)
        return on_evict

    def _forget_hook(self, tier: Tier):
        def on_forget(keys: list[ChunkKey]) -> None:
            """Another process removed ``keys`` from ``tier``: tell listeners (no cascade: their
            descendants may be that process's to manage; a lookup stops at the gap anyway)."""
            self._notify("evicted", tier, keys)
        return on_forget

    def delete(self, key: ChunkKey) -> bool:
        """Remove ``key`` and (since they become unreachable) its descendants from every tier."""
        removed = False
        for tier in self.tiers:
            if tier.delete(key):
                removed = True
                self._notify("evicted", tier, [key])
        self.lineage.forget_shared(key)
        self.lineage.cascade([key])
        return removed

    # -- lifecycle -------------------------------------------------------------------------------
    def prepare_memory(self, payload_len: int) -> bool:
        """Let tiers allocate their buffers for payloads of ``payload_len`` bytes now (the RAM slab,
        and its prefault when ``memory.prefault``), instead of at the first put."""
        self._promotion.max_payload = max(self._promotion.max_payload, payload_len)
        return any([t.prepare(payload_len) for t in self.tiers])

    def start_background_threads(self) -> None:
        """Start the promoter and the tiers' threads (disk writers...) now: they inherit the CPU
        affinity of the calling thread (the connector calls this from a thread allowed on every CPU)."""
        self.promoter.start()
        for t in self.tiers:
            t.start_threads()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for queued background writes of every tier; False if ``timeout`` expired first."""
        end = None if timeout is None else time.monotonic() + timeout
        ok = True
        for t in self.tiers:
            left = None if end is None else max(0.0, end - time.monotonic())
            ok = t.flush(left) and ok
        return ok

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
