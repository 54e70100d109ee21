"""Queue-time prefetch (worker half): ``PrefetchReader`` copies the chunks of waiting requests into the
worker's RAM tier on one background thread, while the engine steps.

Contract:
- ``step(meta)`` (each step, when vLLM binds the step's metadata): takes the step's
  ``prefetch_cancels`` and ``prefetches`` (``prefetch.py``); never blocks on I/O.
- Plans run one at a time in the order given; a plan's chunks in order (a chunk's parent is copied
  before it: promotion never makes an orphan). A chunk already in the top local tier is skipped
  (``resident``); another is read top-down with the store's own promotion (``read_into(promote=True)``:
  verified, then copied into the local tiers above the one that held it), under a deadline of
  ``timeout_s`` per chunk. The first chunk that cannot be read (miss, tier unavailable, deadline,
  size) ends its plan: counted ``failed`` with the rest, logged at DEBUG; it is a miss later, never an
  error of the request (the scheduler claims from the index at admission, as without a prefetch).
- A cancelled plan stops before its next chunk (``cancelled``: the chunks left); a cancelled plan not
  yet started is dropped. ``take_done`` returns each finished plan's ``PrefetchOutcome`` once.
- The thread is started at the first plan (none in the constructor), with the process's whole CPU
  set (``run_in_thread_on_any_cpu``): it must not wait for the engine's compute cores. ``close``
  stops it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol, Sequence

from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, PrefetchOutcome, PrefetchPlan
from kvtier.promoter import run_in_thread_on_any_cpu
from kvtier.tiers.protocol import Deadline, Status

log = logging.getLogger("kvtier.connector")


class PrefetchStore(Protocol):
    """What the prefetch needs of the store (``kvtier.store.TieredStore`` provides it)."""

    def read_into(self, keys: Sequence[Any], outs: Sequence[memoryview], deadline: Deadline | None = None, *,
                  promote: bool | None = None, local_only: bool = False, lent: bool = False) -> list[Any]: ...
    def where(self, key: Any) -> str | None: ...


class PrefetchReader:
    def __init__(self, store: PrefetchStore, *, chunk_nbytes: Callable[[], int], top_tier: str = "memory",
                 timeout_s: float = 30.0) -> None:
        self.store = store
        self._chunk_nbytes = chunk_nbytes      # the payload size, known once the KV caches are registered
        self.top_tier = top_tier
        self.timeout_s = timeout_s
        self._lock = threading.Condition()
        self._plans: deque[PrefetchPlan] = deque()
        self._cancelled: set[str] = set()
        self._done: dict[str, PrefetchOutcome] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self._buf: bytearray | None = None

    # -- the engine's side -----------------------------------------------------------------------
    def step(self, meta: KvtierConnectorMetadata) -> None:
        if not meta.prefetches and not meta.prefetch_cancels:
            return
        with self._lock:
            if self._closed:
                return
            for req_id in meta.prefetch_cancels:
                queued = [p for p in self._plans if p.req_id == req_id]
                for p in queued:
                    self._plans.remove(p)
                    self._done[req_id] = PrefetchOutcome(cancelled=len(p.keys))
                if not queued:
                    self._cancelled.add(req_id)   # running now (or already done: then harmless)
            for plan in meta.prefetches:
                self._cancelled.discard(plan.req_id)
                self._plans.append(plan)
            self._lock.notify_all()
        if meta.prefetches and self._thread is None:
            self._start()

    def take_done(self) -> dict[str, PrefetchOutcome]:
        with self._lock:
            done, self._done = self._done, {}
        return done

    def pending(self) -> int:
        with self._lock:
            return len(self._plans)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._plans.clear()
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- the thread --------------------------------------------------------------------------------
    def _start(self) -> None:
        t = threading.Thread(target=self._run, name="kvtier-prefetch", daemon=True)
        self._thread = t
        run_in_thread_on_any_cpu(t.start)     # the thread inherits the wide CPU mask

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._plans and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                plan = self._plans.popleft()
            try:
                outcome = self.run_plan(plan)
            except Exception as e:   # a bug is a miss later, never a dead engine
                log.warning("kvtier: prefetch of %s failed: %s", plan.req_id, e)
                outcome = PrefetchOutcome(failed=len(plan.keys), error="exception")
            with self._lock:
                self._cancelled.discard(plan.req_id)
                self._done[plan.req_id] = outcome

    def _cancelled_now(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._cancelled or self._closed

    def run_plan(self, plan: PrefetchPlan) -> PrefetchOutcome:
        """Copy ``plan``'s chunks up, in order (see the module's contract); on the calling thread."""
        out = PrefetchOutcome()
        t0 = time.perf_counter()
        for i, key in enumerate(plan.keys):
            if self._cancelled_now(plan.req_id):
                out.cancelled = len(plan.keys) - i
                break
            if self.store.where(key) == self.top_tier:
                out.resident += 1
                continue
            err = self._read(key)
            if err is not None:
                out.failed, out.error = len(plan.keys) - i, err
                log.debug("kvtier: prefetch of %s stopped at chunk %d of %d: %s", plan.req_id, i, len(plan.keys),
                          err)
                break
            out.fetched += 1
        out.seconds = time.perf_counter() - t0
        return out

    def _read(self, key: bytes) -> str | None:
        n = self._chunk_nbytes()
        if n <= 0:
            return "disabled"
        if self._buf is None or len(self._buf) < n:
            self._buf = bytearray(n)
        try:
            res = self.store.read_into([key], [memoryview(self._buf)[:n]], Deadline.after(self.timeout_s),
                                       promote=True)[0]
        except Exception as e:   # a broken tier is a miss
            log.debug("kvtier: prefetch read failed: %s", e)
            return "store_exception"
        if res.status is not Status.HIT or res.meta is None:
            return "unavailable" if res.status is Status.UNAVAILABLE else "miss"
        if res.meta.payload_len != n:
            return "size"
        return None
