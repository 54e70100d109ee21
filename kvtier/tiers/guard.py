"""GuardedTier: a shared backend behind bounded threads, deadlines and a circuit breaker.

``GuardedTier.wrap(inner, cfg, telemetry)`` (the registry does it for every tier whose
``capabilities.shared`` is True) returns a ``Tier`` with the inner tier's name and
capabilities whose calls can never hang or flood the caller:

* **Bounded threads.** Every call to the inner tier runs on a pool of ``cfg.max_inflight``
  threads, and at most ``max_inflight`` calls are in flight at once (no unbounded queue).
  A stalled backend (a SIGSTOPped server, a FUSE read blocked in the kernel) holds at most
  that many threads, never the caller's.
* **Deadlines.** A caller waits at most its ``Deadline`` (capped at ``cfg.lookup_timeout_s``
  for ``longest_prefix`` and ``cfg.io_timeout_s`` for reads) for a free slot and for the
  answer; then it gets ``UNAVAILABLE("timeout")`` while the call finishes (or not) on its
  pool thread.
* **Circuit breaker** (``breaker.py``). A timeout, an exception or an ``UNAVAILABLE`` answer
  opens it: no new I/O goes to the backend, calls answer ``UNAVAILABLE("down")`` at once, and
  a background probe asks the backend every ``cfg.probe_interval_s`` (only when a pool slot
  is free); the first answer closes it. Events once per burst.
* **Writes** are asynchronous: ``write`` queues the items (at most ``4 * max_inflight``;
  beyond that, or while the breaker is open, items are dropped and counted
  ``dropped_store`` once per burst) and returns at once; items without ``release`` are copied
  first, so the caller may reuse its buffer. ``on_done`` / ``release`` follow from a pool thread.

The per-key legacy methods (``contains``, ``get_into``, ``get``, ``put``) go through the same
guarded batched path; ``keys``/``children``/``holds``/``has_children`` are the inner tier's
local view (they must not do I/O).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence, TypeVar

from kvtier.chunk import ChunkMeta
from kvtier.config import SharedTierBase
from kvtier.keys import ChunkKey
from kvtier.metrics import Telemetry
from kvtier.tiers.base import Tier, WrappingTier, as_byte_view, copy_bytes
from kvtier.tiers.breaker import Breaker
from kvtier.tiers.protocol import Deadline, PrefixResult, ReadResult, Status, WriteDone, WriteItem

T = TypeVar("T")
PROBE_KEY = ChunkKey(b"\0" * 32)
MAX_BACKLOG_ENTRIES = 4096     # queued writes, whatever their bytes (``write_backlog`` bounds the bytes)


class DaemonPool:
    """``n`` daemon threads running submitted callables (a thread stuck in a stalled backend must
    never block interpreter exit, which ``ThreadPoolExecutor``'s threads would)."""

    def __init__(self, n: int, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        for i in range(n):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        if self._closed:
            raise RuntimeError("pool is shut down")
        fut: Future = Future()
        self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def shutdown(self, n: int) -> None:
        self._closed = True
        for _ in range(n):
            self._q.put(None)


def _nbytes(item: WriteItem) -> int:
    p = item.payload
    return p.nbytes if isinstance(p, memoryview) else len(p)


class _Unavailable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class GuardedTier(WrappingTier):
    def __init__(self, inner: Tier, cfg: SharedTierBase, telemetry: Telemetry) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.cfg = cfg
        self._tm = telemetry
        self.breaker = Breaker(inner.name, telemetry)
        self._slots = threading.BoundedSemaphore(cfg.max_inflight)
        self._pool: DaemonPool | None = None
        self._lock = threading.Lock()
        self._writes: collections.deque[tuple[WriteItem, WriteDone | None]] = collections.deque()
        self._writes_inflight = 0
        self._backlog_bytes = 0                          # payload bytes in ``_writes``
        self._batch_started: dict[int, float] = {}     # id(batch) -> monotonic start (stall watchdog)
        self._idle = threading.Condition(self._lock)
        self._dropping = False
        self._probe: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False

    @property
    def capabilities(self):  # type: ignore[override]
        """The inner tier's (a backend may refine them once connected, e.g. its size limit)."""
        return self.inner.capabilities

    @classmethod
    def wrap(cls, inner: Tier, cfg: SharedTierBase, telemetry: Telemetry) -> Tier:
        """``inner`` behind the guard (its hooks are forwarded: evictions it reports reach the store)."""
        self = cls(inner, cfg, telemetry)
        self._pool = DaemonPool(cfg.max_inflight, f"kvtier-{inner.name}")
        inner.on_evict = lambda keys: self._report_evicted(keys)
        inner.on_forget = lambda keys: self._report_forgotten(keys)
        return self

    # -- the guarded call ------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T], deadline: Deadline, what: str) -> T:
        """Run ``fn`` on a pool thread; raise _Unavailable("down"/"busy"/"timeout"/"error")."""
        if self.breaker.is_open or self._closed:
            self.breaker.refuse()
            raise _Unavailable("down")
        wait = deadline.remaining()
        if not self._slots.acquire(timeout=None if wait == float("inf") else wait):
            self._fail("busy", f"{what}: all {self.cfg.max_inflight} slots held by calls still in flight")
            raise _Unavailable("busy")
        try:
            fut = self._submit(fn)
        except RuntimeError:           # pool shut down (closing)
            self._slots.release()
            raise _Unavailable("down") from None
        try:
            left = deadline.remaining()
            return fut.result(timeout=None if left == float("inf") else left)
        except FutureTimeout:
            self._fail("timeout", f"{what} took longer than its deadline")
            raise _Unavailable("timeout") from None
        except _Unavailable:
            raise
        except Exception as e:       # the backend raised: it is down for us
            self._fail("error", f"{what}: {type(e).__name__}: {e}")
            raise _Unavailable("error") from None

    def _submit(self, fn: Callable[[], T], after: Callable[[], None] | None = None) -> "Future[T]":
        """Run ``fn`` on the pool (the caller holds a slot; it is released when ``fn`` returns)."""
        assert self._pool is not None

        def run() -> T:
            try:
                return fn()
            finally:
                self._slots.release()
                if after is not None:
                    after()
        return self._pool.submit(run)

    def _fail(self, reason: str, detail: str) -> None:
        if self.breaker.trip(f"{reason}: {detail}"):
            self._start_probe()

    def _answered(self, status: Status) -> None:
        if status is Status.UNAVAILABLE:
            self._fail("unavailable", "the backend answered 'unavailable'")

    # -- probe -----------------------------------------------------------------------------------
    def _start_probe(self) -> None:
        with self._lock:
            if self._closed or (self._probe is not None and self._probe.is_alive()):
                return
            self._probe = threading.Thread(target=self._probe_loop, name=f"kvtier-{self.name}-probe", daemon=True)
            self._probe.start()

    def _probe_loop(self) -> None:
        while self.breaker.is_open and not self._stop.wait(self.cfg.probe_interval_s):
            if not self._slots.acquire(blocking=False):
                continue                # every slot is held by a stalled call: still down
            try:
                fut = self._submit(lambda: self.inner.longest_prefix([PROBE_KEY], Deadline.after(self.cfg.io_timeout_s)))
            except RuntimeError:
                self._slots.release()
                return
            try:
                res = fut.result(timeout=self.cfg.io_timeout_s)
            except Exception:            # timeout or error: still down
                continue
            if res.status is not Status.UNAVAILABLE:
                self.breaker.reset()
                with self._lock:
                    self._dropping = False
                self._pump()

    # -- batched protocol --------------------------------------------------------------------------
    def longest_prefix(self, keys: Sequence[ChunkKey], deadline: Deadline) -> PrefixResult:
        if not keys:
            return PrefixResult(0, Status.HIT)
        dl = deadline.cap(self.cfg.lookup_timeout_s)
        try:
            res = self._call(lambda: self.inner.longest_prefix(keys, dl), dl, "existence check")
        except _Unavailable:
            return PrefixResult(0, Status.UNAVAILABLE)
        self._answered(res.status)
        return res

    def read_into(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview], deadline: Deadline, *,
                  lent: bool = False) -> list[ReadResult]:
        """Not ``lent``: the pool thread reads into private buffers and the caller's are filled
        only if the call returns in time (a late answer never lands in a buffer the caller reused).
        ``lent``: the caller's buffers go to the inner tier as they are (also ``lent``): no private
        buffers, no copies."""
        if not keys:
            return []
        dl = deadline.cap(self.cfg.io_timeout_s)
        views = [as_byte_view(o, writable=True) for o in outs]
        bufs = views if lent else [memoryview(bytearray(len(v))) for v in views]
        try:
            res = self._call(lambda: self.inner.read_into(keys, bufs, dl, lent=lent), dl, "read")
        except _Unavailable as e:
            return [ReadResult.unavailable(e.reason) for _ in keys]
        if not lent:
            for r, v, b in zip(res, views, bufs):
                if r.ok and r.meta is not None:
                    copy_bytes(v[:r.meta.payload_len], b[:r.meta.payload_len])
        if all(r.status is Status.UNAVAILABLE for r in res):
            self._answered(Status.UNAVAILABLE)
        return res

    def write(self, items: Sequence[WriteItem], on_done: WriteDone | None = None) -> list[bool]:
        with self._lock:
            oldest = min(self._batch_started.values(), default=None)
        if oldest is not None and time.monotonic() - oldest > self.cfg.io_timeout_s:
            self._fail("timeout", f"a write has been in flight for more than {self.cfg.io_timeout_s} s")
        out: list[bool] = []
        for item in items:
            with self._lock:
                size = _nbytes(item)
                room = not self._writes or (self._backlog_bytes + size <= self.cfg.write_backlog
                                            and len(self._writes) < MAX_BACKLOG_ENTRIES)
                ok = not self.breaker.is_open and not self._closed and room
                if ok:
                    self._dropping = False
                    if item.release is None:        # copy now: the caller may reuse its buffer
                        item = WriteItem(item.meta, memoryview(bytes(item.payload)))
                    self._writes.append((item, on_done))
                    self._backlog_bytes += size
                    self._writes_inflight += 1
                    first_drop = False
                else:
                    first_drop, self._dropping = not self._dropping, True
            if not ok:
                if item.release is not None:
                    item.release()
                if first_drop:
                    self._tm.event("dropped_store", self.name,
                                   "backend unavailable" if self.breaker.is_open else "write backlog full")
                else:
                    self._tm._add(f"dropped.{self.name}")
            out.append(ok)
        self._pump()
        return out

    def _pump(self) -> None:
        """Start queued writes while pool slots are free (one batch per slot)."""
        while True:
            with self._lock:
                if not self._writes or self._closed:
                    return
                if not self._slots.acquire(blocking=False):
                    return
                batch = [self._writes.popleft() for _ in range(min(len(self._writes), 16))]
                self._backlog_bytes -= sum(_nbytes(it) for it, _ in batch)
            try:
                self._submit(lambda b=batch: self._write_batch(b), after=self._pump)
            except RuntimeError:
                self._slots.release()
                self._finish(batch, False)
                return

    def _write_batch(self, batch: list[tuple[WriteItem, WriteDone | None]]) -> None:
        with self._lock:
            self._batch_started[id(batch)] = time.monotonic()
        try:
            if self.breaker.is_open:
                raise _Unavailable("down")
            by_key = {it.meta.key: d for it, d in batch}
            accepted = self.inner.write([it for it, _ in batch],
                                        lambda k, ok: (by_key.get(k) or (lambda *_: None))(k, ok))
            for (it, d), ok in zip(batch, accepted):
                if not ok and d is not None:
                    d(it.meta.key, False)
        except Exception as e:
            if not isinstance(e, _Unavailable):
                self._fail("error", f"write: {type(e).__name__}: {e}")
            for it, d in batch:
                if it.release is not None:
                    try:
                        it.release()
                    except Exception:
                        pass
                if d is not None:
                    d(it.meta.key, False)
        finally:
            with self._lock:
                self._batch_started.pop(id(batch), None)
                self._writes_inflight -= len(batch)
                self._idle.notify_all()

    def _finish(self, batch, ok: bool) -> None:
        for it, d in batch:
            if it.release is not None:
                it.release()
            if d is not None:
                d(it.meta.key, ok)
        with self._lock:
            self._writes_inflight -= len(batch)
            self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writes handed to the guard are written: first the guard's own queue, then the
        backend's (a shared filesystem accepts a write into its own writer queue and returns)."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if not self._idle.wait_for(lambda: self._writes_inflight == 0, timeout):
                return False
        if self.breaker.is_open or self._closed:
            return self.inner.flush(0)      # never wait on a backend that is down: say whether it is idle
        return self.inner.flush(None if end is None else max(0.0, end - time.monotonic()))

    def delete_many(self, keys) -> int:
        keys = list(keys)
        try:
            return self._call(lambda: self.inner.delete_many(keys), Deadline.after(self.cfg.io_timeout_s), "delete")
        except _Unavailable:
            return 0

    # -- per-key legacy methods over the guarded path -------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return self.longest_prefix([key], Deadline.never()).num_chunks == 1

    def get_into(self, key: ChunkKey, out: memoryview) -> ChunkMeta | None:
        return self.read_into([key], [out], Deadline.never())[0].meta

    def get(self, key: ChunkKey) -> tuple[ChunkMeta, memoryview] | None:
        try:
            return self._call(lambda: self.inner.get(key), Deadline.after(self.cfg.io_timeout_s), "read")
        except _Unavailable:
            return None

    def put(self, meta: ChunkMeta, payload: bytes | memoryview) -> bool:
        return self.write([WriteItem(meta, as_byte_view(payload))])[0]

    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key]) > 0

    def payload_size(self, key: ChunkKey) -> int | None:
        return self.inner.payload_size(key)

    def close(self) -> None:
        """Stop the probe, drop queued writes, close the inner tier (threads stuck in a stalled
        backend are abandoned: they are daemon threads and hold nothing of the caller's)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._writes)
            self._writes.clear()
            self._backlog_bytes = 0
        self._stop.set()
        self._finish(pending, False)
        if self._pool is not None:
            self._pool.shutdown(self.cfg.max_inflight)
        self.inner.close()
