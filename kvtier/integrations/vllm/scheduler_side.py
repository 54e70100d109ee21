"""Scheduler half of the connector: what can be loaded, and which chunks to load and save.

Contract (vLLM ``KVConnectorBase_V1`` scheduler methods):

- ``num_new_matched_tokens(request, num_computed_tokens)`` is side-effect free towards the
  store (``lookup`` only) and claims only chunks the store holds right now, beyond what
  vLLM's prefix cache already holds, never the prompt's last token (vLLM must compute at
  least one token to sample), in whole chunks (a multiple of the block size).
- ``after_alloc`` turns the last claim into a pending load; ``build_meta`` ships it (block
  ids straight from the KV cache manager) together with the chunks that become fully
  computed in this step (chunked prefill: only chunks complete after this step).
- Chunks the store already holds are never saved again; preemption restarts the request
  (vLLM calls ``num_new_matched_tokens`` again); ``finished`` (also abort) drops its state.
- Worker reports (``on_worker_meta``) record what was actually loaded per request, next to
  what was claimed, in the request log (JSON lines) and the metrics.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from kvtier.integrations.vllm.metadata import (
    KvtierConnectorMetadata,
    KvtierWorkerMetadata,
    LoadChunk,
    LoadPlan,
    SaveChunk,
)
from kvtier.keys import ChunkKey, Namespace, chunk_keys

if TYPE_CHECKING:
    from kvtier.integrations.vllm.metrics import ConnectorMetrics

log = logging.getLogger("kvtier.connector")


class LookupStore(Protocol):
    def lookup(self, keys: Sequence[ChunkKey]) -> Any: ...


def request_extra(request: Any) -> bytes:
    """Extra key bytes for everything besides token ids that changes KV: LoRA, cache salt, mm inputs."""
    parts: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', '')}:{getattr(lora, 'lora_int_id', '')}:"
                     f"{getattr(lora, 'lora_path', '')}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    mm = [str(getattr(f, "identifier", "")) for f in (getattr(request, "mm_features", None) or [])]
    if mm:
        parts.append("mm=" + ",".join(mm))
    return "\x1f".join(parts).encode() if parts else b""


@dataclass
class _ReqState:
    request: Any
    keys: list[ChunkKey]
    stored_chunks: int = 0          # leading chunks the store held at the last lookup
    claim_start: int = 0            # last claim: [claim_start, claim_end) tokens
    claim_end: int = 0
    pending_load: tuple[int, int] | None = None
    next_save_chunk: int = 0
    claimed_total: int = 0
    tiers: tuple[str, ...] = field(default_factory=tuple)


class RequestLog:
    """Append-only JSON lines (one event per line) for tests and audits; no-op without a path."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if self._path is None:
            return
        line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
        with self._lock:
            try:
                with open(self._path, "a") as f:
                    f.write(line)
            except OSError as e:
                log.warning("kvtier: cannot write request log %s: %s", self._path, e)


class SchedulerSide:
    def __init__(self, store: LookupStore, namespace: Namespace, *, block_size: int, save: bool,
                 min_hit_chunks: int, metrics: "ConnectorMetrics | None" = None,
                 request_log: RequestLog | None = None, worker_key_capacity: int = 0) -> None:
        self.store = store
        self.namespace = namespace
        self.chunk_size = namespace.chunk_size
        self.block_size = block_size
        self.blocks_per_chunk = self.chunk_size // block_size
        self.save = save
        self.min_hit_chunks = min_hit_chunks
        self.metrics = metrics
        self.log = request_log or RequestLog(None)
        self._reqs: dict[str, _ReqState] = {}
        # Keys a worker in ANOTHER process reported stored (its RAM tier is invisible here).
        self._worker_keys: OrderedDict[bytes, None] = OrderedDict()
        self._worker_key_capacity = worker_key_capacity
        self._block_ids_of = None  # set by bind(); req_id -> list[int] (group 0)

    def bind(self, block_ids_of) -> None:
        self._block_ids_of = block_ids_of

    # -- lookup ----------------------------------------------------------------------------
    def _state(self, request: Any) -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            tokens = request.prompt_token_ids
            if tokens is None:  # prompt embeddings: not cacheable by token ids
                return None
            st = _ReqState(request, chunk_keys(self.namespace, tokens, request_extra(request)))
            self._reqs[request.request_id] = st
        return st

    def _available_chunks(self, keys: Sequence[ChunkKey]) -> tuple[int, tuple[str, ...]]:
        n, tiers = 0, []
        while n < len(keys):
            if keys[n] in self._worker_keys:
                n += 1
                tiers.append("worker")
                continue
            try:
                res = self.store.lookup(keys[n:])
            except Exception as e:  # a broken store is a miss, never a crash
                log.warning("kvtier: lookup failed: %s", e)
                if self.metrics:
                    self.metrics.error("lookup")
                break
            if res.num_chunks == 0:
                break
            n += res.num_chunks
            tiers.extend(res.tiers[: res.num_chunks])
        return n, tuple(tiers)

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        st = self._state(request)
        if st is None or not st.keys:
            return 0
        n, tiers = self._available_chunks(st.keys)
        st.stored_chunks = n
        st.tiers = tiers
        # Whole blocks, and never the prompt's last token (vLLM must compute >= 1 token): the
        # last chunk may be loaded in part, so a full hit leaves the same tail as vLLM's own cache.
        limit = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        hit_tokens = 0 if n < self.min_hit_chunks else min(n * self.chunk_size, limit)
        claim = max(0, hit_tokens - num_computed_tokens)
        st.claim_start, st.claim_end = (num_computed_tokens, hit_tokens) if claim else (0, 0)
        if self.metrics:
            self.metrics.lookup()
        return claim

    def hit_tiers(self, request: Any, num_external_tokens: int) -> dict[str, int]:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens == 0:
            return {}
        c = self.chunk_size
        out: dict[str, int] = {}
        for ci in range(st.claim_start // c, -(-st.claim_end // c)):
            tier = st.tiers[ci] if ci < len(st.tiers) else "unknown"
            n = min(st.claim_end, (ci + 1) * c) - max(st.claim_start, ci * c)
            out[tier] = out.get(tier, 0) + n
        return out

    # -- allocation / step planning ----------------------------------------------------------
    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        st = self._state(request)
        if st is None:
            return
        st.next_save_chunk = max(st.next_save_chunk, st.stored_chunks)  # never re-save what the store holds
        if self.metrics:
            self.metrics.admitted(request.num_prompt_tokens, self.hit_tiers(request, num_external_tokens))
        if num_external_tokens <= 0:
            st.pending_load = None
            return
        end = st.claim_end
        start = end - num_external_tokens
        if start != st.claim_start or start % self.block_size or end % self.block_size:
            # vLLM admitted a different range than claimed: load nothing rather than guess.
            log.error("kvtier: inconsistent claim for %s: claimed [%d,%d), admitted %d external tokens",
                      request.request_id, st.claim_start, st.claim_end, num_external_tokens)
            if self.metrics:
                self.metrics.error("claim_mismatch")
        st.pending_load = (start, end)
        st.claimed_total += end - start

    def build_meta(self, scheduler_output: Any) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata()
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            table = self._block_ids_of(req_id) if self._block_ids_of else []
            if st.pending_load is not None:
                start, end = st.pending_load
                st.pending_load = None
                plan = self._load_plan(req_id, st, start, end, table)
                if plan is not None:
                    meta.loads.append(plan)
                    self.log.write("claim", req=req_id, prompt_tokens=st.request.num_prompt_tokens,
                                   local_tokens=start, claimed_tokens=end - start)
            if self.save:
                meta.saves.extend(self._save_chunks(req_id, st, num_new, table))
        return meta

    def _load_plan(self, req_id: str, st: _ReqState, start: int, end: int, table: list[int]) -> LoadPlan | None:
        bpc, bs, c = self.blocks_per_chunk, self.block_size, self.chunk_size
        if len(table) < end // bs:
            log.error("kvtier: block table of %s too short for load [%d,%d)", req_id, start, end)
            return None
        chunks = []
        for ci in range(start // c, -(-end // c)):     # chunks overlapping [start, end)
            first = (max(start, ci * c) - ci * c) // bs
            last = (min(end, (ci + 1) * c) - ci * c) // bs
            chunks.append(LoadChunk(bytes(st.keys[ci]), tuple(table[ci * bpc + first:ci * bpc + last]), first))
        return LoadPlan(req_id, start, end, tuple(chunks))

    def _save_chunks(self, req_id: str, st: _ReqState, num_new: int, table: list[int]) -> list[SaveChunk]:
        req = st.request
        computed_after = req.num_computed_tokens + num_new   # num_computed_tokens is pre-step here
        full = min(min(computed_after, req.num_prompt_tokens) // self.chunk_size, len(st.keys))
        bpc = self.blocks_per_chunk
        out = []
        while st.next_save_chunk < full:
            ci = st.next_save_chunk
            blocks = table[ci * bpc:(ci + 1) * bpc]
            if len(blocks) < bpc:
                break
            out.append(SaveChunk(req_id, ci, bytes(st.keys[ci]),
                                 bytes(st.keys[ci - 1]) if ci else None, tuple(blocks)))
            st.next_save_chunk += 1
        return out

    # -- completion ------------------------------------------------------------------------
    def finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)

    def on_worker_meta(self, meta: KvtierWorkerMetadata) -> None:
        for req_id, o in meta.loads.items():
            self.log.write("load", req=req_id, loaded_tokens=o.loaded_tokens, failed_tokens=o.failed_tokens,
                           error=o.error)
        self.forget_worker_keys(meta.missing_keys)
        if meta.pid != os.getpid() and self._worker_key_capacity > 0:
            for k in meta.stored_keys:
                self._worker_keys[k] = None
                self._worker_keys.move_to_end(k)
            while len(self._worker_keys) > self._worker_key_capacity:
                self._worker_keys.popitem(last=False)

    def forget_worker_keys(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._worker_keys.pop(k, None)
