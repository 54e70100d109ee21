"""The shared-fs tier's background writers: a bounded queue, never blocking the caller.

``submit`` queues one chunk write (or reports a duplicate of a queued one, or a full queue:
the caller counts the drop); ``submit_touch`` queues an access-stamp refresh (dropped silently
when full: stamps are a hint). ``writer_threads`` daemon threads run the jobs through the
tier's ``write_one`` / ``touch`` callables, then call each write's ``release`` and ``on_done``.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from kvtier.chunk import ChunkMeta
from kvtier.tiers.protocol import WriteDone

WriteOne = Callable[[ChunkMeta, memoryview, int], bool]
Touch = Callable[[list[tuple[bytes, int]]], None]


class WriteQueue:
    def __init__(self, threads: int, depth: int, write_one: WriteOne, touch: Touch) -> None:
        self._n = threads
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._write_one = write_one
        self._touch = touch
        self._pending: set[bytes] = set()
        self._idle = threading.Condition()
        self._inflight = 0
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self._n):
            t = threading.Thread(target=self._loop, name=f"kvtier-sharedfs-writer-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def submit(self, meta: ChunkMeta, payload: memoryview, release: Callable[[], None] | None,
               on_done: WriteDone | None, stamp: int) -> str:
        """"queued", "duplicate" (the same key is queued: nothing taken) or "full" (nothing taken)."""
        with self._idle:
            if meta.key in self._pending:
                return "duplicate"
            try:
                self._q.put_nowait(("write", meta, payload, release, on_done, stamp))
            except queue.Full:
                return "full"
            self._pending.add(meta.key)
            self._inflight += 1
        return "queued"

    def submit_touch(self, stamps: list[tuple[bytes, int]]) -> None:
        try:
            self._q.put_nowait(("touch", stamps))
        except queue.Full:
            pass

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if job[0] == "touch":
                try:
                    self._touch(job[1])
                except Exception:
                    pass
                continue
            _, meta, payload, release, on_done, stamp = job
            ok = False
            try:
                ok = self._write_one(meta, payload, stamp)
            except Exception:      # never let a writer die: a failed write is a dropped store
                ok = False
            finally:
                if release is not None:
                    release()
                with self._idle:
                    self._pending.discard(meta.key)
                    self._inflight -= 1
                    self._idle.notify_all()
                if on_done is not None:
                    on_done(meta.key, ok)

    def flush(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        """Ask the threads to stop after the queued jobs; never waits (one may be stuck in a mount)."""
        for _ in self._threads:
            try:
                self._q.put_nowait(None)
            except queue.Full:
                break


__all__ = ["WriteQueue"]
