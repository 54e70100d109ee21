"""What the scheduler half tells the worker half each step, and what the worker reports back.

Both travel between processes (EngineCore -> worker, pickled by vLLM), so they are
plain dataclasses of ints, strings and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class LoadChunk:
    """Load one chunk: write its blocks ``first_block:`` into ``block_ids`` (in order)."""

    key: bytes
    block_ids: tuple[int, ...]
    first_block: int = 0


@dataclass(frozen=True)
class LoadPlan:
    """One request's load for this step: tokens ``[start_token, end_token)`` in ``chunks``."""

    req_id: str
    start_token: int
    end_token: int
    chunks: tuple[LoadChunk, ...]


@dataclass(frozen=True)
class SaveChunk:
    """Save one fully computed chunk (index ``chunk_index`` of the prompt) from ``block_ids``."""

    req_id: str
    chunk_index: int
    key: bytes
    parent: bytes | None
    block_ids: tuple[int, ...]


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SaveChunk] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class LoadOutcome:
    """What a worker did with one request's load plan."""

    loaded_tokens: int = 0
    failed_tokens: int = 0
    error: str | None = None


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: load outcomes and keys the worker now holds."""

    pid: int = 0
    loads: dict[str, LoadOutcome] = field(default_factory=dict)
    stored_keys: list[bytes] = field(default_factory=list)
    missing_keys: list[bytes] = field(default_factory=list)   # claimed but not loadable any more

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvtierWorkerMetadata":
        if not isinstance(other, KvtierWorkerMetadata):
            return self
        loads = dict(self.loads)
        for req_id, o in other.loads.items():
            mine = loads.get(req_id)
            # TP ranks: a request's load counts only as far as every rank loaded it.
            loads[req_id] = o if mine is None else LoadOutcome(
                min(mine.loaded_tokens, o.loaded_tokens), max(mine.failed_tokens, o.failed_tokens),
                mine.error or o.error)
        mine_keys = set(self.stored_keys)
        return KvtierWorkerMetadata(self.pid, loads,
                                    self.stored_keys + [k for k in other.stored_keys if k not in mine_keys],
                                    self.missing_keys + other.missing_keys)
