"""Synchronous loads (from ``start_load_kv``, before the forward pass): the chunks of this
step's local-tier plans, read ahead of the block copies.

``SyncLoader.run(plans, deadline, disabled)`` reads every planned chunk on ``depth``
(``PREFETCH_DEPTH``) threads into a ring of ``depth + 1`` chunk buffers (file read + checksum
verify overlap the copies) and copies whole blocks from each verified buffer straight into
vLLM's blocks, in request order, before it returns. A chunk that cannot be read (miss, bad
payload, deadline passed) makes that chunk and every later chunk of its plan a load error;
a read past the deadline also fails every later plan of the step (they would miss it too),
and the ring and the pool are dropped (a late read may still write into them). Side-effect
free towards the worker: what happened comes back in a ``SyncLoadResult``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvtier.integrations.vllm.load_times import LoadTimes
from kvtier.integrations.vllm.metadata import LoadOutcome, LoadPlan

log = logging.getLogger("kvtier.connector")

PREFETCH_DEPTH = 2   # chunk reads in flight ahead of the block copies (sync and async loads)

#: read(key, buffer) -> (ok, error): fill ``buffer`` with the verified chunk from the local tiers
ReadFn = Callable[[bytes, Any], tuple[bool, "str | None"]]
#: scatter(block_ids, first_block, buffer): copy the chunk in ``buffer`` into those blocks
ScatterFn = Callable[[tuple[int, ...], int, Any], None]


@dataclass
class SyncLoadResult:
    """Per plan (in order): ``outcomes``, bytes copied, seconds; and for the step: the keys copied
    into blocks, requests and block ids that failed, first missing keys, error kinds to count."""

    outcomes: list[LoadOutcome]
    nbytes: list[int]
    seconds: list[float]
    times: LoadTimes
    loaded: list[bytes] = field(default_factory=list)
    failed_reqs: set[str] = field(default_factory=set)
    error_blocks: set[int] = field(default_factory=set)
    missing: list[bytes] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class SyncLoader:
    def __init__(self, read: ReadFn, scatter: ScatterFn, new_buffer: Callable[[], Any], *, chunk_nbytes: int,
                 blocks_per_chunk: int, block_size: int, depth: int = PREFETCH_DEPTH) -> None:
        self._read = read
        self._scatter = scatter
        self._new_buffer = new_buffer
        self.chunk_nbytes = chunk_nbytes
        self.blocks_per_chunk = blocks_per_chunk
        self.block_size = block_size
        self.depth = depth
        self.buffers: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None

    def _timed_read(self, key: bytes, buf: Any) -> tuple[bool, str | None, float]:
        t0 = time.perf_counter()
        ok, err = self._read(key, buf)
        return ok, err, time.perf_counter() - t0

    def _ring(self) -> list[Any]:
        while len(self.buffers) < self.depth + 1:
            self.buffers.append(self._new_buffer())
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="kvtier-load")
        return self.buffers

    def run(self, plans: Sequence[LoadPlan], deadline: float, disabled: bool = False) -> SyncLoadResult:
        """Load ``plans`` into their blocks by ``deadline`` (monotonic); ``disabled``: fail them all."""
        jobs = [(p, i, ch) for p, plan in enumerate(plans) for i, ch in enumerate(plan.chunks)]
        failed_at: dict[int, tuple[int, str]] = {}      # plan index -> (first failed chunk, error)
        bufs = [] if disabled else self._ring()
        nbuf = len(bufs)
        futures: dict[int, Any] = {}
        res = SyncLoadResult([LoadOutcome() for _ in plans], [0] * len(plans), [0.0] * len(plans), LoadTimes())
        times = res.times

        def submit(j: int) -> None:
            if j < len(jobs) and not disabled and jobs[j][0] not in failed_at:
                assert self._pool is not None
                futures[j] = self._pool.submit(self._timed_read, jobs[j][2].key, bufs[j % nbuf])

        for j in range(min(self.depth, len(jobs))):
            submit(j)
        t_plan = time.perf_counter()
        abandoned = False
        for j, (p, i, ch) in enumerate(jobs):
            submit(j + self.depth)   # its buffer was last used by job j-1, already copied
            if p in failed_at:
                continue
            if disabled:
                ok, err = False, "disabled"
            else:
                tw = time.perf_counter()
                try:
                    ok, err, read_s = futures.pop(j).result(timeout=max(0.0, deadline - time.monotonic()))
                    times.read += read_s
                except FutureTimeout:
                    ok, err, abandoned = False, "timeout", True
                times.wait += time.perf_counter() - tw
            if ok:
                tc = time.perf_counter()
                self._scatter(ch.block_ids, ch.first_block, bufs[j % nbuf])
                times.copy += time.perf_counter() - tc
                n = len(ch.block_ids) * self.chunk_nbytes // self.blocks_per_chunk
                res.nbytes[p] += n
                times.nbytes += n
                times.chunks += 1
                res.outcomes[p].loaded_tokens += len(ch.block_ids) * self.block_size
                res.loaded.append(ch.key)
                continue
            failed_at[p] = (i, err or "unknown")
            res.missing.append(ch.key)
            res.errors.append(err or "unknown")
            log.warning("kvtier: load of chunk %d for %s failed (%s); vLLM will recompute",
                        i, plans[p].req_id, err)
            if abandoned:   # the rest of this step's loads would miss the deadline too
                for q in range(p + 1, len(plans)):   # later plans have not started
                    failed_at.setdefault(q, (0, "timeout"))
        if abandoned:       # reads still in flight may write into these buffers later: drop them
            self.buffers, self._pool = [], None
        else:
            for f in futures.values():
                f.result()
        for p, plan in enumerate(plans):
            outcome = res.outcomes[p]
            if p in failed_at:
                first, outcome.error = failed_at[p]
                res.failed_reqs.add(plan.req_id)
                for ch in plan.chunks[first:]:
                    res.error_blocks.update(ch.block_ids)
                    outcome.failed_tokens += len(ch.block_ids) * self.block_size
            res.seconds[p] = time.perf_counter() - t_plan
        return res
