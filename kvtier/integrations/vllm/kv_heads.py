"""Chunks cut per KV head: a tensor-parallel-independent layout (``connector.tp_layout: per-kv-head``).

With tensor parallelism each rank holds a slice of every layer's KV heads. Stored per rank (the default,
``per-rank``), a chunk is one rank's slice and the namespace names the TP size and rank: a TP = 1 and a
TP = 2 replica of the same model never share a chunk. Stored per KV head, part ``p`` of chunk ``i`` is
``H`` entries, one per KV head ``h`` of the model (``head_key(part key, h)``), each holding that head's
pages over the part's layers: ``[num_layers, blocks_per_chunk, 1, block_size, 2 * head_size]`` in the
engine's page layout (LBHNC: a head's page is one dense run). The bytes of head ``h`` do not depend on
how many ranks the engine has, so the namespace leaves TP out and any TP size reads them (vLLM's
``canonical_mapping.py`` does the same for its CPU primary tier: every KV head, all tokens of a block).

Which heads a rank holds (``KvHeads.for_rank``, vLLM's sharding): with ``T`` ranks and ``H >= T`` heads,
rank ``r`` holds heads ``[r * H/T, (r + 1) * H/T)``; with ``H < T`` heads are replicated, rank ``r``
holding head ``r // (T/H)``: every replica saves it into its own local tiers (a duplicate write to a
shared tier is the same bytes under the same key).

Heads form their own chains: the parent of head ``h`` of a part is head ``h`` of the part before it in
the parts' chain (``head_key(chain parent, h)``). One rank writes a head's whole chain, so the store's
parent rule (never an orphan) holds in every rank's own store. A chunk is held when every head of every
part is (the scheduler looks up ``head_chain``): the scheduler claims a chunk only if every rank can load
its share.

No I/O, no torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

_HEAD_PERSON = b"kvtier-kvhead"     # BLAKE2b personalisation of head keys


class HeadShardingError(ValueError):
    """The engine's KV heads do not shard across its ranks the way vLLM shards them (one-line reason)."""


def head_key(key: bytes, head: int) -> bytes:
    """The store key of KV head ``head`` of the chunk part keyed ``key``."""
    return hashlib.blake2b(bytes(key) + head.to_bytes(2, "little"), digest_size=len(key),
                           person=_HEAD_PERSON).digest()


def head_chain(keys: Sequence[bytes], heads: int) -> list[bytes]:
    """Every head of every key in order (key by key, head by head): what the scheduler looks up."""
    return [head_key(k, h) for k in keys for h in range(heads)]


@dataclass(frozen=True)
class KvHeads:
    """The model's KV heads and the ones this rank holds (``first`` .. ``first + count - 1``)."""

    total: int
    first: int = 0
    count: int = 0

    def __post_init__(self) -> None:
        if self.total < 1 or self.count < 0 or self.first < 0 or self.first + self.count > self.total:
            raise HeadShardingError(f"KV heads {self.first}..{self.first + self.count - 1} of {self.total}")

    @classmethod
    def for_rank(cls, total: int, tp_size: int, tp_rank: int) -> "KvHeads":
        """vLLM's sharding of ``total`` KV heads over ``tp_size`` ranks, for rank ``tp_rank``."""
        if total < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise HeadShardingError(f"{total} KV heads, TP rank {tp_rank} of {tp_size}")
        if total >= tp_size:
            if total % tp_size:
                raise HeadShardingError(f"{total} KV heads do not split evenly over {tp_size} TP ranks")
            per = total // tp_size
            return cls(total, tp_rank * per, per)
        if tp_size % total:
            raise HeadShardingError(f"{tp_size} TP ranks do not replicate {total} KV heads evenly")
        return cls(total, tp_rank // (tp_size // total), 1)

    @property
    def local(self) -> range:
        """The global indices of this rank's heads."""
        return range(self.first, self.first + self.count)

    def keys(self, key: bytes) -> list[bytes]:
        """This rank's head keys of the part keyed ``key``, in head order."""
        return [head_key(key, h) for h in self.local]




def engine_kv_heads(vllm_config: Any, tp_layout: str, mla: bool, mamba: bool = False) -> KvHeads | None:
    """This process's KV heads when chunks are stored per KV head (``tp_layout`` ``per-kv-head``, not MLA, whose
    latent has no heads and is TP-independent anyway); None per rank. HeadShardingError when the model's heads
    do not shard over its TP ranks, or it keeps Mamba state (a state page has no KV heads)."""
    if tp_layout != "per-kv-head" or mla:
        return None
    if mamba:
        raise HeadShardingError("Mamba state pages have no KV heads to store apart; use tp_layout per-rank")
    from kvtier.integrations.vllm.namespace import parallel_ranks

    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    total = int(vllm_config.model_config.get_total_num_kv_heads())
    return KvHeads.for_rank(total, tp_size, parallel_ranks(vllm_config)[0])


__all__ = ["HeadShardingError", "KvHeads", "engine_kv_heads", "head_chain", "head_key"]
