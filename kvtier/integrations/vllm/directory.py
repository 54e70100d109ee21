"""What the scheduler knows without I/O: where the worker's chunks are, and the shared tier's
answers per request.

``Directory``: key -> top local tier of the worker holding it, fed by the worker's reports
(stored / promoted / evicted keys, ``KvtierWorkerMetadata``), bounded LRU (``capacity``
chunks: the worker's RAM + SSD budgets in chunks). Used when the worker runs in another
process, whose tiers the scheduler cannot see.

``RemoteLookups``: one batched, deadline-bounded existence query to the shared tier per
request (``store.shared_prefix``), run on a small daemon pool, never on EngineCore's loop.
``answer(...)`` is None while the query is pending (the connector then tells vLLM "ask
again"), the number of further chunks the shared tier holds once it answered, and 0 once
``lookup_timeout_s`` passed without an answer (the request proceeds without the shared
tier's chunks; counted). Answers are cached per request until it finishes.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvtier.keys import ChunkKey
from kvtier.tiers.protocol import Deadline, PrefixResult, Status

log = logging.getLogger("kvtier.connector")


class Directory:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._where: OrderedDict[bytes, str] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def get(self, key: bytes) -> str | None:
        return self._where.get(key)

    def stored(self, keys: Sequence[bytes], tiers: Sequence[str]) -> None:
        if self.capacity <= 0:
            return
        tiers = list(tiers) + [""] * (len(keys) - len(tiers))
        for k, t in zip(keys, tiers):
            self._where[k] = t or "worker"
            self._where.move_to_end(k)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._where.pop(k, None)


@dataclass
class _Query:
    start: int                      # first chunk index asked about
    future: "Future[PrefixResult]"
    t0: float
    given_up: bool = False


class RemoteLookups:
    def __init__(self, query: Callable[[Sequence[ChunkKey], Deadline], PrefixResult], lookup_timeout_s: float,
                 threads: int = 2, on_timeout: Callable[[], None] | None = None) -> None:
        from kvtier.tiers.guard import DaemonPool

        self._query = query
        self.timeout = lookup_timeout_s
        self._pool = DaemonPool(threads, "kvtier-shared-lookup")
        self._threads = threads
        self._q: dict[str, _Query] = {}
        self._on_timeout = on_timeout
        self.timeouts = 0
        self.unavailable = 0

    def answer(self, req_id: str, keys: Sequence[ChunkKey], start: int) -> int | None:
        """Chunks ``keys[start:]`` the shared tier holds (leading run), None while pending."""
        q = self._q.get(req_id)
        if q is None or q.start != start:
            dl = Deadline.after(self.timeout)
            q = _Query(start, self._pool.submit(lambda: self._query(keys[start:], dl)), time.monotonic())
            self._q[req_id] = q
        if q.given_up:
            return 0
        if not q.future.done():
            if time.monotonic() - q.t0 < self.timeout:
                return None
            q.given_up = True
            self.timeouts += 1
            if self._on_timeout is not None:
                self._on_timeout()
            log.info("kvtier: shared-tier lookup for %s took longer than %.2f s; proceeding without it",
                     req_id, self.timeout)
            return 0
        try:
            res: Any = q.future.result()
        except Exception as e:   # shared_prefix never raises; a bug is a miss
            log.warning("kvtier: shared-tier lookup failed: %s", e)
            return 0
        if res.status is Status.UNAVAILABLE:
            self.unavailable += 1
        return res.num_chunks

    def wait_any(self, timeout: float) -> bool:
        """Block (GIL released) until a pending query has answered or ``timeout`` passed, never past
        a pending query's ``lookup_timeout_s``; False at once when none is pending. Side-effect free."""
        now = time.monotonic()
        pending = [q for q in self._q.values() if not q.given_up and not q.future.done()]
        if not pending:
            return False
        left = min(timeout, max(0.0, min(q.t0 + self.timeout for q in pending) - now))
        done, _ = wait([q.future for q in pending], timeout=left, return_when=FIRST_COMPLETED)
        return bool(done)

    def forget(self, req_id: str) -> None:
        self._q.pop(req_id, None)

    def close(self) -> None:
        self._pool.shutdown(self._threads)
