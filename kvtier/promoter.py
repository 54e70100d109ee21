"""Background promotion: copy chunks read from disk into RAM off the latency-critical path.

A ``Promoter`` owns one daemon thread that runs ``promote(key, scratch)`` for each queued
key, at idle CPU priority (``SCHED_IDLE`` where the OS allows it, else nice 19), so it
only uses CPU time nothing else wants. While any ``paused()`` section is open (the
connector's synchronous load) it starts no new promotion, so it never competes with a
load for the disk either. The queue is bounded (``max_pending`` keys; extra keys are
dropped: promotion is an optimisation) and deduplicated. ``submit(keys, min_hits=n)``
queues a key only at its n-th submission (an admission filter: chunks read once are
never copied; the counts live in a bounded LRU of ``max_tracked`` keys). ``close()``
drops what is queued and joins the thread.

Contract for ``promote``: it must never raise for a cache fault (the store's tiers turn
faults into misses); anything it does raise is logged and the thread carries on.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from kvtier.keys import ChunkKey

log = logging.getLogger("kvtier.store")

PromoteFn = Callable[[ChunkKey, bytearray], bytearray]


def widen_thread_affinity() -> set[int] | None:
    """Let the calling thread run on every CPU this process may use (not only the cores an
    engine bound its compute threads to); returns the new mask, or None if unchanged."""
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))   # the kernel masks it with the cpuset
        after = os.sched_getaffinity(0)
        return after if after != before else None
    except (AttributeError, OSError):
        return None


def run_in_thread_on_any_cpu(fn: Callable[[], None]) -> None:
    """Run ``fn`` in a short-lived thread with ``widen_thread_affinity`` applied, so threads it
    creates inherit the wide mask; the caller's own affinity is never touched. Re-raises."""
    errors: list[BaseException] = []

    def body() -> None:
        widen_thread_affinity()
        try:
            fn()
        except BaseException as e:  # handed back to the caller
            errors.append(e)

    t = threading.Thread(target=body, name="kvtier-spawn", daemon=True)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def lower_thread_priority() -> str:
    """Make the calling thread run only when a CPU would otherwise idle; returns what was applied."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # Linux: 0 = the calling thread
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice 19"
    except (AttributeError, OSError):
        return "normal"


class Promoter:
    def __init__(self, promote: PromoteFn, max_pending: int = 4096, max_tracked: int = 65536) -> None:
        self._promote = promote
        self._max_pending = max_pending
        self._max_tracked = max_tracked
        self._hits: OrderedDict[ChunkKey, int] = OrderedDict()   # submissions so far, below min_hits
        self._queue: OrderedDict[ChunkKey, None] = OrderedDict()
        self._cond = threading.Condition()
        self._paused = 0
        self._active = False            # a promotion is running right now
        self._closed = False
        self._thread: threading.Thread | None = None
        self.promoted = 0               # promote() calls completed (for tests and stats)
        self.dropped = 0

    def submit(self, keys: Sequence[ChunkKey], min_hits: int = 1) -> int:
        """Queue each of ``keys`` at its ``min_hits``-th submission (deduplicated, bounded);
        returns how many were queued now."""
        n = 0
        with self._cond:
            if self._closed:
                return 0
            for k in keys:
                if k in self._queue:
                    continue
                if min_hits > 1:
                    seen = self._hits.pop(k, 0) + 1
                    if seen < min_hits:
                        self._hits[k] = seen
                        if len(self._hits) > self._max_tracked:
                            self._hits.popitem(last=False)
                        continue
                if len(self._queue) >= self._max_pending:
                    self.dropped += 1
                    continue
                self._queue[k] = None
                n += 1
            if n:
                self._start_locked()
                self._cond.notify_all()
        return n

    def start(self) -> None:
        """Start the thread now (it inherits the calling thread's CPU affinity); else at the first submit."""
        with self._cond:
            if not self._closed:
                self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-promote", daemon=True)
            self._thread.start()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No promotion starts while this is open (one already running is not waited for: it
        is one chunk, at idle priority)."""
        with self._cond:
            self._paused += 1
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (1 if self._active else 0)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the queue is empty and nothing runs (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or (not self._queue and not self._active), timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
            t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def _run(self) -> None:
        how = lower_thread_priority()
        log.debug("kvtier: promoter thread running at %s priority", how)
        scratch = bytearray()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (self._queue and not self._paused))
                if self._closed:
                    self._cond.notify_all()
                    return
                key, _ = self._queue.popitem(last=False)
                self._active = True
            try:
                scratch = self._promote(key, scratch)
            except Exception as e:  # never let the thread die; a failed promotion is only a lost optimisation
                log.warning("kvtier: background promotion of %s failed: %s", bytes(key).hex()[:16], e)
            finally:
                with self._cond:
                    self._active = False
                    self.promoted += 1
                    self._cond.notify_all()
