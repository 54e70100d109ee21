"""``JobBoard``: the tier's asynchronous jobs, each reported once, and the keys they hold in flight.

The scheduler thread submits a job (its id, its keys and the work to run) and returns at once; the
work runs on an executor thread and yields a ``JobOutcome``. ``finished()`` (scheduler thread) hands
out each finished job exactly once and only then releases its keys, so a lookup of a key of a job
not yet reported answers RETRY. Work that raises is a failed job, never an exception upwards.
``drain()`` waits until every submitted job's work has returned (no job touches the primary memory
after it). Ownership: ``_inflight`` and ``_keys`` belong to the scheduler thread; the finished queue
is the only thing both sides touch (``queue.SimpleQueue``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Callable, Collection, Iterable

log = logging.getLogger("kvtier.vllm_tiering")


@dataclass(frozen=True)
class JobOutcome:
    """What one job's work did: ``successful_keys`` is None when every key shares ``success``."""

    success: bool
    successful_keys: tuple[bytes, ...] | None = None
    transfer_bytes: int = 0
    transfer_time: float = 0.0


@dataclass(frozen=True)
class FinishedJob:
    job_id: int
    outcome: JobOutcome


class JobBoard:
    def __init__(self, executor_factory: Callable[[], Executor]) -> None:
        self._executor_factory = executor_factory
        self._executor: Executor | None = None
        self._done: queue.SimpleQueue[FinishedJob] = queue.SimpleQueue()
        self._inflight: dict[bytes, int] = {}           # key -> jobs holding it
        self._keys: dict[int, tuple[bytes, ...]] = {}   # job id -> its keys (until reported)
        self._futures: set[Future] = set()
        self._lock = threading.Lock()                   # guards _futures only

    def use_executor(self, executor: Executor) -> None:
        """Run jobs on ``executor`` from now on (before the first submit; tests, benchmarks)."""
        if self._executor is not None:
            raise RuntimeError("the job executor is already running")
        self._executor = executor

    def submit(self, job_id: int, keys: Collection[bytes], work: Callable[[], JobOutcome]) -> None:
        """Run ``work`` in the background as job ``job_id``; ``keys`` are in flight until it is reported."""
        if job_id in self._keys:
            raise ValueError(f"job {job_id} was submitted twice")
        held = tuple(keys)
        self._keys[job_id] = held
        for k in held:
            self._inflight[k] = self._inflight.get(k, 0) + 1
        if self._executor is None:
            self._executor = self._executor_factory()
        try:
            fut = self._executor.submit(self._run, job_id, work)
        except RuntimeError as e:                        # executor shut down: a failed job
            log.warning("kvtier tier: job %d not started: %s", job_id, e)
            self._done.put(FinishedJob(job_id, JobOutcome(False)))
            return
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._forget)

    def _run(self, job_id: int, work: Callable[[], JobOutcome]) -> None:
        t0 = time.monotonic()
        try:
            outcome = work()
        except Exception as e:                           # a bug or a backend fault: a failed job
            log.warning("kvtier tier: job %d failed: %s: %s", job_id, type(e).__name__, e)
            outcome = JobOutcome(False, transfer_time=time.monotonic() - t0)
        self._done.put(FinishedJob(job_id, outcome))

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    def in_flight(self, key: bytes) -> bool:
        """Whether a job not yet reported holds ``key`` (scheduler thread)."""
        return key in self._inflight

    def pending(self) -> int:
        """Jobs submitted and not yet reported."""
        return len(self._keys)

    def finished(self) -> Iterable[FinishedJob]:
        """Every job finished since the last call, each once; their keys leave flight."""
        out: list[FinishedJob] = []
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return out
            for k in self._keys.pop(job.job_id, ()):
                n = self._inflight.get(k, 0) - 1
                if n > 0:
                    self._inflight[k] = n
                else:
                    self._inflight.pop(k, None)
            out.append(job)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until the work of every submitted job has returned; False if ``timeout`` passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                futs = list(self._futures)
            if not futs:
                return True
            for f in futs:
                left = None if end is None else max(0.0, end - time.monotonic())
                try:
                    f.exception(timeout=left)
                except TimeoutError:
                    return False

    def shutdown(self) -> None:
        """Wait for running jobs, then stop the executor (queued jobs still run and report)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
