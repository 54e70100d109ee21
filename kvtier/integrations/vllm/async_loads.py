"""Asynchronous loads (vLLM's ``load_kv_async``): a request whose claim includes chunks of a
shared (network) tier waits for its KV while every other request keeps running.

``AsyncLoader.submit(plan)`` queues the plan for one background thread, which reads its
chunks in order (each read bounded by the plan's deadline, ``connector.load_timeout_s``
from submission) into its own buffer and copies them into the request's blocks. The first
chunk that cannot be read (miss, unavailable backend, deadline passed) ends the plan: it
and every later chunk become load errors (vLLM recomputes them). ``take_done()`` hands
back finished plans: the worker reports their request ids in ``get_finished``
(``finished_recving``) and their failed block ids in ``get_block_ids_with_load_errors``
in the **same** step, as vLLM requires.

A stalled backend therefore delays only the requests waiting on it, and at most until
their deadline: the thread waits in ``GuardedTier`` (bounded by the deadline), never in
the engine's loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kvtier.integrations.vllm.metadata import LoadOutcome, LoadPlan

log = logging.getLogger("kvtier.connector")

#: read(key, deadline_monotonic) -> (ok, error): fill the loader's buffer with the chunk
ReadFn = Callable[[bytes, float], tuple[bool, str | None]]
#: scatter(block_ids, first_block): copy the loader's buffer into those blocks
ScatterFn = Callable[[tuple[int, ...], int], None]


@dataclass
class DoneLoad:
    req_id: str
    outcome: LoadOutcome
    error_blocks: set[int] = field(default_factory=set)
    missing: list[bytes] = field(default_factory=list)
    loaded: list[bytes] = field(default_factory=list)
    seconds: float = 0.0


class AsyncLoader:
    def __init__(self, read: ReadFn, scatter: ScatterFn, *, block_size: int, load_timeout_s: float) -> None:
        self._read = read
        self._scatter = scatter
        self._block_size = block_size
        self._timeout = load_timeout_s
        self._q: queue.SimpleQueue[tuple[LoadPlan, float] | None] = queue.SimpleQueue()
        self._done: list[DoneLoad] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._inflight: set[str] = set()
        self._closed = False

    def submit(self, plan: LoadPlan) -> None:
        """Queue ``plan``; its deadline starts now."""
        with self._lock:
            if self._closed:
                raise RuntimeError("async loader is closed")
            self._inflight.add(plan.req_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-async-load", daemon=True)
                self._thread.start()
        self._q.put((plan, time.monotonic() + self._timeout))

    def inflight(self) -> set[str]:
        with self._lock:
            return set(self._inflight)

    def take_done(self) -> list[DoneLoad]:
        with self._lock:
            done, self._done = self._done, []
            for d in done:
                self._inflight.discard(d.req_id)
            return done

    def wait_idle(self, timeout: float) -> bool:
        """(tests, shutdown) Until every submitted plan is done; False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if len(self._inflight) == len(self._done):
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._q.put(None)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            plan, deadline = job
            t0 = time.perf_counter()
            try:
                done = self._load(plan, deadline)
            except Exception as e:   # never let the thread die: the whole plan is a load error
                log.exception("kvtier: async load of %s failed", plan.req_id)
                done = DoneLoad(plan.req_id, LoadOutcome(0, 0, f"exception: {e}"))
                for ch in plan.chunks:
                    done.error_blocks.update(ch.block_ids)
                    done.outcome.failed_tokens += len(ch.block_ids) * self._block_size
            done.seconds = time.perf_counter() - t0
            with self._lock:
                self._done.append(done)

    def _load(self, plan: LoadPlan, deadline: float) -> DoneLoad:
        done = DoneLoad(plan.req_id, LoadOutcome())
        failed_at: int | None = None
        for i, ch in enumerate(plan.chunks):
            if time.monotonic() >= deadline:
                ok, err = False, "timeout"
            else:
                ok, err = self._read(ch.key, deadline)
            if not ok:
                failed_at, done.outcome.error = i, err or "unknown"
                done.missing.append(ch.key)
                log.warning("kvtier: async load of chunk %d for %s failed (%s); vLLM will recompute",
                            i, plan.req_id, err)
                break
            self._scatter(ch.block_ids, ch.first_block)
            done.outcome.loaded_tokens += len(ch.block_ids) * self._block_size
            done.loaded.append(ch.key)
        if failed_at is not None:
            for ch in plan.chunks[failed_at:]:
                done.error_blocks.update(ch.block_ids)
                done.outcome.failed_tokens += len(ch.block_ids) * self._block_size
        return done
