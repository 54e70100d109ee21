"""Asynchronous loads (vLLM's ``load_kv_async``): a request whose claim includes chunks of a
shared (network) tier waits for its KV while every other request keeps running.

``AsyncLoader.submit(plan)`` queues the plan for one background loader thread. Its chunks
are read ``depth`` at a time on a pool of reader threads (as the synchronous load's
``PREFETCH_DEPTH``), each into one of ``depth + 1`` ring buffers and each read bounded by the
plan's deadline (``connector.load_timeout_s`` from submission, passed to the store, whose
``GuardedTier`` never waits past it); the loader thread copies verified chunks into the
request's blocks **in request order**, then hands each to ``promote`` (copy into the local
tiers; in order, so a chunk's parent is always local before the chunk). The first chunk that
cannot be read (miss, unavailable backend, deadline passed) ends the plan: it and every later
chunk become load errors (vLLM recomputes them); reads of later chunks not yet started are
cancelled, and if one is still running the ring and the pool are abandoned (a late read never
lands in a buffer the next plan uses; the abandoned threads end with their reads, which the
deadline bounds). The reads *lend* their ring buffers to the store (``read_into(lent=True)``:
the shared tier reads straight into them, no bounce copy), so a failed read's buffer may still
be written by a backend thread after the read returned: after any failed plan the ring is
dropped and the next plan gets fresh buffers. ``take_done()`` hands back finished plans: the
worker reports their request ids in ``get_finished`` (``finished_recving``) and their failed block ids in
``get_block_ids_with_load_errors`` in the **same** step, as vLLM requires.

Ordering on a device (``kvtier.transfer.streams``, the ``ordering`` given: the worker's background
lane): ``submit`` (the engine's thread) marks the compute stream's state, and the plan's first block
copy waits for that mark (the blocks were allocated, and may be zeroed, on the compute stream); the
plan's copies end with an event on the transfer stream, and ``take_done`` hands a plan back only once
that event has completed, so vLLM never schedules the request while its blocks are still being written.
The reader threads claim a ring buffer (wait for its last copy) before reading into it.

``wait_done(timeout)`` blocks (GIL released) until a plan has finished or ``timeout`` passed:
the worker calls it in a step that scheduled no tokens (see ``WorkerSide.get_finished``), so an
engine with nothing to run but requests waiting for their KV no longer spins its Python loop
against the loader's threads.

A stalled backend therefore delays only the requests waiting on it, and at most until their
deadline: the threads wait in ``GuardedTier`` (bounded by the deadline), never in the
engine's loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtier.integrations.vllm.metadata import LoadOutcome, LoadPlan
from kvtier.tiers.guard import DaemonPool
from kvtier.transfer.streams import NoOrdering, Ordering

log = logging.getLogger("kvtier.connector")

#: read(key, buffer, deadline_monotonic) -> (ok, error, meta): fill ``buffer`` with the verified chunk
ReadFn = Callable[[bytes, Any, float], tuple[bool, "str | None", Any]]
#: scatter(block_ids, first_block, buffer): copy the chunk in ``buffer`` into those blocks
ScatterFn = Callable[[tuple[int, ...], int, Any], None]
#: promote(meta, buffer): copy a chunk read from a lower tier into the local tiers (best effort)
PromoteFn = Callable[[Any, Any], None]
#: a fresh chunk buffer
BufferFn = Callable[[], Any]

GRACE_S = 1.0     # beyond the deadline, how long the loader waits for a read before abandoning it


@dataclass
class DoneLoad:
    req_id: str
    outcome: LoadOutcome
    error_blocks: set[int] = field(default_factory=set)
    missing: list[bytes] = field(default_factory=list)
    loaded: list[bytes] = field(default_factory=list)
    seconds: float = 0.0
    event: Any = None          # after the plan's block copies (None: nothing in flight)

    def landed(self) -> bool:
        """Every block copy of the plan has completed."""
        return self.event is None or self.event.query()


class AsyncLoader:
    def __init__(self, read: ReadFn, scatter: ScatterFn, new_buffer: BufferFn, *, block_size: int,
                 load_timeout_s: float, depth: int = 2, promote: PromoteFn | None = None,
                 ordering: Ordering | None = None) -> None:
        self._read = read
        self._ordering = ordering if ordering is not None else NoOrdering()
        self._scatter = scatter
        self._promote = promote
        self._new_buffer = new_buffer
        self._block_size = block_size
        self._timeout = load_timeout_s
        self.depth = max(1, depth)
        self._q: queue.SimpleQueue[tuple[LoadPlan, float, Any] | None] = queue.SimpleQueue()
        self._done: list[DoneLoad] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._inflight: set[str] = set()
        self._closed = False
        self.buffers: list[Any] = []          # the ring (loader thread only)
        self._pool: DaemonPool | None = None
        self.abandoned = 0                    # rings/pools given up on a read still running
        self.rings_dropped = 0                # rings given up after a failed read (lent buffers)

    def submit(self, plan: LoadPlan) -> None:
        """(engine thread) Queue ``plan``; its deadline starts now, its copies wait for the compute stream's
        work queued so far."""
        mark = self._ordering.compute_mark()
        with self._lock:
            if self._closed:
                raise RuntimeError("async loader is closed")
            self._inflight.add(plan.req_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-async-load", daemon=True)
                self._thread.start()
        self._q.put((plan, time.monotonic() + self._timeout, mark))

    def inflight(self) -> set[str]:
        with self._lock:
            return set(self._inflight)

    def take_done(self) -> list[DoneLoad]:
        """Finished plans whose block copies have landed (the others stay until theirs have)."""
        with self._lock:
            done, waiting = [], []
            for d in self._done:
                (done if d.landed() else waiting).append(d)
            self._done = waiting
            for d in done:
                self._inflight.discard(d.req_id)
            return done

    def wait_done(self, timeout: float) -> bool:
        """Block until a finished plan is ready for ``take_done`` (True) or ``timeout`` passed, or
        nothing is in flight (False); side-effect free."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._done) or len(self._inflight) == 0, timeout) \
                and bool(self._done)

    def wait_idle(self, timeout: float) -> bool:
        """(tests, shutdown) Until every submitted plan is done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._inflight) == len(self._done), timeout)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._q.put(None)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                if self._pool is not None:
                    self._pool.shutdown(self.depth)
                return
            plan, deadline, mark = job
            t0 = time.perf_counter()
            try:
                done = self._load(plan, deadline, mark)
            except Exception as e:   # never let the thread die: the whole plan is a load error
                log.exception("kvtier: async load of %s failed", plan.req_id)
                self._abandon()
                done = DoneLoad(plan.req_id, LoadOutcome(0, 0, f"exception: {e}"))
                for ch in plan.chunks:
                    done.error_blocks.update(ch.block_ids)
                    done.outcome.failed_tokens += len(ch.block_ids) * self._block_size
                if plan.whole:
                    done.outcome.failed_tokens = plan.end_token - plan.start_token
                try:    # copies it issued before failing must land before vLLM recomputes into the blocks
                    done.event = self._ordering.record()
                except Exception:
                    log.exception("kvtier: recording the end of a failed async load failed")
            done.seconds = time.perf_counter() - t0
            with self._cond:
                self._done.append(done)
                self._cond.notify_all()

    def _ring(self) -> tuple[list[Any], DaemonPool]:
        while len(self.buffers) < self.depth + 1:
            self.buffers.append(self._new_buffer())
        if self._pool is None:
            self._pool = DaemonPool(self.depth, "kvtier-async-read")
        return self.buffers, self._pool

    def _abandon(self) -> None:
        """A read may still write into the ring: never reuse it (nor the pool's busy threads)."""
        self.abandoned += 1
        self.buffers = []
        if self._pool is not None:
            self._pool.shutdown(self.depth)     # its threads exit once their reads return
            self._pool = None

    def _load(self, plan: LoadPlan, deadline: float, mark: Any) -> DoneLoad:
        done = DoneLoad(plan.req_id, LoadOutcome())
        chunks = plan.chunks
        bufs, pool = self._ring()
        nbuf = len(bufs)
        futures: dict[int, Future] = {}

        def submit(j: int) -> None:
            if j < len(chunks):
                key, buf = chunks[j].key, bufs[j % nbuf]
                futures[j] = pool.submit(lambda: self._read(key, buf, deadline))

        for j in range(min(self.depth, len(chunks))):
            submit(j)
        failed_at: int | None = None
        for i, ch in enumerate(chunks):
            submit(i + self.depth)     # its buffer was last used by chunk i-1, already copied
            fut = futures.pop(i)
            try:
                ok, err, meta = fut.result(timeout=max(0.0, deadline - time.monotonic()) + GRACE_S)
            except FutureTimeout:
                futures[i] = fut
                ok, err, meta = False, "timeout", None
            if not ok:
                failed_at, done.outcome.error = i, err or "unknown"
                done.missing.append(ch.key)
                log.warning("kvtier: async load of chunk %d for %s failed (%s); vLLM will recompute",
                            i, plan.req_id, err)
                break
            if i == 0:
                self._ordering.follow(mark)     # after the compute stream's allocation (and zeroing)
            self._scatter(ch.block_ids, ch.first_block, bufs[i % nbuf])
            done.outcome.loaded_tokens += len(ch.block_ids) * self._block_size
            done.loaded.append(ch.key)
            if self._promote is not None and meta is not None:
                try:
                    self._promote(meta, bufs[i % nbuf])
                except Exception as e:   # promotion is an optimisation: never fail a load for it
                    log.warning("kvtier: promoting a shared-tier chunk failed: %s", e)
        if done.loaded:
            done.event = self._ordering.record()
        running = [f for f in futures.values() if not f.cancel()]   # not started yet: skipped
        if any(not f.done() for f in running):
            self._abandon()
        elif failed_at is not None:     # the reads lend the ring (``lent``): a failed one may still
            self.buffers = []           # be written by a backend thread after it returned
            self.rings_dropped += 1
        if failed_at is not None:
            for ch in chunks[failed_at:]:
                done.error_blocks.update(ch.block_ids)
                done.outcome.failed_tokens += len(ch.block_ids) * self._block_size
        if plan.whole:      # parts of several groups: the claim's tokens count once, loaded or failed whole
            tokens = plan.end_token - plan.start_token
            done.outcome.loaded_tokens, done.outcome.failed_tokens = (0, tokens) if failed_at is not None \
                else (tokens, 0)
        return done
