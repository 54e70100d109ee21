"""What the scheduler half tells the worker half each step, and what the worker reports back.

Both travel between processes (EngineCore -> worker, pickled by vLLM), so they are
plain dataclasses of ints, strings and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvtier.read_speed import TierSpeed, fold


@dataclass(frozen=True)
class LoadChunk:
    """Load one chunk: write its blocks ``first_block:`` into ``block_ids`` (in order)."""

    key: bytes
    block_ids: tuple[int, ...]
    first_block: int = 0


@dataclass(frozen=True)
class LoadPlan:
    """One request's load for this step: tokens ``[start_token, end_token)`` in ``chunks``.

    ``async_load``: the claim includes chunks of a shared (network) tier: the worker loads it on a
    background thread and reports the request in ``get_finished`` (vLLM's ``load_kv_async``).
    ``whole``: the chunks are the parts of several KV-cache groups (``cache_groups.py``): the plan
    loads whole or fails whole, reported per request (vLLM cannot map block ids of several groups
    back to requests), and its tokens count once however many parts they have."""

    req_id: str
    start_token: int
    end_token: int
    chunks: tuple[LoadChunk, ...]
    async_load: bool = False
    whole: bool = False


@dataclass(frozen=True)
class SaveChunk:
    """Save one fully computed chunk (index ``chunk_index`` of the request's tokens) from ``block_ids``.

    ``generated``: the chunk covers generated tokens (saved only with ``connector.save_generated``)."""

    req_id: str
    chunk_index: int
    key: bytes
    parent: bytes | None
    block_ids: tuple[int, ...]
    generated: bool = False


@dataclass(frozen=True)
class PrefetchPlan:
    """Copy a waiting request's chunks ``keys`` (in order; ``tiers``: where the scheduler saw each)
    into the worker's local tiers above the one holding each, RAM first (``prefetch.py``)."""

    req_id: str
    keys: tuple[bytes, ...]
    tiers: tuple[str, ...] = ()


@dataclass
class PrefetchOutcome:
    """What a worker did with one prefetch plan: chunks copied up now, already in RAM, failed (that
    chunk and the rest of the plan are left), left when the plan was cancelled; seconds it took."""

    fetched: int = 0
    resident: int = 0
    failed: int = 0
    cancelled: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """``releases``: finished requests whose blocks vLLM keeps until the worker has copied this
    step's saves out of them; the worker reports them in ``get_finished`` (finished_sending).
    ``idle``: this step scheduled no tokens while an asynchronous load is in flight; the worker's
    ``get_finished`` then waits (GIL released, bounded) for the load instead of letting the
    engine step again at once.
    ``step_tokens`` / ``step_span``: the work of this step's forward pass (tokens scheduled, and the sum
    over requests of ``(context + new)^2 - context^2``), set when every scheduled request is known;
    the worker times the forward pass and reports it back (``KvtierWorkerMetadata.forward``)."""

    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SaveChunk] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    idle: bool = False
    step_tokens: int = 0
    step_span: int = 0
    prefetches: list[PrefetchPlan] = field(default_factory=list)   # waiting requests' chunks into RAM
    prefetch_cancels: list[str] = field(default_factory=list)      # requests whose prefetch is to stop

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.releases or self.prefetches or self.prefetch_cancels)


@dataclass
class LoadOutcome:
    """What a worker did with one request's load plan."""

    loaded_tokens: int = 0
    failed_tokens: int = 0
    error: str | None = None


@dataclass
class SaveOutcome:
    """What a worker saved for one request in one step: chunks and bytes the store accepted (of
    them, those covering generated tokens) and chunks that were not saved (refused or failed)."""

    chunks: int = 0
    nbytes: int = 0
    generated_chunks: int = 0
    generated_bytes: int = 0
    failed: int = 0

    def add(self, other: "SaveOutcome") -> "SaveOutcome":
        return SaveOutcome(self.chunks + other.chunks, self.nbytes + other.nbytes,
                           self.generated_chunks + other.generated_chunks,
                           self.generated_bytes + other.generated_bytes, self.failed + other.failed)


@dataclass(frozen=True)
class TierChange:
    """One chunk entering (``stored``) or leaving (``removed``) one tier of the worker, in the order
    it happened; ``tier`` is the tier's name (``memory``, ``disk``, ``shared``: a save whose write to
    the shared tier was accepted). The scheduler turns these into KV events (``kv_events.py``)."""

    kind: Literal["stored", "removed"]
    tier: str
    key: bytes


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: load outcomes and what changed in the worker's tiers.

    ``stored_keys`` (with ``stored_tiers``, the top local tier now holding each) entered the
    worker's local tiers (saved, demoted or promoted); ``evicted_keys`` left every local tier
    of the worker; ``missing_keys`` were claimed but could not be loaded.

    Tensor parallel: vLLM folds the ranks' reports with ``aggregate``. A chunk is available
    only where **every** rank stored it (each rank holds its own slice of the KV), so stored
    keys are intersected, missing/evicted keys are united, and a load counts as far as the
    rank that loaded least. Every rank of a TP>1 engine reports each step (``always_report``),
    even when it has nothing to say, so an empty rank empties the intersection.

    Chunks stored per KV head (``per_kv_head``, ``kv_heads.py``): every stored key is one KV head's, which
    the rank (or ranks) holding that head store, so stored keys (and tier entries) are united instead: the
    scheduler needs every head of a chunk, which is what every rank can load.

    ``tier_changes`` (only with KV events enabled): every tier's entries and exits, in order.
    Folded like the keys: an entry counts where every rank made it, an exit where any rank did.

    ``read_speeds``: this worker's estimate of each tier's reads (``kvtier.read_speed``), sent when it
    changed; folded with the slower rank. ``forward``: (tokens, span, seconds) of the step's forward
    pass (the step's ``step_tokens`` / ``step_span``), the slowest rank's. ``disabled``: the worker
    serves without the cache (``connector.on_unsupported: serve-without-cache``) and why; any rank's
    reason disables the engine's claims."""

    pid: int = 0
    loads: dict[str, LoadOutcome] = field(default_factory=dict)
    stored_keys: list[bytes] = field(default_factory=list)
    missing_keys: list[bytes] = field(default_factory=list)   # claimed but not loadable any more
    stored_tiers: list[str] = field(default_factory=list)     # parallel to stored_keys ("" = unknown)
    evicted_keys: list[bytes] = field(default_factory=list)
    saves: dict[str, SaveOutcome] = field(default_factory=dict)   # per request, this step (bytes: all ranks)
    tier_changes: list[TierChange] = field(default_factory=list)
    read_speeds: dict[str, TierSpeed] = field(default_factory=dict)
    forward: tuple[int, int, float] | None = None
    prefetched: dict[str, PrefetchOutcome] = field(default_factory=dict)   # prefetch plans finished
    disabled: str = ""                                                    # why this worker serves without cache
    per_kv_head: bool = False                                             # stored keys are KV heads' (united)

    def tier_of(self) -> dict[bytes, str]:
        tiers = self.stored_tiers + [""] * (len(self.stored_keys) - len(self.stored_tiers))
        return dict(zip(self.stored_keys, tiers))

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvtierWorkerMetadata":
        if not isinstance(other, KvtierWorkerMetadata):
            return self
        loads: dict[str, LoadOutcome] = {}
        for req_id in list(self.loads) + [r for r in other.loads if r not in self.loads]:
            mine, theirs = self.loads.get(req_id), other.loads.get(req_id)
            if mine is None or theirs is None:   # an async load another rank reports in another step
                loads[req_id] = mine or theirs   # type: ignore[assignment]
                continue
            # TP ranks: a request's load counts only as far as every rank loaded it.
            loads[req_id] = LoadOutcome(min(mine.loaded_tokens, theirs.loaded_tokens),
                                        max(mine.failed_tokens, theirs.failed_tokens), mine.error or theirs.error)
        their_keys = set(other.stored_keys)
        mine_tiers = self.tier_of()
        united = self.per_kv_head or other.per_kv_head
        stored = [k for k in self.stored_keys if k in their_keys]          # intersection, in order
        if united:
            mine_tiers = {**other.tier_of(), **mine_tiers}
            stored = list(dict.fromkeys(self.stored_keys + other.stored_keys))
        gone = self.evicted_keys + [k for k in other.evicted_keys if k not in set(self.evicted_keys)]
        missing = self.missing_keys + [k for k in other.missing_keys if k not in set(self.missing_keys)]
        saves = dict(self.saves)
        for req_id, o in other.saves.items():
            saves[req_id] = saves[req_id].add(o) if req_id in saves else o
        theirs_in = {c for c in other.tier_changes if c.kind == "stored"}
        changes = [c for c in self.tier_changes if c.kind != "stored" or c in theirs_in or united]
        mine_out = {c for c in self.tier_changes if c.kind != "stored"}
        changes += [c for c in other.tier_changes if (c.kind != "stored" or united) and c not in mine_out
                    and c not in changes]
        speeds = dict(self.read_speeds)
        for tier, sp in other.read_speeds.items():
            speeds[tier] = fold(speeds[tier], sp) if tier in speeds else sp
        forward = max((f for f in (self.forward, other.forward) if f is not None), key=lambda f: f[2], default=None)
        prefetched = {**other.prefetched, **self.prefetched}   # a rank's report of a plan is enough
        return KvtierWorkerMetadata(self.pid, loads, stored, missing, [mine_tiers[k] for k in stored], gone,
                                    saves, changes, speeds, forward, prefetched, self.disabled or other.disabled,
                                    united)
