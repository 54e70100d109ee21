"""KV events: what kvtier's tiers hold, announced through vLLM's own KV-events stream.

vLLM publishes the ``KVCacheEvent`` objects the scheduler-side connector returns from
``take_events()`` together with its own GPU prefix-cache events, once per engine step, on the
publisher ``--kv-events-config`` configures (ZMQ PUB, msgpack ``KVEventBatch``). KV-aware
routers (llm-d's indexer, Dynamo's KV router, AIBrix) index those events per replica, so with
them kvtier's RAM, SSD and shared tiers count as cache the replica holds.

Contract:

- The unit of an event is vLLM's block, not kvtier's chunk: a chunk of ``chunk_size`` tokens
  spans ``chunk_size // block_size`` vLLM blocks; its ``BlockStored`` carries those blocks'
  hashes (``request.block_hashes``, vLLM's own prefix hashing, converted like vLLM's events:
  ``maybe_convert_block_hash``), ``parent_block_hash`` = the hash of the block before the
  chunk's first one (None for the first chunk), the chunk's token ids, ``block_size`` = vLLM's
  block size, the request's LoRA, and per-block ``extra_keys`` as vLLM computes them.
- ``medium`` names the tier (``MEDIUM``): ``CPU`` for the RAM tier (vLLM's ``MEDIUM_CPU``, what
  its own CPU offloading publishes), ``DISK`` for the SSD tier, ``SHARED`` for the shared tier;
  ``locality`` is ``LOCAL`` for RAM and SSD, ``REMOTE`` for the shared tier.
- ``BlockStored`` when a chunk enters a tier (saved, written through, demoted, promoted);
  ``BlockRemoved`` with that tier's medium when it leaves it (evicted, deleted, orphaned).
  A shared-tier chunk is announced once (``BlockStored``, ``SHARED``) by the replica whose save
  wrote it, never removed (other replicas and the tier's janitor change the shared tier).
- The scheduler remembers each chunk's blocks (``remember``: chunks it plans to save, chunks it
  claims) in a bounded LRU (``ChunkHashMap``) keyed by chunk key; the worker's reports (tier
  changes by chunk key) are turned into events with it. A change of a chunk the map forgot (or
  never saw: a chunk saved by an earlier engine) is skipped and counted (``unmapped``).
- Nothing here may fail an engine step: every error is counted, logged once, and the step goes
  on without the events of that call. Disabled (no ``--kv-events-config``), nothing is kept.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvtier.integrations.vllm.metadata import TierChange

log = logging.getLogger("kvtier.connector")

#: kvtier tier name -> the ``medium`` of its events.
MEDIUM: dict[str, str] = {"memory": "CPU", "disk": "DISK", "shared": "SHARED"}
#: kvtier tier name -> the ``locality`` of its events (relative to the publishing replica).
LOCALITY: dict[str, str] = {"memory": "LOCAL", "disk": "LOCAL", "shared": "REMOTE"}
#: Chunks remembered per engine by default: about 1 KiB each for a 256-token chunk (its token ids,
#: 4 bytes each, and 32 bytes of hash per block); the connector sizes it to the local tiers.
DEFAULT_MAP_CAPACITY = 16384
#: Shared-tier chunks remembered as already announced (each is announced at most once while here).
ANNOUNCED_MAX = 65536


@dataclass(frozen=True)
class ChunkBlocks:
    """What vLLM's ``BlockStored`` says about the blocks one chunk covers."""

    block_hashes: tuple[Any, ...]          # ExternalBlockHash (bytes, or int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    parent_block_hash: Any | None
    token_ids: "array[int] | tuple[int, ...]"   # compact (4 bytes a token) while remembered
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None


def chunk_blocks(request: Any, chunk_index: int, chunk_size: int, block_size: int) -> ChunkBlocks | None:
    """The blocks chunk ``chunk_index`` of ``request`` covers, from vLLM's ``request.block_hashes``
    (one hash per ``block_size`` tokens, chained over the prefix); None when vLLM has not hashed
    that far yet or hashes at another granularity (then no event rather than a wrong one)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = getattr(request, "block_hashes", None)
    tokens = request.all_token_ids
    bpc = chunk_size // block_size
    first, last = chunk_index * bpc, (chunk_index + 1) * bpc
    if hashes is None or len(hashes) < last or len(hashes) * block_size > len(tokens):
        return None
    lora = request.lora_request
    return ChunkBlocks(
        block_hashes=tuple(maybe_convert_block_hash(h) for h in hashes[first:last]),
        parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
        token_ids=_compact(tokens[first * block_size:last * block_size]),
        block_size=block_size,
        lora_id=getattr(lora, "adapter_id", None) if lora is not None else None,
        lora_name=getattr(lora, "name", None) if lora is not None else None,
        extra_keys=_extra_keys(request, first, last, block_size))


def _compact(tokens: Sequence[int]) -> "array[int] | tuple[int, ...]":
    try:
        return array("I", tokens)
    except OverflowError:   # a token id outside uint32
        return tuple(tokens)


def _extra_keys(request: Any, first: int, last: int, block_size: int) -> tuple[Any, ...] | None:
    """vLLM's per-block extra keys (LoRA name, multimodal identifiers, cache salt) as its own
    events publish them; None when the request has none."""
    if request.lora_request is None and not request.cache_salt and not request.mm_features:
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    keys, mm_idx = [], 0
    for i in range(first, last):
        k, mm_idx = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_idx)
        keys.append(k)
    out = to_event_extra_keys(keys)
    return tuple(out) if out is not None else None


class ChunkHashMap:
    """chunk key -> ``ChunkBlocks``, least recently used forgotten beyond ``capacity`` chunks."""

    def __init__(self, capacity: int = DEFAULT_MAP_CAPACITY) -> None:
        self.capacity = max(1, capacity)
        self._map: OrderedDict[bytes, ChunkBlocks] = OrderedDict()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def put(self, key: bytes, blocks: ChunkBlocks) -> None:
        self._map[key] = blocks
        self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)
            self.forgotten += 1

    def get(self, key: bytes) -> ChunkBlocks | None:
        blocks = self._map.get(key)
        if blocks is not None:
            self._map.move_to_end(key)
        return blocks


@dataclass
class KvEventCounts:
    """What the events did since the engine started."""

    stored: int = 0            # BlockStored events (one per chunk and tier)
    removed: int = 0           # BlockRemoved events
    unmapped: int = 0          # tier changes skipped: the chunk's blocks are not (any more) known
    unhashed: int = 0          # chunks not remembered: vLLM had no block hashes for them
    errors: int = 0
    by_medium: dict[str, int] = field(default_factory=dict)


class KvEvents:
    """The scheduler's KV events: ``remember`` chunks, feed ``on_changes``, hand ``take`` to vLLM."""

    def __init__(self, *, enabled: bool, chunk_size: int, block_size: int, capacity: int = DEFAULT_MAP_CAPACITY,
                 metrics: Any = None) -> None:
        self.enabled = enabled
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.metrics = metrics
        self.map = ChunkHashMap(capacity)
        self.counts = KvEventCounts()
        self._pending: list[Any] = []
        self._announced: OrderedDict[bytes, None] = OrderedDict()
        self._logged: set[str] = set()

    def failed(self, where: str, e: BaseException) -> None:
        self.counts.errors += 1
        if self.metrics is not None:
            try:
                self.metrics.error("kv_events")
            except Exception:
                pass
        if where not in self._logged:
            self._logged.add(where)
            log.warning("kvtier: KV events: %s failed (logged once, counted): %s", where, e)

    def remember(self, key: bytes, request: Any, chunk_index: int) -> None:
        """(scheduler) Chunk ``chunk_index`` of ``request`` is ``key``: keep its blocks for its events."""
        if not self.enabled or self.map.get(key) is not None:    # get: now recently used
            return
        try:
            blocks = chunk_blocks(request, chunk_index, self.chunk_size, self.block_size)
        except Exception as e:
            self.failed("remember", e)
            return
        if blocks is None:
            self.counts.unhashed += 1
            return
        self.map.put(key, blocks)

    def on_changes(self, changes: Sequence[TierChange]) -> None:
        """(scheduler) The worker's tier changes, in order: queue their events for ``take``."""
        if not self.enabled or not changes:
            return
        for ch in changes:
            try:
                self._change(ch)
            except Exception as e:   # this change's event is lost, not the others'
                self.failed("on_changes", e)

    def _change(self, ch: TierChange) -> None:
        medium = MEDIUM.get(ch.tier)
        if medium is None:
            return
        if ch.tier == "shared":
            if ch.kind != "stored" or ch.key in self._announced:
                return
        blocks = self.map.get(ch.key)
        if blocks is None:
            self.counts.unmapped += 1
            return
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        if ch.kind == "stored":
            self._pending.append(BlockStored(
                block_hashes=list(blocks.block_hashes), parent_block_hash=blocks.parent_block_hash,
                token_ids=list(blocks.token_ids), block_size=blocks.block_size, lora_id=blocks.lora_id,
                medium=medium, lora_name=blocks.lora_name,
                extra_keys=list(blocks.extra_keys) if blocks.extra_keys is not None else None,
                group_idx=0, locality=LOCALITY[ch.tier]))
            self.counts.stored += 1
            if ch.tier == "shared":
                self._announced[ch.key] = None
                while len(self._announced) > ANNOUNCED_MAX:
                    self._announced.popitem(last=False)
        else:
            self._pending.append(BlockRemoved(block_hashes=list(blocks.block_hashes), medium=medium, group_idx=0,
                                              locality=LOCALITY[ch.tier]))
            self.counts.removed += 1
        self.counts.by_medium[medium] = self.counts.by_medium.get(medium, 0) + 1

    def take(self) -> list[Any]:
        """(scheduler, once per step) The events queued since the last call."""
        out, self._pending = self._pending, []
        return out

    def stats(self) -> dict[str, Any]:
        c = self.counts
        return {"enabled": self.enabled, "stored": c.stored, "removed": c.removed, "unmapped": c.unmapped,
                "unhashed": c.unhashed, "errors": c.errors, "by_medium": dict(c.by_medium),
                "remembered": len(self.map), "forgotten": self.map.forgotten}
