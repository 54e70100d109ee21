"""Local-SSD tier: one verified file per chunk in a directory shared by processes.

Layout under ``<disk.path>/<namespace.short_id()>/`` (kvtier/tiers/disklayout.py, shared with
``kvtier fsck``)::

    namespace.json      the namespace fields (for humans and fsck)
    ledger              8-byte used-bytes counter; flock on it serialises publish/delete
    chunks/ab/<key hex>.kvc   published chunks (chunk.py format)
    tmp/<key hex>.<pid>.<thread>.<n>.tmp    files being written

The directory is the source of truth. A chunk is written to ``tmp/`` and published
with ``os.replace`` under the ledger lock, so a final name never holds a partial
file; the ledger is updated in the same critical section (and recomputed from a
directory scan at open and on rescans), which keeps the byte budget across every
process sharing the directory. Each process keeps an index (sizes, parents, LRU or
cost order): ``contains`` / ``longest_prefix`` are index-only (no system call, cheap
enough for the scheduler's loop). The index learns other processes' chunks from a
background rescan thread (every ``rescan_interval_s``; never on a caller's thread) and
from reads (a read of an unindexed chunk that succeeds indexes it; a read of a vanished
file drops it, counted ``missing``). The publish path never rescans the directory: it
evicts from the index it has. See docs/store-design.md for the trade-offs and the budget
margin.

Writes: ``put`` writes and publishes synchronously; ``write(items, on_done)`` queues them
on the writer pool (``writer.py``): an item with ``release`` is written straight from the
caller's buffer (a pinned RAM slot), one without is copied into a staging buffer first.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from kvtier.chunk import (HEADER_SIZE, TRAILER_SIZE, ChunkError, ChunkMeta, check_read_size, encode_header,
                          file_size)
from kvtier.eviction import PolicyName
from kvtier.keys import ChunkKey, Namespace
from kvtier.metrics import QUEUE_DEPTH, Telemetry
from kvtier.tiers import diskio, manifest
from kvtier.tiers.base import Tier, TierUsage, as_byte_view
from kvtier.tiers.diskindex import DiskIndex
from kvtier.tiers.disklayout import Ledger, NamespaceDir
from kvtier.tiers.protocol import Capabilities, WriteDone, WriteItem
from kvtier.tiers.writer import Job, WriterPool

class DiskTier(Tier):
    name = "disk"
    capabilities = Capabilities(shared=False, evicts_itself=False, complete_index=True, local_budget=True)

    def __init__(self, root: Path, namespace: Namespace, capacity: int, fsync: str, o_direct: bool,
                 policy: PolicyName, writer_threads: int, queue_depth: int, telemetry: Telemetry,
                 o_direct_read: bool | None = None) -> None:
        super().__init__()
        self.root = root
        self.namespace = namespace
        self.capacity = capacity
        self.fsync = fsync
        self.o_direct = o_direct
        self.o_direct_read = o_direct if o_direct_read is None else o_direct_read
        #: chunk payloads at least this large are read in pieces in flight with the checksum
        #: overlapped (``diskio.read_chunk_file``); above every chunk's size: one read per chunk
        self.read_pipeline_min = diskio.PIPELINE_MIN
        self._ns = namespace.digest()
        self.layout = NamespaceDir(root)
        self._tmp = self.layout.tmp
        self._tm = telemetry
        self._index = DiskIndex(self.layout, policy)
        self._ledger_file: Ledger | None = None
        self._seq = itertools.count()
        self._writers = WriterPool(self, writer_threads, queue_depth, telemetry)
        self.last_scan_s = 0.0
        self.rescan_interval_s = 5.0
        self.rescans = 0                         # background rescans completed (tests, stats)
        self._scanned_at = float("-inf")
        self._closed = False
        self._stop = threading.Event()
        self._rescanner: threading.Thread | None = None

    @classmethod
    def open(cls, path: str | Path, namespace: Namespace, capacity: int, *, fsync: str = "never",
             o_direct: bool = False, policy: PolicyName = "lru", writer_threads: int = 2,
             queue_depth: int = 256, rescan_interval_s: float = 5.0,
             telemetry: Telemetry | None = None, o_direct_read: bool | None = None) -> "DiskTier":
        """Create/open the namespace directory, clean dead writers' temp files, rebuild the index.

        ``o_direct`` applies to writes and, unless ``o_direct_read`` says otherwise, to reads
        (buffered reads get the kernel's readahead)."""
        root = Path(path) / namespace.short_id()
        self = cls(root, namespace, capacity, fsync, o_direct, policy, writer_threads, queue_depth,
                   telemetry or Telemetry(), o_direct_read)
        self.rescan_interval_s = rescan_interval_s
        self.layout.create(namespace)
        self._ledger_file = Ledger.open(self.layout.ledger)
        self.clean_temp_files()
        self._note_other_namespaces(Path(path))
        t0 = time.perf_counter()
        with self._shared():
            self._rescan_locked()
        self.last_scan_s = time.perf_counter() - t0
        if rescan_interval_s > 0:
            self._rescanner = threading.Thread(target=self._rescan_loop, name="kvtier-disk-rescan", daemon=True)
            self._rescanner.start()
        return self

    # -- paths, ledger --------------------------------------------------------------------
    def path_of(self, key: ChunkKey) -> str:
        return self.layout.path_of(key)

    @contextmanager
    def _shared(self) -> Iterator[None]:
        """Exclusive across threads (lock) and processes (flock on the ledger)."""
        assert self._ledger_file is not None
        with self._ledger_file.locked():
            yield

    def _ledger(self) -> int:
        assert self._ledger_file is not None
        return self._ledger_file.read()

    def _set_ledger(self, used: int) -> None:
        assert self._ledger_file is not None
        self._ledger_file.write(used)

    def _note_other_namespaces(self, path: Path) -> None:
        """Chunks of other namespaces (another model, dtype, block size, layout...) in the same
        directory are never read (their keys differ): say so once, counted (``foreign_namespace``)."""
        others = NamespaceDir.others_under(path, self.root)
        if others:
            self._tm.event("foreign_namespace", self.name, f"{len(others)} other namespace(s) in {path} "
                           f"({', '.join(sorted(others)[:3])}) are not reused by {self.root.name}")

    def clean_temp_files(self) -> int:
        """Remove temp files of dead writers (or older than an hour). Returns how many."""
        removed = self.layout.remove_dead_temp_files()
        if removed:
            self._tm.event("temp_cleaned", self.name, f"{removed} temp files of dead writers removed")
        return removed

    def _rescan_locked(self) -> list[ChunkKey]:
        """Rebuild the index from the directory and reset the ledger (holding the shared lock)."""
        found = self._index.scan()
        gone = self._index.merge_scan(found, None)
        self._set_ledger(sum(size for size, _ in found.values()))
        self._scanned_at = time.monotonic()
        return gone

    def _rescan_loop(self) -> None:
        """(background thread) Learn other processes' chunks every ``rescan_interval_s``, without the
        ledger lock (publishes of every process go on meanwhile); chunks that vanished (evicted or
        removed by another process) leave the index and are reported to ``on_forget``."""
        from kvtier.promoter import lower_thread_priority

        lower_thread_priority()
        while not self._stop.wait(self.rescan_interval_s):
            try:
                before = set(self._index.keys())
                gone = self._index.merge_scan(self._index.scan(), before)
                self._scanned_at = time.monotonic()
                self.rescans += 1
                if gone:
                    self._tm.event("missing", self.name, f"{len(gone)} chunks removed by another process")
                    self._report_forgotten(gone)
            except Exception as e:   # never let the thread die (a vanished directory, EIO...)
                if self._closed:
                    return
                self._tm.event("io_error", self.name, f"rescan: {e}")

    def save_manifest(self) -> None:
        """Atomically write (key, parent) of every indexed chunk with a known parent."""
        records = self._index.manifest_records()
        tmp = f"{self._tmp}/manifest.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            manifest.save(self.root / "manifest", tmp, records)
        except OSError as e:
            self._tm.event("io_error", self.name, f"manifest: {e}")

    # -- Tier API -------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        """Index-only (no system call): indexed or queued for writing."""
        return key in self._index or self._writers.pending(key)

    def payload_size(self, key: ChunkKey) -> int | None:
        size = self._index.size(key)
        if size is not None:
            return size - HEADER_SIZE - TRAILER_SIZE
        return self._writers.pending_size(key)

    def get_into(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        t0 = time.perf_counter()
        out = as_byte_view(out, writable=True)
        meta = self._writers.read_pending(key, out)
        if meta is None:
            meta = self._read(key, out)
        if meta is None:
            self._tm.miss(self.name)
            return None
        self._tm.hit(self.name, meta.payload_len, time.perf_counter() - t0)
        return meta

    def _read(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        path = self.path_of(key)
        try:
            meta = diskio.read_chunk_file(path, out, self._ns, key, o_direct=self.o_direct_read,
                                          pipeline_min=self.read_pipeline_min)
        except FileNotFoundError:
            if key in self._index:
                self._tm.event("missing", self.name, f"{key.hex()[:16]} vanished")
                self._index.drop(key)
                self._report_forgotten([key])
            return None
        except ChunkError as e:
            self._tm.event(e.kind, self.name, f"{key.hex()[:16]}: {e}")
            self._remove_file(key)
            return None
        except OSError as e:
            self._tm.event("io_error", self.name, f"read {key.hex()[:16]}: {e}")
            return None
        self._index.add(key, file_size(meta.payload_len), meta.parent, True, meta.num_tokens)
        return meta

    def get(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        try:
            size: int | None = os.stat(self.path_of(key)).st_size
        except OSError:
            pending = self._writers.pending_size(key)       # payload bytes of a queued write
            size = None if pending is None else file_size(pending)
        if size is None:
            if key in self._index:
                self._tm.event("missing", self.name, f"{key.hex()[:16]} vanished")
                self._index.drop(key)
                self._report_forgotten([key])
            self._tm.miss(self.name)
            return None
        try:
            check_read_size(self._ns, size)       # allocate from a checked size only
        except ChunkError as e:
            self._tm.event(e.kind, self.name, f"{key.hex()[:16]}: {e}")
            self._remove_file(key)
            self._tm.miss(self.name)
            return None
        buf = memoryview(bytearray(max(0, size - HEADER_SIZE - TRAILER_SIZE)))
        try:
            meta = self.get_into(key, buf)
        except ValueError:   # replaced meanwhile by a larger chunk file (another writer): a miss
            self._tm.miss(self.name)
            return None
        return None if meta is None else (meta, buf[:meta.payload_len])

    def put(self, meta: ChunkMeta, payload: bytes | memoryview) -> bool:
        """Synchronous write + publish in the calling thread."""
        return self.write_file(meta, as_byte_view(payload))

    def write(self, items: Sequence[WriteItem], on_done: WriteDone | None = None) -> list[bool]:
        """Queue background writes (never blocks; a full queue drops the item, counted). An item
        with ``release`` is written from its own buffer, released once written; one without is
        copied into a staging buffer before this returns."""
        out = []
        for item in items:
            if item.release is not None:
                out.append(self._writers.submit(Job(item.meta, item.payload, item.release, on_done=on_done)))
            else:
                out.append(self._writers.submit_copy(item.meta, as_byte_view(item.payload), on_done))
        return out

    def flush(self, timeout: float | None = None) -> bool:
        return self._writers.flush(timeout)

    def start_threads(self) -> None:
        """Start the background writer threads now, with the calling thread's CPU affinity."""
        self._writers.start()

    start_writers = start_threads

    def write_file(self, meta: ChunkMeta, payload: memoryview) -> bool:
        """Write to a temp file, then publish under the ledger lock (evicting to make room)."""
        if len(payload) != meta.payload_len:
            raise ValueError(f"payload is {len(payload)} bytes, meta says {meta.payload_len}")
        size = file_size(meta.payload_len)
        final = self.path_of(meta.key)
        if os.path.exists(final):
            self._index.add(meta.key, size, meta.parent, True, meta.num_tokens)
            return True
        if size > self.capacity:
            self._tm.event("dropped_store", self.name, f"chunk of {size} B exceeds the disk budget")
            return False
        t0 = time.perf_counter()
        tmp = f"{self._tmp}/{meta.key.hex()}.{os.getpid()}.{threading.get_ident()}.{next(self._seq)}.tmp"
        header = encode_header(self._ns, meta)
        try:
            diskio.write_chunk_file(tmp, header, payload, o_direct=self.o_direct,
                                    fsync=self.fsync != "never")
        except OSError as e:
            diskio.unlink_quiet(tmp)
            kind = "enospc" if e.errno == 28 else "io_error"
            self._tm.event(kind, self.name, f"write {meta.key.hex()[:16]}: {e}")
            return False
        ok = self._publish(tmp, final, meta, size)
        if ok:
            self._tm.wrote(self.name, meta.payload_len, time.perf_counter() - t0)
        return ok

    def _publish(self, tmp: str, final: str, meta: ChunkMeta, size: int) -> bool:
        """Rename ``tmp`` to ``final`` under the ledger lock (evicting to make room); ``tmp`` removed if not renamed."""
        evicted: list[ChunkKey] = []
        ok = renamed = False
        used: int | None = None
        try:
            with self._shared():
                if os.path.exists(final):          # another writer published the same key first
                    ok = True
                else:
                    used = self._ledger()
                    while used + size > self.capacity:   # evict from the index only: never rescan here
                        guard = self.evict_guard
                        victim = self._index.pick_victim(     # never evict the new chunk's own parent
                            lambda k: k == meta.parent or (guard is not None and guard(k)))
                        if victim is None:   # the bytes belong to chunks we do not know (yet): drop
                            break
                        used -= self._unlink_locked(victim)
                        evicted.append(victim)
                    if used + size <= self.capacity:
                        self.layout.publish(tmp, final)
                        renamed = True
                        used += size
                        self._set_ledger(used)
                        ok = True
                        if self.fsync == "always":
                            diskio.fsync_dir(os.path.dirname(final))
                    else:
                        self._set_ledger(used)
                        self._tm.event("dropped_store", self.name, "disk budget full of unevictable chunks")
        except OSError as e:
            self._tm.event("enospc" if e.errno == 28 else "io_error", self.name, f"publish: {e}")
            ok = False
        finally:
            if not renamed:
                diskio.unlink_quiet(tmp)
        if ok:
            self._index.add(meta.key, size, meta.parent, True, meta.num_tokens)
        if evicted:
            self._tm.evicted(self.name, len(evicted))
        self._tm.usage(self.name, self._ledger() if used is None else used, self.capacity)
        self._report_evicted(evicted)
        return ok

    def _unlink_locked(self, key: ChunkKey) -> int:
        """Remove a published chunk (holding the shared lock). Returns the bytes freed."""
        path = self.path_of(key)
        self._index.drop(key)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0                      # another process removed it (and its ledger bytes)
        return size

    def _remove_file(self, key: ChunkKey) -> bool:
        with self._shared():
            freed = self._unlink_locked(key)
            if freed:
                self._set_ledger(self._ledger() - freed)
        return freed > 0

    def delete(self, key: ChunkKey) -> bool:
        cancelled = self._writers.cancel(key)
        return self._remove_file(key) or cancelled

    def usage(self) -> TierUsage:
        return TierUsage(self._ledger(), self.capacity, len(self._index))

    def rescan(self) -> None:
        """Re-read the directory (other processes' chunks) and reset the ledger."""
        with self._shared():
            gone = self._rescan_locked()
        self._report_forgotten(gone)

    def keys(self) -> list[ChunkKey]:
        return self._index.keys()

    def parent(self, key: ChunkKey) -> ChunkKey | None:
        return self._index.parent(key)

    def holds(self, key: ChunkKey) -> bool:
        return key in self._index or self._writers.pending(key)

    def has_children(self, key: ChunkKey) -> bool:
        return self._index.has_children(key) or bool(self._writers.pending_children(key))

    def children(self, key: ChunkKey) -> list[ChunkKey]:
        """Indexed and pending (queued) chunks whose parent is ``key``."""
        kids = self._index.children(key)
        return sorted(kids.union(self._writers.pending_children(key)))

    def orphans(self, present: Callable[[ChunkKey], bool]) -> list[ChunkKey]:
        return self._index.orphans(present)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._rescanner is not None:
            self._rescanner.join(10)
        self._writers.close()
        self.save_manifest()
        QUEUE_DEPTH.set(0)
        if self._ledger_file is not None:
            self._ledger_file.close()


__all__ = ["DiskTier"]
