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
- ``save_generated``: the chunks covering generated tokens are saved as decode fills them
  (``step_plans.py``: the per-request state, load and save plans). The last sampled token has no
  KV yet. A chunk completed in a step whose tokens were not known at scheduling (async
  scheduling) is saved at ``finished``: vLLM keeps the blocks (delay_free_blocks) until the worker
  has copied them (``releases`` -> finished_sending).
- Worker reports (``on_worker_meta``) record what was actually loaded per request, next to
  what was claimed, in the request log (JSON lines) and the metrics, and feed the
  ``Directory`` of the worker's chunks (stored, promoted, evicted), and, with ``kv_events``,
  vLLM's KV events of the tiers (``kv_events.py``: the chunks planned for saving and those the
  store holds at admission are remembered with their vLLM block hashes).
- No data-plane I/O on EngineCore's loop: local availability is the store's index lookup
  plus the directory; a shared tier is asked once per request, off the loop
  (``RemoteLookups``); while that answer is pending ``num_new_matched_tokens`` returns None
  (vLLM asks again next step), at most ``store.shared.lookup_timeout_s``. A claim that
  includes shared-tier chunks is loaded asynchronously (``load_async``): the request waits
  in vLLM's WAITING_FOR_REMOTE_KVS while others run; ``finished`` delays freeing its blocks
  while that load is in flight.
- Claims that pay off (``claims.policy: pays-off``, ``claim_policy.py`` via ``claim_gate.py``): of
  the chunks the tiers hold, the leading ones whose expected load (the worker's measured read speed
  of their tier, ``read_speeds`` in its reports) saves the most against their expected compute (the
  engine's forward passes as the worker timed them, ``forward`` in its reports, or the calibration in
  the config), at most ``margin`` x that compute; the rest are recomputed, counted per (tier,
  reason) once per request, the decision and its inputs logged at DEBUG. When no claim reaching
  into the shared tier would pay off, its query time included, the shared tier is not even asked.
  ``always``: every chunk any tier holds (no estimate is used).
- Several KV-cache groups (vLLM's hybrid KV cache manager, ``cache_groups.py``): a chunk is held when
  every one of its parts is (one prefix lookup over the parts' chain); queue-time prefetch is off. Chunks
  stored per KV head (``kv_heads.py``): every head of every part (``heads`` keys per part), so a chunk is
  claimed only when every rank can load its heads; queue-time prefetch is off. Mamba hybrids: the chain is
  the attention parts; a hit ends at the last chained chunk whose Mamba states are held (``_state_end``:
  local index, or the shared tier asked once for the longest hit's states). With
  several groups or a sliding window every claim is loaded asynchronously and fails whole
  (``get_transfer_results`` reports the request, which vLLM then recomputes, and kvtier claims nothing
  more for it).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from kvtier.config import ClaimsConfig
from kvtier.integrations.vllm.claim_gate import ClaimGate
from kvtier.integrations.vllm.cache_groups import CacheGroups, part_key
from kvtier.integrations.vllm.claim_policy import ClaimDecision
from kvtier.integrations.vllm.directory import Directory, RemoteLookups
from kvtier.integrations.vllm.kv_events import KvEvents
from kvtier.integrations.vllm.request_keys import KEY_FIELDS, KeyFieldsMissing, request_extra
from kvtier.integrations.vllm.request_log import RequestLog
from kvtier.integrations.vllm.metadata import KvtierConnectorMetadata, KvtierWorkerMetadata, SaveChunk
from kvtier.integrations.vllm.prefetch import QueuePrefetch
from kvtier.integrations.vllm.step_plans import RequestState, SavePlanner, boundary_states, load_plan, step_work
from kvtier.keys import ChunkKey, Namespace, chunk_keys

if TYPE_CHECKING:
    from kvtier.integrations.vllm.metrics import ConnectorMetrics

log = logging.getLogger("kvtier.connector")
#: In a step with no tokens scheduled, the longest ``build_meta`` waits for a pending shared-tier
#: answer (the worker's ``get_finished`` waits as long for an async load): the most a request
#: arriving at such an idle engine waits more.
IDLE_WAIT_S = 0.02
__all__ = ["KEY_FIELDS", "KeyFieldsMissing", "RequestLog", "SchedulerSide", "request_extra"]


class LookupStore(Protocol):
    """What the scheduler needs of the store: index-only lookups and the shared tier's query."""

    def lookup(self, keys: Sequence[ChunkKey]) -> Any: ...
    def has_remote(self) -> bool: ...
    def shared_prefix(self, keys: Sequence[ChunkKey], deadline: Any) -> Any: ...


class SchedulerSide:
    def __init__(self, store: LookupStore, namespace: Namespace, *, block_size: int, save: bool,
                 min_hit_chunks: int, save_generated: bool = False, metrics: "ConnectorMetrics | None" = None,
                 request_log: RequestLog | None = None, worker_key_capacity: int = 0,
                 shared_lookup_timeout_s: float = 0.5, kv_events: KvEvents | None = None,
                 claims: "ClaimsConfig | None" = None, chunk_nbytes: int = 0, async_read_depth: int = 2,
                 prefetch_ram: int = 0, groups: CacheGroups | None = None, heads: int = 0) -> None:
        self.store = store
        self.groups = groups                # None: one full-attention group (vLLM gave no config yet)
        self.chained = groups.chain_parts if groups is not None else (0,)    # parts every chunk has
        self.states = groups.state_parts if groups is not None else ()       # Mamba state parts: leaves
        self.heads = heads                  # chunks stored per KV head: the model's KV heads (0: per rank)
        self.width = len(self.chained) * max(1, heads)   # chained store keys per chunk
        self.loads_whole = groups is not None and groups.loads_whole
        self.namespace = namespace
        self.chunk_size = namespace.chunk_size
        self.block_size = block_size
        self.blocks_per_chunk = self.chunk_size // block_size
        self.save = save
        self.save_generated = save and save_generated
        self.min_hit_chunks = min_hit_chunks
        self.metrics = metrics
        self.log = request_log or RequestLog(None)
        self._reqs: dict[str, RequestState] = {}
        self._refused: set[str] = set()       # requests not cached: a key field is missing (counted once)
        # What a worker in ANOTHER process reported in its tiers (invisible here otherwise).
        self.directory = Directory(worker_key_capacity)
        self._block_ids_of = None  # set by bind(); req_id -> one block-id list per KV-cache group
        # claims that pay off: the worker's read speeds and forward passes -> the claim policy
        self.gate = ClaimGate(claims or ClaimsConfig(policy="always"), chunk_size=self.chunk_size,
                              chunk_nbytes=chunk_nbytes, async_read_depth=async_read_depth)
        self._remote: RemoteLookups | None = None
        if store.has_remote():
            self._remote = RemoteLookups(self.gate.timed_query(store.shared_prefix), shared_lookup_timeout_s,
                                         on_timeout=(lambda: metrics.error("shared_lookup_timeout"))
                                         if metrics else None)
        self._loading: set[str] = set()     # requests with an asynchronous load in flight
        self._releasing: dict[str, list[SaveChunk]] = {}   # finished: saves to ship, then free the blocks
        self.kv_events = kv_events if kv_events is not None and kv_events.enabled else None
        self.save_plans = SavePlanner(store, self.directory, namespace, block_size=block_size,
                                      save_generated=self.save_generated, metrics=metrics, kv_events=self.kv_events,
                                      groups=groups, heads=heads)
        # queue-time prefetch of waiting requests' chunks into the worker's RAM (prefetch.py)
        self.prefetch = QueuePrefetch(prefetch_ram, chunk_nbytes, block_size=block_size, chunk_size=self.chunk_size,
                                      request_log=self.log) \
            if prefetch_ram > 0 and chunk_nbytes > 0 and self.width == 1 and not heads else None

    def bind(self, block_ids_of) -> None:
        self._block_ids_of = block_ids_of

    def on_new_request(self, request: Any) -> None:
        """A request entered vLLM's waiting queue (queue-time prefetch, ``prefetch.py``)."""
        if self.prefetch is not None:
            self.prefetch.arrived(request, self)

    # -- lookup ----------------------------------------------------------------------------
    def _state(self, request: Any) -> RequestState | None:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            tokens = request.prompt_token_ids
            if tokens is None:  # prompt embeddings: not cacheable by token ids
                return None
            try:
                extra = request_extra(request)
            except KeyFieldsMissing as e:
                if request.request_id not in self._refused:
                    self._refused.add(request.request_id)
                    log.error("kvtier: not caching request %s: %s (the key would merge what must differ)",
                              request.request_id, e)
                    if self.metrics:
                        self.metrics.error("key_fields_missing")
                return None
            st = RequestState(request, chunk_keys(self.namespace, tokens, extra), extra)
            self._reqs[request.request_id] = st
        return st

    def _available_chunks(self, keys: Sequence[ChunkKey]) -> tuple[int, tuple[str, ...]]:
        n, tiers = 0, []
        while n < len(keys):
            where = self.directory.get(keys[n])
            if where is not None:
                n += 1
                tiers.append(where)
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

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens to load beyond ``num_computed_tokens``; None = ask again (the shared tier's
        answer is pending, at most ``shared_lookup_timeout_s``)."""
        st = self._state(request)
        if st is None or not st.keys or st.load_failed:
            return 0
        parts = self.width
        chain = st.parts_chain(self.chained, self.heads)
        if st.local_pending is not None:
            n, tiers = st.local_pending
        else:
            n, tiers = self._available_chunks(chain)
            n, tiers = n // parts, tiers[::parts][:n // parts]   # chunks with every part held
        # Whole blocks, and never the prompt's last token (vLLM must compute >= 1 token): the
        # last chunk may be loaded in part, so a full hit leaves the same tail as vLLM's own cache.
        limit = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        useful = min(len(st.keys), -(-limit // self.chunk_size))   # chunks that can add tokens
        local = n
        if (self._remote is not None and not st.remote_failed and n < useful
                and limit > max(n * self.chunk_size, num_computed_tokens)
                and self._worth_asking(st, request, n, tiers, limit, num_computed_tokens)):
            more = self.prefetch.known_shared(request.request_id, n) if self.prefetch else None
            if more is None:
                more = self._remote.answer(request.request_id, chain, n * parts)
                more = None if more is None else more // parts
            if more is None:
                st.local_pending = (n, tiers)
                return None
            n += more
            tiers = tiers + ("shared",) * more
        if self.states and n:
            end = self._state_end(st, request.request_id, local, n)
            if end is None:
                st.local_pending = (local, tiers[:local])
                return None
            n, tiers = end, tiers[:end]
        st.local_pending = None
        st.stored_chunks = n
        st.tiers = tiers
        hit_tokens = 0 if n < self.min_hit_chunks else min(n * self.chunk_size, limit)
        if self.gate.pays_off and hit_tokens > num_computed_tokens:
            hit_tokens = self._paying_tokens(st, request, hit_tokens, num_computed_tokens)
        claim = max(0, hit_tokens - num_computed_tokens)
        st.claim_start, st.claim_end = (num_computed_tokens, hit_tokens) if claim else (0, 0)
        st.claim_async = claim > 0 and (hit_tokens > local * self.chunk_size or self.loads_whole)
        if self.metrics:
            self.metrics.lookup()
        return claim

    def _state_end(self, st: RequestState, req_id: str, local: int, n: int) -> int | None:
        """A Mamba hybrid's hit ends where every Mamba part of its last chunk is held (``cache_groups.py``): the
        last of the ``n`` chained chunks with its states in the local tiers, or, beyond the ``local`` ones, the
        ``n``-th if the shared tier holds its states (asked once, off the loop; None while pending)."""
        def leaves(c: int) -> list[bytes]:
            return [part_key(st.keys[c - 1], g) for g in self.states]

        if n > local and self._remote is not None and not st.remote_failed:
            held = self._remote.answer(f"{req_id}#state{n}", leaves(n), 0)
            if held is None:
                return None
            st.state_queries.add(f"{req_id}#state{n}")
            if held == len(self.states):
                return n
        for c in range(min(n, local), 0, -1):
            if all(self.save_plans.held(ChunkKey(k)) for k in leaves(c)):
                return c
        return 0

    # -- claims that pay off -------------------------------------------------------------------
    def _count(self, st: RequestState, d: ClaimDecision) -> None:
        if d.declined and not st.declines_counted:    # once per request (vLLM may ask several times)
            st.declines_counted = True
            if self.metrics:
                for (tier, reason), k in d.declined.items():
                    self.metrics.declined(tier, reason, k)

    def _paying_tokens(self, st: RequestState, request: Any, hit_tokens: int, computed: int) -> int:
        """``hit_tokens`` cut to the leading chunks that pay off (``claim_policy.decide``)."""
        end, d = self.gate.cut(request.request_id, st.tiers, computed, hit_tokens)
        self._count(st, d)
        return 0 if -(-end // self.chunk_size) < self.min_hit_chunks else end

    def _worth_asking(self, st: RequestState, request: Any, n: int, tiers: Sequence[str], limit: int,
                      computed: int) -> bool:
        """Whether shared-tier chunks could be claimed at all (``pays-off``): the best claim, were the
        shared tier to hold every chunk after the ``n`` local ones, with its query still to pay,
        includes one of them; else the query is skipped, counted once per request as one declined
        shared-tier chunk."""
        if not self.gate.pays_off:
            return True
        hypothetical = tuple(tiers)[:n] + ("shared",) * max(0, -(-limit // self.chunk_size) - n)
        end, d = self.gate.cut(request.request_id, hypothetical, computed, limit, ask_shared=True)
        if end > n * self.chunk_size:
            return True
        if end >= min(limit, n * self.chunk_size) and not st.skip_counted and self.metrics:
            st.skip_counted = True     # the local chunks pay off; the first shared one would not
            self.metrics.declined("shared", d.reason or "slow", 1)
        return False

    def load_async(self, request: Any) -> bool:
        """Whether the last claim of ``request`` must be loaded asynchronously (shared-tier chunks)."""
        st = self._reqs.get(request.request_id)
        return st is not None and st.claim_async and st.claim_end > st.claim_start

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
        if self.prefetch is not None:     # the claimed chunks' tiers, for the request log
            c = self.chunk_size
            self.prefetch.admitted(request.request_id, st.tiers[st.claim_start // c:-(-st.claim_end // c)]
                                   if num_external_tokens > 0 else ())
        st.next_save_chunk = max(st.next_save_chunk, st.stored_chunks)  # never re-save what the store holds
        for ci in range(min(st.stored_chunks, len(st.keys)) if self.kv_events is not None else 0):
            self.kv_events.remember(bytes(st.keys[ci]), request, ci)   # held now: announce their evictions
        if self.metrics:
            self.metrics.admitted(request.num_prompt_tokens, self.hit_tiers(request, num_external_tokens))
        if num_external_tokens <= 0:
            st.pending_load = None
            st.pending_async = False
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
        st.pending_async = st.claim_async
        st.claimed_total += end - start

    def build_meta(self, scheduler_output: Any) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        idle = not any(scheduled.values())
        if idle and self._remote is not None:
            # nothing to run but requests waiting for the shared tier's answer: wait for one (GIL
            # released) instead of stepping again at once; bounded by IDLE_WAIT_S
            self._remote.wait_any(IDLE_WAIT_S)
        # asynchronous loads: vLLM does not schedule the request (it waits for its KV) this step
        for req_id in [r for r, st in self._reqs.items() if st.pending_async and st.pending_load and r not in scheduled]:
            self._emit_load(meta, req_id, self._reqs[req_id])
        states = boundary_states(scheduler_output) if self.save_plans.mamba_groups else {}
        for req_id, num_new in scheduled.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            table = self._emit_load(meta, req_id, st)
            if self.save:   # num_computed_tokens is pre-step here
                computed = st.request.num_computed_tokens + num_new
                meta.saves.extend(self.save_plans.saves_upto(req_id, st, computed, table, states.get(req_id)))
        for req_id, saves in self._releasing.items():    # finished requests: last chunks, then free
            meta.saves.extend(saves)
            meta.releases.append(req_id)
        self._releasing.clear()
        meta.idle = idle and bool(self._loading)
        if self.prefetch is not None:
            self.prefetch.step(meta, self)
        meta.step_tokens, meta.step_span = step_work(scheduled, self._reqs)
        return meta

    def _emit_load(self, meta: KvtierConnectorMetadata, req_id: str, st: RequestState) -> Sequence[Sequence[int]]:
        """Turn the request's pending load (if any) into a plan in ``meta``; its block tables."""
        table = self._block_ids_of(req_id) if self._block_ids_of else ([],)
        if st.pending_load is None:
            return table
        start, end = st.pending_load
        st.pending_load = None
        plan = load_plan(req_id, st, start, end, table, block_size=self.block_size, chunk_size=self.chunk_size,
                         groups=self.groups)
        st.pending_async = False
        if plan is not None:
            meta.loads.append(plan)
            if plan.async_load:
                self._loading.add(req_id)
            self.log.write("claim", req=req_id, prompt_tokens=st.request.num_prompt_tokens,
                           local_tokens=start, claimed_tokens=end - start, async_load=plan.async_load)
        return table

    # -- completion ------------------------------------------------------------------------
    def finished(self, request: Any, block_ids: Sequence[Sequence[int]] | None = None) -> bool:
        """Drop the request's state; True = vLLM must not free its blocks yet: an asynchronous load
        still writes into them (the worker's ``finished_recving`` releases them), or, with
        ``save_generated``, full chunks of its computed tokens (``block_ids``, vLLM's block table)
        are still unsaved: the next step's metadata ships them with a release, and the worker's
        ``finished_sending`` frees the blocks once it has copied them. The last sampled token has
        no KV, so at most ``num_tokens - 1`` tokens count. ``block_ids``: one list per KV-cache group."""
        req_id = request.request_id
        st = self._reqs.pop(req_id, None)
        self._refused.discard(req_id)
        if self.prefetch is not None:
            self.prefetch.finished(req_id)
        if self._remote is not None:
            self._remote.forget(req_id)
            for q in st.state_queries if st is not None else ():
                self._remote.forget(q)
        if req_id in self._loading:
            return True
        saves: list[SaveChunk] = []
        if st is not None and self.save_generated and block_ids is not None and st.request is request:
            try:
                computed = min(request.num_computed_tokens, request.num_tokens - 1)
                saves = self.save_plans.saves_upto(req_id, st, computed, [list(t) for t in block_ids])
            except Exception as e:   # never fail vLLM's finish path for a cache
                log.warning("kvtier: planning the last saves of %s failed: %s", req_id, e)
                if self.metrics:
                    self.metrics.error("finish_save_plan")
                saves = []
        if st is not None:
            self.log.write("finished", req=req_id, prompt_tokens=request.num_prompt_tokens,
                           tokens=len(getattr(request, "all_token_ids", ())) or request.num_prompt_tokens,
                           saved_chunks=st.next_save_chunk, last_saves=len(saves))
        if saves:
            self._releasing[req_id] = saves
            return True
        return False

    def on_finished_recving(self, req_ids) -> None:
        for r in req_ids or ():
            self._loading.discard(r)

    def on_worker_meta(self, meta: KvtierWorkerMetadata) -> None:
        for req_id, sv in meta.saves.items():
            self.log.write("save", req=req_id, chunks=sv.chunks, bytes=sv.nbytes, generated_chunks=sv.generated_chunks,
                           generated_bytes=sv.generated_bytes, failed=sv.failed)
        for req_id, o in meta.loads.items():
            self.log.write("load", req=req_id, loaded_tokens=o.loaded_tokens, failed_tokens=o.failed_tokens,
                           error=o.error)
            st = self._reqs.get(req_id)
            if o.failed_tokens and st is not None and st.claim_async:
                st.remote_failed = True   # vLLM retries the request: recompute, do not wait on the tier again
                st.load_failed = self.loads_whole   # vLLM recomputes the whole request (failed_recving)
        if self.prefetch is not None and meta.prefetched:
            self.prefetch.on_done(meta.prefetched, self._reqs)
        if meta.read_speeds:
            self.gate.on_speeds(meta.read_speeds)
        if meta.forward is not None:
            self.gate.on_forward(*meta.forward)
        if self.kv_events is not None:
            self.kv_events.on_changes(meta.tier_changes)
        self.forget_worker_keys(meta.missing_keys)
        self.forget_worker_keys(meta.evicted_keys)
        if meta.pid != os.getpid():
            self.directory.stored(meta.stored_keys, meta.stored_tiers)

    def forget_worker_keys(self, keys: Sequence[bytes]) -> None:
        self.directory.forget(keys)

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()
