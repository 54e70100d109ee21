"""``KvtierSecondaryTier``: kvtier's SSD and shared tiers as a secondary tier of vLLM's offloading.

vLLM's ``TieringOffloadingManager`` keeps KV in a CPU primary tier and cascades every stored chunk
to its secondary tiers; a chunk a secondary tier holds is promoted back into the primary tier on a
lookup. This class is such a secondary tier, loaded by module path (no vLLM change)::

    {"type": "KvtierSecondaryTier", "module_path": "kvtier.integrations.vllm_tiering",
     "kvtier_config_file": "/etc/kvtier/tier.yaml"}

Below it is kvtier's ``TieredStore`` without its RAM tier (``settings.TierSettings``): the SSD tier
(byte budget, eviction) and/or one shared backend (shared filesystem, Valkey, Mooncake) behind
kvtier's guard (deadlines, bounded threads, breaker; the shared filesystem's janitor keeps its
budget). Chunks live in their own namespace (``namespace``), in kvtier's verified chunk format.

What vLLM's interface demands, and how it is met (every method runs on the scheduler thread and
returns without I/O but for the first call, which opens the store):

* ``lookup``: RETRY while a job not yet reported holds the key; MISS after a failed load of it
  (until it is stored again); HIT from the local tiers' index; otherwise the shared tier is asked
  in the background (``lookups.SharedLookups``): RETRY until it answered, then HIT or MISS.
* ``submit_store`` / ``submit_load``: the bytes move on job threads (``transfers``); each job is
  reported once by ``get_finished_jobs``; a load that could not verify every chunk is a failed job
  naming the keys that did load (vLLM keeps those and recomputes the rest). Nothing raises.
* ``take_events``: stores and local evictions as ``OffloadingEvent``s (``events``).
* ``drain_jobs``: returns once no job touches the primary region; ``shutdown`` also closes the store.
* ``touch``: a no-op (kvtier's eviction order follows its own reads and writes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, Collection, Iterable, Mapping

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.integrations.vllm_tiering.events import TierEvents
from kvtier.integrations.vllm_tiering.jobs import JobBoard
from kvtier.integrations.vllm_tiering.keymap import KeyMap
from kvtier.integrations.vllm_tiering.namespace import chunk_tokens, offload_namespace
from kvtier.integrations.vllm_tiering.settings import TierSettings
from kvtier.integrations.vllm_tiering.transfers import ChunkTransfers
from kvtier.store import TieredStore

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

    from kvtier.integrations.vllm_tiering.lookups import SharedLookups

log = logging.getLogger("kvtier.vllm_tiering")

FAILED_KEYS_REMEMBERED = 1 << 16


class KvtierSecondaryTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview, tier_type: str,
                 kvtier_config_file: str | None = None, kvtier_config: Mapping[str, Any] | None = None,
                 enable_kv_events: bool = False, locality: str | None = None, job_threads: int = 4,
                 backpressure_detector: "BackpressureDetector | None" = None) -> None:
        """Validate the configuration (ConfigError, one line); the store opens at first use."""
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = TierSettings.from_entry(kvtier_config_file, kvtier_config, enable_kv_events,
                                                locality, job_threads)
        self.locality = Locality(self.settings.locality) if self.settings.locality else None
        config = offloading_spec.config
        self.chunk_tokens = chunk_tokens(config)
        self.namespace = offload_namespace(config, self.block_size_bytes, self.settings.kvtier.store.deployment)
        self.keymap = KeyMap(self.namespace)
        events_on = self.settings.enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        if self.settings.enable_kv_events and not events_on:
            log.warning("kvtier tier %s: enable_kv_events is set but vLLM's KV cache events are off; "
                        "the tier emits no events", tier_type)
        self.events = TierEvents(events_on, self.medium, self.locality, self.keymap,
                                 report_evictions=self.settings.kvtier.store.shared is None)
        threads = self.settings.job_threads
        self.jobs = JobBoard(lambda: ThreadPoolExecutor(threads, thread_name_prefix="kvtier-vllm-tier"))
        self._store: TieredStore | None = None
        self._transfers: ChunkTransfers | None = None
        self._lookups: "SharedLookups | None" = None
        self._store_keys: dict[int, list[OffloadKey]] = {}
        self._load_keys: dict[int, list[OffloadKey]] = {}
        self._failed: OrderedDict[OffloadKey, None] = OrderedDict()
        self._closed = False

    # -- opening ---------------------------------------------------------------------------------
    def open(self) -> TieredStore:
        """Open kvtier's store now (otherwise the first call does); returns it."""
        if self._store is None:
            if self._closed:
                raise RuntimeError("the kvtier tier is shut down")
            store = TieredStore.open(self.settings.store_config(self.chunk_tokens), self.namespace)
            store.subscribe(self.events.on_store_event)
            store.start_background_threads()
            self._transfers = ChunkTransfers(store, self.keymap, self._primary_kv_view, self.block_size_bytes,
                                             self.chunk_tokens, self.settings.load_timeout_s)
            self._store = store
            log.info("kvtier tier %s: namespace %s, tiers %s, %d-byte chunks of %d tokens", self.tier_type,
                     self.namespace.short_id(), [t.name for t in store.tiers], self.block_size_bytes,
                     self.chunk_tokens)
        return self._store

    @property
    def store(self) -> TieredStore:
        return self.open()

    def _transfer(self) -> ChunkTransfers:
        self.open()
        assert self._transfers is not None
        return self._transfers

    def _shared_lookups(self) -> "SharedLookups":
        if self._lookups is None:
            from kvtier.integrations.vllm_tiering.lookups import SharedLookups

            self._lookups = SharedLookups(self.tier_type, self.store, self.keymap, self.settings.lookup_timeout_s)
        return self._lookups

    # -- lookups ---------------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self.jobs.in_flight(key):
            return LookupResult.RETRY
        if key in self._failed:
            return LookupResult.MISS
        store = self.store
        if store.where(self.keymap.chunk_key(key)) is not None:
            return LookupResult.HIT
        if not store.has_remote():
            return LookupResult.MISS
        verdict = self._shared_lookups().lookup(key, req_context)
        if verdict is None:
            return LookupResult.RETRY
        return LookupResult.HIT if verdict else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lookups is not None:
            self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._lookups is not None:
            self._lookups.flush()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return

    # -- jobs --------------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        for k in keys:
            self._failed.pop(k, None)
        transfers, chunk_ids = self._transfer(), job_metadata.chunk_ids
        self._store_keys[job_metadata.job_id] = keys
        self.jobs.submit(job_metadata.job_id, keys, lambda: transfers.store_rows(keys, chunk_ids))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        transfers, chunk_ids = self._transfer(), job_metadata.chunk_ids
        self._load_keys[job_metadata.job_id] = keys
        self.jobs.submit(job_metadata.job_id, keys, lambda: transfers.load_rows(keys, chunk_ids))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        for job in self.jobs.finished():
            out = job.outcome
            stored = self._store_keys.pop(job.job_id, None)
            loaded = self._load_keys.pop(job.job_id, None)
            successful = None
            if stored is not None and out.success:
                self.events.stored(stored)
            if loaded is not None and not out.success:
                ok = set(out.successful_keys or ())
                self._mark_failed([k for k in loaded if k not in ok])
                successful = out.successful_keys or None
            results.append(JobResult(job_id=job.job_id, success=out.success, successful_keys=successful,
                                     transfer_time=out.transfer_time, transfer_bytes=out.transfer_bytes or None))
        return results

    def _mark_failed(self, keys: list[OffloadKey]) -> None:
        """Keys whose load failed are misses until stored again (vLLM then recomputes them once,
        instead of promoting a chunk that cannot load over and over)."""
        for k in keys:
            self._failed[k] = None
            self._failed.move_to_end(k)
        while len(self._failed) > FAILED_KEYS_REMEMBERED:
            self._failed.popitem(last=False)
        if self._lookups is not None:
            self._lookups.mark_miss(keys)

    def has_pending_work(self) -> bool:
        return self.jobs.pending() > 0

    def drain_jobs(self) -> None:
        self.jobs.drain()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.events.take()

    def shutdown(self) -> None:
        """Wait for running jobs, stop the lookup thread, flush and close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.jobs.drain()
        self.jobs.shutdown()
        if self._lookups is not None:
            self._lookups.shutdown()
        if self._store is not None:
            self._store.flush(self.settings.load_timeout_s)
            self._store.close()
        if self._transfers is not None:
            self._transfers.release()
