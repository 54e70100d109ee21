"""What the scheduler knows of one request, and what a step's metadata asks of the worker for it.

Contract:

- ``RequestState``: one request's keys (prompt chunks; with ``save_generated`` grown over generated
  tokens), its last lookup and claim, its pending load and the next chunk to save.
- ``load_plan``: an admitted claim ``[start, end)`` -> the ``LoadPlan`` of the chunks overlapping
  it, whole blocks from the request's block tables (one per KV-cache group; a chunk of a G-group
  engine is G parts, ``cache_groups.py``: a sliding-window group loads only the blocks vLLM keeps for
  ``end``); None (logged) when a table is too short or holds the null block where KV must go.
- ``SavePlanner.saves_upto``: the chunks to save now: not yet saved, full once ``computed`` tokens
  have KV, their blocks allocated. With ``save_generated`` the request's keys grow with its known
  tokens (``all_token_ids``: prompt + sampled tokens, never spec-decode drafts or async-scheduling
  placeholders), so the full chunks covering generated tokens are saved as decode fills them, with
  the same chained keys a next turn's prompt (the same ids up to the end of the reply) looks up; a
  generated chunk the worker's tiers or the local store already hold is skipped (index only). Every
  chunk planned is remembered for the KV events (``kv_events``) with its vLLM block hashes.
- ``step_work``: (tokens, span) a step computes, for the worker's forward-pass timing.

No I/O beyond the store's index lookup; no vLLM imports.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from kvtier.integrations.vllm.cache_groups import NULL_BLOCK, CacheGroups, chain_parent, part_key, saveable
from kvtier.integrations.vllm.kv_heads import head_key
from kvtier.integrations.vllm.directory import Directory
from kvtier.integrations.vllm.kv_events import KvEvents
from kvtier.integrations.vllm.metadata import LoadChunk, LoadPlan, SaveChunk
from kvtier.keys import ChunkKey, Namespace, extend_chunk_keys

if TYPE_CHECKING:
    from kvtier.integrations.vllm.metrics import ConnectorMetrics

log = logging.getLogger("kvtier.connector")


class IndexLookup(Protocol):
    """The store's index-only lookup."""

    def lookup(self, keys: Sequence[ChunkKey]) -> Any: ...


@dataclass
class RequestState:
    request: Any
    keys: list[ChunkKey]            # prompt chunks; with save_generated grown over generated tokens
    extra: bytes = b""
    stored_chunks: int = 0          # leading chunks the store held at the last lookup
    claim_start: int = 0            # last claim: [claim_start, claim_end) tokens
    claim_end: int = 0
    pending_load: tuple[int, int] | None = None
    next_save_chunk: int = 0
    claimed_total: int = 0
    tiers: tuple[str, ...] = field(default_factory=tuple)
    claim_async: bool = False       # the last claim includes shared-tier chunks
    pending_async: bool = False
    remote_failed: bool = False     # a load from the shared tier failed: never claim from it again
    # while the shared tier's answer is pending: the local part (chunks, tiers) found at the first
    # ask, reused by every "ask again" (no store lookup per engine step)
    local_pending: tuple[int, tuple[str, ...]] | None = None
    declines_counted: bool = False  # this request's declined chunks were counted (once per request)
    skip_counted: bool = False      # its shared-tier query was skipped and counted
    load_failed: bool = False       # a load of several KV-cache groups failed: the request recomputes, no claim
    saves_ended: bool = False       # a chunk could not be saved whole (freed sliding-window blocks)
    chain: list[bytes] = field(default_factory=list)   # every part's key (several groups), extended with keys
    states_saved: set[int] = field(default_factory=set)  # chunks whose Mamba state parts were saved
    state_queries: set[str] = field(default_factory=set)  # its shared-tier queries for Mamba states

    def parts_chain(self, parts: int | Sequence[int], heads: int = 0) -> list[bytes]:
        """Every chained part of every chunk key in chain order (``cache_groups.chain``; ``parts``: their count,
        or the parts themselves, ``CacheGroups.chain_parts``), extended as keys grow; with chunks stored per KV
        head (``heads`` > 0, ``kv_heads.py``) every head of every part."""
        chained = range(parts) if isinstance(parts, int) else tuple(parts)
        if tuple(chained) == (0,) and not heads:
            return self.keys      # type: ignore[return-value]
        width = len(chained) * max(1, heads)
        while len(self.chain) < len(self.keys) * width:
            ci, rest = divmod(len(self.chain), width)
            key = part_key(self.keys[ci], chained[rest // max(1, heads)])
            self.chain.append(head_key(key, rest % heads) if heads else key)
        return self.chain


def load_plan(req_id: str, st: RequestState, start: int, end: int, tables: Sequence[Sequence[int]], *,
              block_size: int, chunk_size: int, groups: CacheGroups | None = None) -> LoadPlan | None:
    """The plan loading tokens ``[start, end)`` of ``st`` into the blocks of ``tables`` (one block table per
    KV-cache group). With several groups every part is its own ``LoadChunk``; with several groups or a
    sliding window the plan is asynchronous and ``whole`` (``CacheGroups.loads_whole``)."""
    bs, c = block_size, chunk_size
    bpc = c // bs
    parts = groups.count if groups is not None else 1
    if len(tables) < parts or any(len(t) < end // bs for t in tables[:parts]):
        log.error("kvtier: block table of %s too short for load [%d,%d)", req_id, start, end)
        return None
    chunks = []
    order = groups.chain_parts + groups.state_parts if groups is not None else (0,)   # leaves after their parent
    for ci in range(start // c, -(-end // c)):     # chunks overlapping [start, end)
        for g in order:
            lo = max(groups.load_start(g, start, end) if groups is not None else start, ci * c)
            hi = min(end, (ci + 1) * c)
            if lo >= hi:        # a sliding-window group keeps nothing of this chunk for ``end``
                continue
            first, last = (lo - ci * c) // bs, (hi - ci * c) // bs
            ids = tuple(tables[g][ci * bpc + first:ci * bpc + last])
            if groups is not None and groups.sparse and NULL_BLOCK in ids:
                log.error("kvtier: the null block in group %d of %s where [%d,%d) must load", g, req_id, start, end)
                return None
            chunks.append(LoadChunk(part_key(st.keys[ci], g), ids, first))
    whole = groups is not None and groups.loads_whole
    return LoadPlan(req_id, start, end, tuple(chunks), async_load=st.pending_async or whole, whole=whole)


def boundary_states(scheduler_output: Any) -> dict[str, dict[tuple[int, int], int]]:
    """vLLM's exact Mamba "align" state blocks of this step (``KVConnectorBlockState.boundary_state_offloads``):
    per request, ``(group, tokens) -> block id``; empty when vLLM offered none."""
    offered = getattr(getattr(scheduler_output, "kv_connector_block_state", None), "boundary_state_offloads", None)
    out: dict[str, dict[tuple[int, int], int]] = {}
    for req_id, entries in (offered or {}).items():
        for group, block, tokens in entries:
            out.setdefault(req_id, {})[(int(group), int(tokens))] = int(block)
    return out


def step_work(scheduled: dict[str, int], reqs: dict[str, RequestState]) -> tuple[int, int]:
    """(tokens, span) this step computes: ``sum(new)``, ``sum((context + new)^2 - context^2)``;
    (0, 0) when a scheduled request is not known here (its context is not)."""
    tokens = span = 0
    for req_id, new in scheduled.items():
        st = reqs.get(req_id)
        if st is None:
            return 0, 0
        ctx = st.request.num_computed_tokens
        tokens += new
        span += (ctx + new) ** 2 - ctx ** 2
    return tokens, span


class SavePlanner:
    """The chunks of a request to save in a step (see the module's contract)."""

    def __init__(self, store: IndexLookup, directory: Directory, namespace: Namespace, *, block_size: int,
                 save_generated: bool, metrics: "ConnectorMetrics | None", kv_events: KvEvents | None,
                 groups: CacheGroups | None = None, heads: int = 0) -> None:
        self.store = store
        self.chained = groups.chain_parts if groups is not None else (0,)
        self.heads = heads                  # chunks stored per KV head: the model's KV heads (0: per rank)
        self.sparse = groups is not None and groups.sparse
        self.mamba_groups = list(groups.state_parts) if groups is not None else []
        self.directory = directory
        self.namespace = namespace
        self.chunk_size = namespace.chunk_size
        self.blocks_per_chunk = self.chunk_size // block_size
        self.save_generated = save_generated
        self.metrics = metrics
        self.kv_events = kv_events

    def full_chunks(self, st: RequestState, computed: int) -> int:
        """Leading chunks of ``st``'s request whose KV exists once ``computed`` tokens are computed:
        prompt chunks, and with ``save_generated`` those of generated tokens whose ids are known
        (keys extended here, incrementally)."""
        req, c = st.request, self.chunk_size
        if not self.save_generated:
            return min(min(computed, req.num_prompt_tokens) // c, len(st.keys))
        tokens = req.all_token_ids
        full = min(computed, len(tokens)) // c
        if full > len(st.keys):
            try:
                extend_chunk_keys(self.namespace, st.keys, tokens, full, st.extra)
            except ValueError as e:   # a token id outside uint32: save no further chunk of it
                log.warning("kvtier: cannot key generated tokens of %s: %s", req.request_id, e)
                if self.metrics:
                    self.metrics.error("generated_key")
        return min(full, len(st.keys))

    def saves_upto(self, req_id: str, st: RequestState, computed: int, tables: Sequence[Sequence[int]],
                   states: dict[tuple[int, int], int] | None = None) -> list[SaveChunk]:
        """The chunks to save now (every chained part of each): not yet saved, full once ``computed`` tokens
        have KV, their blocks allocated in every group's table and none of them vLLM's null block; then the
        Mamba parts (leaves, one block each) of every saved chunk whose end vLLM offered a state for in
        ``states`` (``(group, tokens) -> block``: ``boundary_state_offloads`` of this step)."""
        full = self.full_chunks(st, computed)
        bpc, prompt, chained = self.blocks_per_chunk, st.request.num_prompt_tokens, self.chained
        out = []
        while st.next_save_chunk < full and not st.saves_ended:
            ci = st.next_save_chunk
            blocks = {g: tuple(tables[g][ci * bpc:(ci + 1) * bpc]) for g in chained if g < len(tables)}
            if len(blocks) < len(chained) or any(len(b) < bpc for b in blocks.values()):
                break
            if self.sparse and not all(saveable(b) for b in blocks.values()):
                st.saves_ended = True      # vLLM freed a sliding window's blocks: the chain would have a gap
                if self.metrics:
                    self.metrics.error("save_window_freed")
                break
            generated = (ci + 1) * self.chunk_size > prompt
            st.next_save_chunk += 1
            first, last = part_key(st.keys[ci], chained[0]), part_key(st.keys[ci], chained[-1])
            if self.kv_events is not None:
                self.kv_events.remember(first, st.request, ci)
                if self.heads:         # the worker's tiers report head keys: head 0's stands for the chunk
                    self.kv_events.remember(head_key(first, 0), st.request, ci)
            if generated and self.held(ChunkKey(head_key(last, self.heads - 1) if self.heads else last)):
                continue              # e.g. the same reply again
            for g in chained:
                out.append(SaveChunk(req_id, ci, part_key(st.keys[ci], g), chain_parent(st.keys, ci, g, chained),
                                     blocks[g], generated=generated))
        if self.mamba_groups and states:
            out += self._state_saves(req_id, st, states)
        return out

    def _state_saves(self, req_id: str, st: RequestState, states: dict[tuple[int, int], int]) -> list[SaveChunk]:
        """The Mamba parts of saved chunks whose end vLLM offered a state for (every Mamba group's), once."""
        out = []
        for ci in sorted({t // self.chunk_size - 1 for _, t in states if t % self.chunk_size == 0 and t > 0}):
            end = (ci + 1) * self.chunk_size
            blocks = [states.get((g, end)) for g in self.mamba_groups]
            if ci >= st.next_save_chunk or ci in st.states_saved or None in blocks or NULL_BLOCK in blocks:
                continue
            st.states_saved.add(ci)
            parent = part_key(st.keys[ci], self.chained[-1])
            out += [SaveChunk(req_id, ci, part_key(st.keys[ci], g), parent, (b,), generated=end > st.request.num_prompt_tokens)
                    for g, b in zip(self.mamba_groups, blocks)]
        return out

    def held(self, key: ChunkKey) -> bool:
        """Whether the worker's tiers or the local store hold ``key`` (index only; failure = no)."""
        if self.directory.get(key) is not None:
            return True
        try:
            return self.store.lookup([key]).num_chunks > 0
        except Exception:   # a broken store: save (a duplicate write is harmless)
            return False
