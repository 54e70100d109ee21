"""Background writer pool of the disk tier: bounded queue, drop-when-full, readable pending jobs.

``submit`` never blocks: when the queue is full the job is dropped, its source
buffer released and a ``dropped_store`` event counted. A queued chunk is *pending*:
``contains`` reports it and ``get`` copies it straight from the source buffer
(reference counted, so the buffer is released only after the write and every
reader finished). ``cancel`` (delete) makes the writer skip a job.
"""

from __future__ import annotations

import mmap
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol

from kvtier.chunk import ChunkMeta
from kvtier.keys import ChunkKey
from kvtier.metrics import QUEUE_DEPTH, Telemetry, log
from kvtier.tiers.protocol import WriteDone


class WriteTarget(Protocol):
    """What the pool writes into (the disk tier): ``write_file`` publishes one chunk file and
    says whether it did, ``delete`` removes a chunk, ``parent_ok`` (set by the store, or None)
    says whether a parent chunk is still in some tier, ``_report_evicted`` tells the tier's
    eviction listeners that chunks left it."""

    parent_ok: Callable[[ChunkKey], bool] | None

    def write_file(self, meta: ChunkMeta, payload: memoryview) -> bool: ...

    def delete(self, key: ChunkKey) -> bool: ...

    def _report_evicted(self, keys: list[ChunkKey]) -> None: ...


@dataclass(eq=False)
class Job:
    meta: ChunkMeta
    view: memoryview
    release: Callable[[], None]
    refs: int = 1
    cancelled: bool = False
    on_done: WriteDone | None = None      # (key, published) once the write finished or failed
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self) -> bool:
        with self.lock:
            if self.refs == 0:
                return False
            self.refs += 1
            return True

    def drop(self) -> None:
        with self.lock:
            self.refs -= 1
            last = self.refs == 0
        if last:
            self.release()


class WriterPool:
    def __init__(self, tier: WriteTarget, threads: int, depth: int, telemetry: Telemetry) -> None:
        self._tier = tier
        self._nthreads = threads
        self._depth = depth
        self._tm = telemetry
        self._q: queue.Queue[Job | None] = queue.Queue(maxsize=depth)
        self._pending: dict[ChunkKey, Job] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._staging_free: list[mmap.mmap] = []
        self._staging_count = 0

    def start(self) -> None:
        """Start the writer threads now (idempotent; otherwise the first submit starts them).
        Threads inherit the calling thread's CPU affinity."""
        if not self._threads:
            for i in range(self._nthreads):
                t = threading.Thread(target=self._run, name=f"kvtier-disk-writer-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def pending(self, key: ChunkKey) -> bool:
        return key in self._pending

    def pending_children(self, key: ChunkKey) -> list[ChunkKey]:
        with self._lock:
            return [k for k, j in self._pending.items() if j.meta.parent == key and not j.cancelled]

    def pending_size(self, key: ChunkKey) -> int | None:
        job = self._pending.get(key)
        return None if job is None else job.meta.payload_len

    def read_pending(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        with self._lock:
            job = self._pending.get(key)
            if job is None or job.cancelled or not job.acquire():
                return None
        try:
            n = job.meta.payload_len
            if len(out) < n:
                raise ValueError(f"output buffer has {len(out)} bytes, chunk needs {n}")
            out[:n] = job.view
            return job.meta
        finally:
            job.drop()

    def submit(self, job: Job) -> bool:
        with self._lock:
            if self._closed:
                outcome = "closed"
            elif job.meta.key in self._pending:
                outcome = "duplicate"
            else:
                self.start()
                try:
                    self._q.put_nowait(job)
                except queue.Full:
                    outcome = "full"
                else:
                    outcome = "queued"
                    self._pending[job.meta.key] = job
                    self._inflight += 1
        if outcome != "queued":
            job.drop()     # outside the lock: release() may take it (staging buffers)
        if outcome == "full":
            self._tm.event("dropped_store", "disk", "write queue full")
        elif outcome == "duplicate":
            _done(job, True)
        QUEUE_DEPTH.set(self._q.qsize())
        return outcome in ("queued", "duplicate")

    def submit_copy(self, meta: ChunkMeta, payload: memoryview, on_done: WriteDone | None = None) -> bool:
        buf = None
        with self._lock:
            for i, b in enumerate(self._staging_free):
                if len(b) >= meta.payload_len:
                    buf = self._staging_free.pop(i)
                    break
            if buf is None and self._staging_count < self._depth:
                self._staging_count += 1
                grow = True
            else:
                grow = False
        if buf is None and not grow:
            self._tm.event("dropped_store", "disk", "no free staging buffer (write queue full)")
            return False
        if buf is None:
            buf = mmap.mmap(-1, max(meta.payload_len, 1))
        view = memoryview(buf)[:meta.payload_len]
        view[:] = payload

        def release(b: mmap.mmap = buf, v: memoryview = view) -> None:
            v.release()
            with self._lock:
                self._staging_free.append(b)
        return self.submit(Job(meta, view, release, on_done=on_done))

    def cancel(self, key: ChunkKey) -> bool:
        with self._lock:
            job = self._pending.pop(key, None)
            if job is not None:
                job.cancelled = True
        return job is not None

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            published = False
            try:
                published = self._write(job)
            except Exception as e:  # never let a writer thread die: a failed write is a dropped store
                log.exception("kvtier disk writer failed")
                self._tm.event("io_error", "disk", f"writer: {e}")
            finally:
                with self._lock:
                    if self._pending.get(job.meta.key) is job:
                        del self._pending[job.meta.key]
                job.drop()
                try:
                    _done(job, published)
                    if not published:   # the chunk left this tier: its children may now be orphans
                        self._tier._report_evicted([job.meta.key])
                finally:
                    with self._lock:
                        self._inflight -= 1
                        self._idle.notify_all()
                QUEUE_DEPTH.set(self._q.qsize())

    def _write(self, job: Job) -> bool:
        if job.cancelled:
            return False
        parent, parent_ok = job.meta.parent, self._tier.parent_ok
        if parent is not None and parent_ok is not None and not parent_ok(parent):
            self._tm.event("orphan_put", "disk", "parent left every tier before the write")
            return False
        if not self._tier.write_file(job.meta, job.view):
            return False
        if parent is not None and parent_ok is not None and not parent_ok(parent):
            self._tier.delete(job.meta.key)     # the parent left while we wrote: no orphan
            self._tm.event("orphan_evicted", "disk", "parent left every tier during the write")
            return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()


def _done(job: Job, ok: bool) -> None:
    if job.on_done is not None:
        try:
            job.on_done(job.meta.key, ok)
        except Exception as e:   # a callback must not kill a writer thread
            log.warning("kvtier: write completion callback failed: %s", e)


__all__ = ["Job", "WriteTarget", "WriterPool"]
