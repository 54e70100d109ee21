"""Test rig for kvtier's vLLM secondary tier: vLLM's own offloading config, spec, keys and jobs on the
CPU (no engine). ``offloading_config`` builds the ``OffloadingConfig`` vLLM's connector would build
for a one-group model; ``spec`` is vLLM's ``TieringOffloadingSpec`` over it (its ``get_manager()``
builds the ``SharedOffloadRegion`` in /dev/shm, the CPU primary tier, and the secondary tiers through
``SecondaryTierFactory``)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

MODULE_PATH = "kvtier.integrations.vllm_tiering"
TIER_TYPE = "KvtierSecondaryTier"
BLOCK_TOKENS = 16


def offloading_config(bytes_per_block: int = 64 * 1024, blocks_per_chunk: int = 1, num_chunks: int = 32,
                      secondary_tiers: list[dict] | None = None, events: bool = False,
                      model: str = "meta-llama/Meta-Llama-3-8B") -> OffloadingConfig:
    """vLLM's offloading config for one full-attention group, a primary of ``num_chunks`` chunks."""
    chunk_bytes = bytes_per_block * blocks_per_chunk
    extra: dict[str, Any] = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_chunks * chunk_bytes,
                             "blocks_per_chunk": blocks_per_chunk, "secondary_tiers": secondary_tiers or []}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK_TOKENS, layer_names=("layers.0.attn",), group_id=0),),
        worker_kv_bytes_per_block=bytes_per_block, enable_kv_cache_events=events, extra_config=extra,
        engine_id=f"kvtier-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
        kv_cache_layout="NHD")


def spec(config: OffloadingConfig):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    return TieringOffloadingSpec(config)


def entry(**fields: Any) -> dict:
    """A ``secondary_tiers`` entry naming kvtier's tier by module path."""
    return {"type": TIER_TYPE, "module_path": MODULE_PATH, **fields}


def disk_entry(path: Path, capacity: str = "64MiB", **fields: Any) -> dict:
    return entry(kvtier_config={"store": {"disk": {"enabled": True, "path": str(path), "capacity": capacity}}},
                 **fields)


def primary(num_chunks: int, chunk_bytes: int) -> tuple[np.ndarray, memoryview]:
    """A primary region of real bytes, with the strides of vLLM's (``(num_chunks, chunk_bytes)`` int8)."""
    arr = np.zeros((num_chunks, chunk_bytes), dtype=np.int8)
    return arr, memoryview(arr)


def build_tier(tier_entry: dict, num_chunks: int = 32, bytes_per_block: int = 64 * 1024, events: bool = False):
    """kvtier's tier built by vLLM's ``SecondaryTierFactory`` from ``tier_entry``, over a fresh primary."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    cfg = offloading_config(bytes_per_block, num_chunks=num_chunks, secondary_tiers=[tier_entry], events=events)
    arr, view = primary(num_chunks, bytes_per_block)
    tier = SecondaryTierFactory.create_secondary_tier(dict(tier_entry), view, spec(cfg))
    return tier, arr


def fill(arr: np.ndarray, chunk_ids, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for c in chunk_ids:
        arr[c] = rng.integers(-128, 128, arr.shape[1], dtype=np.int8)
        out.append(arr[c].tobytes())
    return out


def keys(n: int, seed: int = 0, group: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [make_offload_key(rng.bytes(32), group) for _ in range(n)]


def job(job_id: int, ks: list[bytes], chunk_ids: list[int], promotion: bool, req: str = "r0") -> TransferJob:
    return TransferJob(job_id=job_id, keys=ks, chunk_ids=np.array(chunk_ids, dtype=np.int32),
                       is_promotion=promotion, req_context=ReqContext(req_id=req))


def finished(tier, n: int = 1, timeout: float = 30.0) -> list[JobResult]:
    """Poll ``get_finished_jobs`` (as vLLM's manager does once per step) until ``n`` jobs reported."""
    out: list[JobResult] = []
    end = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        out.extend(tier.get_finished_jobs())
        if len(out) < n:
            time.sleep(0.005)
    return out


def resolve(tier, key: bytes, req: ReqContext, timeout: float = 30.0):
    """Look ``key`` up as vLLM's scheduler does: again each step (``on_schedule_end``) while RETRY."""
    from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext

    end = time.monotonic() + timeout
    while True:
        r = tier.lookup(key, req)
        if r is not LookupResult.RETRY or time.monotonic() > end:
            return r
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        time.sleep(0.005)
