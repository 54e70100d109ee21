"""Layer-pipelined synchronous loads (``connector.load_mode = "layerwise"``).

``start_load_kv`` hands the step's local-tier plans to ``LayerLoader.start``, which returns at once;
the forward pass then runs, and vLLM calls ``wait_for_layer_load(layer)`` before each attention
layer, which waits only until that layer's blocks are in place (``wait_layer``). vLLM 0.32 makes
that call from ``maybe_transfer_kv_layer`` around ``unified_attention_with_output`` (the CPU
backend's opaque attention op included), for every attention layer of a step with connector metadata.

How the per-layer order works with whole chunks: a chunk is stored and verified whole (every layer
in one payload, checksum over all of it, ``kvtier/chunk.py``), so no byte of a chunk is used before
its verified read ends. A background thread reads every planned chunk once, through the store
(``depth`` reads in flight, each into a chunk buffer of its own), copies layer 0 of each chunk into
vLLM's blocks as soon as that chunk is verified, and once every read has ended copies layer 1, 2,
... of all chunks, in layer order, marking each layer done. Layer 0 is thus ready when the reads
are (they overlap each other and the copies of layer 0); the copies of layers 1..L-1 overlap the
forward pass of the layers before them. Memory: one chunk buffer per chunk of the step (all of them
are held until the last layer is copied; kept for the next step), where the whole-request path needs
``depth + 1``.

Errors (never wrong KV served, never a hung engine):
- A chunk that cannot be read (miss, bad payload, size) makes that chunk and every later chunk of
  its plan a load error, as the whole-request path does: their blocks are never written, and are
  reported through ``get_block_ids_with_load_errors`` so vLLM recomputes them (its scheduler drops
  the step's output of an affected request).
- ``wait_layer`` waits at most until the load's deadline. Past it the run is abandoned: under the
  copy lock, so no block is written after it, every plan of the step becomes a load error from its
  first chunk (no chunk has all its layers), later waits return at once, and the buffers and the
  read pool are dropped (a late read may still write into them).
- ``finish`` (after the forward pass: ``wait_for_save`` or ``get_block_ids_with_load_errors``,
  whichever vLLM calls first) waits for the rest, bounded by the same deadline. A layer the loader
  copied that vLLM never waited for (an attention backend that does not call the connector per
  layer) may have been read before its copy: every plan of that step is then reported as failed
  (recomputed) and ``unwaited`` is set, so the caller can fall back to the whole-request path.

Ordering on a device (``kvtier.transfer.streams``): ``start`` (the engine's thread) makes the lane's
transfer stream wait for the compute stream (the blocks were allocated and zeroed there); the copies of
each layer end with an event recorded on the transfer stream, and ``wait_layer`` makes the compute
stream wait on that event once the host saw the layer's copies queued, so attention never reads a
block before its copy landed. On the CPU these are no-ops (``Ordering`` below is what the tests record).

What happened comes back as the whole-request path's ``SyncLoadResult`` (``sync_loads.py``), so
the worker accounts for both the same way. Side-effect free towards the worker.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

from kvtier.integrations.vllm.load_times import LoadTimes
from kvtier.integrations.vllm.metadata import LoadOutcome, LoadPlan
from kvtier.integrations.vllm.sync_loads import PREFETCH_DEPTH, ReadFn, SyncLoadResult
from kvtier.transfer.streams import NoOrdering, Ordering

if TYPE_CHECKING:
    from kvtier.transfer.blocks import BlockCopier

log = logging.getLogger("kvtier.connector")

#: scatter_layer(layer, block_ids, first_block, buffer): copy layer ``layer`` of the chunk in
#: ``buffer`` (its blocks ``first_block:``) into those blocks of that layer
LayerScatterFn = Callable[[int, tuple[int, ...], int, Any], None]


@dataclass
class _Job:
    plan: int
    index: int            # chunk index within its plan
    key: bytes
    block_ids: tuple[int, ...]
    first_block: int
    buffer: Any = None
    ok: bool = False


@dataclass
class _Run:
    plans: Sequence[LoadPlan]
    deadline: float
    jobs: list[_Job]
    done: list[threading.Event]
    result: SyncLoadResult
    events: list[Any] = field(default_factory=list)   # per layer: the transfer stream's event after its copies
    failed_at: dict[int, tuple[int, str]] = field(default_factory=dict)
    waited: set[int] = field(default_factory=set)
    abandoned: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    t0: float = field(default_factory=time.perf_counter)
    t_done: float = 0.0               # the last layer copied (perf_counter)


class LayerLoader:
    """One step's synchronous loads, layer by layer (module doc). Not thread-safe towards its
    caller: ``start``, ``wait_layer`` and ``finish`` come from the thread running the forward pass."""

    def __init__(self, read: ReadFn, scatter_layer: LayerScatterFn, new_buffer: Callable[[], Any], *,
                 num_layers: int, chunk_nbytes: int, blocks_per_chunk: int, block_size: int,
                 depth: int = PREFETCH_DEPTH, ordering: Ordering | None = None) -> None:
        self._read = read
        self._scatter_layer = scatter_layer
        self._ordering = ordering if ordering is not None else NoOrdering()
        self._new_buffer = new_buffer
        self.num_layers = num_layers
        self.chunk_nbytes = chunk_nbytes
        self.blocks_per_chunk = blocks_per_chunk
        self.block_size = block_size
        self.depth = depth
        self.buffers: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()       # held around every block copy; abandonment takes it
        self._run: _Run | None = None
        self.unwaited = False               # a finished run had layers vLLM never waited for

    @property
    def active(self) -> bool:
        return self._run is not None

    # -- caller side ---------------------------------------------------------------------------
    def start(self, plans: Sequence[LoadPlan], deadline: float, disabled: bool = False) -> None:
        """Begin loading ``plans`` (monotonic ``deadline``); returns at once. ``disabled``: fail them all."""
        assert self._run is None, "finish the previous run first"
        jobs = [_Job(p, i, ch.key, tuple(ch.block_ids), ch.first_block)
                for p, plan in enumerate(plans) for i, ch in enumerate(plan.chunks)]
        res = SyncLoadResult([LoadOutcome() for _ in plans], [0] * len(plans), [0.0] * len(plans), LoadTimes())
        run = _Run(plans, deadline, jobs, [threading.Event() for _ in range(self.num_layers)], res,
                   [None] * self.num_layers)
        self._run = run
        if disabled or not jobs:
            for p, plan in enumerate(plans):
                if plan.chunks:
                    self._fail(run, p, 0, "disabled")
            self._set_all(run)
            run.finished.set()
            return
        while len(self.buffers) < len(jobs):
            self.buffers.append(self._new_buffer())
        for job, buf in zip(jobs, self.buffers):
            job.buffer = buf
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="kvtier-load")
        self._ordering.follow_compute()      # the blocks were allocated (and zeroed) on the compute stream
        threading.Thread(target=self._work, args=(run, self._pool), name="kvtier-layers", daemon=True).start()

    def wait_layer(self, layer: int) -> None:
        """Return once ``layer``'s blocks are in place, or the run was abandoned at its deadline."""
        run = self._run
        if run is None or not 0 <= layer < self.num_layers:
            return
        run.waited.add(layer)
        ev = run.done[layer]
        if not ev.is_set():
            tw = time.perf_counter()
            if not ev.wait(max(0.0, run.deadline - time.monotonic())):
                self._abandon(run, layer)
            run.result.times.wait += time.perf_counter() - tw
        self._ordering.fence(run.events[layer])   # attention on this layer runs after its copies land

    def finish(self) -> SyncLoadResult | None:
        """End the current run (waits for its copies up to its deadline); its result, None if none ran."""
        run = self._run
        if run is None:
            return None
        if not run.finished.wait(max(0.0, run.deadline - time.monotonic())):
            self._abandon(run, None)
        self._run = None
        res = run.result
        copied = any(j.ok and j.index < run.failed_at.get(j.plan, (1 << 30,))[0] for j in run.jobs)
        unwaited = copied and not run.abandoned and len(run.waited) < self.num_layers
        if unwaited:
            self.unwaited = True
            log.error("kvtier: vLLM waited for %d of %d layers in a step with layer-pipelined loads: the step's "
                      "loaded requests are recomputed", len(run.waited), self.num_layers)
            for p, plan in enumerate(run.plans):
                if plan.chunks:
                    self._fail(run, p, 0, "unwaited")
        for p, plan in enumerate(run.plans):
            outcome = res.outcomes[p]
            if p in run.failed_at:
                first, outcome.error = run.failed_at[p]
                res.failed_reqs.add(plan.req_id)
                outcome.failed_tokens = 0
                for ch in plan.chunks[first:]:
                    res.error_blocks.update(ch.block_ids)
                    outcome.failed_tokens += len(ch.block_ids) * self.block_size
            ok_jobs = [j for j in run.jobs if j.plan == p and j.index < run.failed_at.get(p, (1 << 30,))[0]]
            outcome.loaded_tokens = sum(len(j.block_ids) for j in ok_jobs) * self.block_size
            res.nbytes[p] = sum(len(j.block_ids) for j in ok_jobs) * self.chunk_nbytes // self.blocks_per_chunk
            res.seconds[p] = (run.t_done or time.perf_counter()) - run.t0
        ok_all = [j for j in run.jobs if j.index < run.failed_at.get(j.plan, (1 << 30,))[0]]
        res.loaded = [j.key for j in ok_all]
        res.times.chunks = len(ok_all)
        res.times.nbytes = sum(res.nbytes)
        if run.abandoned:       # reads still in flight may write into these buffers later: drop them
            self.buffers, self._pool = [], None
        return res

    # -- internals -----------------------------------------------------------------------------
    def _set_all(self, run: _Run) -> None:
        for ev in run.done:
            ev.set()

    def _fail(self, run: _Run, plan: int, index: int, err: str) -> None:
        """Plan ``plan`` fails from chunk ``index`` on (keeps an earlier failure)."""
        prev = run.failed_at.get(plan)
        if prev is not None and prev[0] <= index:
            return
        run.failed_at[plan] = (index, err)
        if prev is None:
            run.result.errors.append(err)
            chunks = run.plans[plan].chunks
            if index < len(chunks):
                run.result.missing.append(chunks[index].key)
            log.warning("kvtier: load of chunk %d for %s failed (%s); vLLM will recompute",
                        index, run.plans[plan].req_id, err)

    def _abandon(self, run: _Run, layer: int | None) -> None:
        """The deadline passed: nothing is written after this; every plan fails from its first chunk."""
        with self._lock:
            if run.abandoned or run.finished.is_set() and all(ev.is_set() for ev in run.done):
                return
            run.abandoned = True
            log.warning("kvtier: layer-pipelined load missed its deadline (waiting for %s)",
                        "the end" if layer is None else f"layer {layer}")
            for p, plan in enumerate(run.plans):
                if plan.chunks:
                    self._fail(run, p, 0, "timeout")
            self._set_all(run)

    def _timed_read(self, key: bytes, buf: Any) -> tuple[bool, str | None, float]:
        t0 = time.perf_counter()
        try:
            ok, err = self._read(key, buf)
        except Exception as e:  # a broken read is a miss
            log.warning("kvtier: read failed: %s", e)
            ok, err = False, "store_exception"
        return ok, err, time.perf_counter() - t0

    def _copy(self, run: _Run, layer: int, jobs: Sequence[_Job]) -> bool:
        """Copy ``layer`` of ``jobs`` (those still valid) into vLLM's blocks; False once abandoned."""
        with self._lock:
            if run.abandoned:
                return False
            tc = time.perf_counter()
            for j in jobs:
                if j.ok and j.index < run.failed_at.get(j.plan, (1 << 30,))[0]:
                    self._scatter_layer(layer, j.block_ids, j.first_block, j.buffer)
            run.result.times.copy += time.perf_counter() - tc
        return True

    def _work(self, run: _Run, pool: ThreadPoolExecutor) -> None:
        """(background thread) Reads in order, ``depth`` in flight; layer 0 per chunk as it lands,
        then the other layers in order."""
        try:
            self._work_inner(run, pool)
        except Exception as e:  # a broken copy fails the step's loads, never the engine
            log.error("kvtier: layer-pipelined load failed: %s", e)
            with self._lock:
                if not run.abandoned:
                    for p, plan in enumerate(run.plans):
                        if plan.chunks:
                            self._fail(run, p, 0, "copy")
            self._set_all(run)
        finally:
            run.finished.set()

    def _work_inner(self, run: _Run, pool: ThreadPoolExecutor) -> None:
        jobs = run.jobs
        futures: dict[int, Future] = {}

        def submit(j: int) -> None:
            if j < len(jobs) and jobs[j].plan not in run.failed_at:
                futures[j] = pool.submit(self._timed_read, jobs[j].key, jobs[j].buffer)

        for j in range(min(self.depth, len(jobs))):
            submit(j)
        for j, job in enumerate(jobs):
            submit(j + self.depth)
            fut = futures.pop(j, None)
            if fut is None:            # its plan failed before it was submitted
                continue
            while True:                # bounded: the caller abandons the run at its deadline
                if run.abandoned:
                    return
                try:
                    ok, err, read_s = fut.result(timeout=0.05)
                    break
                except TimeoutError:
                    continue
            run.result.times.read += read_s
            if job.plan in run.failed_at:
                continue
            if not ok:
                with self._lock:
                    if not run.abandoned:
                        self._fail(run, job.plan, job.index, err or "unknown")
                continue
            job.ok = True
            if not self._copy(run, 0, [job]):
                return
        run.events[0] = self._ordering.record()
        run.done[0].set()
        for layer in range(1, self.num_layers):
            if not self._copy(run, layer, jobs):
                return
            run.events[layer] = self._ordering.record()
            run.done[layer].set()
        run.t_done = time.perf_counter()


class LayerwiseLoads:
    """The worker's layer-pipelined loads: a ``LayerLoader`` over its registered layers, the store's
    ``busy`` section (background promotion waits) held from ``start`` to ``finish``, vLLM's layer
    names -> layer index. ``usable`` turns False once vLLM was seen not to wait per layer."""

    def __init__(self, loader: LayerLoader, layer_names: Sequence[str],
                 busy: Callable[[], ContextManager[None]]) -> None:
        self.loader = loader
        self._index = {name: i for i, name in enumerate(layer_names)}
        self._busy = busy
        self._section: ExitStack | None = None
        self._plans: list[LoadPlan] = []
        self._t0 = 0.0

    @classmethod
    def build(cls, read: ReadFn, copier: "BlockCopier", layer_names: Sequence[str],
              busy: Callable[[], ContextManager[None]], *, chunk_nbytes: int,
              blocks_per_chunk: int, block_size: int) -> "LayerwiseLoads":
        def scatter_layer(layer: int, block_ids: tuple[int, ...], first_block: int, buf: Any) -> None:
            copier.scatter(block_ids, first_block, buf, layers=range(layer, layer + 1))

        loader = LayerLoader(read, scatter_layer, copier.new_buffer, num_layers=copier.views.num_layers,
                             chunk_nbytes=chunk_nbytes, blocks_per_chunk=blocks_per_chunk, block_size=block_size,
                             ordering=copier)
        return cls(loader, layer_names, busy)

    @property
    def usable(self) -> bool:
        return not self.loader.unwaited

    def start(self, plans: Sequence[LoadPlan], deadline: float, disabled: bool = False) -> None:
        self._section = ExitStack()
        self._section.enter_context(self._busy())
        self._plans, self._t0 = list(plans), time.perf_counter()
        self.loader.start(plans, deadline, disabled)

    def wait(self, layer_name: str) -> None:
        i = self._index.get(layer_name)
        if i is not None:
            self.loader.wait_layer(i)

    def finish(self) -> tuple[list[LoadPlan], SyncLoadResult, float] | None:
        """(plans, result, start time) of the run that ends now; None when none was running."""
        res = self.loader.finish()
        if self._section is not None:
            self._section.close()
            self._section = None
        if res is None:
            return None
        return self._plans, res, self._t0
