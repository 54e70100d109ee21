"""``KvtierConnector``: vLLM's ``KVConnectorBase_V1`` as a thin facade over two halves.

Enable with::

    --kv-transfer-config '{"kv_connector":"KvtierConnector",
      "kv_connector_module_path":"kvtier.integrations.vllm.connector","kv_role":"kv_both",
      "kv_connector_extra_config":{"kvtier_config":{...KvtierConfig as a dict...}}}'

or ``"kvtier_config_file": "/path/kvtier.yaml"`` in the extra config; ``KVTIER_*``
environment variables apply too (``kvtier.config.load_config``: file <- env <- dict).

vLLM builds one instance per role: SCHEDULER (in the EngineCore process) delegates to
``SchedulerSide``, WORKER (in each worker process) to ``WorkerSide``. Each process opens
the store through ``kvtier.store.shared_store`` (one instance per process and namespace).
Loads from the local tiers are synchronous, before the forward pass; a claim that includes
shared-tier chunks is loaded asynchronously (``load_kv_async``; ``get_finished`` reports
it); saves copy out of the paged buffers in ``wait_for_save`` and are written to the tiers
in the background by the store. ``get_num_new_matched_tokens`` may return ``(None, False)``
("ask again") while the shared tier's existence answer is pending (bounded by
``store.shared.lookup_timeout_s``).

Layouts and devices: the connector asks vLLM for the ``LBHNC`` KV cache layout
(``get_required_kvcache_layout``, as vLLM's OffloadingConnector does) and serves every block-compact
layout vLLM resolves; the worker derives the layout from the views it registers, and every copy is
ordered against vLLM's compute stream (``kvtier.transfer``). An engine kvtier cannot serve fails at
start unless ``connector.on_unsupported`` is ``serve-without-cache``. With layer-pipelined loads
(``connector.load_mode: layerwise``) the connector needs piecewise CUDA graphs
(``requires_piecewise_for_cudagraph``): a full graph would skip ``wait_for_layer_load``.

Hybrid models: the connector implements ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on;
each KV-cache group is one part of every chunk (``cache_groups.py``: sliding-window groups load only
the blocks vLLM keeps, loads of several groups are asynchronous and fail per request through
``get_transfer_results``). Groups kvtier cannot serve (Mamba / linear-attention state, ...) are refused
at start like an unserved layout.

KV events: with vLLM's ``--kv-events-config`` enabled, ``take_events`` (scheduler) returns
``BlockStored`` / ``BlockRemoved`` for kvtier's tiers (medium ``CPU`` / ``DISK`` / ``SHARED``)
with vLLM's block hashes, published by vLLM with its own events (``kv_events.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.compute import dtype_itemsize, kv_bytes
from kvtier.integrations.vllm.cache_groups import CacheGroups, UnsupportedGroups, cache_groups, cpu_mla_refusal
from kvtier.integrations.vllm.extra_config import config_from_extra
from kvtier.integrations.vllm.kv_events import DEFAULT_MAP_CAPACITY, KvEvents
from kvtier.integrations.vllm.kv_heads import HeadShardingError, KvHeads, engine_kv_heads
from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, KvtierWorkerMetadata
from kvtier.integrations.vllm.metrics import ConnectorMetrics, SnapshotWriter, metrics_port, serve
from kvtier.integrations.vllm.namespace import (engine_layout, engine_namespace, kv_dtype_name, parallel_ranks,
                                                resolved_layout_name)
from kvtier.integrations.vllm.prefetch_reads import PrefetchReader
from kvtier.integrations.vllm.scheduler_side import RequestLog, SchedulerSide
from kvtier.integrations.vllm.worker_side import UnsupportedEngine, WorkerSide
from kvtier.read_speed import ReadSpeeds
from kvtier.transfer.page_layout import LBHNC, REQUIRED_LAYOUT, LayoutError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector")


def _log_level_from_env() -> None:
    """``KVTIER_LOG_LEVEL=DEBUG`` (or INFO...) makes kvtier's loggers print to stderr in every engine
    process (e.g. the per-load phase times at DEBUG)."""
    level = os.environ.get("KVTIER_LOG_LEVEL")
    root = logging.getLogger("kvtier")
    if not level or getattr(root, "_kvtier_env_handler", False):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    root._kvtier_env_handler = True  # type: ignore[attr-defined]

_TIER_SOURCE = {"memory": CacheHitSource.HOST, "ram": CacheHitSource.HOST, "worker": CacheHitSource.HOST,
                "disk": CacheHitSource.DISK, "ssd": CacheHitSource.DISK}


def _kv_events_enabled(vllm_config: "VllmConfig") -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with ``enable_kv_cache_events``)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def _engine(vllm_config: "VllmConfig") -> str:
    """"model M, attention backend B" for errors."""
    attn = getattr(vllm_config, "attention_config", None)
    backend = getattr(attn, "backend", None) if attn is not None else None
    name = getattr(backend, "name", backend) or "chosen by vLLM"
    return f"model {vllm_config.model_config.model}, attention backend {name}"


def _chunk_bytes(vllm_config: "VllmConfig", chunk_size: int, kv_cache_config: "KVCacheConfig | None" = None) -> int:
    """KV bytes of one chunk (all layers, every part), to bound the worker-keys set and for the claim policy:
    from vLLM's KV-cache groups (page bytes x layers, right for MLA's one latent and for hybrid models),
    else from the model config and the KV dtype."""
    try:
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups:
            pages = sum(int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names) for g in groups)
            return max(1, pages * chunk_size // int(groups[0].kv_cache_spec.block_size))
    except Exception:  # an exotic spec: the model-config estimate below
        pass
    try:
        mc = vllm_config.model_config
        return max(1, kv_bytes(mc.get_num_layers(vllm_config.parallel_config),
                               mc.get_num_kv_heads(vllm_config.parallel_config), mc.get_head_size(),
                               dtype_itemsize(kv_dtype_name(vllm_config)), tokens=chunk_size))
    except Exception:  # an exotic model config or KV dtype: a conservative default
        return 1 << 20


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_level_from_env()
        from kvtier.store import shared_store

        self.config = config_from_extra(self._kv_transfer_config.kv_connector_extra_config)
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # vLLM 0.32 defaults to "fail"; for a cache, a chunk that cannot be loaded must be
            # recomputed, never fail the request. The scheduler reads the policy right after
            # constructing the connector.
            log.info("kvtier: setting kv_load_failure_policy='recompute' (was %r)",
                     self._kv_transfer_config.kv_load_failure_policy)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        cfg = self.config
        block_size = int(vllm_config.cache_config.block_size)
        engine = _engine(vllm_config)
        reason = ""
        groups: CacheGroups | None = None
        try:
            layout = engine_layout(vllm_config, kv_cache_config)
        except LayoutError as e:
            layout, reason = LBHNC, str(e)
        try:
            groups = cache_groups(kv_cache_config)
        except UnsupportedGroups as e:
            reason = str(e)
        self.groups = groups
        self._unsupported = bool(reason)
        self._no_claims = False        # a worker reported it serves without the cache (plans made still run)
        if reason and cfg.connector.on_unsupported != "serve-without-cache":
            raise UnsupportedEngine(f"kvtier cannot serve this engine ({engine}): {reason}. To run without "
                                    f"kvtier's cache, set connector.on_unsupported: serve-without-cache")
        if reason:
            log.error("kvtier: serving without the cache (%s; connector.on_unsupported: serve-without-cache): %s",
                      engine, reason)
        kv_heads: KvHeads | None = None
        if not reason:
            reason = cpu_mla_refusal(groups, vllm_config)
            try:
                kv_heads = engine_kv_heads(vllm_config, cfg.connector.tp_layout, groups is not None and groups.mla,
                                           groups is not None and groups.mamba)
            except HeadShardingError as e:
                reason = reason or f"connector.tp_layout per-kv-head: {e}"
            self._unsupported = bool(reason)
            if reason and cfg.connector.on_unsupported != "serve-without-cache":
                raise UnsupportedEngine(f"kvtier cannot serve this engine ({engine}): {reason}. To run without "
                                        f"kvtier's cache, set connector.on_unsupported: serve-without-cache")
        store_cfg = cfg.store
        if groups is not None and groups.mamba and store_cfg.chunk_size != block_size:
            # Mamba state exists at block ends only: a chunk is one block (cache_groups.py)
            log.info("kvtier: chunk size %d -> the engine's block size %d (a Mamba hybrid keeps state per block)",
                     store_cfg.chunk_size, block_size)
            store_cfg = store_cfg.model_copy(update={"chunk_size": block_size})
        if self._unsupported and store_cfg.chunk_size % block_size:
            # served without the cache: any chunk size the engine's blocks divide (nothing is stored)
            store_cfg = store_cfg.model_copy(update={"chunk_size": block_size * max(1, store_cfg.chunk_size // block_size)})
        self.namespace = engine_namespace(vllm_config, kv_cache_config, store_cfg.chunk_size, layout,
                                          deployment=cfg.store.deployment, groups=groups,
                                          per_kv_head=kv_heads is not None)
        self.metrics = ConnectorMetrics()
        # With vLLM's multiprocess executor (the default on CPU) the worker runs in another
        # process: the scheduler then sees the SSD tier directly and the worker's RAM tier only
        # through the keys the worker reports, so it opens no RAM tier of its own.
        backend = str(getattr(vllm_config.parallel_config, "distributed_executor_backend", "") or "")
        self._worker_elsewhere = role == KVConnectorRole.SCHEDULER and backend != "uni"
        if self._worker_elsewhere and store_cfg.memory.enabled:
            store_cfg = store_cfg.model_copy(update={"memory": store_cfg.memory.model_copy(update={"enabled": False})})
        self.store = shared_store(store_cfg, self.namespace)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._prefetch: PrefetchReader | None = None     # worker: queue-time prefetch (connector.prefetch_ram)
        role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        kv_events = _kv_events_enabled(vllm_config) and not self._unsupported
        self._events: KvEvents | None = None
        if role == KVConnectorRole.SCHEDULER:
            mem, disk = cfg.store.memory, cfg.store.disk
            chunk_bytes = _chunk_bytes(vllm_config, self.namespace.chunk_size, kv_cache_config)
            local_budget = (mem.capacity if mem.enabled else 0) + (disk.capacity if disk.enabled else 0)
            # every chunk the local tiers can hold, twice over (re-saves, shared-tier writes)
            self._events = KvEvents(enabled=kv_events, chunk_size=self.namespace.chunk_size, block_size=block_size,
                                    capacity=min(1 << 20, max(DEFAULT_MAP_CAPACITY, 2 * local_budget // chunk_bytes)),
                                    metrics=self.metrics)
            self._sched = SchedulerSide(
                self.store, self.namespace, block_size=block_size, save=cfg.connector.save,
                min_hit_chunks=cfg.connector.min_hit_chunks, save_generated=cfg.connector.save_generated,
                metrics=self.metrics,
                request_log=RequestLog(cfg.connector.request_log),
                worker_key_capacity=local_budget // chunk_bytes * (kv_heads.total if kv_heads else 1)
                if self._worker_elsewhere else 0,
                shared_lookup_timeout_s=cfg.store.shared.lookup_timeout_s if cfg.store.shared else 0.5,
                kv_events=self._events, claims=cfg.claims, chunk_nbytes=chunk_bytes,
                async_read_depth=cfg.connector.async_read_depth, prefetch_ram=cfg.connector.prefetch_ram,
                groups=groups, heads=kv_heads.total if kv_heads is not None else 0)
            port = metrics_port(cfg.metrics.port, None)
        else:
            self._worker = WorkerSide(self.store, layout, chunk_size=store_cfg.chunk_size, block_size=block_size,
                                      load_timeout_s=cfg.connector.load_timeout_s, metrics=self.metrics,
                                      promote=cfg.connector.promote, background_cpus=cfg.connector.background_cpus,
                                      promote_min_hits=cfg.connector.promote_min_hits,
                                      always_report=self.namespace.tp_size > 1,
                                      async_read_depth=cfg.connector.async_read_depth, kv_events=kv_events,
                                      read_speeds=ReadSpeeds(half_life_s=cfg.claims.half_life_s,
                                                             unavailable_s=cfg.claims.unavailable_s),
                                      layerwise=cfg.connector.load_mode == "layerwise",
                                      on_unsupported=cfg.connector.on_unsupported, engine=engine, groups=groups,
                                      saves=not (groups is not None and groups.mla
                                                 and parallel_ranks(vllm_config)[0] != 0),   # MLA: rank 0 writes
                                      kv_heads=kv_heads if not self._unsupported else None)
            if self._unsupported:
                self._worker.disabled = reason
            if cfg.connector.prefetch_ram:
                self._prefetch = PrefetchReader(self.store, timeout_s=cfg.connector.load_timeout_s,
                                                chunk_nbytes=lambda: getattr(self._worker, "chunk_nbytes", 0))
            port = metrics_port(cfg.metrics.port, self.namespace.tp_rank)
        if port:
            serve(port, cfg.metrics.host)
        stats_dir = cfg.connector.stats_dir or (
            Path(cfg.store.disk.path) / "_stats" if cfg.store.disk.enabled and cfg.store.disk.path else None)
        self._snapshots = SnapshotWriter.start(Path(stats_dir), role_name, cfg.connector.stats_interval_s) \
            if stats_dir else None
        if self._snapshots is not None:
            atexit.register(self._snapshots.stop)
        if self._unsupported and self.metrics:
            self.metrics.error("layout")
        log.info("kvtier connector (%s, pid %d): namespace %s (%s, vLLM layout %s, payload %s, dtype %s, chunk %d)",
                 role_name, os.getpid(), self.namespace.short_id(), self.namespace.model,
                 resolved_layout_name(vllm_config, kv_cache_config), layout.name, self.namespace.dtype,
                 self.namespace.chunk_size)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        """The per-layer ``[num_blocks, kv_heads, block_size, content]`` layout, every platform's (the CPU
        backend's own); vLLM may resolve another block-compact one, which kvtier serves too."""
        return REQUIRED_LAYOUT

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-pipelined loads need ``wait_for_layer_load`` before each attention layer, which a full
        CUDA graph would skip: vLLM then runs piecewise graphs."""
        try:
            return config_from_extra(extra_config).connector.load_mode == "layerwise"
        except Exception as e:   # a bad config fails at the connector's construction, with its own message
            log.debug("kvtier: reading the config for the CUDA graph mode failed: %s", e)
            return False

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is only a future miss

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        if self._worker is not None and not self._unsupported:
            self._worker.register(kv_caches)    # UnsupportedEngine fails the start (on_unsupported: fail)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KvtierConnectorMetadata):
            self._worker.step_bound(connector_metadata)     # the step's forward pass is timed from here
        if self._prefetch is not None and isinstance(connector_metadata, KvtierConnectorMetadata):
            self._prefetch.step(connector_metadata)         # waiting requests' chunks, in the background

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KvtierConnectorMetadata):
            if not any(not p.async_load for p in meta.loads):
                # vLLM 0.32 calls start_load_kv after the forward pass when the step has no
                # synchronous load (``SchedulerOutput.has_sync_kv_loads``): the pass has ended
                self._worker.forward_done()
            self._worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:    # load_mode layerwise: until this layer's blocks are loaded
            self._worker.wait_layer(layer_name)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        # vLLM binds this step's metadata around get_finished (``_get_kv_connector_output``); an idle
        # step (no tokens scheduled, a load in flight) lets the worker wait for the load
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        done = self._worker.get_finished(finished_req_ids,
                                         idle=isinstance(meta, KvtierConnectorMetadata) and meta.idle)
        sent = self._worker.take_released()     # finished requests whose last saves are copied
        return (sent or None), (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``, and the requests whose load of several KV-cache groups failed (vLLM recomputes
        them: it cannot map failed block ids of several groups back to requests)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_requests() if self._worker is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed, failed_recving=failed)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # whole chunks are copied once, in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        self._worker.forward_done()
        self._worker.finish_layers()        # a layer-pipelined load ends here (its failures skip saves)
        if isinstance(meta, KvtierConnectorMetadata):
            self._worker.save(meta)
        self._worker.end_step()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        meta = self._worker.take_worker_meta() if self._worker is not None else None
        done = self._prefetch.take_done() if self._prefetch is not None else {}
        if done:
            meta = meta or KvtierWorkerMetadata(os.getpid())
            meta.prefetched = done
        return meta

    def shutdown(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
        try:
            self.store.flush(timeout=10)
        except Exception as e:  # never fail vLLM's shutdown
            log.warning("kvtier: flush at shutdown failed: %s", e)
        if self._snapshots is not None:
            self._snapshots.stop()
        if self._events is not None and self._events.enabled:
            log.info("kvtier: KV events: %s", self._events.stats())

    # ---------------------------------------------------------------- scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.bind(lambda req_id: kv_cache_manager.get_block_ids(req_id))   # one list per group

    def on_new_request(self, request: "Request") -> None:
        if self._sched is not None and not self._unsupported:
            self._sched.on_new_request(request)     # queue-time prefetch: its shared-tier check starts now

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._sched is None or self._unsupported or self._no_claims:
            return 0, False
        n = self._sched.num_new_matched_tokens(request, num_computed_tokens)
        if n is None:
            return None, False          # the shared tier's answer is pending: ask again next step
        return n, bool(n) and self._sched.load_async(request)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if self._sched is not None and not self._unsupported:
            self._sched.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self._sched is None or self._unsupported:
            return KvtierConnectorMetadata()
        return self._sched.build_meta(scheduler_output)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        if self._sched is None or not num_external_tokens:
            return {}
        out: dict[CacheHitSource, int] = {}
        for tier, n in self._sched.hit_tiers(request, num_external_tokens).items():
            src = _TIER_SOURCE.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + n
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._sched is not None and isinstance(meta, KvtierWorkerMetadata):
            if meta.disabled and not self._no_claims:
                self._no_claims = True      # a worker serves without the cache: claim nothing from now on
                log.error("kvtier: a worker serves without the cache (%s); the scheduler claims nothing", meta.disabled)
            self._sched.on_worker_meta(meta)
        if self._sched is not None:
            self._sched.on_finished_recving(connector_output.finished_recving)

    def take_events(self) -> Iterable[Any]:
        """(scheduler, each step) ``BlockStored`` / ``BlockRemoved`` of kvtier's tiers since the last call."""
        if self._events is None or not self._events.enabled:
            return ()
        try:
            return self._events.take()
        except Exception as e:  # events never fail a step
            self._events.failed("take", e)
            return ()

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        # True: an async load still writes the blocks, or their last full chunks are still to be
        # saved (save_generated); the worker's get_finished releases them
        return self._sched.finished(request, None if self._unsupported else (block_ids,)), None

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with one block-id list per KV-cache group (vLLM's hybrid KV cache manager)."""
        if self._sched is None:
            return False, None
        return self._sched.finished(request, None if self._unsupported else block_ids), None
